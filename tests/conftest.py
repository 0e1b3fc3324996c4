"""Shared fixtures: tiny random-weight models written once per session (never downloaded)."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from jaxserve.testing.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=0)


@pytest.fixture(scope="session")
def xla_cache_dir(tmp_path_factory):
    """One persistent compilation cache for every test that starts `jaxserve serve` processes of
    the tiny model (router, disagg): the first start compiles, the others load."""
    return str(tmp_path_factory.mktemp("xla-cache"))


# Small shapes: 4 seats, a 32-token budget in tiles of 8, blocks of 4 tokens; few buckets.
TINY_ENGINE = dict(max_num_seqs=4, max_model_len=128, block_size=4, prefill_tile=8, max_num_batched_tokens=32,
                   num_kv_blocks=96, swap_space=1 << 20, xla_optimization_level=0, compilation_cache_dir="",
                   cache_dir="", progress=False, long_prefill_token_threshold=0)
# cache_dir="" (like compilation_cache_dir="") keeps every test's start-up from reading what an earlier run
# kept (executables, calibration timings, identities); tests of those caches pass their own tmp_path.
# long_prefill_token_threshold=0 keeps the tests' chunking deterministic: the default derives it
# from timings measured at start-up (tests/engine/test_chunk_policy.py covers that path).


# TINY_ENGINE serving prompt logprobs, on few buckets (each compiles a step and a prompt-logprob
# function): the engine tests of prompt logprobs and the HTTP echo tests share one.
PROMPT_LOGPROBS_ENGINE = dict(TINY_ENGINE, enable_prompt_logprobs=True, decode_buckets=(4,),
                              decode_only_buckets=(1, 4), prefill_buckets=(0, 4))


@pytest.fixture(scope="session")
def prompt_logprobs_llm(tiny_llama_dir):
    from jaxserve import LLM

    return LLM(tiny_llama_dir, **PROMPT_LOGPROBS_ENGINE)


# TINY_ENGINE serving embeddings, on the same few buckets: the engine tests of embeddings and the
# /v1/embeddings and Embed RPC tests share one.
EMBEDDING_ENGINE = dict(TINY_ENGINE, enable_embeddings=True, decode_buckets=(4,), decode_only_buckets=(1, 4),
                        prefill_buckets=(0, 4))


@pytest.fixture(scope="session")
def embedding_llm(tiny_llama_dir):
    from jaxserve import LLM

    return LLM(tiny_llama_dir, **EMBEDDING_ENGINE)


# Markers whose tests run only when `-m` names them: CI's default run stays well under 15 minutes
# on 2 cores. slow: the full from_pretrained comparison, benchmark commands end to end, checks
# another test covers on a smaller model; full_grid: the whole kernel case grid.
OPT_IN_MARKERS = {"slow": "slow: run with -m slow", "full_grid": "full kernel grid: run with -m full_grid"}


def pytest_collection_modifyitems(config, items):
    asked = config.getoption("-m") or ""
    for marker, reason in OPT_IN_MARKERS.items():
        if marker in asked:
            continue
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)
