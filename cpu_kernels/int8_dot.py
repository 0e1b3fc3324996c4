"""The native int8 kernel (int8_dot.cc) in a trace: `int8_dot`, int8 [M, K] x int8 [N, K] -> int32
[M, N] exact, and `w8a8_dot`, w8a8's whole matmul (the activations rounded to int8 per row, that
dot, the rescaling) as one custom call.

The runner turns them on while tracing a single-device CPU step (`cpu_kernels()`, a trace-time
switch like models/batch_invariant.py) and w8a8's matmul (models/linear.py) calls `w8a8_dot` for
steps of at most `max_rows()` rows, where it beats XLA:CPU's int8 dot; a step with more rows, any
other platform, and a tensor-parallel mesh (whose sharded weights a custom call would gather)
keep XLA's ops. Both sum exactly in int32 and round and rescale in the same float order, so
switching between them changes no bit of the result.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Iterator

import jax
import jax.numpy as jnp

from cpu_kernels import build

# Rows up to which the kernel beats XLA's int8 dot over the embedded model's w8a8 projections, by
# what the CPU has (docs/benchmarks.md "Fewer operations per CPU decode step"). With AVX-512 VNNI
# XLA's own dot is fast and ahead from 8 rows (2-core Xeon); on AVX2 alone it is slower and the
# fused kernel wins up to 16 (2-core EPYC: 0.78x of XLA's time at 8 rows, 0.88-0.94x at 16,
# 1.05-1.10x at 24-32). Without either the crossover was never measured: the smaller one.
_MAX_ROWS_VNNI = 4
_MAX_ROWS_AVX2 = 16

_ACTIVE = contextvars.ContextVar("jaxserve_cpu_kernels", default=False)
_MAX_ROWS = contextvars.ContextVar("jaxserve_cpu_kernels_max_rows", default=None)


def active() -> bool:
    """Whether the code being traced now may call the native kernels."""
    return _ACTIVE.get()


@functools.cache
def _crossover_rows() -> int:
    from jaxserve.runner.fingerprint import cpu_flags    # (jaxserve imports this package)

    flags = cpu_flags().split()
    if "avx512_vnni" in flags:
        return _MAX_ROWS_VNNI
    return _MAX_ROWS_AVX2 if "avx2" in flags else _MAX_ROWS_VNNI


def max_rows() -> int:
    """The most rows a w8a8 matmul traced now sends to the kernel: this CPU's measured crossover
    with XLA's dot, unless `cpu_kernels(max_rows=...)` set another."""
    override = _MAX_ROWS.get()
    return _crossover_rows() if override is None else override


@contextlib.contextmanager
def cpu_kernels(enabled: bool = True, max_rows: int | None = None) -> Iterator[None]:
    """Trace inside this to let the traced code call the native kernels. Registers them first
    (`enabled` is dropped when they cannot be built: the caller's program then keeps XLA's ops).
    `max_rows` replaces the CPU's crossover (benchmarks measuring the kernel past it)."""
    token = _ACTIVE.set(bool(enabled) and build.registered())
    rows_token = _MAX_ROWS.set(max_rows)
    try:
        yield
    finally:
        _MAX_ROWS.reset(rows_token)
        _ACTIVE.reset(token)


def int8_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x int8 [M, K], w int8 [N, K] (row-major: w8a8's [out, in]) -> int32 [M, N] = x @ w.T.

    The kernel's integer core on its own: the engine calls `w8a8_dot`, whose float inputs cannot
    be made to round to chosen int8 values, so the tests check the exact sums (saturation's
    extremes included) through this one."""
    if x.dtype != jnp.int8 or w.dtype != jnp.int8 or x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"int8_dot takes int8 [M, K] and [N, K], got {x.dtype}{list(x.shape)} and "
                         f"{w.dtype}{list(w.shape)}")
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.int32)
    return jax.ffi.ffi_call(build.HANDLERS["JaxserveInt8Dot"], out)(x, w)


def w8a8_dot(x: jax.Array, act_smooth: jax.Array, w: jax.Array, scale: jax.Array) -> jax.Array:
    """x float32 [M, K], act_smooth float32 [K], w int8 [N, K], scale float32 [N] -> float32 [M, N]:
    models/linear.py's w8a8 arithmetic (x * act_smooth rounded to int8 with max |.| / 127 per row,
    ties to even; the exact int32 dot; times the row's scale, then the weight's), in one call."""
    k = x.shape[-1] if x.ndim == 2 else None
    if (x.ndim != 2 or x.dtype != jnp.float32 or w.dtype != jnp.int8 or w.ndim != 2 or w.shape[1] != k
            or act_smooth.shape != (k,) or scale.shape != (w.shape[0],)):
        raise ValueError(f"w8a8_dot takes float32 x [M, K], act_smooth [K], int8 w [N, K] and scale [N]; got x "
                         f"{x.dtype}{list(x.shape)}, act_smooth {list(act_smooth.shape)}, w {w.dtype}"
                         f"{list(w.shape)}, scale {list(scale.shape)}")
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(build.HANDLERS["JaxserveW8A8Dot"], out)(
        x, act_smooth.astype(jnp.float32), w, scale.astype(jnp.float32))
