"""w8a8: int8 weights x int8 activations, smoothed (SmoothQuant, Xiao et al. 2023).

Why: XLA:CPU runs an int8 x int8 -> int32 dot with the CPU's 8-bit dot-product instructions, about
3x faster than its float32 dot from two rows up (docs/benchmarks.md), while a weight-only int8
weight must be widened to float before the dot. Rounding activations to int8 per token costs
accuracy where a few input channels carry much larger values than the rest (+2.8% perplexity on
the embedded model). Smoothing moves part of each channel's range into the weights first:

    s_i = act_max_i ** alpha / w_max_i ** (1 - alpha)       (w_max_i over every output row)
    x W = (x / s) (s W)                                      exact in real arithmetic

so `act_smooth` = 1 / s multiplies the inputs at run time and the weight rounded to int8 is s W.
act_max comes from the calibration pass (quant/calibration.py); projections that read the same
input (q | k | v, gate | up) share one s, computed over all their rows, since they run as one
fused matmul.
"""

from __future__ import annotations

import numpy as np

from jaxserve.models.quantized_tensor import QuantizedTensor
from jaxserve.quant.int8 import quantize_int8
from jaxserve.quant.spec import W8A8_SMOOTHING_ALPHA

_FLOOR = 1e-5       # a channel never seen active (or an all-zero weight column) keeps s finite


def smoothing(weights: list[np.ndarray], act_absmax: np.ndarray, alpha: float = W8A8_SMOOTHING_ALPHA) -> np.ndarray:
    """act_smooth [in] for the float [out_i, in] weights that read one input of max |x| act_absmax."""
    w_max = np.max([np.abs(np.asarray(w, np.float32)).max(axis=0) for w in weights], axis=0)
    s = np.maximum(act_absmax, _FLOOR) ** alpha / np.maximum(w_max, _FLOOR) ** (1.0 - alpha)
    return (1.0 / s).astype(np.float32)


def quantize_w8a8(w: np.ndarray, act_smooth: np.ndarray) -> QuantizedTensor:
    """w float [out, in] -> int8 per output channel of w / act_smooth, carrying act_smooth."""
    t = quantize_int8(np.asarray(w, np.float32) / act_smooth[None, :])
    return QuantizedTensor("int8", t.qweight, t.scale, act_smooth=np.asarray(act_smooth, np.float32))
