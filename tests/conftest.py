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


def pytest_collection_modifyitems(config, items):
    # `slow` tests (the full from_pretrained comparison, end-to-end runs of benchmark commands,
    # checks another test covers on a smaller model) run only when asked for with `-m slow`: the
    # default run, which CI takes, stays well under 15 minutes on 2 cores
    if "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
