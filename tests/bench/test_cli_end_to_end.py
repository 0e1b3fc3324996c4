"""Every `jaxserve bench` subcommand and `jaxserve plan`, end to end on tiny models.

The jaxserve backend runs on FakeLLM here (no compilation); the PyTorch backends run a tiny
random Llama for real. test_real_engine.py runs the real jaxserve engine once.
"""

import json
import os

import pytest

from jaxserve.bench import cli
from jaxserve.bench.results import SCHEMA


def bench(model_dir, out_dir, *argv):
    return cli.main(["bench", *argv, "--model", model_dir, "--output-dir", str(out_dir), "--no-progress",
                     "--num-warmup", "1"])


def check_files(result, n_png):
    files = result["files"]
    with open(files[0]) as f:
        data = json.load(f)
    assert data["schema"] == SCHEMA and data["runs"]
    pngs = [p for p in files if p.endswith(".png")]
    assert len(pngs) == n_png
    import matplotlib.image

    for p in pngs:
        img = matplotlib.image.imread(p)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    return data


def test_throughput_runs_every_backend_side_by_side(tiny_model_dir, fake_jaxserve, tmp_path):
    res = bench(tiny_model_dir, tmp_path, "throughput", "--backend", "jaxserve,hf,hf-cb", "--num-prompts", "5",
                "--input-len", "8:40", "--output-len", "2:6", "--hf-batch-size", "2", "--name", "tp")
    data = check_files(res, 2)
    assert [r["backend"] for r in data["runs"]] == ["jaxserve", "hf", "hf-cb"]
    wanted = {f"random-{i}" for i in range(5)}
    for run in data["runs"]:
        assert {r["request_id"] for r in run["requests"]} == wanted
        assert run["metrics"]["completed"] == 5
        assert run["metrics"]["total_output_tokens"] == data["workload"]["total_output_tokens"]
        assert all(len(r["token_times"]) == r["output_len"] for r in run["requests"])
    # the PyTorch paths agree with each other: same weights, same token ids, greedy
    hf_cb = data["runs"][2]["agreement"]
    assert hf_cb["reference"] == "jaxserve" and hf_cb["compared"] == 5
    assert data["runs"][0]["checkpoint_identity"] == "sha256:fake"
    assert data["runs"][1]["checkpoint_identity"] == data["model"]["files_sha256"]
    assert data["environment"]["packages"]["torch"]
    assert fake_jaxserve[0].model == os.path.abspath(tiny_model_dir)
    assert fake_jaxserve[0].progress is False   # --no-progress also silences compiling and warm-up
    from transformers.utils import logging as hf_logging

    try:
        assert not hf_logging.is_progress_bar_enabled()   # ... and transformers' weight loading
    finally:
        hf_logging.enable_progress_bar()


def test_throughput_repeats_take_turns_on_one_loaded_backend_each_and_report_median_ratios(
        tiny_model_dir, fake_jaxserve, tmp_path, capsys):
    res = bench(tiny_model_dir, tmp_path, "throughput", "--backend", "jaxserve,hf", "--num-prompts", "4",
                "--input-len", "40:60", "--output-len", "2:4", "--hf-batch-size", "2", "--repeats", "3",
                "--name", "rep")
    data = check_files(res, 2)
    runs = data["runs"]
    assert [(r["backend"], r["config"]["repeat"]) for r in runs] == [
        ("jaxserve", 1), ("hf", 1), ("jaxserve", 2), ("hf", 2), ("jaxserve", 3), ("hf", 3)]
    assert len(set(r["label"] for r in runs)) == 6 and runs[0]["label"] == "jaxserve#1"
    assert len(fake_jaxserve) == 1                                  # built and warmed once
    # each round starts from a cold prefix cache: the same prompts are not answered from round 1
    assert all(q["num_cached_tokens"] == 0 for r in runs if r["backend"] == "jaxserve" for q in r["requests"])
    tput = {(r["backend"], r["config"]["repeat"]): r["metrics"]["output_throughput"] for r in runs}
    summary = data["extra"]["repeats"]
    ratios = [tput["jaxserve", k] / tput["hf", k] for k in (1, 2, 3)]
    assert summary["reference"] == "jaxserve"
    assert summary["ratio_of_reference"]["hf"]["per_round"] == pytest.approx(ratios)
    assert summary["ratio_of_reference"]["hf"]["median"] == pytest.approx(sorted(ratios)[1])
    assert summary["output_throughput"]["hf"]["median"] == pytest.approx(sorted(tput["hf", k] for k in (1, 2, 3))[1])
    assert "median" in capsys.readouterr().out


