"""In-place weight updates (LLM.update_weights) and pause/resume (AsyncEngine) on the tiny random
Llama: after an update the engine's greedy outputs are HF transformers' of the new weights, no
prefix cached under the old weights is served, nothing compiles; the named-tensor form updates
only the tensors named; bad updates raise ValueErrors naming the leaf and change nothing; the
pause modes abort, wait for or hold the requests in flight, and requests added while paused run
after resume. Nothing here waits on the clock: a StepGate holds requests where a test needs them."""

import asyncio
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve import LLM, SamplingParams
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.models.params import params_from_hf
from jaxserve.sampling_params import OutputKind
from jaxserve.testing.tiny_models import hf_greedy, make_tiny_model
from tests.conftest import TINY_ENGINE
from tests.server.step_gate import StepGate

PROMPT = "The tide comes in twice a day"
N = 12
GREEDY = SamplingParams(max_tokens=N, min_tokens=N, temperature=0.0)
HANG_GUARD_S = 120
MLP_0 = [f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]


def tensors_of(path):
    return load_file(os.path.join(path, "model.safetensors"))


@pytest.fixture(scope="module")
def second_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama-seed1"), "llama", seed=1)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, **TINY_ENGINE)


@pytest.fixture
def first_weights(llm, tiny_llama_dir):
    """The test may change the weights; the module's engine gets the first model's back after it."""
    yield
    llm.update_weights(tensors_of(tiny_llama_dir).items(), version="first")


def pytree_of(llm, path):
    runner = llm.engine.runner
    dtype = runner.params["norm"]["weight"].dtype
    return params_from_hf(runner.model_config, tensors_of(path), dtype)


def greedy_ids(llm, prompt=PROMPT):
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_pytree_update_gives_the_second_models_outputs_and_no_stale_prefix(llm, tiny_llama_dir, second_dir,
                                                                           first_weights):
    ids = llm.get_tokenizer().encode(PROMPT)
    first, second = hf_greedy(tiny_llama_dir, ids, N), hf_greedy(second_dir, ids, N)
    assert first != second
    assert greedy_ids(llm) == first
    assert greedy_ids(llm) == first        # now served from the prefix cache
    before = llm.stats()
    assert before.scheduler.prefix_cache_hits > 0 and before.scheduler.num_kv_blocks_cached > 0

    llm.update_weights(pytree_of(llm, second_dir), version=7)
    s = llm.stats()
    assert s.scheduler.num_kv_blocks_cached == 0 and s.scheduler.prefix_cache_nodes == 0   # flushed
    assert llm.weights_version == 7 and s.weights.version == "7" and s.weights.num_updates == before.weights.num_updates + 1

    assert greedy_ids(llm) == second
    after = llm.stats()
    assert after.scheduler.prefix_cache_hits == s.scheduler.prefix_cache_hits        # nothing cached under the old weights served
    assert greedy_ids(llm) == second                             # the cache works again, under the new weights
    assert llm.stats().scheduler.prefix_cache_hits > after.scheduler.prefix_cache_hits
    assert llm.stats().steps.num_compilations_after_warmup == 0


def test_pytree_leaves_already_placed_are_used_without_a_copy(llm, second_dir, first_weights):
    new = pytree_of(llm, second_dir)             # jax arrays on the default device, the engine's dtype
    llm.update_weights(new)
    assert llm.engine.runner.params["layers_0"]["mlp"]["down_proj"]["kernel"] is new["layers_0"]["mlp"]["down_proj"]["kernel"]
    assert llm.weights_version is None and llm.stats().steps.num_compilations_after_warmup == 0


def test_named_partial_update_replaces_only_the_tensors_named(llm, tiny_llama_dir, second_dir, tmp_path,
                                                              first_weights):
    # a checkpoint of the first model with layer 0's MLP taken from the second: HF's reference
    mixed = tensors_of(tiny_llama_dir)
    theirs = tensors_of(second_dir)
    mixed.update({n: theirs[n] for n in MLP_0})
    for f in os.listdir(tiny_llama_dir):
        if f != "model.safetensors":
            shutil.copy(os.path.join(tiny_llama_dir, f), tmp_path)
    save_file(mixed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})

    before = llm.engine.runner.params
    llm.update_weights(((n, theirs[n]) for n in MLP_0), version="mlp0")
    after = llm.engine.runner.params
    assert after["layers_1"]["mlp"]["down_proj"]["kernel"] is before["layers_1"]["mlp"]["down_proj"]["kernel"]
    assert after["layers_0"]["self_attn"]["qkv_proj"]["kernel"] is before["layers_0"]["self_attn"]["qkv_proj"]["kernel"]
    ids = llm.get_tokenizer().encode(PROMPT)
    want = hf_greedy(str(tmp_path), ids, N)
    assert want != hf_greedy(tiny_llama_dir, ids, N)
    assert greedy_ids(llm) == want
    assert llm.stats().steps.num_compilations_after_warmup == 0


