"""scripts/gpu_parity_check.py (step 3 of scripts/gpu_check.sh) without a GPU: its arguments, how
it reports a difference, and its CPU dry run (the Triton kernel in its interpreter, the tiny
random model, 8 prompts x 8 tokens) run in-process."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "gpu_parity_check.py")
GPU_CHECK = os.path.join(REPO, "scripts", "gpu_check.sh")


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("gpu_parity_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_parses_and_runs_the_parity_step_under_a_timeout():
    subprocess.run(["bash", "-n", GPU_CHECK], check=True)
    with open(GPU_CHECK) as f:
        text = f.read()
    assert "timeout -k 5 190 \"$PY\" scripts/gpu_parity_check.py" in text
    assert "parity rc=$parity_rc" in text and "[ $parity_rc -eq 0 ]" in text


def test_arguments(script):
    args = script.parse_args([])
    assert (args.impl, args.device, args.shape, args.num_prompts, args.new_tokens) == (
        "gpu", "cuda", "smollm2-135m", 8, 32)
    assert script.parse_args(["--device", "cpu", "--impl", "triton_interpret"]).impl == "triton_interpret"
    with pytest.raises(SystemExit):   # a CPU has no compiled kernel to check
        script.parse_args(["--device", "cpu"])
    with pytest.raises(SystemExit):   # prompts (<= 90 tokens) + outputs must fit max_model_len
        script.parse_args(["--new-tokens", "100"])


def test_a_difference_is_reported_with_the_margin_hf_had_there(script, capsys):
    hf = [dict(ids=[5, 6, 7], tokens=[1, 2, 3, 4], margins=[1.0, 0.5, 2e-4, 1.0], error=1e-5, ratio=20.0),
          dict(ids=[8], tokens=[9, 9], margins=[1.0, 1.0], error=1e-5, ratio=1e5)]
    assert script.compare("gpu", [[1, 2, 8, 8], [9, 9]], "hf", [hf[0]["tokens"], hf[1]["tokens"]], hf) is False
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "parity impl=gpu vs hf: 1/2 identical"
    assert out[1].startswith("  prompt 0: first difference at output token 2: gpu [8, 8] vs hf [3, 4]")
    assert "margin there 2.00e-04 logits = 20x its fp32 rounding error" in out[1]
    assert len(out) == 2
    assert script.compare("gpu", [[1, 2, 3, 4]], "reference", [[1, 2, 3, 4]], hf[:1]) is True
    assert capsys.readouterr().out == "parity impl=gpu vs reference: 1/1 identical\n"
    assert script.compare("gpu", [[1, 5]], "reference", [[1, 6]], None) is False   # HF failed: no margins
    assert capsys.readouterr().out.splitlines()[1] == (
        "  prompt 0: first difference at output token 1: gpu [5] vs reference [6]")


def test_without_hf_the_engines_are_still_compared_and_the_run_fails(script, tmp_path, capsys, monkeypatch):
    for var, value in script.ENV_DEFAULTS:
        monkeypatch.setenv(var, os.environ.get(var, value))

    def broken_hf(*args):
        raise RuntimeError("no transformers here")

    ran = []

    def fake_engine(model_dir, impl, prompts, new_tokens, engine):
        ran.append((impl, [len(p) for p in prompts]))
        return [[7] * new_tokens for _ in prompts], ""

    monkeypatch.setattr(script, "hf_greedy", broken_hf)
    monkeypatch.setattr(script, "run_engine", fake_engine)
    rc = script.main(["--device", "cpu", "--impl", "triton_interpret", "--shape", "tiny", "--num-prompts", "3",
                      "--model-dir", str(tmp_path / "tiny")])
    out = capsys.readouterr().out
    assert rc == 1
    assert "gpu_parity: FAIL hf: RuntimeError: no transformers here" in out
    assert "parity impl=triton_interpret vs reference: 3/3 identical" in out and " vs hf" not in out
    assert [impl for impl, _ in ran] == ["triton_interpret", "reference"]
    assert ran[0][1] == ran[1][1] and len(ran[0][1]) == 3   # each slot's first candidate, same for both


@pytest.mark.slow
def test_dry_run_on_the_cpu_with_the_triton_interpreter(script, tmp_path, capsys, monkeypatch):
    for var, value in script.ENV_DEFAULTS:   # main() sets these: undone after the test
        monkeypatch.setenv(var, os.environ.get(var, value))
    rc = script.main(["--device", "cpu", "--impl", "triton_interpret", "--shape", "tiny", "--new-tokens", "8",
                      "--model-dir", str(tmp_path / "tiny")])
    out = capsys.readouterr().out
    assert rc == 0, out
    for line in ("parity impl=triton_interpret vs hf: 8/8 identical",
                 "parity impl=reference vs hf: 8/8 identical",
                 "parity impl=triton_interpret vs reference: 8/8 identical"):
        assert line in out.splitlines()
    assert "engine impl=triton_interpret: attention triton_interpret;" in out   # the kernel really ran
    assert "gpu_parity: PASS" in out
