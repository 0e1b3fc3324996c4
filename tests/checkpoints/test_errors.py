"""Every way a checkpoint can be wrong ends in its own error class, with a message that says why."""

import json
import os

import numpy as np
import pytest
from ckpt_testkit import tiny_config, tiny_tensors, write_gguf, write_hf_dir

from jaxserve.checkpoints import (
    CheckpointNotFoundError,
    ConfigMismatchError,
    MissingTensorError,
    UnsupportedArchitectureError,
    UnsupportedFormatError,
    UnsupportedTensorTypeError,
    load_checkpoint,
)


def test_a_missing_path_is_a_file_not_found_error(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError):
        load_checkpoint(str(tmp_path / "nope"))


def test_a_directory_with_no_checkpoint_says_what_it_expected(tmp_path):
    (tmp_path / "readme.txt").write_text("hi")
    with pytest.raises(CheckpointNotFoundError, match="safetensors"):
        load_checkpoint(tmp_path)


def test_config_json_without_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config("llama")))
    with pytest.raises(CheckpointNotFoundError, match="no \\*.safetensors"):
        load_checkpoint(tmp_path)


def test_an_index_that_names_a_missing_shard(tmp_path):
    config = tiny_config("llama")
    path = write_hf_dir(tmp_path, config, tiny_tensors(config), shards=2, tokenizer=False)
    os.remove(os.path.join(path, "model-00002-of-00002.safetensors"))
    with pytest.raises(CheckpointNotFoundError, match="model-00002-of-00002"):
        load_checkpoint(path)


def test_a_file_that_is_not_gguf(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"\x00" * 64)
    with pytest.raises(UnsupportedFormatError, match="not a GGUF"):
        load_checkpoint(tmp_path / "model.bin")


def test_unsupported_hf_architecture(tmp_path):
    config = tiny_config("llama") | {"model_type": "gpt2"}
    path = write_hf_dir(tmp_path, config, tiny_tensors(tiny_config("llama")), tokenizer=False)
    with pytest.raises(UnsupportedArchitectureError, match="gpt2"):
        load_checkpoint(path)


def test_unsupported_gguf_architecture(tmp_path):
    config = tiny_config("llama")
    path = write_gguf(tmp_path / "m.gguf", "falcon", config, tiny_tensors(config), tokenizer=False)
    with pytest.raises(UnsupportedArchitectureError, match="falcon"):
        load_checkpoint(path)


def test_unsupported_gguf_tensor_type(tmp_path):
    config = tiny_config("qwen2")
    tensors = tiny_tensors(config)
    norm = tensors.pop("model.norm.weight")
    path = write_gguf(tmp_path / "m.gguf", "qwen2", config, tensors, tokenizer=False,
                      raw={"output_norm.weight": (norm.astype(np.int32), None)})
    with pytest.raises(UnsupportedTensorTypeError, match="output_norm.weight.*I32"):
        load_checkpoint(path)


def test_a_tensor_whose_shape_disagrees_with_the_config(tmp_path):
    config = tiny_config("llama")
    tensors = tiny_tensors(config | {"intermediate_size": 128})
    path = write_hf_dir(tmp_path, config, tensors, tokenizer=False)
    with pytest.raises(ConfigMismatchError, match=r"mlp\..*_proj\.weight has shape .*128.*256"):
        load_checkpoint(path)


def test_a_gguf_whose_metadata_disagrees_with_its_tensors(tmp_path):
    config = tiny_config("llama")
    path = write_gguf(tmp_path / "m.gguf", "llama", config | {"num_key_value_heads": 4},
                      tiny_tensors(config), tokenizer=False)
    with pytest.raises(ConfigMismatchError, match="k_proj.weight has shape"):
        load_checkpoint(path)


def test_a_missing_tensor_is_named(tmp_path):
    config = tiny_config("llama")
    tensors = tiny_tensors(config)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(MissingTensorError, match="model.layers.1.mlp.down_proj.weight"):
        load_checkpoint(write_hf_dir(tmp_path / "hf", config, tensors, tokenizer=False))
    with pytest.raises(MissingTensorError, match="model.layers.1.mlp.down_proj.weight"):
        load_checkpoint(write_gguf(tmp_path / "m.gguf", "llama", config, tensors, tokenizer=False))


def test_more_layers_than_the_config_says(tmp_path):
    config = tiny_config("llama")
    tensors = tiny_tensors(config | {"num_hidden_layers": 3})
    with pytest.raises(ConfigMismatchError, match="model.layers.2"):
        load_checkpoint(write_hf_dir(tmp_path, config, tensors, tokenizer=False))


def test_an_untied_config_needs_lm_head(tmp_path):
    config = tiny_config("llama", tied=False)
    tensors = tiny_tensors(tiny_config("llama", tied=True))
    with pytest.raises(MissingTensorError, match="lm_head.weight"):
        load_checkpoint(write_hf_dir(tmp_path, config, tensors, tokenizer=False))


def test_errors_are_value_errors_for_bad_content(tmp_path):
    # callers that only know the builtins still catch them
    for cls in (ConfigMismatchError, MissingTensorError, UnsupportedArchitectureError,
                UnsupportedTensorTypeError, UnsupportedFormatError):
        assert issubclass(cls, ValueError)
    assert issubclass(CheckpointNotFoundError, FileNotFoundError)


def test_mlp_biases_are_refused_as_unsupported(tmp_path):
    config = tiny_config("llama", mlp_bias=True)
    with pytest.raises(UnsupportedArchitectureError, match="mlp_bias"):
        load_checkpoint(write_hf_dir(tmp_path, config, tiny_tensors(config), tokenizer=False))
