"""Checkpoint identity: a sha256 over the bytes of the files a checkpoint was loaded from.

Everything derived from the weights (compilation cache entries, later quantization scales) is keyed
by this string, so an engine can never pick up artifacts made for another checkpoint. Files are
hashed in a streaming fashion so a multi-gigabyte checkpoint is never held in memory to hash it.

Hashing reads every byte, so it is done once per file version rather than once per process: with
a cache directory, the identity is stored under a key made of each file's path and stat (size,
mtime, and the ctime and inode, which a write changes even when a tool puts the old mtime back),
and a later start re-hashes only when a file changed.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable

from .disk_cache import DiskCache

_CHUNK = 1 << 22  # 4 MiB reads: large enough that hashing runs at hashlib's speed
IDENTITY_DIR = "identity"


def file_identity(paths: Iterable[str | os.PathLike], cache_dir: str | os.PathLike | None = None) -> str:
    """"sha256:<hex>" over the concatenated bytes of `paths`, in the order given; looked up in,
    and stored to, `cache_dir` when one is given."""
    paths = [os.fspath(p) for p in paths]
    if not cache_dir:
        return _hash_files(paths)
    cache = DiskCache(os.path.join(os.fspath(cache_dir), IDENTITY_DIR))
    key = version_key(paths) + ".json"
    entry = cache.get_json(key)
    if isinstance(entry, dict) and isinstance(entry.get("identity"), str):
        return entry["identity"]
    identity = _hash_files(paths)
    cache.put_json(key, {"identity": identity, "files": paths})
    return identity


def version_key(paths: list[str]) -> str:
    """A hex key that changes whenever one of `paths` is replaced, rewritten or resized."""
    versions = []
    for path in paths:
        st = os.stat(path)
        versions.append([os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino])
    return hashlib.sha256(json.dumps(versions).encode()).hexdigest()


def _hash_files(paths: list[str]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"
