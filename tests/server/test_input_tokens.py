"""server/input_tokens.py: the cap on a request's input tokens summed over its prompts. Its default
(--max-prompts prompts of the longest runnable prompt), token ids counted as they are, texts
tokenized only when their byte bound passes the cap, and the refusal naming the cap and the flag."""

import asyncio

import pytest

from jaxserve.sched.limits import RequestLimits
from jaxserve.server.input_tokens import ADDED_TOKENS_BOUND, check_input_tokens, input_token_cap
from jaxserve.server.request_caps import RequestCaps


class CharTokenizer:
    """One token per two characters (rounded up) and a BOS: fewer tokens than bytes, as BPE
    gives; records what it was asked to encode."""

    def __init__(self):
        self.encoded = []

    def encode(self, text):
        self.encoded.append(text)
        return [1] + [0] * (-(-len(text) // 2))


class FakeAsyncEngine:
    def __init__(self, limits):
        self.tokenizer = CharTokenizer()
        self.engine = type("E", (), {"input_processor": type("D", (), {"limits": limits})()})()

    @property
    def tokenized(self):
        return self.tokenizer.encoded

    async def run_tokenizer(self, fn):
        return fn(self.tokenizer)


LIMITS = RequestLimits(max_model_len=128, block_size=4, num_pool_blocks=96)


def check(engine, prompts, caps):
    asyncio.run(check_input_tokens(engine, prompts, caps, what="the prompt"))


def test_the_default_is_max_prompts_of_the_longest_runnable_prompt():
    assert input_token_cap(RequestCaps(), LIMITS) == 64 * 128
    assert input_token_cap(RequestCaps(max_prompts=3), LIMITS) == 3 * 128
    # a pool smaller than max_model_len bounds the longest prompt instead
    assert input_token_cap(RequestCaps(max_prompts=3), RequestLimits(128, 4, 10)) == 3 * 40
    assert input_token_cap(RequestCaps(max_input_tokens=77), LIMITS) == 77
    with pytest.raises(ValueError, match="max_input_tokens"):
        RequestCaps(max_input_tokens=0)


def test_token_ids_are_counted_and_the_refusal_names_the_cap():
    engine = FakeAsyncEngine(LIMITS)
    caps = RequestCaps(max_input_tokens=100)
    check(engine, [{"prompt_token_ids": [5] * 50}, {"prompt_token_ids": [5] * 50}], caps)
    with pytest.raises(ValueError, match=r"101 tokens in all.*limit is 100 input tokens.*--max-input-tokens"):
        check(engine, [{"prompt_token_ids": [5] * 50}, {"prompt_token_ids": [5] * 51}], caps)
    assert engine.tokenized == []


def test_texts_are_tokenized_only_when_their_bound_passes_the_cap():
    engine = FakeAsyncEngine(LIMITS)
    caps = RequestCaps(max_input_tokens=100)
    short = "x" * (100 - ADDED_TOKENS_BOUND)        # its byte bound is the cap: never tokenized
    check(engine, [{"prompt": short}], caps)
    assert engine.tokenized == []
    # 150 bytes bound past the cap, but 1 + 75 tokens are within it: counted exactly, accepted
    check(engine, [{"prompt": "y" * 150}], caps)
    assert "y" * 150 in engine.tokenized
    # texts and ids together: 1 + 50 + 60 = 111 tokens
    with pytest.raises(ValueError, match="111 tokens"):
        check(engine, [{"prompt": "z" * 100}, {"prompt_token_ids": [5] * 60}], caps)
    # a multi-byte text: its bound counts bytes, not characters (one emoji is 4 bytes)
    engine = FakeAsyncEngine(LIMITS)
    check(engine, [{"prompt": "\U0001F30A" * 25}], caps)      # 100 bytes + the added bound > 100
    assert engine.tokenized
