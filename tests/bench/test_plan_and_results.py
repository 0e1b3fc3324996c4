"""Little's law planning, the knee finder, and cross-backend token agreement."""

import pytest

from jaxserve.bench.cmd_plan import knee, plan
from jaxserve.bench.results import agreement


def test_knee_is_where_a_saturating_curve_bends():
    xs = [1, 2, 4, 8, 16, 32]
    ys = [10, 20, 39, 70, 80, 82]
    assert xs[knee(xs, ys)] == 8


def test_knee_of_two_points_is_the_better_one():
    assert knee([1, 2], [5.0, 4.0]) == 0


def test_plan_applies_littles_law_and_counts_engines_at_the_knee():
    sweep = [{"batch_size": b, "output_tok_s": y} for b, y in zip([1, 2, 4, 8, 16, 32], [10, 20, 39, 70, 80, 82])]
    p = plan(rate=3.0, duration=6.0, sweep=sweep, output_len=100)
    assert p["concurrency"] == pytest.approx(18.0)
    assert p["knee_batch"] == 8 and p["engines_at_knee"] == 3          # ceil(18 / 8)
    assert p["token_rate_needed"] == pytest.approx(300.0)
    assert p["engines_for_token_rate"] == 5                             # ceil(300 / 70)


def test_plan_rejects_non_positive_inputs():
    with pytest.raises(ValueError, match="rate and duration"):
        plan(0.0, 1.0)


def test_agreement_stops_comparing_at_the_first_stop_token():
    ref = {"a": [5, 6, 7], "b": [1, 2, 3], "c": [9, 2, 4]}
    other = {"a": [5, 6, 7], "b": [4, 2, 3], "c": [9, 2, 8], "d": [0]}
    got = agreement(ref, other, stop_ids=[2])
    assert got["compared"] == 3
    assert got["identical"] == 2          # a fully, c up to the stop token 2; b differs at index 0
    assert got["mean_matching_prefix"] == pytest.approx((1.0 + 0.0 + 1.0) / 3)


def test_the_jaxserve_cli_mounts_plan_and_exits_zero(capsys):
    from jaxserve.cli import main

    assert main(["plan", "--rate", "1.5", "--duration", "2"]) == 0
    assert "3.0 requests in flight" in capsys.readouterr().out


def test_the_transfer_rule_prices_kv_bytes_over_the_link():
    from jaxserve.bench.cmd_plan import kv_bytes_per_token, transfer_plan

    # SmolLM2-135M: 30 layers, 3 KV heads of 64 -> 2 x 30 x 3 x 64 x 2 bytes (bfloat16)
    smol = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    assert kv_bytes_per_token(smol, 2) == 23040
    t = transfer_plan(23040, 100.0, 1.0, [1000, 100_000])      # 100 Gbit/s = 12.5 GB/s
    small, big = t["rows"]
    assert small["transfer_s"] == 1000 * 23040 / 12.5e9 and small["verdict"] == "pays"
    assert big["share"] == 100_000 * 23040 / 12.5e9 and big["verdict"] == "marginal"
    assert t["longest_prompt_that_pays"] == int(0.05 * 12.5e9 // 23040)


def test_plan_prints_the_transfer_table(capsys, tmp_path):
    import json

    from jaxserve.cli import main

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4,
                                                      "num_key_value_heads": 2, "hidden_size": 64}))
    assert main(["plan", "--rate", "1", "--duration", "1", "--link-gbps", "1", "--model-config", str(tmp_path),
                 "--latency-target-ms", "100", "--prompt-lens", "100,100000"]) == 0
    out = capsys.readouterr().out
    assert "256 bytes/token" in out and "pays" in out and "does not pay" in out
