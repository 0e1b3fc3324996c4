"""The modes `jaxserve bench accuracy` compares, and the params each runs with.

Every mode starts from the same checkpoint load and goes through the engine's own preparation
(quant/prepare.py), so what is measured is what the engine would serve:
    float32           the checkpoint in float32 (the reference)
    int8, int4, int4_g128, int4_symmetric, fp8, fp8_uncalibrated   weight modes
    w8a8, w8a8_lm_head   int8 weights x int8 activations (the second with the LM head in int8 too)
    kv_fp8, kv_int8   float32 weights, quantized KV cache
    int4_gguf_native  a GGUF's own Q4_0/Q4_1 blocks (only for a GGUF source)
    int4_native_dot   int4 (a GGUF's own blocks, else group 32) traced with the CPU's native kernels
                      on, as the engine's CPU steps are: activations rounded to int8 per group
                      (cpu_kernels/int4_dot.py; a step of many rows rounds them as the kernel does)
    int4_native_dot_lm_head   the same with the LM head in int4 too (group 32, with a minimum)
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import jax.numpy as jnp

from jaxserve.checkpoints import Checkpoint, load_checkpoint
from jaxserve.models.config import ModelConfig
from jaxserve.models.params import params_from_hf
from jaxserve.quant.prepare import QuantRequest, prepare

MODES = {
    "float32": QuantRequest(),
    "int8": QuantRequest("int8"),
    "int4": QuantRequest("int4", 32),
    "int4_g128": QuantRequest("int4", 128),
    "int4_symmetric": QuantRequest("int4", 32, int4_symmetric=True),
    "fp8": QuantRequest("fp8"),
    "fp8_uncalibrated": QuantRequest("fp8", calibrated=False),
    "w8a8": QuantRequest("w8a8"),
    "w8a8_lm_head": QuantRequest("w8a8", lm_head=True),
    "kv_fp8": QuantRequest(kv_cache_dtype="fp8_e4m3"),
    "kv_int8": QuantRequest(kv_cache_dtype="int8"),
    "int4_gguf_native": QuantRequest("int4"),
    "int4_native_dot": QuantRequest("int4", 32),
    "int4_native_dot_lm_head": QuantRequest("int4", 32, lm_head=True),
}
NATIVE_INT4_DOT = ("int4_native_dot", "int4_native_dot_lm_head")     # modes traced with the native kernels on


@dataclass(frozen=True)
class ModeParams:
    mode: str
    params: dict
    kv_scales: dict | None
    kv_dtype: str | None
    weight_bytes: int          # bytes of the decoder projections as served
    native_kernels: bool = False      # trace with the CPU's native kernels on (cpu_kernels/)


def mode_params(mode: str, ckpt: Checkpoint, model_config: ModelConfig, *, source: str | None = None,
                calibration_data: str | None = None, cache_dir: str | None = None) -> ModeParams:
    """Params of `mode` from the float checkpoint `ckpt` (a native mode reloads `source`)."""
    request = MODES[mode]
    if mode in NATIVE_INT4_DOT:
        from cpu_kernels import build

        if not build.registered():
            raise ValueError(f"{mode} needs the native CPU kernels (no C++ compiler, or JAXSERVE_CPU_KERNELS=0)")
    if calibration_data:
        request = dataclasses.replace(request, calibration_data=calibration_data)
    if mode == "int4_gguf_native" or (mode in NATIVE_INT4_DOT and is_gguf(source)):
        ckpt = load_checkpoint(source, native_quantization="int4")
    prepared = prepare(ckpt, request, model_config, jnp.float32, cache_dir)
    params = params_from_hf(model_config, prepared.checkpoint.tensors, jnp.float32)
    return ModeParams(mode, params, prepared.kv_scales, prepared.kv_dtype,
                      _projection_bytes(prepared.checkpoint), mode in NATIVE_INT4_DOT)


def is_gguf(source: str | None) -> bool:
    from jaxserve.checkpoints import embedded_model_path

    path = source or embedded_model_path()
    return os.path.isfile(path) and path.endswith(".gguf")


def _projection_bytes(ckpt: Checkpoint) -> int:
    from jaxserve.quant.checkpoint import quantizable_weights

    linear = quantizable_weights(ckpt)
    return sum(t.nbytes for name, t in ckpt.tensors.items() if name in linear)
