"""The jaxserve backend on the real engine (a tiny random Llama), side by side with HF static batching."""

import json

import pytest

from jaxserve.bench import cli


def test_jaxserve_and_hf_give_identical_greedy_tokens_and_the_engine_stays_clean(tiny_model_dir, tmp_path):
    res = cli.main([
        "bench", "throughput", "--model", tiny_model_dir, "--output-dir", str(tmp_path), "--no-progress",
        "--backend", "jaxserve,hf", "--num-prompts", "5", "--input-len", "8:40", "--output-len", "3:8",
        "--max-model-len", "64", "--max-num-seqs", "4", "--num-kv-blocks", "32", "--max-num-batched-tokens", "64",
        "--engine-arg", "decode_buckets=(4,)", "--jaxserve-api", "engine", "--no-plots",
    ])
    with open(res["files"][0]) as f:
        data = json.load(f)
    jx, hf = data["runs"]
    assert hf["agreement"]["compared"] == 5 and hf["agreement"]["identical"] == 5
    assert jx["checkpoint_identity"] and jx["checkpoint_identity"] != "unknown"
    stats = jx["engine_stats"]
    assert stats["steps"]["num_compilations_after_warmup"] == 0
    blocks = stats["scheduler"]
    assert blocks["num_kv_blocks_free"] + blocks["num_kv_blocks_cached"] == blocks["num_kv_blocks_total"]
    kv = jx["kv_usage"]
    assert 0 < kv["utilization_mean"] <= 1 and kv["peak_used_blocks"] <= kv["reserve_max_model_len_blocks"]
    assert all(len(r["token_times"]) == r["output_len"] for r in jx["requests"])


@pytest.mark.slow
def test_speculative_config_runs_jaxserve_with_and_without_it_on_one_runner(tiny_model_dir, tmp_path):
    res = cli.main([
        "bench", "throughput", "--model", tiny_model_dir, "--output-dir", str(tmp_path), "--no-progress",
        "--backend", "jaxserve,hf", "--dataset", "edit", "--num-prompts", "3", "--temperature", "0.8",
        "--max-model-len", "1024", "--max-num-seqs", "4", "--num-kv-blocks", "256", "--max-num-batched-tokens", "64",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "adaptive": false}',
        "--jaxserve-api", "engine", "--no-plots",
    ])
    with open(res["files"][0]) as f:
        data = json.load(f)
    assert [r["label"] for r in data["runs"]] == ["jaxserve", "jaxserve+spec"]
    plain, spec = data["runs"]
    # greedy only: the sampled workload skips it, saying why
    assert [s["backend"].split("[")[0] for s in data["extra"]["skipped"]] == ["hf"]
    # seeded sampling: the same tokens with and without speculation
    assert spec["agreement"]["compared"] == 3 and spec["agreement"]["identical"] == 3
    assert spec["engine_stats"]["scheduler"]["spec_num_verifications"] > 0
    assert plain["engine_stats"]["scheduler"]["spec_num_verifications"] == 0
    for run in data["runs"]:
        stats = run["engine_stats"]
        assert stats["num_compilations_after_warmup"] == 0
        assert stats["num_kv_blocks_free"] + stats["num_kv_blocks_cached"] == stats["num_kv_blocks_total"]
