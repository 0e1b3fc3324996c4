"""HF checkpoint directories (config.json + safetensors, sharded or not) written in the test."""

import hashlib
import json
import os

import ml_dtypes
import numpy as np
import pytest
from ckpt_testkit import CHAT_TEMPLATE, tiny_config, tiny_tensors, write_hf_dir

from jaxserve.checkpoints import load_checkpoint


def _sha256(paths) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            digest.update(f.read())
    return "sha256:" + digest.hexdigest()


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_tensors_and_config_load_unchanged(tmp_path, model_type, shards):
    config = tiny_config(model_type, tied=model_type != "qwen2")
    tensors = tiny_tensors(config)
    ckpt = load_checkpoint(write_hf_dir(tmp_path, config, tensors, shards=shards))
    assert ckpt.format == "hf" and ckpt.config == config
    assert set(ckpt.tensors) == set(tensors)
    for name, want in tensors.items():
        np.testing.assert_array_equal(ckpt.tensors[name], want, err_msg=name)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32], ids=lambda d: np.dtype(d).name)
def test_stored_float_dtypes_are_kept(tmp_path, dtype):
    config = tiny_config("llama")
    tensors = tiny_tensors(config, dtype=dtype)
    ckpt = load_checkpoint(write_hf_dir(tmp_path, config, tensors))
    assert {a.dtype for a in ckpt.tensors.values()} == {np.dtype(dtype)}
    name = "model.layers.1.mlp.up_proj.weight"
    np.testing.assert_array_equal(ckpt.tensors[name].view(np.uint16 if dtype != np.float32 else np.uint32),
                                  tensors[name].view(np.uint16 if dtype != np.float32 else np.uint32))


def test_identity_hashes_config_then_shards_in_sorted_order(tmp_path):
    config = tiny_config("llama")
    path = write_hf_dir(tmp_path, config, tiny_tensors(config), shards=3)
    shards = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    want = _sha256([os.path.join(path, "config.json")] + [os.path.join(path, n) for n in shards])
    assert load_checkpoint(path).identity == want


def test_identity_changes_with_one_weight(tmp_path):
    config = tiny_config("llama")
    tensors = tiny_tensors(config)
    a = load_checkpoint(write_hf_dir(tmp_path / "a", config, tensors)).identity
    tensors["model.norm.weight"] = tensors["model.norm.weight"].copy()
    tensors["model.norm.weight"][3] += 1
    b = load_checkpoint(write_hf_dir(tmp_path / "b", config, tensors)).identity
    assert a != b and a.startswith("sha256:")


def test_tokenizer_and_chat_template_come_from_the_directory(tmp_path):
    config = tiny_config("llama")
    ckpt = load_checkpoint(write_hf_dir(tmp_path, config, tiny_tensors(config)))
    assert ckpt.tokenizer.chat_template == CHAT_TEMPLATE
    ids = ckpt.tokenizer("the hello<|im_end|>").input_ids
    assert ids[-1] == 2 and ckpt.tokenizer.decode(ids) == "the hello<|im_end|>"


def test_a_directory_without_tokenizer_files_has_no_tokenizer(tmp_path):
    config = tiny_config("llama")
    ckpt = load_checkpoint(write_hf_dir(tmp_path, config, tiny_tensors(config), tokenizer=False))
    assert ckpt.tokenizer is None


def test_a_model_saved_by_transformers_loads_with_its_state_dict(tmp_path):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(tmp_path, max_shard_size="100KB")  # sharded, with an index
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    ckpt = load_checkpoint(tmp_path)
    state = model.state_dict()
    assert set(ckpt.tensors) == set(state)
    for name, value in state.items():
        np.testing.assert_array_equal(ckpt.tensors[name], value.numpy(), err_msg=name)
    with open(tmp_path / "config.json") as f:
        assert ckpt.config == json.load(f)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_attention_bias_brings_q_k_v_and_o_biases(tmp_path, model_type):
    # as HF's Llama and Qwen3 attention (Qwen2 has q/k/v biases only, tested above)
    config = tiny_config(model_type, attention_bias=True)
    tensors = tiny_tensors(config)
    assert "model.layers.1.self_attn.o_proj.bias" in tensors
    ckpt = load_checkpoint(write_hf_dir(tmp_path, config, tensors, tokenizer=False))
    assert set(ckpt.tensors) == set(tensors)


def test_gguf_llama_with_biases_sets_attention_bias(tmp_path):
    from ckpt_testkit import write_gguf

    config = tiny_config("llama", attention_bias=True)
    tensors = tiny_tensors(config)
    ckpt = load_checkpoint(write_gguf(tmp_path / "m.gguf", "llama", config, tensors, tokenizer=False))
    assert ckpt.config["attention_bias"] is True
    # biases of q and k are permuted by llama.cpp like their weights, and come back in HF order
    for name in ("model.layers.0.self_attn.q_proj.bias", "model.layers.1.self_attn.k_proj.bias",
                 "model.layers.1.self_attn.o_proj.bias"):
        np.testing.assert_array_equal(ckpt.tensors[name], tensors[name])