def test_bad_updates_name_the_leaf_and_change_nothing(llm, tiny_llama_dir, second_dir):
    params = llm.engine.runner.params
    good = pytree_of(llm, second_dir)

    wrong_shape = {**good, "norm": {"weight": np.zeros((3,), np.float32)}}
    with pytest.raises(ValueError, match="norm/weight has shape"):
        llm.update_weights(wrong_shape)
    missing = {k: v for k, v in good.items() if k != "norm"}
    with pytest.raises(ValueError, match="missing leaves.*norm/weight"):
        llm.update_weights(missing)
    extra = {**good, "layers_9": {"w": np.zeros((2,), np.float32)}}
    with pytest.raises(ValueError, match="unknown leaves.*layers_9/w"):
        llm.update_weights(extra)
    wrong_dtype = {**good, "norm": {"weight": np.asarray(good["norm"]["weight"], np.float16)}}
    with pytest.raises(ValueError, match="norm/weight has dtype float16"):
        llm.update_weights(wrong_dtype)

    theirs = tensors_of(second_dir)
    with pytest.raises(ValueError, match="unknown tensor 'model.layers.0.mlp.fc.weight'"):
        llm.update_weights([("model.layers.0.mlp.fc.weight", theirs[MLP_0[0]])])
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.k_proj.weight' is missing"):
        llm.update_weights([("model.layers.0.self_attn.q_proj.weight", theirs["model.layers.0.self_attn.q_proj.weight"])])
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\)"):
        llm.update_weights([("model.norm.weight", np.zeros((3,), np.float32))])
    with pytest.raises(ValueError, match="version must be an int, a str or None"):
        llm.update_weights(good, version=1.5)
    assert llm.engine.runner.params is params
    assert greedy_ids(llm) == hf_greedy(tiny_llama_dir, llm.get_tokenizer().encode(PROMPT), N)


# -- pause and resume through the AsyncEngine --------------------------------------------------
def stream_params(n=N):
    return SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, output_kind=OutputKind.DELTA)


def run_gated(llm, body):
    """body(aengine, gate) on a fresh event loop, with the engine's steps held by a closed StepGate;
    the engine's own methods come back afterwards (the module shares it)."""
    engine = llm.engine

    async def main():
        gate = StepGate(engine)
        aengine = AsyncEngine(engine)
        try:
            return await asyncio.wait_for(body(aengine, gate), HANG_GUARD_S)
        finally:
            gate.open()
            await aengine.shutdown()
            for name in ("step", "add_processed", "abort"):
                engine.__dict__.pop(name, None)
    result = asyncio.run(main())
    s = engine.stats()   # every request ended (aborted, finished): no block is held
    assert s.scheduler.num_kv_blocks_free + s.scheduler.num_kv_blocks_cached == s.scheduler.num_kv_blocks_total
    return result


class Stream:
    """A request's outputs, collected in a task; `first` is set once something arrived."""

    def __init__(self, aengine, prompt, params, request_id):
        self.outputs, self.first = [], asyncio.Event()
        self.task = asyncio.create_task(self._run(aengine, prompt, params, request_id))

    async def _run(self, aengine, prompt, params, request_id):
        async for out in aengine.generate(prompt, params, request_id=request_id):
            self.outputs.append(out)
            self.first.set()
        return self.outputs

    @property
    def token_ids(self):
        return [t for o in self.outputs for t in o.outputs[0].token_ids]


def test_pause_abort_ends_the_requests_in_flight(llm):
    async def body(aengine, gate):
        a, b = Stream(aengine, PROMPT, stream_params(), "a"), Stream(aengine, "def add(a, b):", stream_params(), "b")
        await a.first.wait()
        await b.first.wait()
        await aengine.pause("abort")
        outs = await asyncio.gather(a.task, b.task)
        stats = await aengine.stats()
        await aengine.resume()
        gate.open()
        c = Stream(aengine, PROMPT, stream_params(4), "c")
        await c.task
        return outs, stats, c

    outs, stats, c = run_gated(llm, body)
    for o in outs:
        assert o[-1].finished and o[-1].outputs[0].finish_reason == "abort"
    assert stats.lifecycle.paused and stats.scheduler.num_running == 0 and stats.scheduler.num_waiting == 0
    assert c.outputs[-1].outputs[0].finish_reason == "length" and len(c.token_ids) == 4


