"""sleep / wake_up on the tiny random Llama (runner/sleep.py): the bytes a sleep reports are
those of the KV arena (and of the weights at level 1) and exactly what leaves jax's live arrays;
after wake_up the greedy outputs are HF transformers' again, nothing compiled, and nothing cached
before the sleep is served; level 2 needs the weights from update_weights first; sleep is refused
while requests run, and a paused engine's kept request recomputes after it; the AsyncEngine
sleeps between steps and a request added while asleep waits for wake_up.

One engine for the module, with one decode and one prefill bucket (start-up is most of the time)."""

import asyncio
import os
import weakref

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxserve import LLM, SamplingParams
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.models.params import params_from_hf
from jaxserve.testing.tiny_models import hf_greedy
from tests.conftest import TINY_ENGINE

PROMPT = "The tide comes in twice a day"
N = 12
GREEDY = SamplingParams(max_tokens=N, min_tokens=N, temperature=0.0)
HANG_GUARD_S = 120
SHAPES = dict(TINY_ENGINE, swap_space=0, decode_buckets=(4,), decode_only_buckets=(4,), prefill_buckets=(0, 4))


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, **SHAPES)


@pytest.fixture(scope="module")
def expected(llm, tiny_llama_dir):
    return hf_greedy(tiny_llama_dir, llm.get_tokenizer().encode(PROMPT), N)


@pytest.fixture
def awake(llm):
    yield
    if llm.is_sleeping:
        llm.wake_up()


def greedy_ids(llm):
    return llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def device_bytes(tree) -> int:
    return sum(shard.data.nbytes for leaf in jax.tree.leaves(tree) for shard in leaf.addressable_shards)


def live_bytes() -> int:
    """Bytes of every live device buffer, each counted once (a shard's view shares its array's)."""
    buffers = {(s.device.id, s.data.unsafe_buffer_pointer()): s.data.nbytes
               for a in jax.live_arrays() for s in a.addressable_shards}
    return sum(buffers.values())


def test_level_1_releases_the_arena_and_the_weights_and_wakes_up_serving_the_same(llm, expected, awake):
    runner = llm.engine.runner
    spec = runner.arena_spec
    assert greedy_ids(llm) == expected
    assert greedy_ids(llm) == expected            # the second from the prefix cache
    assert llm.stats().scheduler.prefix_cache_nodes > 0
    arena, weights = device_bytes(runner.kv_caches), device_bytes(runner.params)
    scratch = device_bytes(runner.scratch_arrays())       # the sampler's neutral arrays, made again when needed
    assert arena == spec.num_blocks * spec.bytes_per_block > 0 and scratch > 0
    buffers = [weakref.ref(x) for x in jax.tree.leaves((runner.params, runner.kv_caches))]
    live_before = live_bytes()

    report = llm.sleep(1)
    assert (report.level, report.kv_cache_bytes, report.weight_bytes, report.scratch_bytes) == (1, arena, weights,
                                                                                              scratch)
    assert report.weight_bytes_held_elsewhere == 0 and report.freed_bytes == report.total_bytes
    assert report.host_weight_bytes == weights                     # one device: the host copy is as big
    assert report.bytes_per_device == ((jax.devices()[0].id, arena + weights + scratch),)
    # gone from the device: every buffer the runner held, and exactly the bytes reported
    assert all(r() is None or r().is_deleted() for r in buffers)
    assert live_before - live_bytes() == report.total_bytes
    s = llm.stats()
    assert s.lifecycle.asleep and s.lifecycle.sleep_level == 1 and llm.is_sleeping
    assert s.scheduler.prefix_cache_nodes == 0 and s.scheduler.num_kv_blocks_cached == 0           # flushed
    with pytest.raises(RuntimeError, match="asleep"):
        greedy_ids(llm)
    with pytest.raises(RuntimeError, match="asleep already"):
        llm.sleep(0)

    woke = llm.wake_up()
    assert (woke.kv_cache_bytes, woke.weight_bytes) == (arena, weights)
    assert live_before - live_bytes() == scratch  # the neutral arrays come back with the first step
    hits = llm.stats().scheduler.prefix_cache_hits
    assert greedy_ids(llm) == expected
    assert live_bytes() == live_before
    s = llm.stats()
    assert s.scheduler.prefix_cache_hits == hits            # nothing cached before the sleep was served
    assert not s.lifecycle.asleep and s.lifecycle.sleep_level == -1
    assert s.steps.num_compilations_after_warmup == 0
    assert llm.wake_up().kv_cache_bytes == 0      # awake already: nothing to do


