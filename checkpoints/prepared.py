"""Prepared GGUF checkpoints: a GGUF is parsed and dequantized once per file version, not per start.

Reading a GGUF is slow where it should not matter: gguf's reader builds a Python object per
vocabulary entry (about 100k for SmolLM2), the block types are dequantized in numpy, and the
tokenizer is rebuilt from the vocabulary and merges by transformers' converter. For the embedded
model that is 4-12 s of every start on the 2-core CPU (the lower figure quiet, the upper under
load), against well under a second to read the result back from safetensors and tokenizer.json.
So the first load keeps its result under the cache directory, keyed by the file's identity:

    <cache_dir>/prepared/<identity hex>/
        tensors.safetensors   HF-named tensors as the GGUF loader returns them
        config.json           the HF-style config
        tokenizer files       tokenizer.save_pretrained (absent when the GGUF has no vocabulary)
        prepared.json         identity, source and PREPARED_FORMAT (written last: it marks a whole entry)

An entry is written beside its final name and renamed into place. Dequantized weights are larger
than the quantized file (float32: 540 MB for the 98 MB embedded model), so checkpoints whose
prepared form would pass MAX_PREPARED_BYTES are not kept: their start-up pays the full load.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

import numpy as np

from .checkpoint import Checkpoint
from .identity import file_identity

log = logging.getLogger(__name__)

PREPARED_DIR = "prepared"
PREPARED_FORMAT = 1
MAX_PREPARED_BYTES = 4 << 30
_BF16 = "bfloat16"        # safetensors' numpy API has no bfloat16: stored as uint16 bits


def load_gguf_prepared(path: str, cache_dir: str | os.PathLike) -> Checkpoint:
    """The GGUF at `path`, from its prepared form when there is one; otherwise loaded from the file
    and prepared for next time."""
    from .gguf_loader import load_gguf

    t0 = time.perf_counter()
    identity = file_identity([path], cache_dir)
    identity_s = time.perf_counter() - t0
    entry = prepared_path(cache_dir, identity)
    ckpt = _load_entry(entry, identity, path)
    if ckpt is None:
        ckpt = load_gguf(path, identity=identity)
        _save_entry(entry, ckpt)
    return _with_seconds(ckpt, identity=identity_s)


def prepared_path(cache_dir: str | os.PathLike, identity: str) -> str:
    return os.path.join(os.fspath(cache_dir), PREPARED_DIR, identity.removeprefix("sha256:"))


def _load_entry(entry: str, identity: str, source: str) -> Checkpoint | None:
    from safetensors import safe_open

    if not os.path.isfile(os.path.join(entry, "prepared.json")):
        return None
    try:
        with open(os.path.join(entry, "prepared.json")) as f:
            meta = json.load(f)
        if meta.get("format") != PREPARED_FORMAT or meta.get("identity") != identity:
            return None
        t0 = time.perf_counter()
        with open(os.path.join(entry, "config.json")) as f:
            config = json.load(f)
        with safe_open(os.path.join(entry, "tensors.safetensors"), "np") as f:
            bf16 = set(json.loads((f.metadata() or {}).get(_BF16, "[]")))
            tensors = {name: _restore(f.get_tensor(name), name in bf16) for name in f.keys()}
        t1 = time.perf_counter()
        tokenizer = None
        if meta.get("tokenizer"):
            from transformers import PreTrainedTokenizerFast

            tokenizer = PreTrainedTokenizerFast.from_pretrained(entry, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - whatever a damaged copy raises, the GGUF is still there
        log.warning("prepared checkpoint %s unreadable (%s); loading the GGUF", entry, e)
        return None
    return Checkpoint(config=config, tensors=tensors, tokenizer=tokenizer, identity=identity, source=source,
                      format="gguf", load_seconds={"weights": t1 - t0, "tokenizer": time.perf_counter() - t1})


def _save_entry(entry: str, ckpt: Checkpoint) -> None:
    from safetensors.numpy import save_file

    size = sum(np.asarray(t).nbytes for t in ckpt.tensors.values())
    if size > MAX_PREPARED_BYTES:
        log.info("not keeping a prepared copy of %s: %.1f GB dequantized", ckpt.source, size / 1e9)
        return
    partial = f"{entry}.{os.getpid()}.partial"
    try:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
        bf16 = sorted(n for n, t in ckpt.tensors.items() if np.asarray(t).dtype.name == _BF16)
        tensors = {n: np.asarray(t).view(np.uint16) if n in bf16 else np.asarray(t) for n, t in ckpt.tensors.items()}
        save_file(tensors, os.path.join(partial, "tensors.safetensors"), metadata={_BF16: json.dumps(bf16)})
        with open(os.path.join(partial, "config.json"), "w") as f:
            json.dump(ckpt.config, f)
        if ckpt.tokenizer is not None:
            ckpt.tokenizer.save_pretrained(partial)
        with open(os.path.join(partial, "prepared.json"), "w") as f:
            json.dump({"format": PREPARED_FORMAT, "identity": ckpt.identity, "source": ckpt.source,
                       "tokenizer": ckpt.tokenizer is not None}, f)
        shutil.rmtree(entry, ignore_errors=True)
        os.rename(partial, entry)
    except OSError as e:      # a full or read-only disk costs the next start a full load, nothing more
        log.warning("could not keep a prepared copy of %s: %s", ckpt.source, e)
        shutil.rmtree(partial, ignore_errors=True)


def _restore(array: np.ndarray, bf16: bool) -> np.ndarray:
    if not bf16:
        return array
    import ml_dtypes

    return array.view(ml_dtypes.bfloat16)


def _with_seconds(ckpt: Checkpoint, **seconds: float) -> Checkpoint:
    import dataclasses

    return dataclasses.replace(ckpt, load_seconds={**ckpt.load_seconds, **seconds})
