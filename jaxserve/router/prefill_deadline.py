"""How long the router waits for a prefill hop (router/disagg.py), learned per prefill engine.

A prefill engine that is stopped or cut off (SIGSTOP, a hung host, a partition) still accepts
connections and its health watch just stays silent, so nothing but a deadline ends a hop to it.
The hop's deadline is

    timeout_s                                           when --prefill-timeout-s is set (> 0), else
    floor_s + slack x (prompt tokens + tokens ahead) / the engine's prefill rate

and never longer than the client's remaining time. "Tokens ahead" are the uncached prompt tokens
of the router's other hops on that engine (it batches them with this one). The rate (tokens/s)
starts at `default_tokens_per_s` and is learned from the engine's completed hops: a moving mean
of (the tokens its prefix index did not match + tokens ahead) / the hop's seconds, from hops of
at least MIN_SAMPLE_TOKENS tokens (below that a hop's time is its fixed cost, not its rate). The
deadline assumes none of the prompt is cached there, so a prefix hit only makes it generous.

A hop that times out makes the engine suspect (replica.py: skipped until it answers a health
check again) and halves its rate, once for all the hops in flight there then: an engine slower
than believed gets doubling deadlines until its hops finish in time, rather than timing out for
ever.
"""

from __future__ import annotations

from dataclasses import dataclass

FAILURE_POLICIES = ("recompute", "fail")
MIN_SAMPLE_TOKENS = 32
RATE_WEIGHT = 0.3            # of a new sample in the moving mean
MIN_TOKENS_PER_S = 1.0       # the halving stops here


@dataclass(frozen=True, slots=True)
class PrefillHopConfig:
    """The router's prefill-hop flags (`jaxserve router --prefill ...`)."""

    timeout_s: float = 0.0                 # --prefill-timeout-s: > 0 sets every hop's deadline; 0 derives it
    floor_s: float = 3.0                   # a derived deadline's fixed part: RPC, queueing, one step
    slack: float = 4.0                     # times the expected prefill time
    default_tokens_per_s: float = 1000.0   # an engine's rate before its first measured hop
    suspect_s: float = 5.0                 # --prefill-suspect-s: a timed-out engine is skipped at least this long
    failure_policy: str = "recompute"      # --prefill-failure-policy: recompute (decode prefills) or fail

    def __post_init__(self) -> None:
        if self.timeout_s < 0:
            raise ValueError(f"--prefill-timeout-s {self.timeout_s} must be >= 0 (0: derived)")
        if self.floor_s <= 0 or self.slack < 1 or self.default_tokens_per_s <= 0:
            raise ValueError(f"prefill deadline floor_s={self.floor_s} must be > 0, slack={self.slack} >= 1, "
                             f"default_tokens_per_s={self.default_tokens_per_s} > 0")
        if self.suspect_s < 0:
            raise ValueError(f"--prefill-suspect-s {self.suspect_s} must be >= 0")
        if self.failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"--prefill-failure-policy {self.failure_policy!r} must be one of "
                             f"{', '.join(FAILURE_POLICIES)}")


class PrefillRate:
    """One prefill engine's learned rate, and the deadline it gives a hop."""

    def __init__(self, config: PrefillHopConfig):
        self.config = config
        self.tokens_per_s = config.default_tokens_per_s
        self.num_samples = 0

    def deadline_s(self, prompt_tokens: int, tokens_ahead: int, remaining_s: float | None) -> float:
        c = self.config
        own = c.timeout_s if c.timeout_s > 0 else \
            c.floor_s + c.slack * (prompt_tokens + tokens_ahead) / self.tokens_per_s
        return own if remaining_s is None else min(own, remaining_s)

    def observe(self, tokens: int, seconds: float) -> None:
        """A hop that ended with its lease: `tokens` computed (and ahead) in `seconds`."""
        if tokens < MIN_SAMPLE_TOKENS or seconds <= 0:
            return
        sample = tokens / seconds
        self.tokens_per_s = sample if self.num_samples == 0 else \
            (1 - RATE_WEIGHT) * self.tokens_per_s + RATE_WEIGHT * sample
        self.num_samples += 1

    def timed_out(self) -> None:
        self.tokens_per_s = max(MIN_TOKENS_PER_S, self.tokens_per_s / 2)