@pytest.mark.parametrize("extra", [["--repeats", "0"], ["--repeats", "2", "--request-rate", "1,2"]])
def test_throughput_repeats_reject_what_they_cannot_do(tiny_model_dir, fake_jaxserve, tmp_path, extra):
    with pytest.raises(SystemExit, match="--repeats"):
        bench(tiny_model_dir, tmp_path, "throughput", "--backend", "jaxserve", "--num-prompts", "2", *extra)


def test_throughput_rate_sweep_uses_the_engine_loop_and_plots_ttft_against_rate(tiny_model_dir, fake_jaxserve,
                                                                                tmp_path):
    res = bench(tiny_model_dir, tmp_path, "throughput", "--backend", "jaxserve", "--num-prompts", "4",
                "--input-len", "8:16", "--output-len", "2:4", "--request-rate", "200,inf", "--max-concurrency", "3")
    data = check_files(res, 3)
    assert [r["config"]["request_rate"] for r in data["runs"]] == [200.0, "inf"]
    assert all(r["config"]["api"] == "engine" for r in data["runs"])     # the cap needs the step loop
    assert data["runs"][0]["kv_usage"]["num_samples"] > 0


def test_static_hf_refuses_timed_arrivals_and_the_skip_is_recorded(tiny_model_dir, fake_jaxserve, tmp_path):
    res = bench(tiny_model_dir, tmp_path, "throughput", "--backend", "jaxserve,hf", "--num-prompts", "2",
                "--input-len", "8", "--output-len", "2", "--request-rate", "100", "--no-plots")
    data = check_files(res, 0)
    assert [r["backend"] for r in data["runs"]] == ["jaxserve"]
    assert "request-rate inf" in data["extra"]["skipped"][0]["reason"]


def test_latency_sweep_feeds_plan(tiny_model_dir, fake_jaxserve, tmp_path, capsys):
    res = bench(tiny_model_dir, tmp_path, "latency", "--backend", "jaxserve,hf", "--batch-size", "1,2,4",
                "--input-len", "12", "--output-len", "3", "--num-iters", "2", "--num-iters-warmup", "1",
                "--name", "lat")
    data = check_files(res, 2)
    sweep = data["extra"]["latency_sweep"]
    assert [p["batch_size"] for p in sweep["hf"]] == [1, 2, 4]
    assert all(p["output_tok_s"] > 0 for p in sweep["jaxserve"])
    assert len(data["runs"]) == 6 and all(len(r["config"]["iteration_latencies_s"]) == 2 for r in data["runs"])
    prompts = [tuple(r["request_id"] for r in run["requests"]) for run in data["runs"]]
    assert len({p for ps in prompts for p in ps}) == (1 + 2 + 4) * 2   # ids per batch size and iteration
    p = cli.main(["plan", "--rate", "2", "--duration", "1.5", "--results", res["files"][0], "--backend", "hf"])
    assert p["concurrency"] == pytest.approx(3.0) and p["knee_batch"] in (1, 2, 4)
    assert "Little's law" in capsys.readouterr().out


def test_prefix_compares_cache_on_and_off(tiny_model_dir, fake_jaxserve, tmp_path):
    res = bench(tiny_model_dir, tmp_path, "prefix", "--num-groups", "2", "--prompts-per-group", "3",
                "--system-prompt-len", "48", "--question-len", "8", "--answer-len", "3",
                "--parallel-prompt-len", "40", "--parallel-output-len", "2")
    data = check_files(res, 3)
    table = data["extra"]["prefix_table"]
    assert table["jaxserve[prefix-cache=on]"]["prefix_hit_rate"] > 0
    assert table["jaxserve[prefix-cache=off]"]["prefix_hit_rate"] == 0
    assert set(data["extra"]["ratios"]) == {"ttft_mean_off_over_on", "throughput_on_over_off"}
    ps = data["extra"]["parallel_sampling"]
    assert "NotImplementedError" in ps["n_samples_cache_on"]["error"]      # the fake samples one sequence
    assert ps["independent_cache_off"]["peak_blocks"] >= 4 * 3             # 4 x ceil(40 / 16)
    assert [llm.engine.prefix_caching for llm in fake_jaxserve] == [True, False]


