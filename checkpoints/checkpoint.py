"""Checkpoint: what every loader hands to the engine, whatever the file format it came from.

Tensors keep HF names and HF layouts ([out, in] for linear weights), so the model code has one
naming scheme to read and HF transformers is the reference for what each tensor means.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

FORMATS = ("gguf", "hf", "jaxserve")


@dataclass(frozen=True, slots=True)
class Checkpoint:
    config: dict[str, Any]                 # HF config.json-style dict (ModelConfig.from_hf_config reads it)
    # HF name -> array in HF layout; float dtypes as stored, GGUF quants as float32, except that a
    # quantized checkpoint holds QuantizedTensors (models/quantized_tensor.py) for its decoder projections
    tensors: Mapping[str, np.ndarray]
    tokenizer: "PreTrainedTokenizerFast | None"  # chat_template set when the source has one; None when
                                                 # the source has no tokenizer (no files, no GGUF vocab)
    identity: str                          # "sha256:<hex>" of the source files (a converted checkpoint keeps its source's)
    source: str                            # the path it was loaded from
    format: str                            # "gguf" | "hf" | "jaxserve"
    # seconds each part of loading took: "weights", "tokenizer", "identity" (start-up timings)
    load_seconds: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"format={self.format!r} must be one of {FORMATS}")
        if not self.identity.startswith("sha256:"):
            raise ValueError(f"identity={self.identity!r} must look like 'sha256:<hex>'")
