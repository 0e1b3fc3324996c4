"""A second start of a tensor-parallel engine whose mesh uses part of the process's devices (a 3-way
mesh on a 4-device host) loads the executables the first start kept, and generates what it did.

Each start is a fresh process, as a server's restart is: within one process JAX's own in-memory
caches would hand back the first start's executables and the load path would never run. An
executable loaded onto every device of the process, JAX's default, aborts the process inside XLA
when its mesh spans fewer (runner/executables.py)."""

import pytest

from jaxserve.testing.tiny_models import make_tiny_model
from tests.parallel.cpu_devices import run_probe

DEVICES = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # 6 query and 6 KV heads, 96 MLP columns: 2 and 3 divide them all
    return make_tiny_model(tmp_path_factory.mktemp("tp-warm"), "llama", seed=3, hidden_size=48, num_heads=6, intermediate_size=96,
                           num_kv_heads=6)


# 3 of 4 in the default run; 2 of 4 (the same path, the other size) with -m slow
@pytest.mark.parametrize("size", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_a_second_start_on_part_of_the_devices_loads_what_the_first_kept(model_dir, tmp_path, size):
    cache = str(tmp_path / "cache")
    cold = run_probe(DEVICES, "start", model_dir, cache, str(size))
    warm = run_probe(DEVICES, "start", model_dir, cache, str(size))
    assert cold["mesh_devices"] == warm["mesh_devices"] == list(range(size))
    assert cold["compiled"] > 0
    assert warm["compiled"] == 0
    assert warm["tokens"] == cold["tokens"]
    assert cold["compilations_after_warmup"] == warm["compilations_after_warmup"] == 0
