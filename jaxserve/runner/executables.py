"""The runner's compiled functions (one step per bucket, one sampler per row count), loaded fast.

Compiling the embedded model's 22 executables took about 300 s on the 2-core CPU under load;
with every executable in XLA's persistent compilation cache a start still took about 100 s,
because a cache hit is found by the lowered program's hash: each step is traced through the 30
layers and lowered first (3-6 s a bucket under load; the cache hit itself 1-2.5 s). So jaxserve
keeps its own cache of serialized executables, keyed by what determines the program without
tracing it: the source of the traced code, the shapes, the model config, the compiler options,
the software and the machine (fingerprint.py). A hit is one file read and a deserialization
(1.2-2.9 s for a step of the embedded model under load, 0.05 s for a sampler).
A miss lowers and compiles and stores the result (`compile_to_keep`: not in XLA's persistent
cache, whose hits cannot be kept).

`ExecutableStore` is a read-only mapping from key to executable. `load` brings in a set of keys
ahead of time; an executable asked for that is not loaded yet is loaded on the spot, so a step
never fails for want of one (that is a stall, logged, which start-up policies exist to avoid).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from jaxserve.checkpoints.disk_cache import DiskCache

log = logging.getLogger(__name__)

FORMAT = 2      # 2: entries kept from an XLA cache hit (format 1) may be broken
# One loader thread: it loads the next executable while the caller runs the last one (warm-up), but
# two deserializing at once were slower than one after the other on the 2-core CPU (4 steps of the
# embedded model: 11.2-11.6 s against 9.0-9.6 s, load average 10): loading holds the GIL for much
# of its time and contends for the allocator.
LOAD_WORKERS = 1
# Every change to the traced code or the shapes writes a new set (22 steps and samplers of the
# embedded model at max_model_len 512: about 50 MB), so the folder keeps the most recently used.
MAX_CACHE_BYTES = 2 << 30


_XLA_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_hits = threading.local()            # .count: XLA persistent-cache hits of this thread's compiles
_listening = threading.Lock()
_listener_installed = False


def compile_to_keep(lowered, compiler_options: dict | None = None) -> tuple[object, bool]:
    """Compile `lowered` for jaxserve's cache: (executable, whether it may be serialized).

    XLA's persistent cache is not written (jaxserve keeps the executable itself). It may still be
    read: an entry an earlier build wrote. An executable XLA:CPU loaded from that cache serializes
    without its compiled functions (the copy loads, then its first run fails with "Function ...
    not found"), so such a hit is used in this process but must not be kept; nor is anything that
    did not compile in this call (found in JAX's in-memory cache, from wherever it came)."""
    global _listener_installed
    from jax import monitoring
    from jax._src import config as jax_config   # its thread-local override of the write threshold

    with _listening:
        if not _listener_installed:
            monitoring.register_event_listener(_on_event)
            _listener_installed = True
    from jaxserve.runner import compile_counter

    _hits.count = 0
    fresh = compile_counter.CompileCounter()
    outer = compile_counter.current()
    with jax_config.persistent_cache_min_compile_time_secs(float("inf")), compile_counter.attributed_to(fresh):
        compiled = lowered.compile(compiler_options=compiler_options or None)
    if outer is not None:       # the mark above replaced the caller's: its owner counts these too
        outer.count += fresh.count
    # Keep only what XLA compiled here and now: an executable JAX handed back from its in-memory
    # cache may itself have come from the persistent cache (a test or an earlier engine in the same
    # process set its folder: that setting is process-wide), and such a copy serializes broken.
    return compiled, _hits.count == 0 and fresh.count > 0


def _on_event(event: str, **kwargs) -> None:
    if event == _XLA_CACHE_HIT:
        _hits.count = getattr(_hits, "count", 0) + 1


class ExecutableCache:
    """Serialized executables on disk, one file per key."""

    def __init__(self, directory: str):
        self._disk = DiskCache(directory)

    @staticmethod
    def key(description: Mapping) -> str:
        """A file name for an executable described by a JSON-able mapping (every input to its program)."""
        blob = json.dumps({"format": FORMAT, **description}, sort_keys=True, default=repr)
        return hashlib.sha256(blob.encode()).hexdigest() + ".xla"

    def load(self, key: str, devices: Sequence | None = None):
        """The executable kept under `key`, loaded onto `devices`: the devices it was compiled for,
        in its device assignment's order (a mesh's devices, flattened; or the one device). JAX's
        default is every device of the process, which XLA accepts only when the program spans them
        all: a 3-way mesh's executable loaded onto 4 devices aborts the process inside XLA (a
        check failure, no Python error), so the caller must say where it runs."""
        from jax.experimental import serialize_executable

        data = self._disk.get(key)
        if data is None:
            return None
        try:
            return serialize_executable.deserialize_and_load(
                *pickle.loads(data), execution_devices=None if devices is None else list(devices))
        except Exception as e:  # noqa: BLE001 - a corrupt or foreign entry is a miss, never a failure
            log.warning("executable cache entry %s unusable (%s); compiling", key, e)
            return None

    def forget(self, key: str) -> None:
        """Drop an entry that loaded but failed to run (see ModelRunner.recompile)."""
        try:
            os.remove(self._disk.path(key))
        except FileNotFoundError:
            pass

    def store(self, key: str, compiled) -> None:
        from jax.experimental import serialize_executable

        try:
            data = pickle.dumps(serialize_executable.serialize(compiled))
        except (ValueError, NotImplementedError, pickle.PicklingError) as e:
            log.info("executable not serializable (%s); it will compile again next start", e)
            return
        self._disk.put(key, data)
        self._disk.trim(MAX_CACHE_BYTES)


class ExecutableStore(Mapping):
    """key -> executable, for a fixed set of keys; `build(key)` produces one (from the cache or by
    compiling). Safe to read from one thread while `load` runs in another."""

    def __init__(self, keys: Iterable[Hashable], build: Callable[[Hashable], object], kind: str):
        self._keys = tuple(keys)
        self._build = build
        self._kind = kind
        self._loaded: dict = {}
        self._lock = threading.Lock()
        self.loaded_on_demand: list = []      # keys a caller needed before they were loaded

    def __getitem__(self, key):
        exe = self._loaded.get(key)
        if exe is None:
            if key not in self._keys:
                raise KeyError(key)
            log.warning("%s %s was not loaded ahead of its first use: loading it now", self._kind, key)
            self.loaded_on_demand.append(key)
            exe = self._ensure(key)
        return exe

    def __iter__(self) -> Iterator:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key) -> bool:
        return key in self._keys

    def replace(self, key, exe) -> None:
        with self._lock:
            self._loaded[key] = exe

    def is_loaded(self, key) -> bool:
        return key in self._loaded

    def load(self, keys: Iterable[Hashable] | None = None, *, on_loaded: Callable | None = None,
             workers: int = LOAD_WORKERS) -> float:
        """Load `keys` (default: all) with `workers` threads; `on_loaded(key, exe)` is called in this
        thread, in order, for every key as it arrives, loaded before or not (so the caller can run
        one while the next loads). Returns the seconds spent."""
        t0 = time.perf_counter()
        keys = list(self._keys if keys is None else keys)
        for k in keys:
            if k not in self._keys:
                raise KeyError(k)
        from jaxserve.runner import compile_counter

        owner = compile_counter.current()     # a compile in the pool counts where the caller's would

        def ensure(key):
            with compile_counter.attributed_to(owner):
                return self._ensure(key)

        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            for key, exe in zip(keys, pool.map(ensure, keys)):
                if on_loaded is not None:
                    on_loaded(key, exe)
        return time.perf_counter() - t0

    def _ensure(self, key):
        exe = self._loaded.get(key)
        if exe is None:
            built = self._build(key)
            with self._lock:
                exe = self._loaded.setdefault(key, built)
        return exe
