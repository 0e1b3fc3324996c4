"""`jaxserve bench serve --slo ...` end to end: against a fake gRPC stream, against engine variants
in process (FakeLLM, then the real engine on the tiny random model). The SLOs are either so loose
that every whole request meets them on any machine, or so tight that none can: the counts this
checks never depend on the machine's speed."""

import json

import pytest

from jaxserve.bench import cli
from jaxserve.engine_args import engine_config

LOOSE = "ttft=100000,tpot=100000000"   # 28 hours to the first token, 28 hours per token
TIGHT = "ttft=0.000000001,tpot=100000000"


def bench(model_dir, out_dir, *argv):
    return cli.main(["bench", "serve", *argv, "--model", model_dir, "--output-dir", str(out_dir), "--no-progress",
                     "--num-warmup", "1"])


def load(res):
    with open(res["files"][0]) as f:
        return json.load(f)


def test_grpc_sweep_counts_rejected_and_cut_streams_as_misses(tiny_model_dir, tmp_path, monkeypatch):
    import asyncio
    import time

    import jaxserve.client

    refused, cut = [], []

    async def stream(prompt_token_ids, params):
        key = sum(prompt_token_ids)
        if key % 3 == 0:                      # the server turns it away
            refused.append(key)
            raise RuntimeError("RESOURCE_EXHAUSTED: too many waiting requests")
        n = params["max_tokens"]
        if key % 3 == 1 and n > 1:            # aborted half way
            cut.append(key)
            n //= 2
        for i in range(n):
            await asyncio.sleep(0.0005)
            yield [i], time.perf_counter()

    monkeypatch.setattr(jaxserve.client, "bench_stream", lambda target, api_key: (stream, "sha256:server"))
    res = bench(tiny_model_dir, tmp_path, "--num-prompts", "12", "--input-len", "8:16", "--output-len", "2:5",
                "--request-rate", "300,inf", "--slo", LOOSE, "--name", "grpc")
    data = load(res)
    assert refused and cut                        # the workload exercises both kinds of miss
    gp = data["extra"]["goodput"]["targets"]["jaxserve-grpc"]
    points = gp["points"]
    assert [p["rate"] for p in points] == [300.0, "inf"]
    assert sum(p["failed"] for p in points) == len(refused)
    assert sum(p["aborted"] for p in points) == len(cut)
    for p in points:
        assert p["sent"] == 12 and p["met"] == 12 - p["failed"] - p["aborted"]
        assert p["attainment"] == pytest.approx(p["met"] / 12)
        assert p["goodput_rps"] == pytest.approx(p["met"] / p["duration_s"])
    assert gp["goodput_rate"] == (None if min(p["attainment"] for p in points) < 0.9 else "inf")
    assert [len(r["config"]["failed_requests"]) for r in data["runs"]] == [p["failed"] for p in points]
    assert any(f.endswith("-attainment-vs-rate.png") for f in res["files"])


@pytest.fixture
def sharing_fake(fake_jaxserve, monkeypatch):
    """FakeLLM with LLM.sharing_runner's contract: scheduling knobs only, else ValueError."""
    from fake_llm import FakeLLM

    def sharing_runner(cls, other, **overrides):
        if set(overrides) - {"long_prefill_token_threshold", "max_num_partial_prefills"}:
            raise ValueError(f"sharing a runner can only change scheduling knobs, not {sorted(overrides)}")
        llm = FakeLLM(other.model, max_num_seqs=other.engine.max_num_seqs, **{**other.kwargs, **overrides})
        llm.shares = other
        fake_jaxserve.append(llm)
        return llm

    monkeypatch.setattr(FakeLLM, "sharing_runner", classmethod(sharing_runner), raising=False)
    return fake_jaxserve


def test_in_process_variants_take_turns_at_each_rate_on_shared_and_own_engines(tiny_model_dir, sharing_fake, tmp_path):
    res = bench(tiny_model_dir, tmp_path, "--num-prompts", "6", "--input-len", "8:16", "--output-len", "2:5",
                "--request-rate", "500,1000", "--slo", LOOSE, "--workload", "interference", "--long-share", "0.34",
                "--long-prompt-len", "40", "--long-output-len", "2",
                "--engine-variant", "default", "--engine-variant", "t0:long_prefill_token_threshold=0",
                "--engine-variant", "seqs2:max_num_seqs=2", "--name", "variants")
    data = load(res)
    base, seqs2 = [llm for llm in sharing_fake if not hasattr(llm, "shares")]   # built with weights, in order
    # the base runs the server's defaults, not LLM's offline ones
    assert base.kwargs["long_prefill_token_threshold"] is None
    assert base.kwargs["prefill_tile"] == engine_config().compilation.prefill_tile
    assert seqs2.engine.max_num_seqs == 2                  # a shape knob: an engine of its own
    shared = [llm for llm in sharing_fake if getattr(llm, "shares", None) is base]
    # one at build for each shared variant, then a fresh engine per run: 2 variants x (1 + 2 rates)
    assert len(shared) == 6
    thresholds = [llm.kwargs["long_prefill_token_threshold"] for llm in shared]
    assert thresholds.count(None) == 3 and thresholds.count(0) == 3
    assert [r["label"] for r in data["runs"]] == ["default@500.0", "t0@500.0", "seqs2@500.0",
                                                  "default@1000.0", "t0@1000.0", "seqs2@1000.0"]
    ids = [sorted(q["request_id"] for q in r["requests"]) for r in data["runs"]]
    assert ids[0] == ids[1] == ids[2] != ids[3] == ids[4] == ids[5]     # same requests at each rate
    assert all(r["config"]["api"] == "engine" for r in data["runs"])
    targets = data["extra"]["goodput"]["targets"]
    assert list(targets) == ["default", "t0", "seqs2"]
    for t in targets.values():
        assert [p["attainment"] for p in t["points"]] == [1.0, 1.0] and t["goodput_rate"] == 1000.0
        assert all(p["by_group"]["long"]["sent"] == 2 and p["by_group"]["chat"]["sent"] == 4 for p in t["points"])
    assert data["extra"]["goodput"]["goodput_over_first"] == {"t0": 1.0, "seqs2": 1.0}
    assert data["workload"]["params"]["num_long"] == 2
    assert sum(f.endswith(".png") for f in res["files"]) == 4   # bars, CDFs, TTFT and attainment against rate


