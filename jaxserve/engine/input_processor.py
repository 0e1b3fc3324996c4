"""The door: every check a request must pass, once, before anything of it reaches the scheduler.

`InputProcessor.process` turns what a user sent (a prompt string or dict, SamplingParams, a
priority) into an `EngineRequest` or raises ValueError with the numbers that explain why not (as
vLLM's server does). Length and KV limits use the scheduler's own formulas (`RequestLimits`), so
what the door accepts the scheduler can run to its end. It holds no engine state and only reads
the tokenizer, so a server may call it off the engine's step thread (a long prompt's tokenization
then stalls no one).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jaxserve.engine.grammar import GrammarCompiler
from jaxserve.lora.request import LoRARequest
from jaxserve.pooling_params import PoolingParams
from jaxserve.refusals import FeatureDisabled
from jaxserve.runner.token_mask import TokenConstraint
from jaxserve.sampling_params import SamplingParams
from jaxserve.sched.limits import RequestLimits
from jaxserve.sched.sampling import MAX_BANNED_IDS


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A validated request: what the engine queues."""

    prompt: str | None                 # the text, when the user sent text
    prompt_token_ids: list[int]
    cache_salt: str | None
    params: SamplingParams
    max_tokens: int                    # params.max_tokens, or what max_model_len leaves
    priority: int
    # structured output: one grammar state per sample, built here (off the step thread)
    constraints: tuple[TokenConstraint, ...] = ()
    pooling: PoolingParams | None = None   # an embedding request (params: its one dropped token)
    # the LoRA adapter it runs under (None: the base model); the engine resolves it in its registry
    lora_request: LoRARequest | None = None
    # that adapter's files, read off the step thread when it is not registered yet
    # (Engine.read_lora; lora/registry.py ReadAdapter), so registering it on the step thread reads nothing
    lora_read: object = None


_PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}


class InputProcessor:
    def __init__(self, *, tokenizer, vocab_size: int, limits: RequestLimits, eos_token_ids: frozenset[int],
                 prompt_logprobs: bool = False, embeddings: bool = False):
        self.tokenizer = tokenizer
        self.prompt_logprobs = prompt_logprobs    # whether the runner computes prompt logprobs
        self.embeddings = embeddings              # whether the runner pools hidden states
        self.vocab_size = vocab_size
        self.limits = limits
        self.eos_token_ids = frozenset(eos_token_ids)
        self.grammars = GrammarCompiler(tokenizer, vocab_size, self.eos_token_ids)

    def process(self, prompt: Any, params: SamplingParams | PoolingParams | None = None, *,
                priority: int = 0, lora_request: LoRARequest | None = None) -> EngineRequest:
        params = SamplingParams() if params is None else params
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a jaxserve.LoRARequest, got {type(lora_request).__name__}")
        pooling = None
        if isinstance(params, PoolingParams):   # an embedding: the prompt and one dropped token
            if not self.embeddings:
                raise ValueError("embeddings need an engine built with enable_embeddings=True "
                                 "(jaxserve serve --enable-embeddings)")
            pooling, params = params, params.sampling_params()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority={priority!r} must be an integer")
        text, ids, cache_salt = self._prompt(prompt)
        if ids is None:
            if not text:
                raise ValueError("the prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: send prompt_token_ids")
            ids = list(self.tokenizer.encode(text))
        n = len(ids)
        if n == 0:
            raise ValueError("the prompt is empty (0 tokens)")
        # the limits first: a prompt too long to run is refused before its ids are scanned
        max_tokens = params.max_tokens if params.max_tokens is not None else self.limits.default_max_tokens(n)
        self.limits.check(n, max_tokens, params.min_tokens)
        self._check_ids("prompt token id(s)", ids)
        if params.stop_token_ids:
            self._check_ids("SamplingParams.stop_token_ids", params.stop_token_ids)
        if params.logit_bias:
            self._check_ids("SamplingParams.logit_bias token id(s)", [t for t, _ in params.logit_bias])
        if params.prompt_logprobs is not None and not self.prompt_logprobs:
            raise FeatureDisabled(f"SamplingParams.prompt_logprobs={params.prompt_logprobs} needs an engine built with "
                             f"enable_prompt_logprobs=True (jaxserve serve --enable-prompt-logprobs)")
        if params.min_tokens:
            banned = self.banned_before_min_tokens(params)
            if len(banned) > MAX_BANNED_IDS:
                raise ValueError(
                    f"min_tokens={params.min_tokens} must hold back {len(banned)} ids (EOS and stop_token_ids) "
                    f"until it is reached; at most {MAX_BANNED_IDS} can be held back")
        constraints = ()
        if params.structured_outputs is not None:
            grammar = self.grammars.compile(params.structured_outputs)
            constraints = tuple(self.grammars.constraint(grammar) for _ in range(params.n))
        return EngineRequest(text, ids, cache_salt, params, max_tokens, priority, constraints, pooling, lora_request)

    def banned_before_min_tokens(self, params: SamplingParams) -> tuple[int, ...]:
        eos = set() if params.ignore_eos else set(self.eos_token_ids)
        return tuple(sorted(eos | set(params.stop_token_ids or ())))

    def _check_ids(self, what: str, ids) -> None:
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"{what} must be integers")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{what} {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")

    @staticmethod
    def _prompt(prompt: Any) -> tuple[str | None, list[int] | None, str | None]:
        """(text, token ids, cache salt) of a prompt string or dict; exactly one of text and ids."""
        if isinstance(prompt, str):
            return prompt, None, None
        if not isinstance(prompt, Mapping):
            raise ValueError(f"a prompt must be a string or a dict, got {type(prompt).__name__}")
        unknown = set(prompt) - _PROMPT_KEYS
        if unknown:
            raise ValueError(f"unknown prompt field(s) {sorted(unknown)}; allowed: {sorted(_PROMPT_KEYS)}")
        cache_salt = prompt.get("cache_salt")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {cache_salt!r}")
        if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError("a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'")
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"prompt must be a string, got {type(text).__name__}")
        ids = prompt.get("prompt_token_ids")
        if ids is not None:
            if not isinstance(ids, (list, tuple)):
                raise ValueError("prompt_token_ids must be a list of integers")
            ids = list(ids)  # each id is checked after the length (process)
        return text, ids, cache_salt
