"""`jaxserve bench host` end to end on the tiny random model: every batch size measured on the
steps where all its requests decode, the parts within the step's wall time, the engine's own
compiled shapes only (0 compilations after warm-up), and the summary computed from the rows."""

import pytest

from jaxserve.bench.cmd_host import PARTS
from jaxserve.cli import build_parser


@pytest.mark.slow
def test_host_ms_and_its_parts_per_batch_size(tmp_path):
    args = build_parser().parse_args([
        "bench", "host", "--batch-sizes", "1,4", "--output-len", "10", "--rounds", "2",
        "--cache-dir", str(tmp_path / "cache"), "--output-dir", str(tmp_path), "--name", "h", "--no-progress"])
    result = args.bench_run(args)
    assert (tmp_path / "h.json").exists()
    rows = result["batches"]
    assert sorted(rows) == [1, 4]
    for batch, row in rows.items():
        assert len(row["rounds"]) == 2
        assert row["compilations_after_warmup"] == 0
        for r in row["rounds"]:
            # 10 outputs: the steps after the prompt's, less the last two, decode everyone
            assert r["steps"] >= 5
            # medians of per-step values each at most the step's wall time are at most its median
            assert 0 < r["host_ms"] <= r["wall_ms"]
            assert all(0 <= r[f"{p}_ms"] <= r["wall_ms"] for p in PARTS + ("wait",))
            # means: collections inside the steps (not added to the parts), the host's mean
            assert 0 <= r["gc_ms"] <= r["host_mean_ms"]
            assert r["admit_schedule_ms"] > 0     # the first step's schedule() took in the burst
    first = rows[1]["host_ms"]
    assert result["summary"]["ratio_to_smallest"] == {b: r["host_ms"] / first for b, r in rows.items()}


def test_buckets_for_one_batch_size_are_valid_engine_buckets():
    # `--batch-sizes 1` alone once asked for decode_buckets=(1, 1), which the engine refuses
    from jaxserve.bench.cmd_host import _buckets
    from jaxserve.engine_args import engine_config

    for batches in ([1], [4], [1, 256], [16, 64]):
        b = _buckets(batches)
        assert b["decode_buckets"] == tuple(sorted({1, batches[-1]}))
        engine_config(max_num_seqs=batches[-1], **b)      # validates the buckets


def test_without_model_times_decode_steps_of_every_batch_size_and_context(tmp_path, monkeypatch):
    # no model: schedule, pack and update of decode steps only; a burst whose prefill outlasts a
    # short output would never decode all at once, so the outputs are sized to the prefill
    from jaxserve.bench import host_without_model

    timed = []
    real = host_without_model.one_round
    monkeypatch.setattr(host_without_model, "one_round", lambda *a: timed.append(a) or real(*a))
    args = build_parser().parse_args([
        "bench", "host", "--without-model", "--batch-sizes", "1,8", "--input-len", "3000", "--steps", "4",
        "--rounds", "2", "--output-dir", str(tmp_path), "--name", "w"])
    result = args.bench_run(args)
    assert (tmp_path / "w.json").exists() and len(timed) == 4
    for batch, row in result["batches"].items():
        for r in row["rounds"]:
            assert r["host_ms"] == pytest.approx(sum(r[f"{p}_ms"] for p in host_without_model.PARTS))
            assert all(r[f"{p}_ms"] > 0 for p in host_without_model.PARTS)
    assert sorted(result["summary"]["host_ms"]) == [1, 8]
