"""Fixtures of the server tests: one in-process tiny engine (compiled once) and the engine flags
that give a `jaxserve serve` subprocess the same shapes."""

import pytest

from tests.conftest import TINY_ENGINE

# max_prefill_seqs = max_num_seqs: the runner then compiles tiles for every seat mid-prefill, so a
# step never outgrows its buckets whatever the scheduler's partial-prefill policy admits
# (with TINY_ENGINE's 2, four short prompts finishing prefill together overflowed the buckets).
# The in-process engine and the server processes share one persistent compilation cache, so the
# servers load what the in-process engine compiled.
SERVER_ENGINE = dict(TINY_ENGINE, max_prefill_seqs=TINY_ENGINE["max_num_seqs"])


@pytest.fixture(scope="session")
def xla_cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("xla-cache"))


@pytest.fixture(scope="session")
def tiny_llm(tiny_llama_dir, xla_cache_dir):
    from jaxserve import LLM

    return LLM(tiny_llama_dir, **dict(SERVER_ENGINE, compilation_cache_dir=xla_cache_dir))


def tiny_engine_flags(compilation_cache_dir: str = "") -> list[str]:
    """SERVER_ENGINE as `jaxserve serve` flags (the same EngineConfig fields, so the same model)."""
    flags = []
    for name, value in SERVER_ENGINE.items():
        if name in ("progress", "compilation_cache_dir"):
            continue
        flags += ["--" + name.replace("_", "-"), str(value)]
    return flags + ["--compilation-cache-dir", compilation_cache_dir]
