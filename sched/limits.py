"""RequestLimits: every limit one request must meet, in one place, with the scheduler's formulas.

The engine's door (engine/input_processor.py) and the scheduler's own `add_request` both call
`check`, so a request the door accepts is one the scheduler can run to the end, and the numbers in
an error are the ones the scheduler would use.
"""

from __future__ import annotations

from dataclasses import dataclass


class ContextLengthExceeded(ValueError):
    """A prompt (with its output) that does not fit max_model_len or the KV pool: each field valid
    on its own, their sum not (jaxserve.refusals; the HTTP 400's code, as OpenAI's)."""
    code = "context_length_exceeded"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_model_len: int          # prompt + output tokens of one request
    block_size: int             # tokens per KV block
    num_pool_blocks: int        # KV blocks a request could ever hold (the whole usable pool)

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        """max_tokens when the user gives none: fill the model length."""
        return self.max_model_len - num_prompt_tokens

    def blocks_needed(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """Blocks a request holds at its longest: the last sampled token's K/V is never computed."""
        return cdiv(num_prompt_tokens + max_tokens - 1, self.block_size)

    def check(self, num_prompt_tokens: int, max_tokens: int, min_tokens: int = 0) -> None:
        """Raise ValueError, with the numbers, unless the request can run to its end."""
        n = num_prompt_tokens
        if n == 0:
            raise ValueError("the prompt is empty (0 tokens)")
        if n >= self.max_model_len:
            raise ContextLengthExceeded(
                f"the prompt has {n} tokens, but max_model_len is {self.max_model_len}: "
                f"at most {self.max_model_len - 1} prompt tokens leave room for one output token")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens!r} must be an integer >= 1")
        if not isinstance(min_tokens, int) or isinstance(min_tokens, bool) or not 0 <= min_tokens <= max_tokens:
            raise ValueError(f"min_tokens={min_tokens!r} must be an integer in [0, max_tokens={max_tokens}]")
        if n + max_tokens > self.max_model_len:
            raise ContextLengthExceeded(
                f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) is {n + max_tokens} tokens, "
                f"beyond max_model_len={self.max_model_len}")
        need = self.blocks_needed(n, max_tokens)
        if need > self.num_pool_blocks:
            raise ContextLengthExceeded(
                f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) needs {need} KV blocks of "
                f"{self.block_size} tokens, but the whole KV pool has {self.num_pool_blocks}; it could never run")
