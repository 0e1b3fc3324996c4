"""The cap on one request's input tokens, summed over its prompts (a completion's list of prompts,
an embeddings body's inputs): `--max-input-tokens`, RequestCaps.max_input_tokens.

Each prompt is already bounded by max_model_len; the sum is not, and an embeddings body of 4,096
inputs of 8,000 tokens each is hours of work on a small machine. The default is what the largest
completion request may already hold: --max-prompts prompts of the longest prompt the engine can
run (max_model_len, or the whole KV pool where that is smaller). Both fronts check it before any
input reaches the engine; the refusal names the cap and the flag.

Counting must not tokenize every body twice (the engine tokenizes each prompt at its door). A
token covers at least one byte of its text (byte-level BPE; SentencePiece with byte fallback), so a
text's UTF-8 length plus the special tokens the tokenizer adds bounds its token count: only a body
whose bound passes the cap is tokenized here, to count it exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from jaxserve.refusals import InputTokensExceeded

# special tokens a tokenizer adds around one text (BOS, EOS, a prefix space): more than any adds
ADDED_TOKENS_BOUND = 8


def input_token_cap(caps, limits) -> int:
    """The cap in force: `caps.max_input_tokens` (server/request_caps.py), or --max-prompts prompts
    of the longest runnable prompt (`limits`: the engine's sched RequestLimits)."""
    if caps.max_input_tokens is not None:
        return caps.max_input_tokens
    return caps.max_prompts * min(limits.max_model_len, limits.num_pool_blocks * limits.block_size)


async def check_input_tokens(aengine, prompts: Sequence[Mapping], caps, *, what: str) -> None:
    """ValueError naming the cap when the prompts' tokens sum past it. `prompts`: engine prompts
    ({"prompt": text} or {"prompt_token_ids": ids}); `what`: how the refusal names them."""
    cap = input_token_cap(caps, aengine.engine.input_processor.limits)
    known, texts = 0, []
    for p in prompts:
        ids = p.get("prompt_token_ids")
        if ids is not None:
            known += len(ids)
        else:
            texts.append(p["prompt"])
    bound = known + sum(len(t.encode("utf-8")) + ADDED_TOKENS_BOUND for t in texts)
    if bound <= cap:
        return
    total = known
    if texts:
        # the door's own encoding (engine/input_processor.py: tokenizer.encode, its special tokens)
        total += sum(await aengine.run_tokenizer(lambda tok: [len(tok.encode(t)) for t in texts]))
    if total > cap:
        raise InputTokensExceeded(f"{what} hold {total} tokens in all; this server's limit is {cap} input tokens per "
                         f"request (--max-input-tokens)")
