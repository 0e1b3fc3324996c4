"""`jaxserve convert`: any checkpoint written in jaxserve's own format, quantized on the way when
asked (checkpoints/convert.py writes and reads the format; this adds the quantization step)."""

from __future__ import annotations

import os

from jaxserve.checkpoints import load_checkpoint, save_converted
from jaxserve.checkpoints.convert import check_destination


def convert(src: str | os.PathLike | None, dst: str | os.PathLike, *, overwrite: bool = False,
            quantization: str = "none", group_size: int = 32, calibration_data: str | None = None) -> str:
    """Write `src` (None = the embedded model) as a converted checkpoint at `dst`, its projections
    in `quantization`'s form (fp8 and w8a8 after a calibration pass over `calibration_data`, or the
    built-in text); returns `dst`. A GGUF's Q8_0 / Q4_0 / Q4_1 weights are kept as they are when
    int8 / int4 is asked for."""
    check_destination(dst, overwrite)
    ckpt = load_checkpoint(src, native_quantization=quantization)
    if quantization != "none":
        import jax.numpy as jnp

        from jaxserve.models.config import ModelConfig
        from jaxserve.quant.prepare import QuantRequest, prepare

        request = QuantRequest(quantization, group_size, calibration_data=calibration_data)
        ckpt = prepare(ckpt, request, ModelConfig.from_hf_config(ckpt.config), jnp.float32).checkpoint
    return save_converted(ckpt, dst, overwrite=overwrite)
