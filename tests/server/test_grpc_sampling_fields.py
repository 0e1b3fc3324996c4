"""The gRPC SamplingParams' penalty, logit-bias and structured-output fields reach the engine:
the same tokens as the Python API with the same values, outputs that match their regex or
schema, and bad values are INVALID_ARGUMENT naming the field."""

import asyncio
import json
import re

import grpc
import pytest
from grpc import aio

from jaxserve import SamplingParams
from jaxserve.client import AsyncGenerationClient
from tests.server.test_front_in_process import HANG_GUARD_S, fresh_engine, serve

PROMPT = "The tide comes in"


def test_penalties_and_logit_bias_over_grpc(tiny_llm):
    kw = dict(max_tokens=8, temperature=0.0, ignore_eos=True, presence_penalty=1.0, frequency_penalty=0.5,
              repetition_penalty=1.2)
    # the served engine shares tiny_llm's KV arena: tiny_llm's prefix cache may index blocks another
    # engine overwrote, and will index blocks the served one overwrites; forget it around each
    tiny_llm.engine.reset_prefix_cache()
    expected = tiny_llm.generate(PROMPT, SamplingParams(**kw), use_tqdm=False)[0].outputs[0].token_ids

    async def body(target, state):
        async with AsyncGenerationClient(target, timeout=HANG_GUARD_S) as c:
            penalised = await c.generate(PROMPT, **kw)
            forced = await c.generate(PROMPT, max_tokens=4, ignore_eos=True, logit_bias={42: 100.0})
            with pytest.raises(aio.AioRpcError) as bad:
                await c.generate(PROMPT, max_tokens=2, logit_bias={10**6: 1.0})
            return penalised, forced, bad.value

    try:
        penalised, forced, bad = asyncio.run(serve(fresh_engine(tiny_llm), body))
    finally:
        tiny_llm.engine.reset_prefix_cache()
    assert penalised.token_ids == expected
    assert forced.token_ids == [42] * 4
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "logit_bias" in bad.details()


def test_structured_outputs_over_grpc(tiny_llm):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}

    async def body(target, state):
        async with AsyncGenerationClient(target, timeout=HANG_GUARD_S) as c:
            rx = await c.generate(PROMPT, max_tokens=20, structured_outputs={"regex": "[0-9]{3}"})
            js = await c.generate(PROMPT, max_tokens=40, structured_outputs={"json_schema": json.dumps(schema)})
            ch = await c.generate(PROMPT, max_tokens=10, structured_outputs={"choice": ["up", "down"]})
            with pytest.raises(aio.AioRpcError) as bad:
                await c.generate(PROMPT, max_tokens=2, structured_outputs={"regex": "(("})
            return rx, js, ch, bad.value

    rx, js, ch, bad = asyncio.run(serve(fresh_engine(tiny_llm), body))
    assert re.fullmatch("[0-9]{3}", rx.text) and rx.finish_reason == "stop"
    assert isinstance(json.loads(js.text)["ok"], bool)
    assert ch.text in ("up", "down")
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "structured_outputs" in bad.details()
