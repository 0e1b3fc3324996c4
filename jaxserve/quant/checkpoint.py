"""A quantized Checkpoint: the source's linear weights replaced by QuantizedTensors, and an
identity of its own.

Only the projections inside the decoder layers are quantized (q, k, v, o, gate, up, down);
the embedding (a lookup, and the tied LM head of SmolLM2-style models), the untied LM head and
the norms stay float by default: the LM head carries the whole logit distribution and the
embedding table is read one row per token. On a CPU, though, the float LM head is a large part
of a small model's decode step (the embedded model's is 113 MB, read every step), so w8a8 and
int4 can take it too (`QuantSpec.lm_head`, EngineConfig.quantize_lm_head): a copy in the mode's
form stored as the checkpoint's `lm_head.weight` (w8a8: smoothed with the final norm's
calibrated range; int4: the projections' groups, no calibration, so a GGUF's natively loaded
blocks take it too); a tied embedding stays float for the lookup (docs/benchmarks.md "Beside
llama.cpp" and "Quantization accuracy" for what it costs in accuracy and gains in speed).

The identity hashes the source's identity with the quantization (mode, group, the calibration's
data), so a quantized checkpoint never passes for its source: the executable and calibration
caches, keyed by identity, keep their entries apart.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping

import numpy as np

from jaxserve.checkpoints import Checkpoint
from jaxserve.models.quantized_tensor import QuantizedTensor
from jaxserve.quant.fp8 import quantize_fp8
from jaxserve.quant.int4 import quantize_int4
from jaxserve.quant.int8 import quantize_int8
from jaxserve.quant.spec import QuantSpec
from jaxserve.models.params import QUANTIZED_LM_HEAD as LM_HEAD
from jaxserve.quant.w8a8 import quantize_w8a8, smoothing


def quantizable_weights(ckpt: Checkpoint) -> dict[str, str]:
    """HF weight name -> the module path of the projection that reads it, for every weight its
    architecture lets quantization replace (models/registry.py); the calibration records each
    projection's input under that path."""
    from jaxserve.checkpoints.layout import tensor_layout
    from jaxserve.models.tensor_layout import module_name

    return {name: module_name(path) for name, path in tensor_layout(ckpt.config).quantizable().items()}


def quantized_identity(source_identity: str, spec: QuantSpec, calibration: str | None = None) -> str:
    blob = json.dumps({"source": source_identity, "quantization": spec.describe(),
                       "calibration": calibration}, sort_keys=True)
    return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()


def quantize_tensor(w: np.ndarray, spec: QuantSpec, act_absmax: float | None = None) -> QuantizedTensor:
    """One float weight in `spec`'s form (w8a8 needs its input's smoothing: quantize_checkpoint)."""
    if spec.mode == "int8":
        return quantize_int8(w)
    if spec.mode == "int4":
        # a width the group does not divide (SmolLM2's 576 = 4.5 x 128) takes the largest group
        # dividing both (576: 64): finer groups, never a partial one
        return quantize_int4(w, math.gcd(w.shape[1], spec.group_size), symmetric=spec.symmetric)
    if spec.mode == "fp8":
        return quantize_fp8(w, act_absmax)
    raise ValueError(f"quantization={spec.mode!r} quantizes nothing")


