"""The tensor-parallel head layout (jaxserve/parallel/layout.py): which sizes fit a model, and
the shard-major column order of the fused projections. Pure numpy; no devices."""

import numpy as np
import pytest

from jaxserve.models.config import ModelConfig
from jaxserve.parallel.layout import HeadLayout, split_columns_order, supported_sizes


def config(heads, kv_heads, intermediate=1536, head_dim=64):
    return ModelConfig("llama", vocab_size=100, hidden_size=heads * head_dim, intermediate_size=intermediate,
                       num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=64,
                       tie_word_embeddings=True)


def test_sizes_that_do_not_divide_the_embedded_models_heads_are_refused_naming_those_that_work():
    smol = config(9, 3)                       # SmolLM2-135M: 9 query heads, 3 KV heads, F = 1536
    assert supported_sizes(smol) == [1, 3]    # 9 divides 9 heads but not F = 1536
    for size in (2, 4, 9):
        with pytest.raises(ValueError, match=f"tensor_parallel_size={size} does not fit.*sizes that work are 1, 3"):
            HeadLayout.for_model(smol, size)
    assert HeadLayout.for_model(smol, 3).kv_heads == 3


def test_kv_heads_are_replicated_when_the_devices_outnumber_them():
    layout = HeadLayout.for_model(config(8, 2, intermediate=64), 8)
    assert (layout.kv_heads, layout.kv_replicas, layout.kv_heads_per_shard) == (8, 4, 1)
    # query head i of the replicated model reads head i // 1, a copy of original head i // 4
    assert layout.original_kv_head().tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="neither divides the 2 KV heads nor is a multiple"):
        HeadLayout.for_model(config(6, 2, intermediate=66), 3)


def test_fused_columns_are_shard_major_whole_heads():
    n, k, h = 4, 2, 2
    layout = HeadLayout.for_model(config(n, k, intermediate=8, head_dim=h), 2)
    cols = layout.qkv_columns().reshape(2, -1, h)        # [shard, heads of the shard, H]
    q, key, value = 0, n * h, (n + k) * h                # where each part starts in the 1-device layout
    assert cols[0, :, 0].tolist() == [q + 0, q + 2, key + 0, value + 0]
    assert cols[1, :, 0].tolist() == [q + 4, q + 6, key + 2, value + 2]
    assert split_columns_order((8, 8), 2).tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]
    assert split_columns_order((2, 4), 2).tolist() == [0, 2, 3, 1, 4, 5]     # parts of different sizes
    one = HeadLayout.for_model(config(n, k, intermediate=8, head_dim=h), 1)
    assert np.array_equal(one.qkv_columns(), np.arange((n + 2 * k) * h))   # one shard: the plain layout
