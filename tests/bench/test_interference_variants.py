"""The interference benchmark's variants: each chunk size gets a step budget that can hold it."""

import pytest

from jaxserve.bench.cmd_interference import _variants


def test_variants_size_the_budget_for_their_chunk():
    v = dict(_variants("64,256,1024,none", budget=512, num_chats=16, tile=32, max_model_len=4352))
    assert v["default"] == {"long_prefill_token_threshold": None}          # the serving default
    assert v["chunk=64"] == {"long_prefill_token_threshold": 64, "max_num_batched_tokens": 512}
    assert v["chunk=256"] == {"long_prefill_token_threshold": 256, "max_num_batched_tokens": 512}
    assert v["chunk=1024"] == {"long_prefill_token_threshold": 1024, "max_num_batched_tokens": 1056}
    assert v["unchunked"] == {"enable_chunked_prefill": False, "max_num_batched_tokens": 4352}


def test_bad_chunk_size_is_rejected():
    with pytest.raises(ValueError, match="chunk-sizes"):
        _variants("0", budget=512, num_chats=16, tile=32, max_model_len=1024)


def test_variants_run_on_the_servers_prefill_tile_unless_one_is_given():
    import argparse

    from jaxserve.bench.args import add_common
    from jaxserve.bench.cmd_interference import serving_prefill_tile
    from jaxserve.engine_args import engine_config
    from jaxserve.llm import OFFLINE_PREFILL_TILE

    p = argparse.ArgumentParser()
    add_common(p, "jaxserve")
    assert serving_prefill_tile(p.parse_args([])) == engine_config().compilation.prefill_tile != OFFLINE_PREFILL_TILE
    assert serving_prefill_tile(p.parse_args(["--engine-arg", "prefill_tile=32"])) == 32


def test_median_round_is_the_round_with_the_median_ratio_and_skips_incomplete_rounds():
    from jaxserve.bench.cmd_interference import median_round

    def pair(p50, p99):
        return {"chats alone": {"chat_itl_p50_s": p50, "chat_itl_p99_s": 2 * p50},
                "default": {"chat_itl_p50_s": p99 / 2, "chat_itl_p99_s": p99}}

    rounds = {1: pair(0.1, 0.25), 2: pair(0.1, 0.18), 3: pair(0.1, 0.21), 4: {"chats alone": pair(0.1, 1)["chats alone"]}}
    assert median_round(rounds) == 3                 # ratios 2.5, 1.8, 2.1; round 4 has no default run
    assert median_round({1: pair(0.1, 0.25), 2: pair(0.1, 0.18)}) == 2   # even count: the lower middle
    assert median_round({1: {}}) is None
