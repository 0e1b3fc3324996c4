"""Picks the ragged paged attention implementation for the platform; the runner calls only this.

The Triton-backend kernel on every CUDA GPU, the pure-JAX XLA implementation on the CPU. The
Mosaic GPU kernel is chosen only when forced: on an H200 (scripts/gpu_kernel_check.py,
2026-12-04) it failed 4 of the 8 kernel-check cases it takes (GQA groups of 3, sliding windows,
a 300-token prefill: errors of 0.2-2.0 against the reference) and did not compile one engine
shape, while the Triton kernel passed every case at 86-107% of Mosaic's speed (docs/kernels.md).
`implementation=` or the environment variable JAXSERVE_ATTENTION_IMPL forces one (the argument
wins), so an engine on the CPU can run a GPU kernel in its interpreter: reference | xla | mosaic
| mosaic_interpret | triton | triton_interpret.

Each kernel states what it cannot take (`unsupported_reason`); a forced or chosen kernel that
cannot take the call falls back, Mosaic -> Triton -> XLA, keeping interpretation when asked
for, so forcing an interpreter never breaks a model (float32 models take Triton's interpreter:
the Mosaic kernel is for 16-bit caches). The choice is made at trace time, once per compiled step.
"""

from __future__ import annotations

import functools
import logging
import os

import jax

from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

log = logging.getLogger(__name__)
ENV_VAR = "JAXSERVE_ATTENTION_IMPL"
IMPLEMENTATIONS = ("reference", "xla", "mosaic", "mosaic_interpret", "triton", "triton_interpret")


def default_implementation(device: jax.Device | None = None) -> str:
    """By platform: "triton" on CUDA GPUs (Hopper included: Mosaic is forced only, see above),
    else "xla"."""
    device = device if device is not None else jax.devices()[0]
    if device.platform in ("gpu", "cuda"):
        return "triton"
    return "xla"


def resolve_implementation(implementation: str | None = None) -> str:
    """The argument, else the environment variable, else the platform default; validated."""
    name = implementation or os.environ.get(ENV_VAR) or default_implementation()
    if name not in IMPLEMENTATIONS:
        source = "implementation" if implementation else ENV_VAR
        raise ValueError(f"{source}={name!r} is not one of {IMPLEMENTATIONS}")
    return name


def _xla():
    try:
        from pallas_kernels.ragged_paged_attention_xla import ragged_paged_attention_xla
    except ImportError:   # the XLA implementation lands separately; the reference is always right
        return ragged_paged_attention_reference
    return ragged_paged_attention_xla


@functools.cache
def _warn_mosaic() -> None:
    log.warning("attention implementation 'mosaic' was forced: it failed 4 of 8 cases of "
                "scripts/gpu_kernel_check.py on an H200 (docs/kernels.md); outputs can be wrong. "
                "'triton' is the GPU default")


def choose(name: str, q, k_cache) -> tuple[str, object, dict]:
    """(implementation actually used, function, extra keyword arguments) for these shapes."""
    interpret = name.endswith("_interpret")
    if name in ("mosaic", "triton") and jax.default_backend() != "gpu":
        raise ValueError(f"implementation {name!r} compiles for CUDA GPUs, the backend is "
                         f"{jax.default_backend()!r}: use {name + '_interpret'!r} to run it here")
    if name.startswith("mosaic"):
        from pallas_kernels import ragged_paged_attention_mosaic as mosaic
        if name == "mosaic":
            _warn_mosaic()
        if mosaic.unsupported_reason(q, k_cache) is None:
            return name, mosaic.ragged_paged_attention_mosaic, {"interpret": interpret}
        name = "triton_interpret" if interpret else "triton"
    if name.startswith("triton"):
        from pallas_kernels import ragged_paged_attention_triton as triton
        if triton.unsupported_reason(q, k_cache) is None:
            return name, triton.ragged_paged_attention_triton, {"interpret": interpret}
        name = "xla"
    if name == "reference":
        return name, ragged_paged_attention_reference, {}
    return "xla", _xla(), {}


def ragged_paged_attention(
    q: jax.Array,              # [T, N, H]
    k_cache: jax.Array,        # [num_blocks, block_size, K, H]
    v_cache: jax.Array,        # [num_blocks, block_size, K, H]
    kv_lens: jax.Array,        # [S] int32
    block_tables: jax.Array,   # [S, W] int32
    cu_q_lens: jax.Array,      # [S + 1] int32
    num_seqs: jax.Array,       # [1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """Same semantics as `ragged_paged_attention_reference`; [T, N, H] in q's dtype."""
    _, fn, extra = choose(resolve_implementation(implementation), q, k_cache)
    return fn(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs,
              sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, **extra)
