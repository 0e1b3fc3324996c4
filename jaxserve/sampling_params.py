"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM's shape).

Validated once at construction, so a bad value is a ValueError naming the field at the door and
never reaches the scheduler or the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import Enum

from jaxserve.structured_outputs import StructuredOutputs

MAX_LOGPROBS = 20  # the device computes this many top logprobs when any request asks
MAX_LOGIT_BIAS = 300   # entries of logit_bias a request may set: the sampler's fixed width (OpenAI's limit too)
MAX_ABS_LOGIT_BIAS = 100.0   # OpenAI's range, [-100, 100]: 100 bans or forces a token already
MAX_PENALTY = 2.0            # presence and frequency penalties in [-2, 2], as OpenAI defines them
MAX_REPETITION_PENALTY = 100.0
# Past this temperature the distribution is uniform to float32 precision for any sane logits; a
# larger value is a mistake (1e308 overflows the device's float32), not a wish for more randomness.
MAX_TEMPERATURE = 100.0
# The wire's and the device's integers are int32: top_k, token counts and token ids fit in it.
MAX_INT32 = 2**31 - 1
# Stop strings are searched in the new text after every token, on the engine's step thread: their
# number and length bound what one request's stop check may cost everyone else's step.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024


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
    # on the device, before temperature and the filters (vLLM's definitions): presence and frequency
    # over the output tokens, repetition over prompt and output; logit_bias {token id: bias}
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | tuple[tuple[int, float], ...] | None = None
    # the output must match a JSON schema, a regex, a choice or a grammar (llguidance, on the device)
    structured_outputs: StructuredOutputs | dict | None = None
    # for each prompt token after the first: its logprob given the tokens before it and the top-k
    # alternatives there (the first gets None); RequestOutput.prompt_logprobs. Needs an engine built
    # with enable_prompt_logprobs; such a request never reads the prefix cache (every prompt
    # position is computed)
    prompt_logprobs: int | None = None

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
        _check(_is_int(self.n) and self.n >= 1, "n", self.n, "must be an integer >= 1")
        _check(_is_finite(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE, "temperature",
               self.temperature, f"must be a finite number in [0, {MAX_TEMPERATURE:g}] (0 means greedy)")
        _check(_is_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        _check(_is_int(self.top_k) and 0 <= self.top_k <= MAX_INT32, "top_k", self.top_k,
               f"must be an integer in [0, {MAX_INT32}] (0 or -1 disables it)")
        _check(_is_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]")
        _check(self.seed is None or _is_int(self.seed), "seed", self.seed, "must be an integer or None")
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and 1 <= self.max_tokens <= MAX_INT32),
               "max_tokens", self.max_tokens, f"must be an integer in [1, {MAX_INT32}] or None")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= MAX_INT32, "min_tokens", self.min_tokens,
               f"must be an integer in [0, {MAX_INT32}]")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            from jaxserve.refusals import ConflictingFields   # each valid alone: no schema says it

            raise ConflictingFields(f"SamplingParams.min_tokens={self.min_tokens!r} must be <= "
                                    f"max_tokens={self.max_tokens}")
        if self.stop is not None:
            _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
                   "must be non-empty strings")
            _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"{len(self.stop)} strings",
                   f"may hold at most {MAX_STOP_STRINGS} strings")
            longest = max((len(s) for s in self.stop), default=0)
            _check(longest <= MAX_STOP_STRING_CHARS, "stop", f"a string of {longest} characters",
                   f"strings may be at most {MAX_STOP_STRING_CHARS} characters")
        if self.stop_token_ids is not None:
            _check(all(_is_int(t) and 0 <= t <= MAX_INT32 for t in self.stop_token_ids), "stop_token_ids",
                   self.stop_token_ids, f"must be integers in [0, {MAX_INT32}]")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
               "logprobs", self.logprobs, f"must be an integer in [0, {MAX_LOGPROBS}] or None")
        _check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs)
                                                and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
               "prompt_logprobs", self.prompt_logprobs, f"must be an integer in [0, {MAX_LOGPROBS}] or None")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(_is_finite(v) and -MAX_PENALTY <= v <= MAX_PENALTY, name, v,
                   f"must be a finite number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
        _check(_is_finite(self.repetition_penalty) and 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY,
               "repetition_penalty", self.repetition_penalty,
               f"must be a finite number in (0, {MAX_REPETITION_PENALTY:g}] (1 means none)")
        if self.logit_bias is not None:
            items = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
            try:
                bias = tuple(sorted((t, b) for t, b in items))
            except (TypeError, ValueError):
                bias = None
            _check(bias is not None, "logit_bias", self.logit_bias, "must map token ids to biases")
            _check(len(bias) <= MAX_LOGIT_BIAS, "logit_bias", f"<{len(bias)} entries>",
                   f"may hold at most {MAX_LOGIT_BIAS} entries")
            for t, b in bias:
                _check(_is_int(t) and 0 <= t <= MAX_INT32, "logit_bias", f"{{{t!r}: ...}}",
                       f"keys must be token ids, integers in [0, {MAX_INT32}]")
                _check(_is_finite(b) and abs(b) <= MAX_ABS_LOGIT_BIAS, "logit_bias", f"{{{t}: {b!r}}}",
                       f"values must be finite numbers in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}]")
            object.__setattr__(self, "logit_bias", bias or None)
        object.__setattr__(self, "structured_outputs", StructuredOutputs.coerce(self.structured_outputs))
        if isinstance(self.output_kind, str):
            object.__setattr__(self, "output_kind", OutputKind(self.output_kind))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler changes this request's logits before choosing (penalties, bias)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or bool(self.logit_bias))

    def with_seed(self, seed: int) -> "SamplingParams":
        return replace(self, seed=seed)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_finite(x) -> bool:
    """A real number that is neither NaN nor infinite (bools are not numbers here)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check(ok: bool, name: str, value, why: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r} {why}")
