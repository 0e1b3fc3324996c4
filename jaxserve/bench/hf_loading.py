"""Loading the PyTorch path: the same GGUF file or HF directory jaxserve reads, in float32."""

from __future__ import annotations

import os
from typing import Any

from jaxserve.bench.backend_base import UnsupportedBackend
from jaxserve.bench.model_files import ModelSpec


def disable_progress_bars() -> None:
    """transformers' own bars (loading weights, ...), for --no-progress; process-wide."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()


def load_hf_model(spec: ModelSpec, dtype: str = "float32") -> Any:
    """dtype as jaxserve's: float32, bfloat16, or auto (float32 on CPU, bfloat16 on a GPU)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise UnsupportedBackend(f"the PyTorch path needs torch and transformers: {e}") from e
    if dtype == "auto":
        dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16, float16 or auto, got {dtype!r}")
    torch_dtype = getattr(torch, dtype)
    if spec.kind == "gguf":
        model = AutoModelForCausalLM.from_pretrained(spec.directory, gguf_file=spec.gguf_file, dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(spec.directory, dtype=torch_dtype)
    if torch.cuda.is_available():
        model = model.to("cuda")
    return model.eval()


def pad_token_id(model: Any) -> int:
    gc = model.generation_config
    for value in (gc.pad_token_id, gc.eos_token_id, model.config.eos_token_id, 0):
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0
