"""runner/kv_transfer.py on small arenas: blocks gathered from one arena and scattered into other
block ids of another arrive bit for bit (float32 and fp8 storage, through the wire's bytes), the
blocks around them untouched, and serving compiles nothing after compile_all()."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runner import compile_counter
from jaxserve.runner.kv_arena import ArenaSpec, allocate_arena
from jaxserve.runner.kv_transfer import KVTransfer


def _runner(dtype, seed):
    spec = ArenaSpec(num_layers=2, num_blocks=12, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    rng = np.random.default_rng(seed)
    kv = [(jnp.asarray(rng.normal(size=spec.layer_shape).astype(np.float32)).astype(dtype),
           jnp.asarray(rng.normal(size=spec.layer_shape).astype(np.float32)).astype(dtype))
          for _ in range(spec.num_layers)] if seed is not None else allocate_arena(spec)
    return _ArenaRunner(spec, kv)


class _ArenaRunner:
    """What KVTransfer asks of a runner: its arena, and a way to replace it by a program's output."""

    def __init__(self, arena_spec, kv_caches):
        self.arena_spec, self.kv_caches = arena_spec, kv_caches

    def transform_arena(self, program) -> None:
        self.kv_caches = program(self.kv_caches)


@pytest.mark.parametrize("dtype", ["float32", "float8_e4m3fn"])
def test_blocks_arrive_in_the_receivers_own_ids(dtype):
    src, dst = _runner(dtype, seed=0), _runner(dtype, seed=None)
    send, recv = KVTransfer(src, 8), KVTransfer(dst, 8)
    send.compile_all()
    recv.compile_all()
    counter = compile_counter.CompileCounter()
    src_ids, dst_ids = [7, 2, 9], [1, 10, 4]
    with compile_counter.attributed_to(counter):
        buf = np.asarray(send.gather(src_ids))[:3]
        wire = np.frombuffer(buf.tobytes(), send.layout.np_dtype).reshape(buf.shape)   # what PullKV carries
        recv.scatter(dst_ids, wire)
        jax.block_until_ready(dst.kv_caches)
    for (sk, sv), (dk, dv) in zip(src.kv_caches, dst.kv_caches):
        for s, d in zip(src_ids, dst_ids):
            np.testing.assert_array_equal(np.asarray(dk[d]).view(np.uint8), np.asarray(sk[s]).view(np.uint8))
            np.testing.assert_array_equal(np.asarray(dv[d]).view(np.uint8), np.asarray(sv[s]).view(np.uint8))
        others = [b for b in range(1, 12) if b not in dst_ids]
        assert not np.asarray(dk[np.array(others)].astype(jnp.float32)).any()   # nothing else written
    assert counter.count == 0


def test_a_buffer_of_the_wrong_shape_is_refused():
    r = _runner("float32", seed=None)
    t = KVTransfer(r, 4)
    with pytest.raises(ValueError, match="shape"):
        t.scatter([1, 2], np.zeros((3, 2, 2, 4, 2, 8), np.float32))
    with pytest.raises(ValueError, match="largest transfer bucket"):
        t.gather(list(range(1, 7)))
