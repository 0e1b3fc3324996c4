"""Expert parallelism (jaxserve/parallel/experts.py): both dispatch forms equal the one-device
MoE layer, engines at expert-parallel sizes 1, 2 and 4 (with and without tensor parallelism)
give one device's greedy outputs, and sizes that do not divide are refused naming those that
work. Checks on devices run in child processes with fake CPU devices (tests/parallel/ep_probe.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxserve.engine_args import engine_config
from jaxserve.parallel.experts import ALL_GATHER, ALL_TO_ALL, check_expert_sizes, dispatch_for
from tests.parallel.cpu_devices import REPO, cpu_device_env

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ep_probe.py")


def run_ep_probe(num_devices: int, *args: str, timeout: float = 1500) -> dict:
    proc = subprocess.run([sys.executable, PROBE, *args], env=cpu_device_env(num_devices), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"probe {args} failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_layer_report(report: dict) -> None:
    checks = report["checks"]
    assert {c["case"] for c in checks} == {"random", "empty_experts", "one_takes_all", "one_shard"}
    assert {c["form"] for c in checks} == {ALL_GATHER, ALL_TO_ALL}
    for c in checks:
        # float32 sums in another order; a dropped or misrouted token is off by the output itself
        assert c["max_abs"] > 0.1, c
        assert c["max_abs_err"] <= 1e-5 * max(1.0, c["max_abs"]), c


def test_both_dispatch_forms_equal_the_one_device_layer_on_hard_routings():
    report = run_ep_probe(4, "layer", "fast")
    assert report["devices"] == 4
    assert_layer_report(report)
    assert {(c["ep"], c["tp"]) for c in report["checks"]} == {(4, 1), (2, 2)}


@pytest.mark.slow
def test_both_dispatch_forms_at_every_mesh_and_size():
    report = run_ep_probe(4, "layer", "full")
    assert_layer_report(report)
    assert {(c["ep"], c["tp"]) for c in report["checks"]} == {(1, 2), (2, 1), (4, 1), (2, 2)}


def test_expert_counts_that_do_not_divide_are_refused_naming_the_sizes_that_work():
    with pytest.raises(ValueError, match="expert_parallel_size=3 does not divide the model's 8 experts: "
                                         "sizes that work are 1, 2, 4, 8"):
        check_expert_sizes(8, 32, 3, 1)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide each expert's 32 intermediate "
                                         "columns.*sizes that work are 1, 2, 4, 8, 16, 32"):
        check_expert_sizes(8, 32, 2, 3)
    with pytest.raises(ValueError, match="expert_parallel_size=2 needs a mixture-of-experts model"):
        check_expert_sizes(0, 0, 2, 1)
    check_expert_sizes(8, 32, 4, 2)          # 8 devices: 2 experts each, 16 columns of each per device
    check_expert_sizes(0, 0, 1, 4)           # a dense model under tensor parallelism: nothing to check
    with pytest.raises(ValueError, match="expert_parallel_size=0 must be a positive integer"):
        engine_config(expert_parallel_size=0)
    with pytest.raises(ValueError, match="expert_dispatch='ring'"):
        engine_config(expert_dispatch="ring")
    assert dispatch_for(4) == dispatch_for(4096) == ALL_GATHER        # the measured choice at both sizes
    assert dispatch_for(4, ALL_TO_ALL) == ALL_TO_ALL


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_engines_at_expert_parallel_sizes_1_2_4_give_one_devices_greedy_outputs(tmp_path, arch):
    from jaxserve.testing.tiny_models import make_tiny_model

    model = make_tiny_model(tmp_path / arch, arch)
    settings = ["1:1:auto", "2:1:all_gather", "2:1:all_to_all", "4:1:auto", "4:1:all_to_all",
                "1:2:auto", "2:2:all_gather", "2:2:all_to_all"]
    report = run_ep_probe(4, "engine", model, *settings)["engines"]
    base = report["1:1:auto"]
    assert base["mesh"] is None and all(len(o) == 12 for o in base["outputs"])
    assert base["prefix_cache_hits"] > 0
    for setting in settings[1:]:
        got = report[setting]
        ep, tp, form = setting.split(":")
        assert got["mesh"] == {"data": 1, "expert": int(ep), "model": int(tp)}
        assert got["outputs"] == base["outputs"], setting
        assert got["compilations_after_warmup"] == 0, setting
        assert got["prefix_cache_hits"] == base["prefix_cache_hits"], setting
        for bucket, ops in got["collectives"].items():
            kinds = [op[0] for op in ops]
            # all_gather's combine is an all-reduce, never an all-to-all; all_to_all's sends are
            if int(ep) > 1 and form == "all_to_all":
                assert "all-to-all" in kinds, (setting, bucket)
            else:
                assert "all-to-all" not in kinds, (setting, bucket)
            # no weight is ever gathered: every all-gather is of activations or logits ([T, D] or [R, V])
            assert all(len(op[2]) <= 2 for op in ops if op[0] == "all-gather"), (setting, bucket, ops)


def test_an_engine_refuses_expert_parallel_sizes_before_it_loads_anything(tmp_path, tiny_llama_dir):
    from jaxserve import LLM
    from jaxserve.testing.tiny_models import make_tiny_model

    moe = make_tiny_model(tmp_path / "moe", "mixtral", num_layers=1)      # 8 experts
    with pytest.raises(ValueError, match="expert_parallel_size=3 does not divide the model's 8 experts: "
                                         "sizes that work are 1, 2, 4, 8"):
        LLM(moe, expert_parallel_size=3, progress=False)
    with pytest.raises(ValueError, match="expert_parallel_size=2 needs a mixture-of-experts model"):
        LLM(tiny_llama_dir, expert_parallel_size=2, progress=False)


@pytest.mark.slow
def test_quantized_experts_split_and_int4_groups_that_would_be_cut_are_refused(tmp_path):
    from jaxserve.testing.tiny_models import make_tiny_model

    mixtral = make_tiny_model(tmp_path / "mixtral", "mixtral")          # experts of 128 columns: 4 groups of 32
    qwen = make_tiny_model(tmp_path / "qwen3_moe", "qwen3_moe")          # experts of 32 columns: one group
    report = run_ep_probe(4, "quantized", mixtral, qwen)
    for mode in ("int8", "int4"):
        assert report[f"{mode}:2:2"] == report[f"{mode}:1:1"], mode
    assert report["refused"] is not None and "hold 1 quantization group(s)" in report["refused"]
    assert "tensor_parallel_size=2 does not divide" in report["refused"]
