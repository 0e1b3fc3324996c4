"""One embedding request's pooled hidden states, added up on the host as its chunks' steps end.

Each step that carries the request's rows hands over their float32 sum (runner/pooling.py
PooledChunk). "mean" adds the chunks in prompt order and divides by the prompt's length; "last"
gets one chunk, the prompt's last row. A preemption that recomputes the prompt starts it again
from position 0 (a pooling request never reads the prefix cache): its sums start over too, so no
position counts twice. A swap resumes where it stopped, the next chunk following the last.
Sums are kept in float64; the vector handed out is float32's values.
"""

from __future__ import annotations

import numpy as np

from jaxserve.pooling_params import PoolingParams

NORM_EPS = 1e-12      # a zero vector stays zero when normalized (as torch's F.normalize)


class PooledEmbedding:
    def __init__(self, params: PoolingParams, num_prompt_tokens: int):
        self.params = params
        self.num_prompt_tokens = num_prompt_tokens
        self.total: np.ndarray | None = None
        self.covered = 0        # prompt positions [0, covered) are in total

    def add(self, chunk) -> None:
        if self.params.pooling == "last":
            if chunk.first != self.num_prompt_tokens - 1 or chunk.count != 1:
                raise RuntimeError(f"last-token pooling got positions [{chunk.first}, {chunk.first + chunk.count}) "
                                   f"of a {self.num_prompt_tokens}-token prompt")
            self.total, self.covered = chunk.total.astype(np.float64), self.num_prompt_tokens
            return
        if chunk.first == 0 and self.covered:      # computed again from the start (recompute)
            self.total, self.covered = None, 0
        if chunk.first != self.covered:
            raise RuntimeError(f"mean pooling got positions from {chunk.first} after [0, {self.covered})")
        s = chunk.total.astype(np.float64)
        self.total = s if self.total is None else self.total + s
        self.covered += chunk.count

    @property
    def complete(self) -> bool:
        return self.total is not None and self.covered == self.num_prompt_tokens

    def embedding(self) -> list[float]:
        if not self.complete:
            raise RuntimeError(f"the embedding is incomplete: {self.covered} of {self.num_prompt_tokens} positions")
        v = self.total / self.covered if self.params.pooling == "mean" else self.total
        if self.params.normalize:
            v = v / max(float(np.linalg.norm(v)), NORM_EPS)
        return v.astype(np.float32).tolist()
