"""int4 weight-only quantization: group-wise along the input axis, two values per byte.

Symmetric (no offset): scale = max|w| of the group / 7, nibble = round(w / scale) + 8 in 1..15.
Asymmetric (offset, llama.cpp's Q4_1 form): scale = (max - min) / 15, offset = min,
nibble = round((w - min) / scale) in 0..15; it spends all 16 levels on the group's range, which
halves the worst rounding error of a group whose values are one-sided.
Packing follows models/quantized_tensor.py: byte j of a group holds element j (low nibble) and
element j + group/2 (high nibble).
"""

from __future__ import annotations

import numpy as np

from jaxserve.models.quantized_tensor import QuantizedTensor


def pack_nibbles(q: np.ndarray, group: int) -> np.ndarray:
    """q uint8 [out, in] in 0..15 -> [out, in // 2] packed per group."""
    out, n = q.shape
    g = q.reshape(out, n // group, 2, group // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(out, n // 2).astype(np.uint8)


def unpack_nibbles(packed: np.ndarray, group: int) -> np.ndarray:
    """The inverse of pack_nibbles: [out, in // 2] -> uint8 [out, in] in 0..15."""
    out, half = packed.shape
    p = packed.reshape(out, half * 2 // group, 1, group // 2)
    return np.concatenate([p & 15, p >> 4], axis=2).reshape(out, half * 2)


def quantize_int4(w: np.ndarray, group: int, *, symmetric: bool = False) -> QuantizedTensor:
    """w float [out, in] -> int4 with one scale (and offset unless symmetric) per `group` inputs."""
    w = np.asarray(w, np.float32)
    out, n = w.shape
    if n % group:
        raise ValueError(f"int4 group {group} does not divide the {n} inputs")
    g = w.reshape(out, n // group, group)
    if symmetric:
        absmax = np.abs(g).max(axis=2)                                   # [out, G]
        scale = np.where(absmax > 0, absmax / 7.0, 1.0).astype(np.float32)
        q = np.clip(np.rint(g / scale[..., None]), -7, 7) + 8
        offset = None
    else:
        lo, hi = g.min(axis=2), g.max(axis=2)
        scale = np.where(hi > lo, (hi - lo) / 15.0, 1.0).astype(np.float32)
        q = np.clip(np.rint((g - lo[..., None]) / scale[..., None]), 0, 15)
        offset = lo.astype(np.float32)
    packed = pack_nibbles(q.reshape(out, n).astype(np.uint8), group)
    return QuantizedTensor("int4", packed, scale, offset)
