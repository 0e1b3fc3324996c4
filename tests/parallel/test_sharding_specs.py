"""Each parameter's PartitionSpec (jaxserve/parallel/sharding.py) and the per-device bytes they
imply, from shapes alone: no devices."""

import dataclasses

from jax.sharding import PartitionSpec as P

from jaxserve.bench.random_model import SHAPES
from jaxserve.models.config import ModelConfig
from jaxserve.models.params import abstract_params, layout_of
from jaxserve.parallel.layout import HeadLayout
from jaxserve.parallel.sharding import leaf_spec, planned_bytes_per_device

TINY = ModelConfig.from_hf_config({"model_type": "llama", **SHAPES["tiny"], "attention_bias": True})


def spec(*path, shape=(8, 8), vocab_split=True, config=TINY):
    # the rule the declared tensors give the leaf (models/registry.py), never one matched by name
    return leaf_spec(layout_of(config), tuple(path), shape, vocab_split)


def test_megatron_split():
    assert spec("layers_0", "self_attn", "qkv_proj", "kernel") == P(None, "model")
    assert spec("layers_0", "self_attn", "qkv_proj", "bias", shape=(8,)) == P("model")
    assert spec("layers_0", "mlp", "gate_up_proj", "kernel") == P(None, "model")
    assert spec("layers_0", "self_attn", "o_proj", "kernel") == P("model", None)
    assert spec("layers_0", "mlp", "down_proj", "kernel") == P("model", None)
    assert spec("layers_0", "self_attn", "o_proj", "bias", shape=(8,)) == P()      # added once, after the sum
    assert spec("layers_0", "input_layernorm", "weight", shape=(8,)) == P()
    assert spec("kv_scales", "k", shape=(2, 4)) == P(None, "model")


def test_quantized_leaves_split_with_their_weight():
    assert spec("layers_0", "mlp", "down_proj", "qweight") == P("model", None)
    assert spec("layers_0", "mlp", "down_proj", "scale", shape=(4, 8)) == P("model", None)   # groups along the input
    assert spec("layers_0", "mlp", "down_proj", "scale", shape=(1, 8)) == P()               # per channel: after the sum
    assert spec("layers_0", "mlp", "gate_up_proj", "scale", shape=(1, 8)) == P(None, "model")
    assert spec("layers_0", "mlp", "gate_up_proj", "act_scale", shape=()) == P()


def test_vocabulary_split_only_when_it_divides():
    assert not TINY.tie_word_embeddings
    assert spec("embed_tokens", "embedding") == P("model", None)
    assert spec("lm_head", "kernel") == P(None, "model")
    assert spec("embed_tokens", "embedding", vocab_split=False) == P()
    assert spec("lm_head", "kernel", vocab_split=False) == P()


def test_llama3_8b_bytes_per_device_halve_with_each_doubling():
    config = ModelConfig.from_hf_config({"model_type": "llama", **SHAPES["llama3-8b"]})
    one = planned_bytes_per_device(abstract_params(config, "bfloat16"), layout_of(config), 1, config.vocab_size)
    assert one == 2 * 8_030_261_248            # Llama-3-8B's parameters, two bytes each
    for size in (2, 4, 8):                      # 8 KV heads: no replication up to 8
        runner = dataclasses.replace(config, num_key_value_heads=HeadLayout.for_model(config, size).kv_heads)
        split = planned_bytes_per_device(abstract_params(runner, "bfloat16"), layout_of(runner), size,
                                         config.vocab_size)
        norms = 2 * (2 * config.num_hidden_layers + 1) * config.hidden_size      # replicated, 2 bytes each
        assert split == (one - norms) // size + norms


def test_a_leaf_outside_the_declared_tensors_is_refused():
    import pytest

    with pytest.raises(ValueError, match="not in the architecture's declared tensors"):
        spec("layers_0", "mlp", "experts", "kernel")
