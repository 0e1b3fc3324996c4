"""The kernels' library built with some instruction sets switched off, one handler registered
under a test target: the library is compiled for the machine that runs it, so the narrower
paths (AVX2, plain C++) only run where a test builds them this way."""

from __future__ import annotations

import ctypes

import jax

from cpu_kernels import build


def narrow_target(symbol: str, flags: tuple[str, ...], name: str) -> str:
    """Build with `flags` (e.g. -mno-avx2), register handler `symbol` as a new FFI target, return it."""
    library = ctypes.cdll.LoadLibrary(str(build.build_library(flags)))
    target = f"{symbol.lower()}_test_{name}"
    if target not in build._REGISTERED:
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
        build._REGISTERED[target] = library       # kept loaded while XLA may call into it
    return target
