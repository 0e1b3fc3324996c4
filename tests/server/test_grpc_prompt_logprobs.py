"""SamplingParams.prompt_logprobs over gRPC: the first Chunk carries one PromptLogprob per prompt
token after the first, the engine's values; a bad value is INVALID_ARGUMENT."""

import asyncio

import grpc
import pytest
from grpc import aio

from jaxserve import LLM, SamplingParams
from jaxserve.server.request_caps import RequestCaps
from tests.server.test_servicer_in_process import serve

PROMPT = "The tide comes in"


def test_prompt_logprobs_over_grpc(prompt_logprobs_llm):
    llm = prompt_logprobs_llm
    llm.engine.reset_prefix_cache()
    want = llm.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2),
                        use_tqdm=False)[0]

    async def body(c, state):
        got = await c.generate(PROMPT, max_tokens=3, temperature=0, prompt_logprobs=2)
        two = await c.generate(PROMPT, n=2, max_tokens=3, temperature=1.0, seed=1, prompt_logprobs=0)
        plain = await c.generate(PROMPT, max_tokens=3, temperature=0)
        with pytest.raises(aio.AioRpcError) as bad:
            await c.generate(PROMPT, max_tokens=2, prompt_logprobs=21)
        return got, two, plain, bad.value

    try:
        got, two, plain, bad = asyncio.run(serve(LLM.sharing_runner(llm).engine, body, limits=RequestCaps(max_n=2)))
    finally:
        llm.engine.reset_prefix_cache()
    ids = want.prompt_token_ids
    assert [e.token_id for e in got.prompt_logprobs] == ids[1:]
    for e, entry in zip(got.prompt_logprobs, want.prompt_logprobs[1:]):
        assert e.logprob == pytest.approx(entry[e.token_id].logprob) and e.rank == entry[e.token_id].rank
        assert [t.token_id for t in e.top] == [t for t, lp in sorted(entry.items(), key=lambda x: x[1].rank)
                                               if lp.rank <= 2]
    assert got.token_ids == want.outputs[0].token_ids
    assert len(two.prompt_logprobs) == len(ids) - 1 and all(not e.top for e in two.prompt_logprobs)
    assert plain.prompt_logprobs == []
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_logprobs" in bad.details()
