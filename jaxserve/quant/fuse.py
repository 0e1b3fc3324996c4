"""Fusing the parts of one projection (q | k | v, gate | up) when some are quantized.

The model runs q/k/v and gate/up as one matmul each (models/params.py), so their quantized parts
must share one form. Scales are per output row, so parts of the same form (kind, group, with or
without offset) stack along the output axis unchanged. A float part, or a part of another form
(a GGUF may store v in another block type than q and k), is brought to the form of the first
quantized part: requantized from its float values.
"""

from __future__ import annotations

import numpy as np

from jaxserve.models.quantized_tensor import QuantizedTensor
from jaxserve.quant.dequantize import dequantize
from jaxserve.quant.fp8 import E4M3_MAX, quantize_fp8
from jaxserve.quant.int4 import quantize_int4
from jaxserve.quant.int8 import quantize_int8
from jaxserve.quant.w8a8 import quantize_w8a8


def _form(t: QuantizedTensor) -> tuple:
    return (t.kind, t.group, t.offset is not None, t.act_smooth is not None)


def requantize_like(w, like: QuantizedTensor) -> QuantizedTensor:
    """`w` (float [out, in] or another QuantizedTensor) in the form of `like`."""
    if isinstance(w, QuantizedTensor):
        if _form(w) == _form(like):
            return w
        w = dequantize(w)
    if like.act_smooth is not None:
        return quantize_w8a8(w, like.act_smooth)
    if like.kind == "int8":
        out = quantize_int8(w, like.group)
        return out if like.offset is None else QuantizedTensor("int8", out.qweight, out.scale,
                                                                np.zeros_like(out.scale))
    if like.kind == "int4":
        return quantize_int4(w, like.group, symmetric=like.offset is None)
    act = None if like.act_scale is None else like.act_scale * E4M3_MAX
    return quantize_fp8(w, act)


def fuse_quantized(parts: list) -> QuantizedTensor:
    """Parts [out_i, in] (at least one QuantizedTensor) -> one QuantizedTensor [sum(out_i), in]."""
    like = next(p for p in parts if isinstance(p, QuantizedTensor))
    same = [requantize_like(p, like) for p in parts]
    offset = None if like.offset is None else np.concatenate([p.offset for p in same])
    acts = [p.act_scale for p in same if p.act_scale is not None]
    if like.act_smooth is not None and any(not np.array_equal(p.act_smooth, like.act_smooth) for p in same):
        raise ValueError("w8a8 parts of one fused projection must share their input's smoothing")
    return QuantizedTensor(like.kind, np.concatenate([p.qweight for p in same]),
                           np.concatenate([p.scale for p in same]), offset, max(acts) if acts else None,
                           like.act_smooth)
