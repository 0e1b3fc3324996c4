"""QuantizedTensor: a linear weight held in a quantized form, in a Checkpoint's tensors mapping.

A loader or `jaxserve.quant.quantize_checkpoint` may put one in place of a float `[out, in]`
weight under the same HF name. It keeps the HF layout (rows are output channels, `in` is the
contraction axis), so `layout.check_tensors` checks its logical `shape` like any other tensor.

Kinds (values of one weight element, `o` its output row, `i` its input column, `g = i // group`):
    int8   qweight int8 [out, in]            w = qweight * scale[o, g]          (+ offset[o, g])
    int4   qweight uint8 [out, in // 2]      w = (nibble - 8) * scale[o, g]     (no offset: symmetric)
                                             w = nibble * scale[o, g] + offset[o, g]   (with offset)
    fp8    qweight float8_e4m3fn [out, in]   w = qweight * scale[o, 0]; inputs are cast to e4m3 after
                                             dividing by act_scale (a calibrated per-tensor scalar)
An int8 tensor with `act_smooth` [in] is the w8a8 form (per-channel scale): its inputs are
multiplied by act_smooth and rounded to int8 per token at run time, and the weight it stands for is
w = qweight * scale[o, 0] * act_smooth[i] (the smoothing moved into the weight before rounding).
`scale` is [out, in // group]; group == in means one scale per output channel. int4 packs two
values per byte within each group: byte j of a group holds element j in its low nibble and
element j + group/2 in its high nibble, which is llama.cpp's Q4_0/Q4_1 order, so those blocks
load without touching a nibble.

Stored flat (converted checkpoints): `<name>.qweight`, `<name>.scale`, optional `<name>.offset`
`<name>.act_scale` and `<name>.act_smooth`; fp8 values as their uint8 bits under `<name>.qweight_fp8`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

KINDS = ("int8", "int4", "fp8")
_PARTS = ("qweight", "qweight_fp8", "scale", "offset", "act_scale", "act_smooth")


@dataclass(frozen=True)
class QuantizedTensor:
    kind: str                       # "int8" | "int4" | "fp8"
    qweight: np.ndarray             # see the module doc: [out, in] (int8, fp8) or [out, in // 2] (int4)
    scale: np.ndarray               # float32 [out, in // group]
    offset: np.ndarray | None = None      # float32 [out, in // group] (int8/int4 with a zero point)
    act_scale: float | None = None        # fp8: per-tensor activation scale (None: not calibrated)
    act_smooth: np.ndarray | None = None  # w8a8: float32 [in], what inputs are multiplied by

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r} must be one of {KINDS}")
        want = {"int8": np.int8, "int4": np.uint8}.get(self.kind)
        if want is not None and self.qweight.dtype != want:
            raise ValueError(f"{self.kind} qweight must be {np.dtype(want)}, got {self.qweight.dtype}")
        if self.kind == "fp8" and self.qweight.dtype.name != "float8_e4m3fn":
            raise ValueError(f"fp8 qweight must be float8_e4m3fn, got {self.qweight.dtype}")
        if self.scale.ndim != 2 or self.scale.shape[0] != self.qweight.shape[0]:
            raise ValueError(f"scale shape {self.scale.shape} does not fit qweight {self.qweight.shape}")
        if self.in_features % self.scale.shape[1]:
            raise ValueError(f"{self.scale.shape[1]} groups do not divide {self.in_features} inputs")
        if self.offset is not None and self.offset.shape != self.scale.shape:
            raise ValueError(f"offset shape {self.offset.shape} differs from scale shape {self.scale.shape}")
        if self.act_smooth is not None and (self.kind != "int8" or self.group != self.in_features
                                            or self.act_smooth.shape != (self.in_features,)):
            raise ValueError(f"act_smooth {self.act_smooth.shape} needs a per-channel int8 weight of "
                             f"{self.in_features} inputs")
        if self.kind == "int4" and self.group % 2:
            raise ValueError(f"int4 group {self.group} must be even (two values per byte)")

    @property
    def mode(self) -> str:
        """The quantization mode this tensor is in (QuantSpec.mode's names)."""
        return "w8a8" if self.act_smooth is not None else self.kind

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * (2 if self.kind == "int4" else 1)

    @property
    def shape(self) -> tuple[int, int]:
        """The logical [out, in] shape of the weight it stands for."""
        return (self.qweight.shape[0], self.in_features)

    @property
    def group(self) -> int:
        return self.in_features // self.scale.shape[1]

    @property
    def nbytes(self) -> int:
        extra = sum(a.nbytes for a in (self.offset, self.act_smooth) if a is not None)
        return self.qweight.nbytes + self.scale.nbytes + extra

    def flat(self, name: str) -> dict[str, np.ndarray]:
        """The arrays to store for this tensor under `name` (see the module doc)."""
        out = {f"{name}.scale": self.scale}
        if self.kind == "fp8":
            out[f"{name}.qweight_fp8"] = self.qweight.view(np.uint8)
        else:
            out[f"{name}.qweight"] = self.qweight
        if self.offset is not None:
            out[f"{name}.offset"] = self.offset
        if self.act_scale is not None:
            out[f"{name}.act_scale"] = np.asarray(self.act_scale, np.float32)
        if self.act_smooth is not None:
            out[f"{name}.act_smooth"] = self.act_smooth
        return out


def is_quantized(tensors: Mapping[str, object]) -> bool:
    return any(isinstance(t, QuantizedTensor) for t in tensors.values())


def flatten(tensors: Mapping[str, object]) -> dict[str, np.ndarray]:
    """Checkpoint tensors with every QuantizedTensor spread into its stored arrays."""
    out: dict[str, np.ndarray] = {}
    for name, t in tensors.items():
        out.update(t.flat(name) if isinstance(t, QuantizedTensor) else {name: t})
    return out


def unflatten(arrays: Mapping[str, np.ndarray]) -> dict[str, object]:
    """The inverse of `flatten`: stored arrays back into QuantizedTensors under their names."""
    import ml_dtypes

    parts: dict[str, dict[str, np.ndarray]] = {}
    out: dict[str, object] = {}
    for key, array in arrays.items():
        base, _, part = key.rpartition(".")
        if part in _PARTS and base:
            parts.setdefault(base, {})[part] = np.asarray(array)
        else:
            out[key] = array
    for name, p in parts.items():
        if "qweight_fp8" in p:
            kind, qweight = "fp8", p["qweight_fp8"].view(ml_dtypes.float8_e4m3fn)
        else:
            qweight = p["qweight"]
            kind = "int8" if qweight.dtype == np.int8 else "int4"
        act = p.get("act_scale")
        out[name] = QuantizedTensor(kind, qweight, p["scale"], p.get("offset"),
                                    None if act is None else float(act), p.get("act_smooth"))
    return out
