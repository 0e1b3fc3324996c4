"""QuantSpec: which quantization a checkpoint gets, as one small value the identity can hash."""

from __future__ import annotations

from dataclasses import asdict, dataclass

# "none": serve the checkpoint as it is (a quantized checkpoint stays quantized)
QUANTIZATION_MODES = ("none", "int8", "int4", "fp8", "w8a8")
LM_HEAD_MODES = ("w8a8", "int4")       # the modes quantize_lm_head takes
# w8a8: the share of each input channel's range moved from the activations into the weights before
# both are rounded to int8 (SmoothQuant's alpha). Measured on the embedded model: 0 gave +2.8%
# perplexity over float32, 0.5 +2.7%, 0.8 -0.2% (docs/benchmarks.md)
W8A8_SMOOTHING_ALPHA = 0.8
INT4_GROUPS = (32, 128)


@dataclass(frozen=True, slots=True)
class QuantSpec:
    mode: str = "none"
    group_size: int = 32            # int4 only: inputs per scale
    calibrated: bool = True         # fp8 only: per-tensor activation scales from a calibration pass
                                    # (w8a8 always calibrates: its smoothing needs per-channel ranges)
    # int4 only: False (the default) keeps a minimum per group (llama.cpp's Q4_1 form), which
    # measured far better on the embedded model than absmax / 7 (docs/benchmarks.md)
    symmetric: bool = False
    # w8a8 and int4: the LM head too (a quantized copy of a tied embedding; the lookup stays float)
    lm_head: bool = False

    def __post_init__(self) -> None:
        if self.mode not in QUANTIZATION_MODES:
            raise ValueError(f"quantization={self.mode!r} must be one of {QUANTIZATION_MODES}")
        if self.lm_head and self.mode not in LM_HEAD_MODES:
            raise ValueError(f"quantize_lm_head needs quantization in {LM_HEAD_MODES} (got {self.mode!r}): the "
                             "LM head is quantized in those forms only")
        if self.mode == "int4" and self.group_size not in INT4_GROUPS:
            raise ValueError(f"int4 group_size={self.group_size} must be one of {INT4_GROUPS}")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def uses_calibration(self) -> bool:
        """Whether quantizing needs the calibration pass's activation ranges (w8a8 always does)."""
        return self.mode == "w8a8" or (self.mode == "fp8" and self.calibrated)

    def describe(self) -> dict:
        """What the quantized checkpoint's identity covers (only the fields its mode reads)."""
        d = asdict(self)
        if self.mode != "int4":
            d.pop("group_size")
            d.pop("symmetric")
        if self.mode != "fp8":
            d.pop("calibrated")
        if self.mode == "w8a8":
            d["smoothing_alpha"] = W8A8_SMOOTHING_ALPHA
        if not self.lm_head:
            d.pop("lm_head")       # identities from before the option stay as they were
        return d
