"""Validating prompts at the door: every bad input becomes a ValueError here, before the
scheduler sees it, with the numbers that explain it (as vLLM's server does)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from jaxserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]
    cache_salt: str | None
    max_tokens: int


_PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}


def process_prompt(prompt: Any, params: SamplingParams, *, tokenizer, vocab_size: int, max_model_len: int,
                   max_blocks: int | None = None, block_size: int = 16) -> ProcessedPrompt:
    cache_salt = None
    text = None
    if isinstance(prompt, str):
        text = prompt
        ids = None
    elif isinstance(prompt, Mapping):
        unknown = set(prompt) - _PROMPT_KEYS
        if unknown:
            raise ValueError(f"unknown prompt field(s) {sorted(unknown)}; allowed: {sorted(_PROMPT_KEYS)}")
        cache_salt = prompt.get("cache_salt")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {cache_salt!r}")
        if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError("a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'")
        text = prompt.get("prompt")
        ids = prompt.get("prompt_token_ids")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"prompt must be a string, got {type(text).__name__}")
    else:
        raise ValueError(f"a prompt must be a string or a dict, got {type(prompt).__name__}")

    if ids is None:
        if not text:
            raise ValueError("the prompt is empty")
        ids = tokenizer.encode(text)
    else:
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt_token_ids must be a list of integers")
        ids = list(ids)
    if not ids:
        raise ValueError("the prompt is empty (0 tokens)")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id(s) {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    n = len(ids)
    if n >= max_model_len:
        raise ValueError(
            f"the prompt has {n} tokens, but max_model_len is {max_model_len}: "
            f"at most {max_model_len - 1} prompt tokens leave room for one output token")
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - n
    if n + max_tokens > max_model_len:
        raise ValueError(
            f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) is {n + max_tokens} tokens, "
            f"beyond max_model_len={max_model_len}")
    if max_blocks is not None:
        need = -(-(n + max_tokens) // block_size)
        if need > max_blocks:
            raise ValueError(
                f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) needs {need} KV blocks of "
                f"{block_size} tokens, but the whole KV pool has {max_blocks}")
    return ProcessedPrompt(text, ids, cache_salt, max_tokens)
