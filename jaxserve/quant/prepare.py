"""What the builder asks of quantization: the checkpoint to serve and the KV cache's scales.

`prepare(ckpt, request, model_config, dtype, cache_dir)`:
- quantization int8 / int4: the checkpoint's decoder projections quantized (what is already in
  that form, a converted checkpoint's or a GGUF's native blocks, is kept; a checkpoint quantized
  in another form is refused);
- fp8, w8a8: the same after a calibration pass over real text (fp8's activation scales, w8a8's
  per-channel smoothing);
- kv_cache_dtype fp8_e4m3 / int8: per-layer per-head K/V scales from the same pass (on the model
  that will be served, quantized weights included), returned as the params' `kv_scales`.
The calibration's maxima are kept under `cache_dir/quant_calibration`, keyed by the checkpoint's
identity, the calibration text and the dtype, so a second start does not run the pass again.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np

from jaxserve.checkpoints import Checkpoint
from jaxserve.models.quantized_tensor import is_quantized
from jaxserve.models.config import ModelConfig
from jaxserve.quant.calibration import CalibrationResult, calibrate
from jaxserve.quant.checkpoint import quantize_checkpoint
from jaxserve.quant.spec import QuantSpec
from jaxserve.quant.texts import read_text, text_id

KV_DTYPES = {"fp8_e4m3": ("float8_e4m3fn", 448.0), "int8": ("int8", 127.0)}
CACHE_DIR = "quant_calibration"
# 2: activation maxima per input channel; 3: keyed by projection module path; 4: the LM head's input too
CACHE_FORMAT = 4


@dataclass(frozen=True, slots=True)
class QuantRequest:
    quantization: str = "none"
    group_size: int = 32
    kv_cache_dtype: str = "auto"
    calibration_data: str | None = None     # a text file; None: the built-in default
    calibrated: bool = True                 # fp8: False measures what skipping calibration costs
    int4_symmetric: bool = False            # int4: absmax / 7, no per-group minimum
    lm_head: bool = False                   # w8a8 / int4: the LM head in that form too


@dataclass(frozen=True)
class Prepared:
    checkpoint: Checkpoint
    kv_scales: dict | None          # {"k": float32 [L, K], "v": [L, K]} for a quantized KV cache
    kv_dtype: str | None            # the arena's element dtype for a quantized KV cache


def quant_request(config) -> QuantRequest:
    """The quantization an EngineConfig asks for."""
    return QuantRequest(config.model.quantization, config.model.quantization_group_size, config.cache.kv_cache_dtype,
                        config.model.calibration_data, lm_head=config.model.quantize_lm_head)


def prepare(ckpt: Checkpoint, request: QuantRequest, model_config: ModelConfig, dtype,
            cache_dir: str | None = None) -> Prepared:
    spec = QuantSpec(request.quantization, request.group_size, request.calibrated, request.int4_symmetric,
                     request.lm_head)
    text = None
    if spec.enabled:
        act = None
        if spec.uses_calibration and not is_quantized(ckpt.tensors):
            text = read_text(request.calibration_data)
            act = _calibration(ckpt, model_config, dtype, text, cache_dir).act_channel_absmax
        ckpt = quantize_checkpoint(ckpt, spec, act_absmax=act, calibration_id=text and text_id(text))
    if request.kv_cache_dtype == "auto":
        return Prepared(ckpt, None, None)
    kv_dtype, qmax = KV_DTYPES[request.kv_cache_dtype]
    text = text or read_text(request.calibration_data)
    cal = _calibration(ckpt, model_config, dtype, text, cache_dir)
    scales = {"k": np.maximum(cal.k_absmax / qmax, 1e-8).astype(np.float32),
              "v": np.maximum(cal.v_absmax / qmax, 1e-8).astype(np.float32)}
    return Prepared(ckpt, scales, kv_dtype)


# calibrations measured in this process, by the key of their cache file: `bench accuracy` and the
# tests prepare several modes of one checkpoint, each of which would run the pass again
_MEASURED: dict[str, CalibrationResult] = {}


def _calibration(ckpt: Checkpoint, model_config: ModelConfig, dtype, text: str,
                 cache_dir: str | None) -> CalibrationResult:
    """The calibration of `ckpt` on `text` (quant/calibration.py), from this process's or the cache
    directory's earlier runs if there were any."""
    import jax.numpy as jnp

    from jaxserve.models.params import params_from_hf

    blob = json.dumps([CACHE_FORMAT, ckpt.identity, text_id(text), str(np.dtype(dtype))])
    key = hashlib.sha256(blob.encode()).hexdigest()
    if key in _MEASURED:
        return _MEASURED[key]
    path = os.path.join(cache_dir, CACHE_DIR, key + ".json") if cache_dir else None
    if path and os.path.isfile(path):
        with open(path) as f:
            d = json.load(f)
        return CalibrationResult({k: np.asarray(v) for k, v in d["act_channel_absmax"].items()},
                                 np.asarray(d["k"]), np.asarray(d["v"]), d["num_tokens"])
    if ckpt.tokenizer is None:
        raise ValueError("calibration needs the checkpoint's tokenizer, and this checkpoint has none")
    tokens = ckpt.tokenizer.encode(text)
    cal = _MEASURED[key] = calibrate(params_from_hf(model_config, ckpt.tensors, jnp.dtype(dtype)), model_config,
                                     tokens)
    if path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"act_channel_absmax": {k: v.tolist() for k, v in cal.act_channel_absmax.items()},
                       "k": cal.k_absmax.tolist(), "v": cal.v_absmax.tolist(),
                       "num_tokens": cal.num_tokens}, f)
        os.replace(tmp, path)
    return cal
