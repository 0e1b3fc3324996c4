"""The checkpoint identity is hashed once per file version: a start with the cache re-hashes only
a file that changed (content, size, or a rewrite that put the old mtime back)."""

import os

import pytest

from jaxserve.checkpoints import identity
from jaxserve.checkpoints.identity import file_identity


@pytest.fixture
def hashes(monkeypatch):
    """The files each real hash read."""
    calls = []
    real = identity._hash_files

    def counting(paths):
        calls.append(list(paths))
        return real(paths)

    monkeypatch.setattr(identity, "_hash_files", counting)
    return calls


def _write(path, data: bytes, mtime_ns: int | None = None):
    path.write_bytes(data)
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))


def test_a_second_start_reads_the_hash_from_the_cache(tmp_path, hashes):
    f = tmp_path / "model.gguf"
    _write(f, b"weights v1")
    first = file_identity([f], tmp_path / "cache")
    assert file_identity([f], tmp_path / "cache") == first == file_identity([f])   # the last one uncached
    assert len(hashes) == 2                                                       # once cached, once not


@pytest.mark.parametrize("change", ["same size, new mtime", "new size", "same size and mtime put back"])
def test_a_changed_file_is_hashed_again(tmp_path, hashes, change):
    f = tmp_path / "model.gguf"
    _write(f, b"weights v1", mtime_ns=1_700_000_000_000_000_000)
    before = file_identity([f], tmp_path / "cache")
    if change == "same size, new mtime":
        _write(f, b"weights v2", mtime_ns=1_700_000_001_000_000_000)
    elif change == "new size":
        _write(f, b"weights v22", mtime_ns=1_700_000_000_000_000_000)
    else:   # a tool that restores timestamps: the ctime still moves
        _write(f, b"weights v2", mtime_ns=1_700_000_000_000_000_000)
    after = file_identity([f], tmp_path / "cache")
    assert after != before and after == file_identity([f])
    assert len(hashes) == 3


def test_every_file_of_a_multi_file_checkpoint_is_in_the_key(tmp_path, hashes):
    a, b = tmp_path / "config.json", tmp_path / "model.safetensors"
    _write(a, b"{}")
    _write(b, b"tensors")
    before = file_identity([a, b], tmp_path / "cache")
    _write(b, b"tensorz", mtime_ns=os.stat(b).st_mtime_ns + 1)
    assert file_identity([a, b], tmp_path / "cache") != before
    assert file_identity([a, b], tmp_path / "cache") == file_identity([a, b])


def test_an_unwritable_cache_costs_a_hash_not_the_load(tmp_path, hashes):
    f = tmp_path / "model.gguf"
    _write(f, b"weights")
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder should be")
    assert file_identity([f], blocker) == file_identity([f])
