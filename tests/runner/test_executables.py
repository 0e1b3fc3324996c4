"""Serialized executables: a cached one runs like the one compiled; damaged entries are misses;
the store loads each key once and records what was needed before it was loaded."""

import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runner.executables import ExecutableCache, ExecutableStore, compile_to_keep


# XLA's persistent cache may be on in this process (an engine built by an earlier test sets its
# folder process-wide, and JAX decides once per process whether to use it), and on a machine that
# ran these tests before it may hold this toy: an executable XLA:CPU loads from that cache
# serializes without its functions ("Function ... not found" on the copy's first run). A constant
# drawn once per process makes each run's toys programs no cache has seen.
_RUN_SALT = float(int.from_bytes(os.urandom(3), "little"))


def _compiled(scale: float):
    lowered = jax.jit(lambda x, y: (x * scale + y + _RUN_SALT, jnp.tanh(x))).lower(
        jax.ShapeDtypeStruct((4, 8), jnp.float32), jax.ShapeDtypeStruct((4, 8), jnp.float32))
    compiled, keepable = compile_to_keep(lowered)
    assert keepable, "a fresh program compiled here must be keepable"
    return compiled


def test_a_stored_executable_loads_and_computes_the_same(tmp_path):
    cache = ExecutableCache(str(tmp_path))
    key = cache.key({"kind": "toy", "scale": 3.0})
    assert cache.load(key) is None
    compiled = _compiled(3.0)
    cache.store(key, compiled)
    loaded = cache.load(key)
    x, y = np.arange(32, dtype=np.float32).reshape(4, 8), np.ones((4, 8), np.float32)
    for got, want in zip(loaded(x, y), compiled(x, y)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_key_covers_every_field_of_the_description():
    base = {"kind": "step", "bucket": (1, 4), "shapes": "RunnerShapes(...)", "machine": {"cpu": "x"}}
    keys = {ExecutableCache.key(base)}
    for field, value in (("kind", "sampler"), ("bucket", (4, 4)), ("shapes", "other"), ("machine", {"cpu": "y"})):
        keys.add(ExecutableCache.key({**base, field: value}))
    assert len(keys) == 5
    assert ExecutableCache.key(dict(reversed(base.items()))) in keys     # order does not matter


def test_a_damaged_entry_is_a_miss(tmp_path, caplog):
    cache = ExecutableCache(str(tmp_path))
    key = cache.key({"kind": "toy"})
    (tmp_path / key).write_bytes(b"not a pickle")
    with caplog.at_level(logging.WARNING):
        assert cache.load(key) is None
    assert "unusable" in caplog.text


def test_the_store_builds_each_key_once_and_reports_loads_on_demand(caplog):
    built = []
    store = ExecutableStore([(1, 0), (1, 1), (4, 1)], lambda k: built.append(k) or f"exe{k}", "step")
    seen = []
    store.load([(1, 1), (1, 0)], on_loaded=lambda k, exe: seen.append((k, exe)))
    assert seen == [((1, 1), "exe(1, 1)"), ((1, 0), "exe(1, 0)")]         # in the order asked
    seen.clear()
    store.load(on_loaded=lambda k, exe: seen.append(k))                    # builds the rest only
    assert sorted(built) == [(1, 0), (1, 1), (4, 1)] and store.loaded_on_demand == []
    assert seen == [(1, 0), (1, 1), (4, 1)]                  # but reports every key: a warm-up runs each
    fresh = ExecutableStore([(1, 0)], lambda k: "exe", "step")
    with caplog.at_level(logging.WARNING):
        assert fresh.get((1, 0)) == "exe" and fresh[(1, 0)] == "exe"
    assert fresh.loaded_on_demand == [(1, 0)] and "not loaded ahead" in caplog.text
    assert fresh.get((9, 9)) is None
    with pytest.raises(KeyError):
        store.load([(9, 9)])


def test_the_cache_keeps_the_most_recently_used_entries_within_its_size(tmp_path, monkeypatch):
    from jaxserve.runner import executables

    cache = ExecutableCache(str(tmp_path))
    keys = [cache.key({"kind": "toy", "scale": float(i)}) for i in range(3)]
    cache.store(keys[0], _compiled(0.0))
    size = (tmp_path / keys[0]).stat().st_size
    monkeypatch.setattr(executables, "MAX_CACHE_BYTES", int(2.5 * size))
    os.utime(tmp_path / keys[0], ns=(1, 1))                 # long unused
    cache.store(keys[1], _compiled(1.0))
    assert cache.load(keys[0]) is not None                  # used again: the most recent now
    cache.store(keys[2], _compiled(2.0))                    # three do not fit: the oldest use goes
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([keys[0], keys[2]])


def test_the_traced_source_covers_the_step_but_not_the_start_up_modules(monkeypatch):
    import builtins

    from jaxserve.runner import fingerprint

    hashed = []
    real_open = builtins.open

    def recording_open(path, *a, **k):
        hashed.append(os.path.basename(os.path.dirname(path)) + "/" + os.path.basename(path))
        return real_open(path, *a, **k)

    fingerprint.traced_source.cache_clear()
    monkeypatch.setattr(builtins, "open", recording_open)
    try:
        fingerprint.traced_source()
    finally:
        monkeypatch.undo()
        fingerprint.traced_source.cache_clear()
    assert {"runner/step.py", "runner/model_runner.py", "runner/sampler.py", "models/llama.py"} <= set(hashed)
    assert not {"runner/warmup.py", "runner/executables.py", "runner/calibration.py"} & set(hashed)
