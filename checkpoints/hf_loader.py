"""Loading a Hugging Face checkpoint directory: config.json plus safetensors, sharded or not.

Tensors are memory-mapped by safetensors and kept in their stored dtype (bfloat16 via ml_dtypes),
so loading costs a read of the files and nothing more; the runner casts when it places them.
"""

from __future__ import annotations

import json
import os
import time

from .checkpoint import Checkpoint
from .errors import CheckpointNotFoundError, ConfigMismatchError
from .identity import file_identity
from .layout import check_model_type, check_tensors
from .tokenizer import directory_tokenizer, has_tokenizer_files

INDEX_FILE = "model.safetensors.index.json"


def is_hf_directory(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and bool(safetensors_files(path))


def safetensors_files(directory: str | os.PathLike) -> list[str]:
    """The weight files of a checkpoint directory, sorted by name (the order identity hashes them in)."""
    index = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not os.path.isfile(os.path.join(directory, n))]
        if missing:
            raise CheckpointNotFoundError(f"{INDEX_FILE} in {directory!r} lists missing shards {missing}")
    else:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    return [os.path.join(directory, n) for n in names]


def read_config(directory: str | os.PathLike) -> dict:
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise CheckpointNotFoundError(f"{directory!r} has no config.json")
    with open(path) as f:
        return json.load(f)


def load_hf(directory: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None) -> Checkpoint:
    """`cache_dir` keeps the identity hash of the files (see identity.py)."""
    from safetensors.numpy import load_file

    t0 = time.perf_counter()
    directory = os.fspath(directory)
    config = read_config(directory)
    check_model_type(config)
    files = safetensors_files(directory)
    if not files:
        raise CheckpointNotFoundError(f"{directory!r} has config.json but no *.safetensors files")
    tensors = {}
    for path in files:
        for name, array in load_file(path).items():
            if name in tensors:
                raise ConfigMismatchError(f"tensor {name!r} appears in more than one shard")
            tensors[name] = array
    t1 = time.perf_counter()
    tokenizer = directory_tokenizer(directory) if has_tokenizer_files(directory) else None
    t2 = time.perf_counter()
    identity = file_identity([os.path.join(directory, "config.json"), *files], cache_dir)
    return Checkpoint(
        config=config,
        tensors=check_tensors(config, tensors),
        tokenizer=tokenizer,
        identity=identity,
        source=directory,
        format="hf",
        load_seconds={"weights": t1 - t0, "tokenizer": t2 - t1, "identity": time.perf_counter() - t2},
    )
