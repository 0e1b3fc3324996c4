"""No compiled step copies the KV arena: its temporaries stay far below one layer's cache, and
no copy operation moves a cache-sized array.

The arena is donated to every step and written in place. Issue 14's configuration cliff was a
step that did not: at max_model_len=1024 the batch-1 decode step held four arena-sized copies
per layer and ran 30x slower than at 8192 (pallas_kernels/ragged_paged_attention_xla.py says
why). A later one did not show in the temporaries: a one-row step copied each layer's donated
K and V into the output buffers before writing its row (runner/kv_write.py says why), a quarter
of the embedded model's batch-1 step. Counting bytes in the compiled executable catches both on
any machine, without timing.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
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


def _compiled(shapes: RunnerShapes, bucket: tuple[int, int]):
    D, P = bucket
    step = make_step(CONFIG, select_attention("xla"), decode_rows=D, prefill_tiles=P, tile=shapes.prefill_tile)
    batch = {k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in
             batch_shapes(D, P, tile=shapes.prefill_tile, table_width=shapes.table_width).items()}
    prev = jax.ShapeDtypeStruct((sample_rows_bucket(D, P),), jnp.int32)
    lowered = jax.jit(step, donate_argnums=(1,)).lower(abstract_params(CONFIG, jnp.float32), ARENA.shape_dtype(),
                                                        batch, prev)
    return lowered.compile()


_COPY = re.compile(r"=\s*(\w+)\[([\d,]*)\]\S*\s+copy\(")


def _copied_bytes(compiled) -> list[int]:
    """The size of every copy operation's result in the executable."""
    sizes = []
    for dtype, dims in _COPY.findall(compiled.as_text()):
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        bits = re.search(r"\d+$", dtype)                       # f32, s8, bf16, ...; pred: a byte
        sizes.append(n * (int(bits.group()) // 8 if bits else 1))
    return sizes


# 1,024 tokens: a table of 65 blocks, one loop window for a lone decode (the cliff's shape);
# 8,192: 513 blocks, several windows
@pytest.mark.parametrize("max_model_len", [1024, 8192])
def test_no_bucket_holds_an_arena_sized_temporary(max_model_len):
    shapes = RunnerShapes(block_size=16, max_model_len=max_model_len, prefill_tile=16, decode_buckets=(4,),
                          prefill_buckets=(0, 1), decode_only_buckets=(1, 2, 4))
    compiled = {bucket: _compiled(shapes, bucket) for bucket in shapes.buckets()}
    assert set(compiled) == {(1, 0), (2, 0), (4, 0), (4, 1)}
    temps = {bucket: c.memory_analysis().temp_size_in_bytes for bucket, c in compiled.items()}
    big = {bucket: t for bucket, t in temps.items() if t >= LAYER_CACHE_BYTES / 2}
    assert not big, f"arena-sized temporaries (bytes) against {LAYER_CACHE_BYTES:,} per cache: {big}"
    copies = {bucket: [b for b in _copied_bytes(c) if b >= LAYER_CACHE_BYTES / 2] for bucket, c in compiled.items()}
    assert not any(copies.values()), f"arena-sized copies (bytes) against {LAYER_CACHE_BYTES:,} per cache: {copies}"
