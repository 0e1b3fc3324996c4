"""AsyncEngine in-process on the tiny model: the three output kinds, abort on cancel (blocks back at
once), external abort, errors at the door, and a crashing step loop that fails every request
instead of hanging it."""

import asyncio

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.async_engine import AsyncEngine, EngineDeadError
from jaxserve.sampling_params import OutputKind
from tests.server.step_gate import StepGate

PROMPTS = ["The tide comes in", "def add(a, b):", "Unicode: café", "A paged KV cache stores keys"]
HANG_GUARD_S = 120   # a hang fails the test instead of stalling the suite


def greedy(n=12, kind=OutputKind.DELTA):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, output_kind=kind)


def run(coro_fn, engine):
    """Run coro_fn(aengine) on a fresh event loop with a fresh AsyncEngine, then shut it down."""
    async def main():
        aengine = AsyncEngine(engine)
        try:
            return await asyncio.wait_for(coro_fn(aengine), HANG_GUARD_S)
        finally:
            await aengine.shutdown()
    return asyncio.run(main())


async def collect(aengine, prompt, params, **kw):
    return [out async for out in aengine.generate(prompt, params, **kw)]


def assert_no_leaks(stats):
    assert stats.scheduler.num_running == 0 and stats.scheduler.num_waiting == 0
    assert stats.scheduler.num_kv_blocks_free + stats.scheduler.num_kv_blocks_cached == stats.scheduler.num_kv_blocks_total


def test_concurrent_delta_streams_concatenate_to_llm_generate_tokens(tiny_llm):
    outs = tiny_llm.generate(PROMPTS, greedy(12, OutputKind.CUMULATIVE), use_tqdm=False)
    want = [o.outputs[0].token_ids for o in outs]

    async def body(aengine):
        streams = await asyncio.gather(*(collect(aengine, p, greedy(12)) for p in PROMPTS))
        return streams, await aengine.stats()

    streams, stats = run(body, tiny_llm.engine)
    for outs, w in zip(streams, want):
        assert [t for o in outs for t in o.outputs[0].token_ids] == w
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        assert not any(o.finished for o in outs[:-1])
        assert len(outs) > 1          # streamed, not delivered at the end
    assert_no_leaks(stats)


def test_cumulative_outputs_grow_and_final_only_sends_one(tiny_llm):
    async def body(aengine):
        cum = await collect(aengine, PROMPTS[0], greedy(10, OutputKind.CUMULATIVE))
        final = await collect(aengine, PROMPTS[0], greedy(10, OutputKind.FINAL_ONLY))
        return cum, final

    cum, final = run(body, tiny_llm.engine)
    lengths = [len(o.outputs[0].token_ids) for o in cum]
    assert lengths == sorted(lengths) and lengths[-1] == 10 and len(cum) > 1
    assert len(final) == 1 and final[0].finished
    assert final[0].outputs[0].token_ids == cum[-1].outputs[0].token_ids
    assert final[0].outputs[0].text == cum[-1].outputs[0].text


def test_default_output_kind_is_delta(tiny_llm):
    async def body(aengine):
        return [o async for o in aengine.generate(PROMPTS[1])]

    outs = run(body, tiny_llm.engine)
    # each output carries only its own new tokens (CUMULATIVE would carry 1, 2, 3, ...; a reader
    # that fell behind gets several steps' in one): together they are the whole output, one
    # token time each
    tokens = [t for o in outs for t in o.outputs[0].token_ids]
    assert all(o.outputs[0].token_ids for o in outs) and outs[-1].finished
    assert len(tokens) == len(outs[-1].metrics.token_times) > 1


def test_cancelling_the_consumer_aborts_the_request_and_frees_its_blocks(tiny_llm):
    engine = LLM.sharing_runner(tiny_llm).engine
    StepGate(engine)   # the request cannot finish before the cancel, however fast the machine

    async def body(aengine):
        started = asyncio.Event()

        async def consume():
            async for _ in aengine.generate(PROMPTS[2], greedy(100)):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await aengine.stats()   # queued after the abort, so applied after it

    stats = run(body, engine)
    assert_no_leaks(stats)
    assert engine.finished_by_reason == {"abort": 1}


def test_external_abort_ends_the_stream_with_finish_reason_abort(tiny_llm):
    engine = LLM.sharing_runner(tiny_llm).engine
    StepGate(engine)   # the request cannot finish before the abort, however fast the machine

    async def body(aengine):
        outs = []
        async for out in aengine.generate(PROMPTS[3], greedy(100, OutputKind.CUMULATIVE), request_id="victim"):
            outs.append(out)
            if len(outs) == 1:
                await aengine.abort("victim")
        return outs, await aengine.stats()

    outs, stats = run(body, engine)
    last = outs[-1]
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert 0 < len(last.outputs[0].token_ids) < 100      # CUMULATIVE keeps what was generated
    assert_no_leaks(stats)


def test_bad_requests_fail_at_the_door_and_the_engine_stays_healthy(tiny_llm):
    async def body(aengine):
        with pytest.raises(ValueError, match="max_model_len"):
            await collect(aengine, PROMPTS[0], SamplingParams(max_tokens=10_000))
        with pytest.raises(ValueError, match="vocabulary"):
            await collect(aengine, {"prompt_token_ids": [1, 10**6]}, greedy())
        blocker = aengine.generate(PROMPTS[0], greedy(50), request_id="dup")
        await blocker.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await collect(aengine, PROMPTS[0], greedy(), request_id="dup")
        await blocker.aclose()
        ok = await collect(aengine, PROMPTS[0], greedy(4))
        return ok, aengine.healthy, await aengine.stats()

    ok, healthy, stats = run(body, tiny_llm.engine)
    assert ok[-1].finished and healthy
    assert_no_leaks(stats)


def test_a_crashing_step_fails_every_request_and_marks_the_engine_unhealthy(tiny_llm):
    doomed = LLM.sharing_runner(tiny_llm).engine     # a disposable engine on the compiled runner
    real_step, steps = doomed.step, []

    def step():
        steps.append(1)
        if len(steps) == 3:
            raise RuntimeError("injected device failure")
        return real_step()

    doomed.step = step
    deaths = []

    async def main():
        aengine = AsyncEngine(doomed, on_dead=deaths.append)
        results = await asyncio.wait_for(asyncio.gather(
            *(collect(aengine, p, greedy(50)) for p in PROMPTS), return_exceptions=True), HANG_GUARD_S)
        with pytest.raises(EngineDeadError):
            await collect(aengine, PROMPTS[0], greedy())
        healthy = aengine.healthy
        stats = await aengine.stats()      # the thread is gone: answered in place, not hung
        await aengine.shutdown()
        return results, healthy, stats

    results, healthy, stats = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert "injected device failure" in str(results[0])
    assert not healthy and len(deaths) == 1
    assert stats.scheduler.num_kv_blocks_total > 0
