"""Recovering Llama-3 rope scaling from a GGUF's `rope_freqs` tensor.

llama.cpp does not store Llama 3.1/3.2's rope scaling parameters: its converter bakes them into
one divisor per rotary frequency (`rope_freqs.weight`, [head_dim / 2]). HF's "llama3" rope type
computes the same divisors from four numbers, so we fit those numbers and accept them only when
they reproduce every stored divisor; a file we cannot reproduce is refused rather than run with
frequencies that are silently wrong.

The divisors are 1 for short wavelengths, `factor` for long ones, and in between
1 / ((1 - s) / factor + s) with s = (orig / wavelen - low) / (high - low), which is linear in
1 / wavelen. Only the ratios orig / low and orig / high matter, so `orig` can be taken from the
file (or Meta's 8192) and low, high follow from the fitted line.
"""

from __future__ import annotations

import numpy as np

_META_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def llama3_divisors(scaling: dict, rope_theta: float, head_dim: int) -> np.ndarray:
    """The per-frequency divisors HF's llama3 rope type applies, as llama.cpp's converter writes them."""
    inv_freq = rope_theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [head_dim / 2]
    wavelen = 2 * np.pi / inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    orig = scaling["original_max_position_embeddings"]
    smooth = (orig / wavelen - low) / (high - low)
    middle = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, middle))


def fit_llama3_scaling(divisors: np.ndarray, rope_theta: float, head_dim: int,
                       original_context: int | None = None) -> dict | None:
    """HF `rope_scaling` reproducing `divisors` ([head_dim / 2]), None for no scaling; raises
    ValueError when no llama3 parameters reproduce them."""
    divisors = np.asarray(divisors, dtype=np.float64)
    if divisors.shape != (head_dim // 2,):
        raise ValueError(f"rope_freqs has shape {divisors.shape}, expected ({head_dim // 2},) for head_dim {head_dim}")
    if np.allclose(divisors, 1.0):
        return None
    factor = float(np.round(divisors.max(), 4))
    orig = int(original_context or _META_DEFAULTS["original_max_position_embeddings"])
    candidates = [dict(_META_DEFAULTS, original_max_position_embeddings=orig)]
    inv_freq = rope_theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    middle = (divisors > 1 + 1e-4) & (divisors < factor * (1 - 1e-4))
    if middle.sum() >= 2:
        smooth = (1 / divisors[middle] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(inv_freq[middle] / (2 * np.pi), smooth, 1)  # s = slope / wavelen + intercept
        span = orig / slope  # high - low
        low = -intercept * span
        candidates.insert(0, {"low_freq_factor": float(np.round(low, 4)),
                              "high_freq_factor": float(np.round(low + span, 4)),
                              "original_max_position_embeddings": orig})
    for candidate in candidates:
        scaling = {"rope_type": "llama3", "factor": factor, **candidate}
        if np.allclose(llama3_divisors(scaling, rope_theta, head_dim), divisors, rtol=1e-4, atol=0):
            return scaling
    raise ValueError("the GGUF's rope_freqs do not match any llama3 rope scaling")
