"""The token mask of a request with structured output: its grammar's state on the host (an
llguidance matcher), which the runner asks for the next token's allowed set, packed as bits
(one int32 per 32 token ids), when it packs a step; the sampler applies it on the device.

The matcher has consumed every token of the request the host knows. A mask is right only when
that is all of them, so a request with a grammar never has a token in flight when it samples:
the engine runs its loop without lookahead while such a request is live (engine.py).
"""

from __future__ import annotations

import numpy as np


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class TokenConstraint:
    __slots__ = ("matcher", "consumed")

    def __init__(self, matcher) -> None:
        self.matcher = matcher       # llguidance.LLMatcher, compiled for the model's tokenizer
        self.consumed = 0            # output tokens fed to it

    def fill(self, row: np.ndarray) -> None:
        """The allowed next tokens into row ([mask_words] int32, C-contiguous)."""
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.size * row.itemsize)

    def consume(self, token_ids) -> None:
        for t in token_ids:
            self.matcher.consume_token(int(t))
        self.consumed += len(token_ids)

    @property
    def finished(self) -> bool:
        """The grammar reached its end (nothing may follow), or the matcher failed."""
        return self.matcher.is_stopped() or self.matcher.is_error()

    @property
    def error(self) -> str | None:
        """Why the matcher failed (it refused a token it had allowed: an llguidance fault, e.g. a
        grammar literal spelled like an added token), or None. Such a sample ends, but the reason
        goes out with it instead of passing for a grammar that completed."""
        return self.matcher.get_error() or "the grammar matcher failed" if self.matcher.is_error() else None
