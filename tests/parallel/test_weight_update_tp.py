"""Weight updates on a 2-way tensor-parallel engine (2 CPU devices in a child: cpu_devices.py):
checkpoint-named tensors are reordered shard-major on the host and placed on the mesh, a pytree
on one device is resharded onto it; after each the greedy outputs are HF transformers' of the
weights served, every leaf keeps the engine's sharding, and nothing compiles."""

import pytest

from jaxserve.testing.tiny_models import make_tiny_model
from tests.parallel.cpu_devices import run_probe


@pytest.mark.slow   # a child with 2 devices compiling its own engine (~45 s); the one-device update runs by default
def test_updates_by_name_and_from_another_layout_serve_the_new_weights(tmp_path):
    first = make_tiny_model(tmp_path / "first", "llama", seed=1, num_heads=8, num_kv_heads=2)
    second = make_tiny_model(tmp_path / "second", "llama", seed=2, num_heads=8, num_kv_heads=2)
    r = run_probe(2, "update", first, second, "2")
    assert r["first"] == r["hf_first"]
    assert r["second"] == r["hf_second"] and r["second"] != r["first"]
    assert r["back"] == r["hf_first"]
    assert r["shardings_kept"] and r["compilations_after_warmup"] == 0
