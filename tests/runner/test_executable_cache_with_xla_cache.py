"""jaxserve's executable cache beside XLA's persistent compilation cache, in fresh processes (XLA's
cache is set up once per process): an executable XLA loaded from its own cache would be kept
broken (it serializes without its compiled functions), so it is used but not kept; and jaxserve's
compiles write nothing to XLA's cache, so they never meet one of their own there."""

import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
from jaxserve.runner.executables import ExecutableCache, compile_to_keep

def f(x, w):
    return jnp.concatenate([jnp.tanh(x @ w), x[:, :3]], axis=1)[:, :16]

lowered = jax.jit(f).lower(jax.ShapeDtypeStruct((4, 16), jnp.float32), jax.ShapeDtypeStruct((16, 16), jnp.float32))
x, w = np.ones((4, 16), np.float32), np.eye(16, dtype=np.float32)
if sys.argv[2] == "plain":
    lowered.compile()                      # an ordinary jit compile: XLA's cache gets an entry
    print(json.dumps({}))
else:
    compiled, keepable = compile_to_keep(lowered)
    out = {"keepable": keepable, "runs": float(np.asarray(compiled(x, w)).sum())}
    if keepable:                           # what the next start would load
        cache = ExecutableCache(sys.argv[3])
        cache.store("k.xla", compiled)
        out["reloaded_runs"] = float(np.asarray(cache.load("k.xla")(x, w)).sum())
    print(json.dumps(out))
"""


def _run(*args) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_executable_from_xlas_cache_is_used_but_not_kept(tmp_path):
    _run(tmp_path / "xla", "plain")
    got = _run(tmp_path / "xla", "keep", tmp_path / "ours")
    assert got["keepable"] is False and got["runs"] > 0


def test_compiling_to_keep_writes_nothing_to_xlas_cache(tmp_path):
    first = _run(tmp_path / "xla", "keep", tmp_path / "ours")
    assert first["keepable"] is True and first["reloaded_runs"] == first["runs"]
    second = _run(tmp_path / "xla", "keep", tmp_path / "ours2")
    assert second["keepable"] is True                 # no entry of the first one's to hit