def test_in_process_search_probes_low_then_stops_when_nothing_can_meet_the_slo(tiny_model_dir, sharing_fake, tmp_path):
    res = bench(tiny_model_dir, tmp_path, "--num-prompts", "4", "--input-len", "8:16", "--output-len", "2:3",
                "--request-rate", "search:100:1000", "--slo", TIGHT, "--in-process", "--no-plots")
    data = load(res)
    t = data["extra"]["goodput"]["targets"]["default"]
    assert t["search"]["probes"] == [{"rate": 100.0, "attainment": 0.0}] and t["goodput_rate"] is None
    assert t["points"][0]["missed_ttft"] == 4


@pytest.mark.slow
def test_real_engine_variants_on_the_tiny_model(tiny_model_dir, tmp_path):
    # start-up keeps nothing from other runs: what this measures must not depend on what the
    # machine's caches hold (an executable serialized under other XLA flags fails to load)
    res = bench(tiny_model_dir, tmp_path, "--num-prompts", "4", "--input-len", "8:24", "--output-len", "2:6",
                "--request-rate", "50", "--slo", LOOSE,
                "--max-model-len", "64", "--max-num-seqs", "4", "--num-kv-blocks", "32",
                "--max-num-batched-tokens", "64", "--engine-arg", "decode_buckets=(4,)",
                "--engine-arg", f"cache_dir={str(tmp_path / 'cache')!r}",
                "--engine-arg", f"compilation_cache_dir={str(tmp_path / 'xla')!r}",
                "--engine-variant", "default", "--engine-variant", "t0:long_prefill_token_threshold=0",
                "--engine-variant", "itl:chunk_policy='itl'",
                "--name", "real")
    data = load(res)
    runs = {r["backend"]: r for r in data["runs"]}
    assert set(runs) == {"default", "t0", "itl"}
    for r in runs.values():
        assert r["metrics"]["completed"] == 4
        assert r["engine_stats"]["steps"]["num_compilations_after_warmup"] == 0
        assert r["config"]["shares_runner_of"] == "jaxserve[base]"
    assert runs["t0"]["config"]["engine_kwargs"]["long_prefill_token_threshold"] == 0
    assert runs["default"]["config"]["engine_kwargs"]["long_prefill_token_threshold"] is None
    assert runs["default"]["engine_stats"]["steps"]["prefill_policy"].startswith("slo")
    assert runs["itl"]["engine_stats"]["steps"]["prefill_policy"].startswith("itl")
    for t in data["extra"]["goodput"]["targets"].values():
        assert t["points"][0]["attainment"] == 1.0 and t["goodput_rate"] == 50.0


@pytest.mark.slow
def test_real_engine_turning_requests_away_counts_misses_not_a_failed_run(tiny_model_dir, tmp_path):
    # all 6 at once to 2 seats with room for 1 more waiting: at least 3 are turned away
    res = bench(tiny_model_dir, tmp_path, "--num-prompts", "6", "--input-len", "8:24", "--output-len", "2:6",
                "--request-rate", "inf", "--slo", LOOSE,
                "--max-model-len", "64", "--max-num-seqs", "2", "--num-kv-blocks", "32",
                "--max-num-batched-tokens", "64", "--engine-arg", "decode_buckets=(2,)",
                "--engine-arg", "max_waiting_requests=1",
                "--engine-arg", f"cache_dir={str(tmp_path / 'cache')!r}",
                "--engine-arg", f"compilation_cache_dir={str(tmp_path / 'xla')!r}",
                "--in-process", "--name", "rejecting")
    data = load(res)
    (point,) = data["extra"]["goodput"]["targets"]["default"]["points"]
    assert point["sent"] == 6 and point["failed"] >= 3 and point["met"] == 6 - point["failed"]
    (run,) = data["runs"]
    assert run["metrics"]["completed"] == point["met"]
    assert any("turned away" in n for n in run["notes"])