def test_interference_runs_each_chunk_setting_on_a_fresh_engine(tiny_model_dir, fake_jaxserve, tmp_path):
    res = bench(tiny_model_dir, tmp_path, "interference", "--num-chats", "3", "--chat-prompt-len", "8",
                "--chat-output-len", "6", "--num-long", "2", "--long-prompt-len", "100", "--long-interval", "0.001",
                "--chunk-sizes", "32,none")
    data = check_files(res, 3)
    table = data["extra"]["interference_table"]
    assert list(table) == ["chats alone", "default", "chunk=32", "unchunked"]
    assert table["default"]["long_ttft_mean_s"] > 0 and table["chats alone"]["chat_itl_p50_s"] > 0
    assert [llm.kwargs.get("long_prefill_token_threshold") for llm in fake_jaxserve] == [None, 32, None]
    assert fake_jaxserve[2].kwargs["enable_chunked_prefill"] is False
    assert fake_jaxserve[0].max_model_len == 256   # raised to fit 100 + 8 tokens, rounded to 256
    longs = [r for r in data["runs"][1]["requests"] if r["group"] == "long"]
    chats = [r for r in data["runs"][1]["requests"] if r["group"] == "chat"]
    assert min(r["arrival_time"] for r in longs) >= max(r["first_token_time"] for r in chats)
    assert "itl_target_met (<= 2)" in data["extra"]["targets"]


def test_interference_repeats_the_baseline_and_default_pair_and_tables_the_median_round(
        tiny_model_dir, fake_jaxserve, tmp_path):
    res = bench(tiny_model_dir, tmp_path, "interference", "--num-chats", "3", "--chat-prompt-len", "8",
                "--chat-output-len", "6", "--num-long", "2", "--long-prompt-len", "100", "--long-interval", "0.001",
                "--chunk-sizes", "32", "--repeats", "3")
    data = check_files(res, 3)
    assert len(fake_jaxserve) == 2                         # the rounds share the default engine
    assert [r["label"] for r in data["runs"]] == [
        "jaxserve[chats alone]#1", "jaxserve[default]#1", "jaxserve[chats alone]#2", "jaxserve[default]#2",
        "jaxserve[chats alone]#3", "jaxserve[default]#3", "jaxserve[chunk=32]"]
    rounds = data["extra"]["rounds"]
    ratios = {k: r["default"]["chat_itl_p99_s"] / r["chats alone"]["chat_itl_p50_s"] for k, r in rounds.items()}
    assert set(ratios) == {"1", "2", "3"}
    assert all(rounds[k]["ratio"] == pytest.approx(v) for k, v in ratios.items())
    median = sorted(ratios.values())[1]
    assert ratios[str(data["extra"]["median_round"])] == pytest.approx(median)
    table = data["extra"]["interference_table"]
    assert list(table) == ["chats alone", "default", "chunk=32"]
    assert data["extra"]["targets"]["chat_p99_itl_over_baseline_p50"] == pytest.approx(median)
    assert table["default"] == {k: v for k, v in rounds[str(data["extra"]["median_round"])]["default"].items()}
    with pytest.raises(SystemExit, match="--repeats"):
        bench(tiny_model_dir, tmp_path, "interference", "--num-chats", "2", "--repeats", "0")


def test_report_writes_a_markdown_table(tiny_model_dir, fake_jaxserve, tmp_path):
    a = bench(tiny_model_dir, tmp_path, "throughput", "--backend", "jaxserve", "--num-prompts", "2",
              "--input-len", "8", "--output-len", "2", "--no-plots", "--name", "a")
    out = tmp_path / "report.md"
    text = cli.main(["bench", "report", a["files"][0], "--output", str(out)])
    assert out.read_text() == text
    lines = text.splitlines()
    assert lines[0].startswith("| result | run |") and lines[2].startswith("| a.json | jaxserve | 2 |")
    assert "sha256:fake" in text


