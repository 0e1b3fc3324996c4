"""Compile this package's C++ kernels once per machine and source, and register them with JAX.

The shared library is built with -march=native (the kernels pick AVX-512 VNNI, AVX2 or plain
C++ at compile time), so it is only valid for the CPU that built it: its file name carries a hash
of the source, the XLA FFI headers, the compiler and the CPU's flags. A compile takes about 2 s;
the result is kept under the jaxserve cache folder and later processes only load it. Concurrent
builders each write their own temporary file and rename it into place, so none reads a half file.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = ("int8_dot.cc", "int4_dot.cc")
ENV_SWITCH = "JAXSERVE_CPU_KERNELS"       # "0" keeps XLA's own ops everywhere
CACHE_ENV = "JAXSERVE_CPU_KERNELS_CACHE"  # where the built library goes (default ~/.cache/jaxserve/cpu_kernels)


def enabled_by_env() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def _cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxserve" / "cpu_kernels"
    return Path(os.environ.get(CACHE_ENV, default))


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def _library_key(cxx: str, include_dir: str, flags: tuple[str, ...]) -> str:
    digest = hashlib.sha256(" ".join(flags).encode())
    here = Path(__file__).parent
    for name in SOURCES:
        digest.update((here / name).read_bytes())
    for header in sorted(Path(include_dir, "xla", "ffi", "api").glob("*.h")):
        digest.update(header.read_bytes())
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    digest.update(version.encode())
    # the instruction sets -march=native compiled for: the same reading the executable cache keys by
    from jaxserve.runner.fingerprint import cpu_flags
    digest.update(cpu_flags().encode())
    return digest.hexdigest()[:20]


def build_library(extra_flags: tuple[str, ...] = ()) -> Path:
    """The kernels' shared library for this machine: from the cache, else compiled into it.
    `extra_flags` go to the compiler after -march=native (the tests build the AVX2 and plain C++
    paths with -mno-avx512f / -mno-avx2). Raises RuntimeError (with the compiler's message) when
    it cannot be built."""
    import jax.ffi

    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    include_dir = jax.ffi.include_dir()
    flags = ("-O3", "-march=native", *extra_flags, "-std=c++17", "-shared", "-fPIC", "-w")
    target = _cache_dir() / f"jaxserve_cpu_kernels-{_library_key(cxx, include_dir, flags)}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    here = Path(__file__).parent
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [cxx, *flags, f"-I{include_dir}",
           *(str(here / name) for name in SOURCES), "-o", tmp]
    log.info("compiling jaxserve's CPU kernels: %s", " ".join(cmd))
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"compiling {', '.join(SOURCES)} failed:\n{done.stderr[-4000:]}")
    os.replace(tmp, target)
    return target


# handler symbol in the library -> the FFI target name the traced code calls
HANDLERS = {"JaxserveInt8Dot": "jaxserve_int8_dot", "JaxserveW8A8Dot": "jaxserve_w8a8_dot",
            "JaxserveInt4Dot": "jaxserve_int4_dot"}


@functools.cache
def registered() -> bool:
    """Whether the kernels are built and registered with JAX for the CPU (once per process; False
    when switched off or when they cannot be built, which is logged once: XLA's ops then serve)."""
    if not enabled_by_env():
        return False
    try:
        library = ctypes.cdll.LoadLibrary(str(build_library()))
    except (RuntimeError, OSError) as err:
        log.warning("jaxserve's CPU kernels are unavailable (%s); XLA's own dots serve instead", err)
        return False
    import jax.ffi

    for symbol, name in HANDLERS.items():
        if name not in _REGISTERED:      # XLA keeps a target for the process: register it once
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
            _REGISTERED[name] = library  # and keep its library loaded while XLA may call into it
    return True


_REGISTERED: dict[str, ctypes.CDLL] = {}
