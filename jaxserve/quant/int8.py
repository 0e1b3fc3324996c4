"""int8 weight-only quantization: symmetric, one scale per output channel (or per group of
inputs, the form llama.cpp's Q8_0 blocks take).

scale = max|w| over the row (group) / 127, q = round(w / scale): the rounding error of one
weight is at most scale / 2 = max|w| / 254, and the largest weight of a row is exact.
"""

from __future__ import annotations

import numpy as np

from jaxserve.models.quantized_tensor import QuantizedTensor


def quantize_int8(w: np.ndarray, group: int | None = None) -> QuantizedTensor:
    """w float [out, in] -> int8 with scale [out, 1] (per channel) or [out, in // group]."""
    w = np.asarray(w, np.float32)
    out, n = w.shape
    group = group or n
    g = w.reshape(out, n // group, group)
    absmax = np.abs(g).max(axis=2)                                       # [out, G]
    scale = np.where(absmax > 0, absmax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(g / scale[..., None]), -127, 127).astype(np.int8)
    return QuantizedTensor("int8", q.reshape(out, n), scale)