def test_report_rejects_files_that_are_not_results(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{}")
    with pytest.raises(ValueError, match="not a jaxserve benchmark result"):
        cli.main(["bench", "report", str(p)])


def test_serve_says_it_needs_the_grpc_client(tiny_model_dir, tmp_path, monkeypatch):
    import importlib

    real = importlib.import_module

    def no_client(name, *a, **k):
        if name == "jaxserve.client":
            raise ImportError("No module named 'jaxserve.client'")
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", no_client)
    with pytest.raises(SystemExit, match="needs jaxserve.client"):
        bench(tiny_model_dir, tmp_path, "serve")


def test_a_backend_that_fails_mid_run_is_recorded_and_the_others_still_report(tiny_model_dir, fake_jaxserve,
                                                                              tmp_path, monkeypatch):
    from fake_llm import FakeLLM

    def broken(self, *a, **k):
        raise ValueError("20 exceeds the largest bucket 19")

    monkeypatch.setattr(FakeLLM, "generate", broken)
    res = bench(tiny_model_dir, tmp_path, "throughput", "--backend", "jaxserve,hf", "--num-prompts", "2",
                "--input-len", "8", "--output-len", "2", "--no-plots")
    data = check_files(res, 0)
    assert [r["backend"] for r in data["runs"]] == ["hf"]
    assert data["extra"]["skipped"] == [{"backend": "jaxserve",
                                         "reason": "failed: ValueError: 20 exceeds the largest bucket 19"}]


def test_serve_drives_the_client_stream_at_each_rate(tiny_model_dir, tmp_path, monkeypatch):
    import asyncio
    import time

    import jaxserve.client

    async def stream(prompt_token_ids, params):
        for i in range(params["max_tokens"]):
            await asyncio.sleep(0.0005)
            yield [i], time.perf_counter()

    monkeypatch.setattr(jaxserve.client, "bench_stream", lambda target, api_key: (stream, "sha256:server"))
    res = bench(tiny_model_dir, tmp_path, "serve", "--num-prompts", "4", "--input-len", "8:16", "--output-len", "2:5",
                "--request-rate", "400,inf", "--max-concurrency", "2")
    data = check_files(res, 3)
    assert [r["label"] for r in data["runs"]] == ["jaxserve-grpc@400.0", "jaxserve-grpc@inf"]
    assert all(r["checkpoint_identity"] == "sha256:server" for r in data["runs"])
    assert all(r["metrics"]["completed"] == 4 for r in data["runs"])


def test_serve_runs_named_targets_in_turn_each_with_its_own_salt(tiny_model_dir, tmp_path, monkeypatch):
    """Two routers in front of the same replicas compared in one run (docs/benchmarks.md, Router):
    each target gets the same requests, under its name, salted with it."""
    import asyncio
    import time

    import jaxserve.client

    seen: dict[str, set] = {}

    def bench_stream(target, api_key):
        async def stream(prompt_token_ids, params):
            seen.setdefault(target, set()).add(params.get("cache_salt"))
            for i in range(params["max_tokens"]):
                await asyncio.sleep(0.0005)
                yield [i], time.perf_counter()

        return stream, "sha256:server"

    monkeypatch.setattr(jaxserve.client, "bench_stream", bench_stream)
    res = bench(tiny_model_dir, tmp_path, "serve", "--num-prompts", "3", "--input-len", "8:16", "--output-len", "2:3",
                "--target", "ca=127.0.0.1:1", "--target", "rr=127.0.0.1:2", "--salt-per-target")
    data = check_files(res, 2)
    assert [r["label"] for r in data["runs"]] == ["ca@inf", "rr@inf"]
    assert seen == {"127.0.0.1:1": {"ca"}, "127.0.0.1:2": {"rr"}}
    assert all(r["metrics"]["completed"] == 3 for r in data["runs"])
