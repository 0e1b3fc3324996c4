"""scripts/cpu_gemm_floor.py: its arithmetic, and a run on tiny shapes."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "cpu_gemm_floor.py")


def load_script():
    spec = importlib.util.spec_from_file_location("cpu_gemm_floor", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_decode_steps_parse_and_repeated_row_counts_add_up():
    assert load_script().parse_steps("25:67,3:2,,3:5") == {25: 67, 3: 7}


def test_the_floor_charges_each_step_its_rows_time_and_prefill_per_row():
    best = {1: 0.02, 25: 0.07, 512: 0.5}
    decode, prefill = load_script().floor_seconds(best, {25: 10, 1: 4}, prefill_tokens=768, prefill_rows=512)
    assert decode == pytest.approx(10 * 0.07 + 4 * 0.02)
    assert prefill == pytest.approx(1.5 * 0.5)
    assert load_script().floor_seconds(best, {}, 0, 512) == (0.0, 0.0)


def test_a_tiny_run_prints_every_row_count_and_the_floor():
    pytest.importorskip("torch")
    res = subprocess.run(
        [sys.executable, SCRIPT, "--hidden", "16", "--intermediate", "32", "--qkv-width", "32", "--layers", "2",
         "--vocab", "64", "--rows", "3", "--decode-steps", "1:3,2:5", "--prefill-tokens", "8",
         "--prefill-rows", "4", "--repeats", "2"],
        capture_output=True, text=True, timeout=120, check=True)
    rows = [int(m[1]) for m in re.finditer(r"^\s*(\d+)\s+[\d.]+\s+[\d.]+$", res.stdout, re.M)]
    assert rows == [1, 2, 3, 4]
    assert re.search(r"^matmul floor: decode [\d.]+ s \+ prefill [\d.]+ s = [\d.]+ s$", res.stdout, re.M), res.stdout


@pytest.mark.parametrize("text", ["25", "a:3", "0:4", "4:-1"])
def test_malformed_decode_steps_are_refused_with_the_offending_pair(text):
    with pytest.raises(ValueError, match=repr(text)):
        load_script().parse_steps(text)


def test_bad_arguments_exit_with_a_usage_error_before_any_timing():
    res = subprocess.run([sys.executable, SCRIPT, "--decode-steps", "32"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "ROWS:STEPS" in res.stderr
    res = subprocess.run([sys.executable, SCRIPT, "--rows", "0"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--rows" in res.stderr