def test_pause_keep_then_update_continues_the_requests_under_the_new_weights(llm, tiny_llama_dir, second_dir,
                                                                              first_weights):
    ids = llm.get_tokenizer().encode(PROMPT)

    async def body(aengine, gate):
        a = Stream(aengine, PROMPT, stream_params(), "a")
        await a.first.wait()
        await aengine.pause("keep")
        held = await aengine.call(lambda e: list(e.scheduler.get_request("a").output_token_ids))
        await aengine.update_weights(pytree_of(llm, second_dir), version=2)
        stats = await aengine.stats()
        await aengine.resume()
        gate.open()
        await a.task
        return a, held, stats

    a, held, stats = run_gated(llm, body)
    k = len(held)
    assert 1 <= k < N and stats.lifecycle.paused and stats.weights.version == "2"
    assert a.outputs[-1].outputs[0].finish_reason == "length" and len(a.token_ids) == N
    assert a.token_ids[:k] == held == hf_greedy(tiny_llama_dir, ids, k)
    # the rest continues from prompt + held tokens, recomputed under the second model's weights
    assert a.token_ids[k:] == hf_greedy(second_dir, ids + held, N - k)
    assert llm.stats().steps.num_compilations_after_warmup == 0


def test_pause_wait_lets_requests_finish_and_holds_new_ones_until_resume(llm, second_dir, first_weights):
    ids = llm.get_tokenizer().encode(PROMPT)

    async def body(aengine, gate):
        a = Stream(aengine, PROMPT, stream_params(), "a")
        await a.first.wait()
        pausing = asyncio.create_task(aengine.pause("wait"))
        await asyncio.sleep(0)       # the pause command is queued before the next call's
        assert await aengine.call(lambda e: e.pausing)
        gate.open()                  # "a" may run to its end now
        await pausing
        a_done = bool(a.outputs) and a.outputs[-1].finished
        # added while paused: accepted, held, not run
        b = Stream(aengine, PROMPT, stream_params(), "b")
        while not await aengine.call(lambda e: any(h[0] == "b" for h in e._held)):
            await asyncio.sleep(0)
        stats = await aengine.stats()
        await aengine.update_weights(pytree_of(llm, second_dir), version="v2")
        b_before = list(b.outputs)
        await aengine.resume()
        await b.task
        return a, a_done, b, b_before, stats

    a, a_done, b, b_before, stats = run_gated(llm, body)
    assert a_done and a.outputs[-1].outputs[0].finish_reason == "length" and len(a.token_ids) == N
    assert stats.lifecycle.paused and stats.scheduler.num_running == 0 and stats.scheduler.num_waiting == 0
    assert b_before == []
    assert b.token_ids == hf_greedy(second_dir, ids, N)


def test_offline_generate_refuses_while_paused(llm):
    llm.pause("keep")
    try:
        with pytest.raises(RuntimeError, match="paused"):
            llm.generate([PROMPT], GREEDY, use_tqdm=False)
    finally:
        llm.resume()
    assert not llm.stats().lifecycle.paused
    assert len(greedy_ids(llm)) == N


# -- a quantized engine ------------------------------------------------------------------------
@pytest.mark.slow   # an int8 engine of its own (~45 s); the update's float path runs by default
def test_a_quantized_engine_quantizes_a_complete_named_update_as_a_fresh_start_would(tiny_llama_dir, second_dir):
    import jax

    from jaxserve.checkpoints.loader import load_checkpoint
    from jaxserve.engine_args import engine_config
    from jaxserve.engine.builder import checkpoint_params
    from jaxserve.models.config import ModelConfig

    llm = LLM(tiny_llama_dir, **TINY_ENGINE, quantization="int8")
    before = llm.engine.runner.params
    with pytest.raises(ValueError, match="complete updates.*is missing"):
        llm.update_weights(((n, tensors_of(second_dir)[n]) for n in MLP_0))
    assert llm.engine.runner.params is before
    llm.update_weights(tensors_of(second_dir).items(), version="q2")

    # what a fresh int8 start on the second model's checkpoint would serve, leaf for leaf
    ckpt = load_checkpoint(second_dir)
    config = engine_config(model=second_dir, **{k: v for k, v in TINY_ENGINE.items() if k != "progress"},
                                      quantization="int8")
    fresh, _ = checkpoint_params(config, ckpt, ModelConfig.from_hf_config(ckpt.config), "float32", None, None, None)
    got = llm.engine.runner.params
    assert jax.tree.structure(got) == jax.tree.structure(fresh)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(fresh)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    assert llm.stats().weights.version == "q2" and llm.stats().steps.num_compilations_after_warmup == 0
    assert len(greedy_ids(llm)) == N


def test_an_update_is_refused_where_it_is_not_built(llm, second_dir):
    engine, params, updates = llm.engine, llm.engine.runner.params, llm.engine.num_weight_updates
    def disaggregated(on):
        engine.kv_connector = object() if on else None

    def several_hosts(on):
        engine.runner.mirror_steps_to(object() if on else None)

    for make, words in ((disaggregated, "disaggregated"), (several_hosts, "several hosts")):
        make(True)
        try:
            with pytest.raises(RuntimeError, match=words):
                llm.update_weights(pytree_of(llm, second_dir))
        finally:
            make(False)
    assert engine.runner.params is params and engine.num_weight_updates == updates
