"""No compiled step copies the KV arena: its temporaries stay far below one layer's cache.

The arena is donated to every step and written in place. Issue 14's configuration cliff was a
step that did not: at max_model_len=1024 the batch-1 decode step held four arena-sized copies
per layer and ran 30x slower than at 8192 (pallas_kernels/ragged_paged_attention_xla.py says
why). Counting bytes in the compiled executable catches that on any machine, without timing.
"""

import jax
import jax.numpy as jnp
import pytest

from jaxserve.models import ModelConfig, abstract_params
from jaxserve.runner.attention import select_attention
from jaxserve.runner.batch import batch_shapes, sample_rows_bucket
from jaxserve.runner.buckets import RunnerShapes
from jaxserve.runner.kv_arena import ArenaSpec
from jaxserve.runner.step import make_step

CONFIG = ModelConfig(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=6, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                     rope_theta=10000.0, max_position_embeddings=8192, tie_word_embeddings=False)
ARENA = ArenaSpec(num_layers=2, num_blocks=4096, block_size=16, num_kv_heads=2, head_dim=8, dtype="float32")
LAYER_CACHE_BYTES = ARENA.bytes_per_block * ARENA.num_blocks // (2 * ARENA.num_layers)


def _temp_bytes(shapes: RunnerShapes, bucket: tuple[int, int]) -> int:
    D, P = bucket
    step = make_step(CONFIG, select_attention("xla"), decode_rows=D, prefill_tiles=P, tile=shapes.prefill_tile)
    batch = {k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in
             batch_shapes(D, P, tile=shapes.prefill_tile, table_width=shapes.table_width).items()}
    prev = jax.ShapeDtypeStruct((sample_rows_bucket(D, P),), jnp.int32)
    lowered = jax.jit(step, donate_argnums=(1,)).lower(abstract_params(CONFIG, jnp.float32), ARENA.shape_dtype(),
                                                        batch, prev)
    return lowered.compile().memory_analysis().temp_size_in_bytes


# 1,024 tokens: a table of 65 blocks, one loop window for a lone decode (the cliff's shape);
# 8,192: 513 blocks, several windows
@pytest.mark.parametrize("max_model_len", [1024, 8192])
def test_no_bucket_holds_an_arena_sized_temporary(max_model_len):
    shapes = RunnerShapes(block_size=16, max_model_len=max_model_len, prefill_tile=16, decode_buckets=(4,),
                          prefill_buckets=(0, 1), decode_only_buckets=(1, 2, 4))
    temps = {bucket: _temp_bytes(shapes, bucket) for bucket in shapes.buckets()}
    assert set(temps) == {(1, 0), (2, 0), (4, 0), (4, 1)}
    copied = {bucket: t for bucket, t in temps.items() if t >= LAYER_CACHE_BYTES / 2}
    assert not copied, f"arena-sized temporaries (bytes) against {LAYER_CACHE_BYTES:,} per cache: {copied}"
