"""The float value a QuantizedTensor stands for, in numpy: the reference every quantized matmul
and loader is tested against."""

from __future__ import annotations

import numpy as np

from jaxserve.models.quantized_tensor import QuantizedTensor
from jaxserve.quant.int4 import unpack_nibbles


def dequantize(t: QuantizedTensor) -> np.ndarray:
    """-> float32 [out, in]."""
    out, n = t.shape
    if t.kind == "int4":
        q = unpack_nibbles(t.qweight, t.group).astype(np.float32)
        if t.offset is None:
            q -= 8.0
    else:
        q = t.qweight.astype(np.float32)
    g = q.reshape(out, n // t.group, t.group) * t.scale[..., None]
    if t.offset is not None:
        g = g + t.offset[..., None]
    w = g.reshape(out, n)
    return w if t.act_smooth is None else w * t.act_smooth[None, :]
