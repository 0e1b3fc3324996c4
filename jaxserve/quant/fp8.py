"""fp8 (e4m3) weights with per-output-channel scales, and the activation scale the step uses.

e4m3 has 3 mantissa bits and a largest finite value of 448: a weight row scaled so that its
largest magnitude is 448 keeps about 2 significant decimal digits everywhere. Activations are
cast to e4m3 too (on Hopper both GEMM operands must be fp8); they are divided by a per-tensor
scale first, act_scale = calibrated max|x| / 448, so the largest activation seen on real text
lands at the top of the range. Without calibration (act_scale 1) activations are cast as they
are: small ones fall into e4m3's subnormals (below 2^-6 only 3 bits of precision remain, below
2^-9 they flush to zero) and any above 448 saturate.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from jaxserve.models.quantized_tensor import QuantizedTensor

E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)      # 448


def quantize_fp8(w: np.ndarray, act_absmax: float | None) -> QuantizedTensor:
    """w float [out, in] -> e4m3 with scale [out, 1]; act_absmax None = uncalibrated (act_scale 1)."""
    w = np.asarray(w, np.float32)
    absmax = np.abs(w).max(axis=1, keepdims=True)
    scale = np.where(absmax > 0, absmax / E4M3_MAX, 1.0).astype(np.float32)
    q = np.clip(w / scale, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    # a float32 value, as it is stored and used in the step
    act_scale = None if act_absmax is None else float(np.float32(max(float(act_absmax), 1e-6) / E4M3_MAX))
    return QuantizedTensor("fp8", q, scale, act_scale=act_scale)
