"""The gRPC control calls (Pause, Resume, UpdateWeights) on the real servicer over loopback:
refused without the API key; an update from a checkpoint directory serves HF transformers'
greedy tokens of the new weights and shows in GetServerInfo; a missing path is INVALID_ARGUMENT;
pause and resume show in GetServerInfo. The shared tiny runner gets its own weights back."""

import asyncio

import grpc
import pytest
from grpc import aio

from jaxserve.client import AsyncGenerationClient
from jaxserve.testing.tiny_models import hf_greedy, make_tiny_model
from tests.server.test_front_in_process import HANG_GUARD_S, fresh_engine, serve

PROMPT = "The tide comes in"
KEY = "control-key"
N = 6


@pytest.fixture(scope="module")
def second_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama-seed3"), "llama", seed=3)


@pytest.mark.slow   # its own servicer and two HF references (~40 s); the HTTP control routes run the same engine calls by default
def test_control_calls_update_pause_and_resume(tiny_llm, tiny_llama_dir, second_dir, tmp_path):
    engine = fresh_engine(tiny_llm)
    own = engine.runner.params
    ids = tiny_llm.get_tokenizer().encode(PROMPT)

    async def body(target, state):
        async with AsyncGenerationClient(target, timeout=HANG_GUARD_S) as anonymous:
            with pytest.raises(aio.AioRpcError) as refused:
                await anonymous.pause("keep")
        async with AsyncGenerationClient(target, api_key=KEY, timeout=HANG_GUARD_S) as c:
            try:
                reply = await c.update_weights(str(second_dir), version="s3")
                info = await c.server_info()
                new = await c.generate(ids, max_tokens=N, temperature=0.0, ignore_eos=True)
                with pytest.raises(aio.AioRpcError) as missing:
                    await c.update_weights(str(tmp_path / "nowhere"))
                aborted = await c.pause("keep")
                paused = await c.server_info()
                await c.resume()
                resumed = await c.server_info()
            finally:
                await state.aengine.update_weights(own)
            back = await c.generate(ids, max_tokens=N, temperature=0.0, ignore_eos=True)
        return refused.value, reply, info, new, missing.value, aborted, paused, resumed, back

    refused, reply, info, new, missing, aborted, paused, resumed, back = asyncio.run(serve(engine, body, api_key=KEY))
    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED
    assert reply.version == "s3" and reply.num_requests_recomputed == 0
    assert info.weights_version == "s3" and info.num_weight_updates == 1 and info.num_compilations_after_warmup == 0
    assert new.token_ids == hf_greedy(second_dir, ids, N)
    assert missing.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not exist" in missing.details()
    assert aborted == [] and paused.paused and not resumed.paused
    assert back.token_ids == hf_greedy(tiny_llama_dir, ids, N)
