"""Converting any checkpoint into jaxserve's own format, and loading it back: the fast path.

A converted checkpoint is a directory:
    config.json      the HF-style config the source produced
    tokenizer files  written by `tokenizer.save_pretrained` (tokenizer.json, so no GGUF parsing again)
    identity.json    the source's identity: a converted checkpoint is the same weights, so anything
                     keyed by the identity (compile cache, quantization scales) stays valid
    weights/         an orbax checkpoint of the tensors, already dequantized and un-permuted
                     (a quantized conversion stores its QuantizedTensors flat: models/quantized_tensor.py)

A quantized conversion (jaxserve/quant/convert.py: int8 / int4 / fp8 / w8a8, the last two after a
calibration pass over real text) stores the quantized weights, and the identity written is the
quantized one (jaxserve/quant/checkpoint.py): the converted directory never passes for its float
source.
Loading it skips dequantization and tokenizer reconstruction; orbax (and so jax) is imported only here.
"""

from __future__ import annotations

import json
import os
import shutil

from .checkpoint import Checkpoint
from .errors import CheckpointNotFoundError
from .layout import check_tensors
from jaxserve.models.quantized_tensor import flatten, is_quantized, unflatten
from .tokenizer import has_tokenizer_files

FORMAT_VERSION = 1
IDENTITY_FILE = "identity.json"
WEIGHTS_DIR = "weights"


def is_converted_directory(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(path, IDENTITY_FILE)) and os.path.isdir(os.path.join(path, WEIGHTS_DIR))


def convert(src: str | os.PathLike | None, dst: str | os.PathLike, *, overwrite: bool = False) -> str:
    """Write `src` (None = the embedded model) as a converted checkpoint at `dst`; returns `dst`.
    A quantized conversion is jaxserve.quant.convert (quantization builds on checkpoints, never
    the other way round)."""
    from .loader import load_checkpoint

    check_destination(dst, overwrite)
    return save_converted(load_checkpoint(src), dst, overwrite=overwrite)


def save_converted(ckpt: Checkpoint, dst: str | os.PathLike, *, overwrite: bool = False) -> str:
    """Write an already loaded checkpoint as a converted checkpoint at `dst`; returns `dst`."""
    import orbax.checkpoint as ocp

    dst = check_destination(dst, overwrite)
    # Written beside the destination and renamed into place, so a crash never leaves a
    # half-written directory that loads.
    partial = dst + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    with open(os.path.join(partial, "config.json"), "w") as f:
        json.dump(ckpt.config, f, indent=2, sort_keys=True)
    if ckpt.tokenizer is not None:
        ckpt.tokenizer.save_pretrained(partial)
    # Uncompressed: restoring skips zstd, which halved load time for the embedded model
    # (a 40% larger directory is the price of the fast path).
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False)) as checkpointer:
        checkpointer.save(os.path.join(partial, WEIGHTS_DIR), args=ocp.args.PyTreeSave(flatten(ckpt.tensors)))
    with open(os.path.join(partial, IDENTITY_FILE), "w") as f:
        json.dump({"identity": ckpt.identity, "source": ckpt.source, "source_format": ckpt.format,
                   "format_version": FORMAT_VERSION, "quantized": is_quantized(ckpt.tensors)}, f, indent=2)
    if os.path.exists(dst):
        shutil.rmtree(dst) if os.path.isdir(dst) else os.remove(dst)
    os.rename(partial, dst)
    return dst


def check_destination(dst: str | os.PathLike, overwrite: bool) -> str:
    dst = os.path.abspath(os.fspath(dst))
    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)) and not overwrite:
        raise FileExistsError(f"convert destination {dst!r} exists and is not empty (pass overwrite=True)")
    return dst


def load_converted(directory: str | os.PathLike) -> Checkpoint:
    import orbax.checkpoint as ocp

    directory = os.path.abspath(os.fspath(directory))
    if not is_converted_directory(directory):
        raise CheckpointNotFoundError(f"{directory!r} is not a converted jaxserve checkpoint")
    with open(os.path.join(directory, IDENTITY_FILE)) as f:
        identity = json.load(f)
    if identity.get("format_version") != FORMAT_VERSION:
        raise CheckpointNotFoundError(
            f"{directory!r} was converted with format_version={identity.get('format_version')}, "
            f"this jaxserve reads {FORMAT_VERSION}: convert it again"
        )
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
        # numpy arrays were saved, so numpy arrays come back: placing them is the runner's job
        tensors = checkpointer.restore(os.path.join(directory, WEIGHTS_DIR), args=ocp.args.PyTreeRestore())
    tokenizer = None
    if has_tokenizer_files(directory):
        from transformers import PreTrainedTokenizerFast

        # the class we saved, not the one AutoTokenizer would guess from config.json's model_type
        tokenizer = PreTrainedTokenizerFast.from_pretrained(directory, local_files_only=True)
    return Checkpoint(
        config=config,
        tensors=check_tensors(config, unflatten(tensors)),
        tokenizer=tokenizer,
        identity=identity["identity"],
        source=directory,
        format="jaxserve",
    )
