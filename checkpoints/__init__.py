"""Checkpoints: GGUF files, HF directories and converted checkpoints, loaded into one `Checkpoint`.

The engine calls `load_checkpoint(path)` and gets HF-named numpy tensors, an HF-style config dict,
a transformers tokenizer and the checkpoint identity. This package never imports jax at import
time (only `convert` and loading a converted checkpoint do, through orbax), and never torch.
"""

from .checkpoint import Checkpoint
from .convert import convert, save_converted
from .embedded import embedded_model_path
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigMismatchError,
    EmbeddedModelMissingError,
    MissingTensorError,
    UnsupportedArchitectureError,
    UnsupportedFormatError,
    UnsupportedTensorTypeError,
)
from .loader import load_checkpoint

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointNotFoundError",
    "ConfigMismatchError",
    "EmbeddedModelMissingError",
    "MissingTensorError",
    "UnsupportedArchitectureError",
    "UnsupportedFormatError",
    "UnsupportedTensorTypeError",
    "convert",
    "embedded_model_path",
    "load_checkpoint",
    "save_converted",
]
