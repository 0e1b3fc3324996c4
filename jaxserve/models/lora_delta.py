"""The LoRA delta of one projection over a batch whose rows use different adapters.

A projection served with LoRA slots (jaxserve/lora/) holds, beside its base weight, every slot's
low-rank factors stacked (built by lora/slot_layout.py):
    lora_a  [in, N, P * R]    slot s's A of each of the P fused parts, side by side
    lora_b  [N, P * R, out]   slot s's B, part i's R rows filling only part i's output columns,
                              the adapter's scale (alpha / r or alpha / sqrt(r)) already folded in
N slots hold adapters; slot 0, "no adapter", has no arrays: it is the zero delta. The step says
which slot each of its rows uses (`lora_slots [T]`, 0 for the base model and padding rows), and
the delta is computed as two dense matmuls over every slot at once, the first one's outputs
masked to the row's own slot:
    xa = x @ lora_a  [T, N * P * R],  zeroed outside the row's slot,  delta = xa @ lora_b
so a batch mixes adapters and the base model freely and the program does not depend on which
adapters are resident (loading one only writes slot arrays). A step with no adapter row skips it. Its cost grows with N * R (a gather
of each row's own factors would not, but materializes [T, in, R] per projection; at the few slots
served here the dense form is the cheaper one on the CPU).

The per-row slots reach every projection through a trace-time context (`lora_rows`), as the
batch-invariant switch does: the step sets it around the model's forward, so no model signature
carries it. A projection traced outside it (a replay, calibration) computes the base model.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

_rows: contextvars.ContextVar = contextvars.ContextVar("lora_rows", default=None)


@contextlib.contextmanager
def lora_rows(slots: jax.Array | None) -> Iterator[None]:
    """While tracing inside the block, projections with LoRA slots add the delta of each row's
    slot (`slots [T]` int32, 0 = no adapter)."""
    token = _rows.set(slots)
    try:
        yield
    finally:
        _rows.reset(token)


def current_rows() -> jax.Array | None:
    return _rows.get()


def has_lora(p: dict) -> bool:
    return "lora_a" in p


def lora_delta(x: jax.Array, p: dict, slots: jax.Array, dtype: Any, precision=None) -> jax.Array:
    """x [T, in] (any float form), slots [T] -> the delta [T, out] in `dtype`, accumulated in float32.
    A step where no row uses an adapter skips both matmuls (lax.cond: one branch runs), so the base
    model's steps on a LoRA engine read no slot array."""
    a, b = p["lora_a"], p["lora_b"]                                 # [in, N, PR], [N, PR, out]
    n_in, n, pr = a.shape
    out = b.shape[-1]
    rows = x.reshape(-1, n_in)
    t = rows.shape[0]

    def delta() -> jax.Array:
        xa = jnp.matmul(rows.astype(a.dtype), a.reshape(n_in, n * pr), precision=precision,
                        preferred_element_type=jnp.float32)          # [T, N * PR]
        own = slots.reshape(t, 1) == jnp.arange(1, n + 1, dtype=slots.dtype)[None, :]      # [T, N]
        xa = jnp.where(own[:, :, None], xa.reshape(t, n, pr), 0.0).reshape(t, n * pr)
        return jnp.matmul(xa.astype(b.dtype), b.reshape(n * pr, out), precision=precision,
                          preferred_element_type=jnp.float32).astype(dtype)       # [T, out]

    d = jax.lax.cond(jnp.any(slots > 0), delta, lambda: jnp.zeros((t, out), dtype))
    return d.reshape(*x.shape[:-1], out)
