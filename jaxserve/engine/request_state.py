"""The engine's side of one live request: one `RequestState`, with one `SampleState` per sample.

The scheduler keeps the token-level state (sched/request.py); this is what turning tokens into
outputs needs: the detokenizer, logprobs, what was already streamed, and how each sample ended
as the user sees it (a stop string is found here, not in the scheduler). A request with n > 1
has n samples, each its own scheduler request (`scheduler_id`), forked from the first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.pooled_embedding import PooledEmbedding
from jaxserve.outputs import Logprob, RequestMetrics
from jaxserve.sampling_params import SamplingParams


@dataclass(slots=True)
class SampleState:
    index: int
    scheduler_id: str
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False          # some step has run for it (it appears in n > 1 outputs)
    sent_tokens: int = 0           # streamed so far (OutputKind.DELTA)
    sent_text: int = 0
    # one sample, no logprobs, no stop strings, no prompt logprobs, no embedding, not final-only:
    # a one-token step takes the output processor's plain path (set when the request is added)
    plain: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.detok.text if self.detok is not None else ""

    def sendable(self) -> tuple[int, int]:
        """(tokens, characters) an output may show: all once finished; while running, not the
        tail that could still turn out to be a stop string (IncrementalDetokenizer.releasable)."""
        if self.finished or self.detok is None:
            return len(self.token_ids), len(self.text)
        return self.detok.releasable()

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason, self.stop_reason = reason, stop_reason


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    samples: list[SampleState]
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: an entry per prompt position, filled as steps compute them
    # (by any sample's rows: the first sample's prefill, a fork's own); None for position 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_missing: int = 0      # positions >= 1 not filled yet
    prompt_logprobs_sent: bool = False    # a DELTA output carried them
    # an embedding request (PoolingParams): its pooled hidden states, summed as its steps end
    pooled: PooledEmbedding | None = None

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
            self.prompt_logprobs_missing = len(self.prompt_token_ids) - 1

    def record_prompt_logprobs(self, chunk) -> None:
        """A step's prompt logprobs of some positions (runner/prompt_logprobs.PromptLogprobChunk):
        the token at each position with its logprob and rank, and the top-k there with theirs.
        A position computed again (after a preemption) keeps its first entry."""
        k = self.params.prompt_logprobs
        ids = self.prompt_token_ids
        for i in range(len(chunk.logprob)):
            pos = chunk.first + i
            if pos >= len(ids) or self.prompt_logprobs[pos] is not None:
                continue
            entry = {ids[pos]: Logprob(float(chunk.logprob[i]), int(chunk.rank[i]))}
            for rank, (tid, lp) in enumerate(zip(chunk.top_ids[i][:k].tolist(), chunk.top_logprobs[i][:k].tolist()),
                                             start=1):
                entry.setdefault(tid, Logprob(lp, rank))
            self.prompt_logprobs[pos] = entry
            self.prompt_logprobs_missing -= 1

    @property
    def finished(self) -> bool:
        samples = self.samples
        if len(samples) == 1:      # n = 1, nearly every request: no generator per step
            return samples[0].finish_reason is not None
        return all(s.finished for s in samples)

    @property
    def finish_reason(self) -> str | None:
        """The reason counted in statistics: the first sample's that ended."""
        return next((s.finish_reason for s in self.samples if s.finished), None)
