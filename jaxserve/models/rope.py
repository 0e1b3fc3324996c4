"""Rotary position embeddings in the Hugging Face "rotate_half" layout.

The model computes cos/sin once per step from the packed `positions` and every layer rotates its
q and k with them. The layout (first half of each head paired with the second half) is the one HF
checkpoints use; the GGUF loader un-permutes llama.cpp's interleaved q/k into it, so one rotation
serves every source. Frequencies are host-side numpy constants: they depend only on the config.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import batch_invariant
from jaxserve.models.config import ModelConfig, RopeScaling


def inverse_frequencies(config: ModelConfig, *, theta: float | None = None,
                        linear_factor: float | None = None) -> np.ndarray:
    """Per-pair rotation speed, [head_dim // 2] float32, with Llama-3 scaling when configured.

    `theta`: a base other than config.rope_theta (Gemma 3's sliding layers); `linear_factor`:
    HF's "linear" scaling, the frequencies divided by it (Gemma 3's global layers)."""
    dim = config.head_dim
    base = config.rope_theta if theta is None else theta
    # float32 throughout, as HF computes them, so angles match HF's to the last bit where possible
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (np.float32(1.0) / (np.float32(base) ** exponents)).astype(np.float32)
    if config.rope_scaling is not None:
        inv_freq = _llama3_scaled(inv_freq, config.rope_scaling)
    if linear_factor is not None:
        inv_freq = (inv_freq / np.float32(linear_factor)).astype(np.float32)
    return inv_freq


def _llama3_scaled(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    # Long wavelengths (beyond what pretraining saw) are slowed by `factor`, short ones are kept,
    # and the band between is interpolated smoothly between the two.
    old_len = np.float32(s.original_max_position_embeddings)
    low_freq_wavelen = old_len / np.float32(s.low_freq_factor)
    high_freq_wavelen = old_len / np.float32(s.high_freq_factor)
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(s.factor), inv_freq)
    smooth = (old_len / wavelen - np.float32(s.low_freq_factor)) / np.float32(
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / np.float32(s.factor) + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(config: ModelConfig, positions: jax.Array, *, theta: float | None = None,
                 linear_factor: float | None = None) -> tuple[jax.Array, jax.Array]:
    """positions [T] int -> (cos, sin), each [T, head_dim] float32 (`theta`, `linear_factor`: as
    in inverse_frequencies)."""
    inv_freq = jnp.asarray(inverse_frequencies(config, theta=theta, linear_factor=linear_factor))  # [H/2]
    rows = positions.astype(jnp.float32)[:, None]                     # [T, 1]
    if not batch_invariant.active():
        angles = rows * inv_freq[None]                                # [T, H/2]
        angles = jnp.concatenate([angles, angles], axis=-1)           # [T, H]
        return jnp.cos(angles), jnp.sin(angles)

    def cos_sin(rows):                                                # [tile, 1] -> [tile, 2H]
        angles = rows * inv_freq[None]
        angles = jnp.concatenate([angles, angles], axis=-1)
        return jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1)

    # in the batch-invariant mode XLA's vectorized cos and sin see the same tile whatever the
    # step's row count (models/batch_invariant.py)
    both = batch_invariant.row_tiled(cos_sin, rows)
    return both[:, :config.head_dim], both[:, config.head_dim:]


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, heads, H] in any dtype, cos/sin [T, H] float32 -> x rotated, in x's dtype.

    The rotation runs in float32 so bf16 models lose no position precision here.
    """
    heads, dim = x.shape[1], x.shape[-1]

    def rotate(x, cos, sin):
        x32 = x.astype(jnp.float32)
        half = dim // 2
        rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)  # rotate_half
        return (x32 * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)

    if not batch_invariant.active():
        return rotate(x, cos, sin)
    # in the mode a multiply-add's rounding (fused or not) must not change with the row count:
    # x's rows with their cos and sin on fixed tiles (models/batch_invariant.py)
    return batch_invariant.row_tiled(
        lambda rows, c, s: rotate(rows.reshape(-1, heads, dim), c, s).reshape(rows.shape[0], -1),
        x.reshape(x.shape[0], -1), cos, sin).reshape(x.shape)
