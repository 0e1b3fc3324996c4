"""Speculative decoding's settings, and how many guessed tokens a step verifies.

A decoding request may carry draft tokens into a step: guesses of its next tokens (an n-gram
lookup over its own tokens, sched/ngram_proposer.py). The step computes them as extra decode rows
and samples a token at every row; the guesses are accepted while each equals the token sampled
one row before it (scheduler.update), so one step can produce up to k + 1 tokens for the price of
k more rows. Whether that pays depends on the machine and the batch: a row costs time (on our CPU
a decode row of the embedded model is compute, not only weight reads), and a guess is worth the
chance it is accepted. `DraftPlanner` makes that trade per step, with the decode-only step times
measured at start-up (rows -> seconds) and each request's acceptance rate so far:

    choose k (drafts per request) maximising  tokens expected / step time
    tokens expected = sum over requests of 1 + a + a^2 + ... + a^k  (a: its acceptance rate)
    step time       = the decode-only step of (requests + drafts) rows

k = 0 (no speculation) wins when the batch is large enough that extra rows cost more than the
accepted guesses save, or when the requests' guesses keep being rejected, so speculation turns
itself off under load. Only decode-only steps speculate: a step that carries a prompt chunk (or
may admit a request: one waits and a seat is free) has prompt work to do that drafts would only
delay.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Sequence

from jaxserve.sched.request import Request

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` shape: {"method": "ngram", "num_speculative_tokens": 4,
    "prompt_lookup_min": 1, "prompt_lookup_max": 4}."""

    method: str = "ngram"
    model: str | None = None              # method "draft_model": the draft's checkpoint (same tokenizer)
    num_speculative_tokens: int = 4       # most draft tokens per request per step
    prompt_lookup_min: int = 1            # shortest suffix of the request's tokens looked up
    prompt_lookup_max: int = 4            # longest one (tried first: a longer match predicts better)
    # acceptance rate assumed for a request with no history yet (its rate is then learned)
    prior_acceptance: float = 0.5
    # True: guess only where the measured step times say it pays (DraftPlanner); False: verify
    # every guess the lookup finds, within the compiled rows, whatever it costs (measurements, tests)
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method={self.method!r} must be one of {METHODS}")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError("speculative_config method='draft_model' needs \"model\": the draft's checkpoint path")
        if self.method == "ngram" and self.model is not None:
            raise ValueError(f"speculative_config method='ngram' takes no model (got model={self.model!r})")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"speculative_config num_speculative_tokens={k!r} must be an int in [1, 16]")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)) or not 1 <= lo <= hi:
            raise ValueError(f"speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{lo!r} and {hi!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config adaptive={self.adaptive!r} must be true or false")
        if not 0 < self.prior_acceptance < 1:
            raise ValueError(f"speculative_config prior_acceptance={self.prior_acceptance!r} must be in (0, 1)")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """From a dict (LLM(speculative_config={...})), a JSON string (the CLI flag), or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON ({e}): {value!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or a JSON object, got {value!r}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**value)


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a verification step yields on average: the sampled one plus each guess accepted in
    turn (guess j survives only if guesses 1..j-1 did)."""
    return sum(acceptance ** j for j in range(k + 1))


class DraftPlanner:
    """Per step: how many drafts each decoding request gets (0 = this step does not speculate)."""

    def __init__(self, config: SpeculativeConfig, max_rows: int,
                 step_seconds: Callable[[int], float] | None = None,
                 draft_seconds: Callable[[int], float] | None = None) -> None:
        """max_rows: most decode rows a step holds (the largest compiled decode-only bucket).
        step_seconds(rows): a decode-only step's time; None: rows are taken as free (tests).
        draft_seconds(requests): one decode step of the draft model (method draft_model), which
        runs k of them before a verification."""
        self.config = config
        self.max_rows = max_rows
        self.step_seconds = step_seconds
        self.draft_seconds = draft_seconds

    def acceptance(self, req: Request) -> float:
        """The request's acceptance rate: accepted / offered guesses, with the prior as one
        pseudo-trial, on counts that decay so a request whose text changes character is re-judged."""
        prior = self.config.prior_acceptance
        return (req.spec_accepted + prior) / (req.spec_trials + 1.0)

    def plan(self, proposals: Sequence[tuple[Request, Sequence[int]]], sync_s: float = 0.0) -> int:
        """proposals: each decoding request of the step with the drafts available to it. Returns k,
        the most drafts any request verifies this step (each takes min(k, what it has)). sync_s:
        what a step run without lookahead adds (the host's work, no longer hidden behind the
        device's): a speculating step pays it, a plain one does not."""
        b = len(proposals)
        if not b or not any(p for _, p in proposals):
            return 0
        best_k, best_rate = 0, None
        for k in range(0, self.config.num_speculative_tokens + 1):
            rows = b + sum(min(k, len(p)) for _, p in proposals)
            if rows > self.max_rows:
                break
            tokens = sum(expected_tokens(self.acceptance(r), min(k, len(p))) for r, p in proposals)
            seconds = self.step_seconds(rows) if self.step_seconds is not None else 1.0
            if k and self.step_seconds is not None:
                seconds += sync_s
                if self.draft_seconds is not None:
                    seconds += k * self.draft_seconds(sum(1 for _, p in proposals if p))
            rate = tokens / seconds
            if best_rate is None or rate > best_rate * 1.02:   # a longer step must win clearly
                best_k, best_rate = k, rate
        return best_k


def record_verification(req: Request, offered: int, accepted: int, decay: float = 0.9) -> None:
    """A step verified `offered` guesses of req and accepted the first `accepted`: trials are the
    accepted guesses plus the one rejected (if any); later guesses were never judged."""
    trials = accepted + (1 if accepted < offered else 0)
    req.spec_accepted = req.spec_accepted * decay + accepted
    req.spec_trials = req.spec_trials * decay + trials
