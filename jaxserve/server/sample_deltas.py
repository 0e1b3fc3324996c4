"""What is new for each sample of a request, from the engine's outputs: one place for both fronts
(gRPC chunks, HTTP/SSE choices).

With n = 1 the engine's DELTA outputs are already deltas; with n > 1 they are cumulative per sample
(each completion carries its index), so what was sent is remembered per index. An aborted group
reports fewer completions than n: every sample not yet finished is closed with reason "abort".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from jaxserve.outputs import Logprob, RequestOutput


@dataclass(frozen=True, slots=True)
class SampleDelta:
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, Logprob]] | None   # one entry per new token, when logprobs were asked for
    finish_reason: str | None = None             # set on the sample's last delta
    stop_reason: int | str | None = None
    num_tokens: int = 0                          # the sample's tokens so far, this delta's included


class SampleDeltas:
    def __init__(self, n: int):
        self.n = n
        self.tokens = [0] * n
        self.chars = [0] * n
        self.completed: set[int] = set()

    @property
    def done(self) -> bool:
        return len(self.completed) == self.n

    def deltas(self, out: RequestOutput) -> Iterator[SampleDelta]:
        for c in out.outputs:
            i = c.index
            if i in self.completed:
                continue
            ids, text, logprobs = c.token_ids, c.text, c.logprobs
            if self.n > 1:
                ids, text = ids[self.tokens[i]:], text[self.chars[i]:]
                logprobs = logprobs[self.tokens[i]:] if logprobs is not None else None
                self.tokens[i], self.chars[i] = len(c.token_ids), len(c.text)
            else:
                self.tokens[i] += len(ids)
            if c.finish_reason is not None:
                self.completed.add(i)
            if ids or text or c.finish_reason is not None:
                yield SampleDelta(i, list(ids), text, list(logprobs) if logprobs is not None else None,
                                  c.finish_reason, c.stop_reason, self.tokens[i])
        if out.finished:
            for i in sorted(set(range(self.n)) - self.completed):
                self.completed.add(i)
                yield SampleDelta(i, [], "", None, "abort", None, self.tokens[i])
