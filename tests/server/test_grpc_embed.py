"""The Embed RPC in-process: HF's embeddings for a batch of texts and token ids, last and mean
pooling, normalized or not, through the client's embed(); refusals are INVALID_ARGUMENT."""

import asyncio

import grpc
import numpy as np
import pytest
from grpc import aio

from jaxserve import LLM
from tests.engine.test_embeddings import PROMPTS, RTOL, hf_embedding
from tests.server.test_servicer_in_process import serve


def test_embed_over_grpc(embedding_llm, tiny_llama_dir):
    engine = LLM.sharing_runner(embedding_llm).engine
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]

    async def body(c, state):
        last = await c.embed(PROMPTS)
        mean = await c.embed([ids[0], PROMPTS[1]], pooling="mean", normalize=False, request_id="e")
        errors = []
        for bad in ([], [""], {"inputs": "x", "pooling": "max"}):
            with pytest.raises(aio.AioRpcError) as e:
                await (c.embed(bad["inputs"], pooling=bad["pooling"]) if isinstance(bad, dict) else c.embed(bad))
            errors.append(e.value)
        return last, mean, errors, state.active_streams

    last, mean, errors, active = asyncio.run(serve(engine, body))
    for got, prompt_ids in zip(last, ids):
        want = hf_embedding(tiny_llama_dir, prompt_ids, "last", True)
        assert np.linalg.norm(np.asarray(got) - want) <= RTOL * np.linalg.norm(want)
    for got, prompt_ids in zip(mean, ids[:2]):
        want = hf_embedding(tiny_llama_dir, prompt_ids, "mean", False)
        assert np.linalg.norm(np.asarray(got) - want) <= RTOL * np.linalg.norm(want)
    assert [e.code() for e in errors] == [grpc.StatusCode.INVALID_ARGUMENT] * 3
    assert "pooling" in errors[2].details() and active == 0
    assert engine.stats().steps.num_compilations_after_warmup == 0


def test_embed_past_the_input_token_cap_is_invalid_argument(embedding_llm):
    engine = LLM.sharing_runner(embedding_llm).engine
    cap = 64 * engine.max_model_len

    async def body(c, state):
        with pytest.raises(aio.AioRpcError) as e:
            await c.embed([[7] * 100] * (cap // 100 + 1))
        return e.value, engine.stats()

    err, stats = asyncio.run(serve(engine, body))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-input-tokens" in err.details()
    assert stats.scheduler.num_running == stats.scheduler.num_waiting == 0
