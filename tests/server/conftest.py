"""Fixtures of the server tests: one in-process tiny engine, compiled once per session into a
persistent compilation cache that the server processes then load instead of compiling again."""

import pytest

from tests.server.shapes import SERVER_ENGINE


@pytest.fixture(scope="session")
def xla_cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("xla-cache"))


# The tiny Qwen3 of tests/server/tiny_chat_model.py (a template that renders tools and thinks),
# with room for prompts that carry tool schemas: the tool-calling and reasoning tests share it.
CHAT_ENGINE = dict(SERVER_ENGINE, max_model_len=1024, block_size=16, num_kv_blocks=320, max_num_batched_tokens=64,
                   prefill_tile=16, decode_buckets=(4,), decode_only_buckets=(1, 4), prefill_buckets=(0, 4))


@pytest.fixture(scope="session")
def tiny_chat_llm(tmp_path_factory):
    from jaxserve import LLM
    from tests.server.tiny_chat_model import make_tiny_chat_qwen3

    return LLM(make_tiny_chat_qwen3(tmp_path_factory.mktemp("tiny-chat-qwen3")), **CHAT_ENGINE)


@pytest.fixture(scope="session")
def tiny_llm(tiny_llama_dir, xla_cache_dir):
    from jaxserve import LLM

    return LLM(tiny_llama_dir, **dict(SERVER_ENGINE, compilation_cache_dir=xla_cache_dir))
