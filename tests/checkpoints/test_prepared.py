"""A GGUF is parsed and dequantized once per file version; later loads read the prepared copy."""

import os

import numpy as np
import pytest
from ckpt_testkit import tiny_config, tiny_tensors, write_gguf
from gguf import GGMLQuantizationType as Q

from jaxserve.checkpoints import gguf_loader, load_checkpoint, prepared


@pytest.fixture
def gguf_loads(monkeypatch):
    calls = []
    real = gguf_loader.load_gguf

    def counting(path, **kw):
        calls.append(path)
        return real(path, **kw)

    monkeypatch.setattr(gguf_loader, "load_gguf", counting)
    return calls


def _gguf(tmp_path, seed=0):
    config = tiny_config("llama")
    return write_gguf(tmp_path / f"m{seed}.gguf", "llama", config, tiny_tensors(config, seed=seed),
                      types=lambda n: Q.Q4_1 if n.endswith("proj.weight") else Q.F32)


def _same(a, b):
    assert a.config == b.config and a.identity == b.identity and a.format == b.format == "gguf"
    assert set(a.tensors) == set(b.tensors)
    for name in a.tensors:
        assert a.tensors[name].dtype == b.tensors[name].dtype, name
        np.testing.assert_array_equal(a.tensors[name], b.tensors[name])
    text = "hello world"
    assert a.tokenizer(text)["input_ids"] == b.tokenizer(text)["input_ids"]


def test_the_second_load_reads_the_prepared_copy(tmp_path, gguf_loads):
    path = _gguf(tmp_path)
    first = load_checkpoint(path, cache_dir=tmp_path / "cache")
    second = load_checkpoint(path, cache_dir=tmp_path / "cache")
    assert gguf_loads == [path]                      # parsed once
    _same(first, load_checkpoint(path))              # what the cache holds is what the file holds
    _same(second, first)
    assert second.source == path
    assert set(second.load_seconds) == {"weights", "tokenizer", "identity"}


def test_another_file_version_gets_its_own_copy(tmp_path, gguf_loads):
    path = _gguf(tmp_path)
    load_checkpoint(path, cache_dir=tmp_path / "cache")
    os.replace(_gguf(tmp_path, seed=1), path)        # new weights under the same name
    changed = load_checkpoint(path, cache_dir=tmp_path / "cache")
    assert gguf_loads == [path, path]
    _same(changed, load_checkpoint(path))


def test_a_damaged_copy_is_a_miss_not_a_failure(tmp_path, gguf_loads):
    path = _gguf(tmp_path)
    ckpt = load_checkpoint(path, cache_dir=tmp_path / "cache")
    entry = prepared.prepared_path(tmp_path / "cache", ckpt.identity)
    with open(os.path.join(entry, "tensors.safetensors"), "r+b") as f:
        f.write(b"garbage!")
    _same(load_checkpoint(path, cache_dir=tmp_path / "cache"), ckpt)
    assert gguf_loads == [path, path]


def test_a_checkpoint_over_the_size_limit_is_not_kept(tmp_path, gguf_loads, monkeypatch):
    monkeypatch.setattr(prepared, "MAX_PREPARED_BYTES", 1000)
    path = _gguf(tmp_path)
    load_checkpoint(path, cache_dir=tmp_path / "cache")
    load_checkpoint(path, cache_dir=tmp_path / "cache")
    assert gguf_loads == [path, path]
