"""The server's caps on one request, enforced by both fronts before the engine sees it.

Not the scheduler's RequestLimits (jaxserve.sched.limits: what max_model_len and the KV pool make
possible for any request); these are what an operator chooses to allow a client (`--max-n`,
`--max-tokens-limit`, `--max-prompts`, `--max-input-tokens`: server/input_tokens.py), below what
the engine could do."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestCaps:
    max_n: int = 1
    max_tokens: int | None = None        # None: only max_model_len bounds it
    max_stop_strings: int = 16
    # prompts in one /v1/completions request (each is an engine request of its own): enough for
    # batched evaluation clients (lm-eval sends its batch in one request), not a queue's worth
    max_prompts: int = 64
    # inputs in one embeddings request (each an engine request; they enter the engine a window at
    # a time: server/embedding_batches.py): OpenAI's API takes 2,048; twice that here
    max_embedding_inputs: int = 4096
    # a body's inputs in the engine at once: small keeps a completion beside a big body within
    # 2x of its idle latency (measured: docs/benchmarks.md), large runs the body faster
    embedding_window: int = 2
    # input tokens of one request, summed over its prompts (server/input_tokens.py); None: the
    # engine's --max-prompts x the longest prompt it can run
    max_input_tokens: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_n, int) or self.max_n < 1:
            raise ValueError(f"max_n={self.max_n!r} must be an integer >= 1")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer >= 1 or None")
        if self.max_input_tokens is not None and (not isinstance(self.max_input_tokens, int)
                                                  or isinstance(self.max_input_tokens, bool) or self.max_input_tokens < 1):
            raise ValueError(f"max_input_tokens={self.max_input_tokens!r} must be an integer >= 1 or None")
        for name in ("max_prompts", "max_embedding_inputs", "embedding_window"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} must be an integer >= 1")
