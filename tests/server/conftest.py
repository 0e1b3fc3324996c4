"""Fixtures of the server tests: one in-process tiny engine, compiled once per session into a
persistent compilation cache that the server processes then load instead of compiling again."""

import pytest

from tests.server.shapes import SERVER_ENGINE


@pytest.fixture(scope="session")
def xla_cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("xla-cache"))


@pytest.fixture(scope="session")
def tiny_llm(tiny_llama_dir, xla_cache_dir):
    from jaxserve import LLM

    return LLM(tiny_llama_dir, **dict(SERVER_ENGINE, compilation_cache_dir=xla_cache_dir))
