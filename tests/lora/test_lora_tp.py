"""LoRA slots under tensor parallelism, on fake CPU devices in a child process
(tests/parallel/cpu_devices.py says why a child): 2 devices (KV heads split) and 4 (KV heads
replicated), one mixed batch of the base model and two adapters equal to HF + peft's greedy tokens;
a column-parallel projection's lora_b and a row-parallel one's lora_a split over the devices, the
other factor replicated; nothing compiled after warm-up."""

import json
import subprocess
import sys

import pytest

from tests.parallel.cpu_devices import REPO, cpu_device_env


@pytest.mark.slow      # a child compiling two tensor-parallel engines (~2 min on 2 cores)
def test_tensor_parallel_lora_equals_hf_peft(tmp_path):
    proc = subprocess.run([sys.executable, "tests/lora/lora_tp_probe.py", str(tmp_path), "2,4"],
                          env=cpu_device_env(4), cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-6000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    hf = report["hf"]
    assert len({tuple(t) for t in hf.values()}) == 3            # the adapters change the output
    for size, engine in report["engines"].items():
        assert engine["tokens"] == {name: hf[name] for name in engine["tokens"]}, size
        assert engine["compilations_after_warmup"] == 0
        n = int(size)
        for leaf, split in (("qkv_b", True), ("qkv_a", False), ("down_a", True), ("down_b", False)):
            *held, total = engine["bytes_per_device"][leaf]        # bytes on each of the engine's devices
            assert held == [total // n if split else total] * n, (size, leaf, held, total)
