"""`jaxserve bench overlap` end to end on the tiny random model: both loops ran every round on
the same workload, produced the same tokens, and the summary is computed from the rounds."""

import statistics

import pytest

from jaxserve.cli import build_parser


@pytest.mark.slow
def test_overlap_runs_both_loops_in_turn_and_summarizes_the_rounds(tmp_path):
    args = build_parser().parse_args([
        "bench", "overlap", "--shape", "tiny", "--num-requests", "6", "--input-len", "8", "--output-len", "12", "--max-num-seqs", "4",
        "--rounds", "2", "--output-dir", str(tmp_path), "--name", "ov", "--no-progress"])
    result = args.bench_run(args)
    assert (tmp_path / "ov.json").exists()
    rounds = result["rounds"]
    assert len(rounds) == 2
    for r in rounds:
        for label in ("on", "off"):
            assert r[label]["output_tokens"] == 6 * 12
            assert r[label]["num_compilations_after_warmup"] == 0
            assert r[label]["host_ms_per_step"] > 0 and 0 <= r[label]["device_idle_fraction"] <= 1
        assert r["same_tokens"]
        assert r["ratio"] == r["on"]["output_tok_s"] / r["off"]["output_tok_s"]
    s = result["summary"]
    assert s["all_same_tokens"]
    assert s["median_ratio"] == statistics.median(r["ratio"] for r in rounds)
    assert s["on_output_tok_s"] == statistics.median(r["on"]["output_tok_s"] for r in rounds)
