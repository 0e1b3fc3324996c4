"""The servicer in-process (grpc.aio on loopback, the compiled tiny runner shared): a full waiting
queue gives RESOURCE_EXHAUSTED, a passed deadline aborts the request and returns every block, an
engine that crashes mid-stream gives INTERNAL to every stream in flight and UNAVAILABLE afterwards,
without hanging, and n samples stream with their indices."""

import asyncio
import dataclasses
import threading

import grpc
import pytest
from grpc import aio

from jaxserve import LLM
from jaxserve.client import AsyncGenerationClient
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.server.request_caps import RequestCaps
from jaxserve.proto import generation_pb2_grpc as pb_grpc
from jaxserve.server.servicer import GenerationServicer
from jaxserve.server.state import Phase, ServerState
from tests.server.step_gate import StepGate

PROMPT = "The tide comes in"
HANG_GUARD_S = 120


async def serve(engine, body, limits=RequestCaps()):
    """Run body(client, state) against a servicer over `engine` on a loopback port."""
    state = ServerState()
    state.aengine = AsyncEngine(engine)
    state.aengine.start()
    state.phase = Phase.SERVING
    server = aio.server()
    pb_grpc.add_GenerationServicer_to_server(
        GenerationServicer(state, max_concurrent_streams=64, limits=limits), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with AsyncGenerationClient(f"127.0.0.1:{port}", timeout=HANG_GUARD_S) as client:
            return await asyncio.wait_for(body(client, state), HANG_GUARD_S)
    finally:
        await state.aengine.shutdown()
        await server.stop(1)


async def first_chunk(stream):
    return await stream.__anext__()


async def wait_for(predicate, what):
    for _ in range(2000):
        if await predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"gave up waiting for {what}")


def test_a_full_waiting_queue_gives_resource_exhausted(tiny_llm):
    engine = LLM.sharing_runner(tiny_llm).engine
    config = engine.scheduler.config
    if not hasattr(config, "max_waiting_requests"):
        pytest.skip("this scheduler has no waiting-queue bound")
    engine.scheduler.config = dataclasses.replace(config, max_waiting_requests=1)
    gate = StepGate(engine)   # no request runs past its first output until the gate opens

    async def body(client, state):
        # four streams take every seat (max_num_seqs=4); a fifth waits; a sixth finds the queue full
        running, waiting, waiter = await _seats_full_and_one_waiting(client, max_tokens=100)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.generate(PROMPT, max_tokens=4)
        gate.open()
        for s in running:
            await s.aclose()
        await waiter
        await waiting.aclose()
        await wait_for(lambda: _idle(client), "the engine to be idle")
        return e.value

    err = asyncio.run(serve(engine, body))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_waiting_requests=1" in err.details()


def test_a_call_cancelled_while_its_request_waits_is_aborted_and_frees_everything(tiny_llm):
    """A gRPC client that leaves before its first token (its request queued behind full seats)
    aborts the request there, without waiting for a seat; the seats' own requests are untouched."""
    engine = LLM.sharing_runner(tiny_llm).engine
    gate = StepGate(engine)   # no request runs past its first output until the gate opens
    aborted = engine.finished_by_reason.get("abort", 0)

    async def body(client, state):
        running, waiting, waiter = await _seats_full_and_one_waiting(client, max_tokens=8)
        waiter.cancel()                        # the client leaves: its call is cancelled
        await asyncio.gather(waiter, return_exceptions=True)
        await waiting.aclose()
        await wait_for(lambda: _waiting_is(client, 0), "the waiting request to be aborted")
        left_running = (await client.server_info()).num_requests_running
        gate.open()
        tokens = []
        for s in running:
            tokens.append(sum(len(c.token_ids) for c in [c async for c in s]))
        await wait_for(lambda: _idle(client), "the engine to be idle")
        return left_running, tokens

    left_running, tokens = asyncio.run(serve(engine, body))
    assert left_running == 4 and tokens == [7] * 4      # the first token came before; the rest after
    assert engine.finished_by_reason.get("abort", 0) == aborted + 1


async def _seats_full_and_one_waiting(client, *, max_tokens: int):
    """Four streams on every seat (max_num_seqs=4), each past its first chunk (a closed StepGate
    holds them there), and a fifth waiting for a seat: (running, waiting, its first-chunk task)."""
    running = [client.stream_chunks(PROMPT, max_tokens=max_tokens, ignore_eos=True) for _ in range(4)]
    for s in running:
        await first_chunk(s)
    waiting = client.stream_chunks(PROMPT, max_tokens=4)
    waiter = asyncio.ensure_future(first_chunk(waiting))
    await wait_for(lambda: _waiting_is(client, 1), "one waiting request")
    return running, waiting, waiter


