"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM's shape).

Validated once at construction, so a bad value is a ValueError naming the field at the door and
never reaches the scheduler or the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

MAX_LOGPROBS = 20  # the device computes this many top logprobs when any request asks


class OutputKind(Enum):
    CUMULATIVE = "cumulative"   # every output carries all tokens so far
    DELTA = "delta"             # every output carries only the new tokens
    FINAL_ONLY = "final_only"   # one output, when the request finishes


@dataclass(frozen=True, slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                     # 0 (or -1) = no top-k cut
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16        # None = up to max_model_len
    min_tokens: int = 0
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None        # top-k logprobs per sampled token (the sampled one always included)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: OutputKind = field(default=OutputKind.CUMULATIVE)

    def __post_init__(self) -> None:
        # Normalise list inputs (a natural thing to pass) into hashable tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is not None:
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        _check(isinstance(self.n, int) and self.n >= 1, "n", self.n, "must be an integer >= 1")
        _check(_is_number(self.temperature) and self.temperature >= 0, "temperature", self.temperature,
               "must be >= 0 (0 means greedy)")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k,
               "must be an integer >= 0 (0 or -1 disables it)")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]")
        _check(self.seed is None or isinstance(self.seed, int), "seed", self.seed, "must be an integer or None")
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
               "max_tokens", self.max_tokens, "must be an integer >= 1 or None")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", self.min_tokens,
               "must be an integer >= 0")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                   f"must be <= max_tokens={self.max_tokens}")
        if self.stop is not None:
            _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
                   "must be non-empty strings")
        if self.stop_token_ids is not None:
            _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                   self.stop_token_ids, "must be non-negative integers")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
               "logprobs", self.logprobs, f"must be an integer in [0, {MAX_LOGPROBS}] or None")
        if isinstance(self.output_kind, str):
            object.__setattr__(self, "output_kind", OutputKind(self.output_kind))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_seed(self, seed: int) -> "SamplingParams":
        return replace(self, seed=seed)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check(ok: bool, name: str, value, why: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r} {why}")