def test_level_0_frees_only_the_arena(llm, expected, awake):
    runner = llm.engine.runner
    params = runner.params
    arena = device_bytes(runner.kv_caches)
    live_before = live_bytes()
    report = llm.sleep(0)
    assert (report.kv_cache_bytes, report.weight_bytes, report.host_weight_bytes) == (arena, 0, 0)
    assert live_before - live_bytes() == report.total_bytes == arena + report.scratch_bytes
    assert runner.params is params                # the weights never moved
    llm.wake_up()
    assert greedy_ids(llm) == expected
    assert llm.stats().steps.num_compilations_after_warmup == 0


def test_level_2_drops_the_weights_until_update_weights_brings_them(llm, tiny_llama_dir, expected, awake):
    runner = llm.engine.runner
    weights = device_bytes(runner.params)
    report = llm.sleep(2)
    assert report.weight_bytes == weights and report.host_weight_bytes == 0
    with pytest.raises(ValueError, match="update_weights"):
        llm.wake_up()
    assert llm.is_sleeping                        # a refused wake_up leaves it asleep
    tensors = load_file(os.path.join(tiny_llama_dir, "model.safetensors"))
    tree = params_from_hf(runner.model_config, tensors, runner.params["norm"]["weight"].dtype)
    llm.update_weights(tree, version="from-trainer")   # placed while asleep (the pytree form keeps these arrays)
    woke = llm.wake_up()
    assert woke.weight_bytes == 0                 # no host copy to restore: the update's arrays are served
    assert greedy_ids(llm) == expected
    # the engine holds the caller's arrays: a sleep lets go of them, but they stay alive with the caller
    report = llm.sleep(1)
    assert report.weight_bytes_held_elsewhere == report.weight_bytes == weights
    assert report.freed_bytes == report.kv_cache_bytes + report.scratch_bytes
    del tree
    llm.wake_up()
    assert greedy_ids(llm) == expected
    assert llm.stats().steps.num_compilations_after_warmup == 0


def test_sleep_is_refused_while_requests_run_and_a_kept_request_recomputes_after_it(llm, expected, awake):
    engine = llm.engine
    with pytest.raises(ValueError, match="level"):
        llm.sleep(3)
    rid = engine.add_request(None, PROMPT, GREEDY)
    outputs = []
    while not outputs:
        outputs = [o for o in engine.step() if o.request_id == rid]
    with pytest.raises(RuntimeError, match="pause"):
        llm.sleep(1)
    assert not llm.is_sleeping
    engine.pause("keep")
    llm.sleep(1)                                  # paused: its KV is dropped, it will recompute
    assert llm.stats().scheduler.num_kv_blocks_free == llm.stats().scheduler.num_kv_blocks_total
    engine.resume()
    assert not engine.has_unfinished_requests()   # resumed but asleep: nothing steps
    llm.wake_up()
    final = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                final = o
    assert final.outputs[0].token_ids == expected
    assert llm.stats().steps.num_compilations_after_warmup == 0


def test_async_engine_sleeps_between_steps_and_a_request_added_while_asleep_waits(llm, expected, awake):
    async def body(aengine):
        report = await aengine.sleep(1)
        assert report.kv_cache_bytes > 0
        outputs = []

        async def consume():
            async for out in aengine.generate(PROMPT, GREEDY, request_id="while-asleep"):
                outputs.append(out)
        task = asyncio.create_task(consume())
        while (await aengine.stats()).scheduler.num_waiting == 0:   # added, and not stepped: asleep
            await asyncio.sleep(0.01)
        assert outputs == [] and (await aengine.stats()).lifecycle.asleep
        await aengine.wake_up()
        await task
        return outputs[-1]

    async def main():
        aengine = AsyncEngine(llm.engine)
        try:
            return await asyncio.wait_for(body(aengine), HANG_GUARD_S)
        finally:
            await aengine.shutdown()
    final = asyncio.run(main())
    assert final.finished and final.outputs[0].token_ids == expected
    assert llm.stats().steps.num_compilations_after_warmup == 0


def test_a_mesh_is_refused_clearly(tiny_llama_dir):
    """Refusals that need no second device (the sub-mesh itself: tests/parallel/test_caller_mesh.py)."""
    from jax.sharding import AbstractMesh, Mesh

    one = np.array(jax.devices()[:1])
    with pytest.raises(ValueError, match="mesh_axis"):
        LLM(tiny_llama_dir, mesh=Mesh(one.reshape(1, 1), ("x", "y")), **SHAPES)
    with pytest.raises(ValueError, match="'z' is not an axis"):
        LLM(tiny_llama_dir, mesh=Mesh(one, ("x",)), mesh_axis="z", **SHAPES)
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        LLM(tiny_llama_dir, mesh=Mesh(one, ("x",)), tensor_parallel_size=2, **SHAPES)
    with pytest.raises(ValueError, match="mesh_axis= names an axis of mesh="):
        LLM(tiny_llama_dir, mesh_axis="x", **SHAPES)
    with pytest.raises(TypeError, match="concrete devices"):
        LLM(tiny_llama_dir, mesh=AbstractMesh((1,), ("x",)), **SHAPES)
