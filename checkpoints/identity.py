"""Checkpoint identity: a sha256 over the bytes of the files a checkpoint was loaded from.

Everything derived from the weights (compilation cache entries, later quantization scales) is keyed
by this string, so an engine can never pick up artifacts made for another checkpoint. Files are
hashed in a streaming fashion so a multi-gigabyte checkpoint is never held in memory to hash it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable

_CHUNK = 1 << 22  # 4 MiB reads: large enough that hashing runs at hashlib's speed


def file_identity(paths: Iterable[str | os.PathLike]) -> str:
    """"sha256:<hex>" over the concatenated bytes of `paths`, in the order given."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"