async def _waiting_is(client, n):
    return (await client.server_info()).num_requests_waiting == n


async def _idle(client):
    info = await client.server_info()
    return (info.num_requests_running == 0 and info.num_requests_waiting == 0
            and info.num_kv_blocks_free + info.num_kv_blocks_cached == info.num_kv_blocks_total)


def test_a_passed_deadline_aborts_the_request_and_returns_every_block(tiny_llm):
    # The step thread waits at a gate until the deadline has passed and the server has let go of
    # the call, so the request cannot run before its deadline however fast the machine is, and
    # the deadline passes however slow it is. Then the engine admits it (it holds blocks) and the
    # abort the server queued takes them back.
    engine = LLM.sharing_runner(tiny_llm).engine
    real_step, gate, blocks_held = engine.step, threading.Event(), []

    def step():
        gate.wait(HANG_GUARD_S)
        outputs = real_step()
        s = engine.stats()
        blocks_held.append(s.scheduler.num_kv_blocks_total - s.scheduler.num_kv_blocks_free - s.scheduler.num_kv_blocks_cached)
        return outputs

    engine.step = step

    async def body(client, state):
        client.timeout = 0.2   # this call's deadline; every other call keeps the hang guard
        try:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.generate(PROMPT, max_tokens=100, ignore_eos=True, request_id="hurried")
        finally:
            client.timeout = HANG_GUARD_S
        # the handler was cancelled at its deadline: its stream is gone and its abort queued
        await wait_for(lambda: _not_active(state, "hurried"), "the server to let go of the call")
        gate.set()
        await wait_for(lambda: _idle(client), "the engine to be idle")
        return e.value, await client.server_info()

    err, info = asyncio.run(serve(engine, body))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert blocks_held and blocks_held[0] > 0, "the request ran after its deadline, holding blocks"
    assert info.num_requests_finished == 1     # as an abort: it stopped long before 100 tokens
    assert info.generation_tokens_total < 100


async def _not_active(state, request_id):
    return request_id not in state.aengine.active_request_ids()


def test_an_engine_crash_gives_internal_to_streams_in_flight_then_unavailable(tiny_llm):
    engine = LLM.sharing_runner(tiny_llm).engine
    real_step, steps = engine.step, []

    def step():
        steps.append(1)
        if len(steps) == 4:
            raise RuntimeError("injected device failure")
        return real_step()

    engine.step = step

    async def body(client, state):
        results = await asyncio.gather(*(client.generate(PROMPT, max_tokens=50, ignore_eos=True) for _ in range(3)),
                                       return_exceptions=True)
        with pytest.raises(grpc.aio.AioRpcError) as after:
            await client.generate(PROMPT, max_tokens=4)
        return results, after.value, state.aengine.healthy

    results, after, healthy = asyncio.run(serve(engine, body))
    for r in results:
        assert isinstance(r, grpc.aio.AioRpcError) and r.code() == grpc.StatusCode.INTERNAL, r
        assert "injected device failure" in r.details()
    assert after.code() == grpc.StatusCode.UNAVAILABLE
    assert not healthy


def test_n_samples_stream_each_sample_with_its_index_and_complete(tiny_llm):
    from jaxserve import SamplingParams
    from jaxserve.sampling_params import OutputKind

    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=11, ignore_eos=True,
                            output_kind=OutputKind.CUMULATIVE)
    want = {c.index: c.token_ids for c in tiny_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs}
    engine = LLM.sharing_runner(tiny_llm).engine

    async def body(client, state):
        chunks = []
        done = await client.generate(PROMPT, n=3, max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
        async for c in client.stream_chunks(PROMPT, n=3, max_tokens=6, temperature=1.0, seed=11, ignore_eos=True):
            chunks.append(c)
        return done, chunks

    done, chunks = asyncio.run(serve(engine, body, limits=RequestCaps(max_n=3)))
    got = {0: done.token_ids, **{i: s.token_ids for i, s in done.samples.items()}}
    assert got == want and len(want) == 3
    assert {c.index for c in chunks} == {0, 1, 2}
    assert all(s.finish_reason == "length" and s.completion_tokens == 6 for s in [done, *done.samples.values()])
