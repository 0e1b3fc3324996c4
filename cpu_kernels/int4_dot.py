"""Float rows x a group-wise int4 weight -> float32, the weight read packed: the native kernel
(int4_dot.cc) in a trace.

int4's matmul (models/linear.py) calls it for CPU steps of at most MAX_ROWS rows while the runner
traces with the native kernels on (`cpu_kernels()`, int8_dot.py's switch): XLA:CPU widens an int4
weight to float in front of its dot, so a decode step read and wrote four times the bytes the
weight holds. Unlike the int8 dot it is not bit-equal to XLA's float dot: each row's activations
are rounded to int8 per weight group (llama.cpp's Q4 x Q8 arithmetic); steps of more rows, which
keep XLA's dot, round theirs the same way first (`round_activations`), so a row's result does
not depend on its step's size beyond float summation order. What the rounding costs
`jaxserve bench accuracy` measures (its `int4_native_dot` mode traces the model as the engine's CPU
steps are: +0.7% perplexity on the embedded model, docs/benchmarks.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cpu_kernels import build

# Rows up to which the kernel serves a step: at 8 rows it still took 0.58x XLA's widened dot over the
# embedded model's projections (scripts/cpu_quant_matmul.py, 2-core EPYC); a prefill chunk keeps
# XLA's float dot, whose GEMM reuses each widened weight across its rows.
MAX_ROWS = 8

def round_activations(x: jax.Array, group: int) -> jax.Array:
    """x [..., K] rounded as the kernel rounds each row's activations: per `group` inputs, to the
    nearest multiple of max |x| / 127 (ties to even), back in x's dtype."""
    g = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // group, group)
    amax = jnp.max(jnp.abs(g), axis=-1, keepdims=True)
    d = jnp.where(amax > 0, amax / jnp.float32(127.0), jnp.float32(1.0))
    return (jnp.round(g / d) * d).reshape(x.shape).astype(x.dtype)


def supports(k: int, groups: int) -> bool:
    """Whether the kernel computes a K-input weight of `groups` scale groups (even group sizes)."""
    return groups > 0 and k % groups == 0 and (k // groups) % 2 == 0


def int4_dot(x: jax.Array, qweight: jax.Array, scale: jax.Array, offset: jax.Array | None = None) -> jax.Array:
    """x float [M, K], qweight uint8 [K / 2, N] (models/linear.py's int4 leaves), scale float32
    [G, N], offset float32 [G, N] or None (symmetric: nibble - 8) -> float32 [M, N] ~= x @ w."""
    m, k = x.shape if x.ndim == 2 else (None, None)
    groups = scale.shape[0] if scale.ndim == 2 else 0
    if (x.ndim != 2 or qweight.dtype != jnp.uint8 or qweight.shape != (k // 2, scale.shape[-1])
            or not supports(k, groups) or (offset is not None and offset.shape != scale.shape)):
        raise ValueError(f"int4_dot takes x [M, K], qweight uint8 [K / 2, N], scale [G, N] (even groups) and "
                         f"offset [G, N] or None; got x {list(x.shape)}, qweight {qweight.dtype}"
                         f"{list(qweight.shape)}, scale {list(scale.shape)}"
                         f"{'' if offset is None else f', offset {list(offset.shape)}'}")
    if offset is None:
        offset = jnp.zeros((0,), jnp.float32)
    out = jax.ShapeDtypeStruct((m, qweight.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(build.HANDLERS["JaxserveInt4Dot"], out)(
        x.astype(jnp.float32), qweight, scale.astype(jnp.float32), offset.astype(jnp.float32))