def quantize_checkpoint(ckpt: Checkpoint, spec: QuantSpec, *,
                        act_absmax: Mapping[str, object] | None = None,
                        calibration_id: str | None = None) -> Checkpoint:
    """`ckpt` with its decoder projections quantized per `spec`.

    act_absmax: the calibrated max |input| of each projection per input channel (fp8 takes their
    maximum), keyed by the projection's module path (quant/calibration.py); fp8 without it is
    uncalibrated (act_scale 1); w8a8 needs it."""
    if not spec.enabled:
        return ckpt
    kinds = {t.mode for t in ckpt.tensors.values() if isinstance(t, QuantizedTensor)}
    if kinds - {spec.mode}:
        raise ValueError(f"{ckpt.source!r} is already quantized ({sorted(kinds)}); quantize its float source "
                         f"instead of serving it as {spec.mode}")
    if spec.mode in ("w8a8", "fp8"):
        _refuse_calibrated_experts(ckpt, spec.mode)
    linear = quantizable_weights(ckpt)
    if not any(n in linear and not isinstance(t, QuantizedTensor) for n, t in ckpt.tensors.items()):
        if spec.lm_head and not isinstance(ckpt.tensors.get(LM_HEAD), QuantizedTensor):
            if spec.uses_calibration:
                raise ValueError(f"{ckpt.source!r} is already quantized without its LM head and keeps no "
                                 "calibration for it: serve quantize_lm_head from its float source")
            # int4 (a GGUF's own blocks): the head needs no calibration, so it is quantized here
            tensors = {**ckpt.tensors, LM_HEAD: _quantized_lm_head(ckpt, spec, None)}
            return dataclasses.replace(ckpt, tensors=tensors, identity=quantized_identity(ckpt.identity, spec, None))
        return ckpt                  # every projection already in this form (a converted checkpoint)
    if spec.uses_calibration and act_absmax is None:
        raise ValueError(f"{spec.mode} with calibration needs act_absmax (jaxserve.quant.calibration)")
    smooth = _smoothing(ckpt.tensors, linear, act_absmax) if spec.mode == "w8a8" else {}
    tensors: dict[str, object] = {}
    for name, w in ckpt.tensors.items():
        # a GGUF's natively loaded blocks stay; its other weights (float, or block types read as
        # float) are quantized like any float weight
        if name not in linear or isinstance(w, QuantizedTensor):
            tensors[name] = w
            continue
        key = linear[name]
        if spec.mode == "w8a8":
            tensors[name] = quantize_w8a8(np.asarray(w), smooth[key])
            continue
        act = float(np.max(act_absmax[key])) if spec.mode == "fp8" and spec.uses_calibration else None
        tensors[name] = quantize_tensor(np.asarray(w), spec, act)
    if spec.lm_head:
        tensors[LM_HEAD] = _quantized_lm_head(ckpt, spec, act_absmax)
    identity = quantized_identity(ckpt.identity, spec, calibration_id if spec.uses_calibration else None)
    return dataclasses.replace(ckpt, tensors=tensors, identity=identity)


def _quantized_lm_head(ckpt: Checkpoint, spec: QuantSpec, act_absmax: Mapping[str, object] | None) -> QuantizedTensor:
    """The LM head [V, D] (the embedding when tied) in the spec's form: w8a8 smoothed by its input's
    range, int4 in the projections' groups."""
    from jaxserve.checkpoints.layout import tensor_layout
    from jaxserve.quant.calibration import LM_HEAD_INPUT

    layout = tensor_layout(ckpt.config)
    source = layout.modules[("embed_tokens",)].hf_name if layout.tied_lm_head is not None else LM_HEAD
    head = ckpt.tensors[source]
    if isinstance(head, QuantizedTensor):
        raise ValueError(f"{source!r} is already quantized ({head.mode}); quantize_lm_head needs a float LM head")
    w = np.asarray(head, np.float32)
    if spec.mode == "int4":
        return quantize_int4(w, spec.group_size, symmetric=spec.symmetric)
    return quantize_w8a8(w, smoothing([w], np.asarray(act_absmax[LM_HEAD_INPUT], np.float32)))


def _refuse_calibrated_experts(ckpt: Checkpoint, mode: str) -> None:
    """w8a8 and fp8 scale activations by a calibrated range per projection input; an expert's
    input is only the tokens routed to it, which the calibration pass (one range per module
    path, over every token) does not separate. int8 and int4 need no calibration."""
    from jaxserve.checkpoints.layout import tensor_layout

    if any(True for _ in tensor_layout(ckpt.config).expert_projections()):
        raise ValueError(f"quantization={mode!r} is not supported for a mixture-of-experts model "
                         f"({ckpt.config.get('model_type')}): its experts would need activation ranges calibrated per "
                         "expert; use int8 or int4")


def _smoothing(tensors: Mapping[str, object], linear: Mapping[str, str],
               act_absmax: Mapping[str, object]) -> dict[str, np.ndarray]:
    """w8a8: one act_smooth per projection input, over every float weight that reads it."""
    readers: dict[str, list[np.ndarray]] = {}
    for name, w in tensors.items():
        if name in linear and not isinstance(w, QuantizedTensor):
            readers.setdefault(linear[name], []).append(np.asarray(w))
    return {key: smoothing(ws, np.asarray(act_absmax[key], np.float32)) for key, ws in readers.items()}
