"""load_checkpoint: one entry point that recognises the format of a path and calls its loader."""

from __future__ import annotations

import os

from .checkpoint import Checkpoint
from .embedded import embedded_model_path
from .errors import CheckpointNotFoundError, UnsupportedFormatError

_GGUF_MAGIC = b"GGUF"


def load_checkpoint(path: str | os.PathLike | None = None, *, cache_dir: str | os.PathLike | None = None,
                    native_quantization: str | None = None) -> Checkpoint:
    """Load a GGUF file, an HF directory or a converted directory; None is the embedded SmolLM2.

    With a `cache_dir`, what loading derives from the files is kept there for the next start:
    the identity hash of every format (identity.py), and a GGUF's parsed and dequantized form
    (prepared.py). `native_quantization` "int8" / "int4": a GGUF's Q8_0 / Q4_0 / Q4_1 linear
    weights load as QuantizedTensors with their own block scales, never through float32
    (gguf_loader.py); other formats ignore it (the engine quantizes their float weights)."""
    from .convert import is_converted_directory, load_converted
    from .hf_loader import is_hf_directory, load_hf

    path = embedded_model_path() if path is None else os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"checkpoint path {path!r} does not exist")
    if os.path.isfile(path):
        with open(path, "rb") as f:
            if f.read(4) != _GGUF_MAGIC:
                raise UnsupportedFormatError(f"{path!r} is a file but not a GGUF file")
        return _load_gguf(path, cache_dir, native_quantization)
    if is_converted_directory(path):
        return load_converted(path)
    if os.path.isfile(os.path.join(path, "config.json")):
        if not is_hf_directory(path):
            raise CheckpointNotFoundError(f"{path!r} has config.json but no *.safetensors files")
        return load_hf(path, cache_dir=cache_dir)
    ggufs = sorted(name for name in os.listdir(path) if name.endswith(".gguf"))
    if len(ggufs) == 1:
        return _load_gguf(os.path.join(path, ggufs[0]), cache_dir, native_quantization)
    raise CheckpointNotFoundError(
        f"{path!r} holds no checkpoint: expected config.json + *.safetensors, a converted checkpoint "
        f"(identity.json + weights/), or a single .gguf file"
        + (f" (found {len(ggufs)} .gguf files: pass one)" if ggufs else "")
    )


def _load_gguf(path: str, cache_dir: str | os.PathLike | None, native_quantization: str | None = None) -> Checkpoint:
    from .gguf_loader import load_gguf
    from .prepared import load_gguf_prepared

    if native_quantization in ("int8", "int4"):
        # the prepared copy holds float32 weights: a native load reads the GGUF's blocks instead
        return load_gguf(path, cache_dir=cache_dir, native_quantization=native_quantization)
    return load_gguf_prepared(path, cache_dir) if cache_dir else load_gguf(path)
