"""Choosing the prefill chunk size from an inter-token-latency budget.

With chunked prefill, every step carries the running decodes plus at most one chunk of prompt
tokens per prefilling request. A decoding request waits one whole step per token, so the step time
is its inter-token latency (ITL). If a step that adds a chunk of C prompt tokens costs about
C / prefill_tokens_per_s more than a decode-only step, then keeping ITL within a budget B above
the decode-only step time means C <= B * prefill_tokens_per_s. That is the largest chunk the ITL
budget allows; a larger chunk shortens long prompts' time to first token (fewer, fuller steps) at
the chats' expense. The engine measures prefill throughput and passes the result as
`long_prefill_token_threshold` (and usually as the token budget's share for prefill).
"""

from __future__ import annotations


def max_chunk_for_itl(itl_budget_s: float, prefill_tokens_per_s: float, *, multiple: int = 16, minimum: int = 16) -> int:
    """Largest prefill chunk (tokens, a multiple of `multiple`, at least `minimum`) whose extra
    step time stays within `itl_budget_s` at `prefill_tokens_per_s`."""
    if not itl_budget_s > 0:
        raise ValueError(f"itl_budget_s must be > 0, got {itl_budget_s!r}")
    if not prefill_tokens_per_s > 0:
        raise ValueError(f"prefill_tokens_per_s must be > 0, got {prefill_tokens_per_s!r}")
    if multiple < 1 or minimum < 1:
        raise ValueError(f"multiple and minimum must be >= 1, got {multiple}, {minimum}")
    c = int(itl_budget_s * prefill_tokens_per_s) // multiple * multiple
    return max(c, minimum)
