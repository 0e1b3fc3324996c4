"""LLM(mesh=...) on 4 CPU devices in a child (cpu_devices.py says why): an engine on a 2-device
sub-mesh a caller owns (a 1-D mesh of its own axis name, devices 2 and 3) and one on a one-device
mesh (device 1) give HF transformers' greedy outputs, and their params, arena and every buffer
they made live only on those devices; sleep(1) there releases exactly the arena's and weights'
bytes of each of them, and wake_up serves the same outputs with nothing compiled. engine_mesh
keeps the caller's device order and refuses meshes with other axes of size > 1."""

import os
import subprocess
import sys
import json

import pytest

from jaxserve.testing.tiny_models import make_tiny_model
from tests.parallel.cpu_devices import REPO, cpu_device_env

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mesh_probe.py")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("mesh-llama"), "llama", seed=1, num_heads=8, num_kv_heads=2)
    proc = subprocess.run([sys.executable, PROBE, path], env=cpu_device_env(4), cwd=REPO, capture_output=True,
                          text=True, timeout=850)
    if proc.returncode != 0:
        raise AssertionError(f"mesh probe failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["devices"] == 4
    return result


@pytest.mark.slow   # a child compiling two engines (~60 s on 2 cores); the refusals run by default (test_sleep.py)
def test_a_sub_mesh_serves_hf_outputs_from_its_own_devices_only(report):
    sub, one = report["sub"], report["one"]
    assert [len(t) for t in report["hf_tokens"]] == [12] * 3
    assert sub["tokens"] == report["hf_tokens"]
    assert sub["tensor_parallel_size"] == 2
    assert sub["mesh"]["axis_sizes"] == {"data": 1, "model": 2} and sub["mesh"]["num_devices"] == 2
    assert sub["params_devices"] == sub["arena_devices"] == [2, 3]
    assert sub["made_on"] == [2, 3]               # every buffer the engine made: devices 0 and 1 untouched
    assert sub["compilations_after_warmup"] == 0
    assert one["tokens"] == report["hf_tokens"]
    assert one["params_devices"] == one["arena_devices"] == [1]
    assert one["mesh"]["axis_sizes"] == {"data": 1, "model": 1}
    assert one["compilations_after_warmup"] == 0


@pytest.mark.slow
def test_sleep_on_the_sub_mesh_releases_each_devices_bytes_and_wakes_up_the_same(report):
    sub = report["sub"]
    slept, woke = sub["sleep"], sub["woke"]
    assert slept["kv_cache_bytes"] == slept["arena_bytes"] > 0
    assert slept["weight_bytes"] == slept["weight_bytes_measured"] > 0
    assert slept["bytes_per_device"] == slept["measured_per_device"]
    assert set(slept["bytes_per_device"]) == {"2", "3"}
    # what left jax's live buffers, device by device, is what the report says
    assert slept["live_dropped"] == {"0": 0, "1": 0, **slept["bytes_per_device"]}
    assert (woke["kv_cache_bytes"], woke["weight_bytes"]) == (slept["kv_cache_bytes"], slept["weight_bytes"])
    assert woke["tokens"] == sub["tokens"]
    assert woke["params_devices"] == woke["arena_devices"] == [2, 3]
    assert sub["compilations_after_warmup"] == 0


@pytest.mark.slow
def test_engine_mesh_keeps_the_callers_order_and_refuses_other_axes(report):
    m = report["mapping"]
    assert m["named"] == [3, 1]                   # a ("data", "model") mesh, devices in its order
    assert m["by_axis"] == [0, 1]                 # mesh_axis names the tensor-parallel axis
    assert "data-parallel replicas are not built" in m["square"]
    assert "{'dp': 2}" in m["square_by_axis"]
    assert "mesh_axis" in m["unnamed"]
