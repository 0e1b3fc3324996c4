"""Tools and reasoning on the gRPC Chat (in-process servicer on loopback, the tiny Qwen3 of
tests/server/tiny_chat_model.py): a required call's arguments validate and come back on the
Complete message with finish_reason "tool_calls" (the Chunks carry the raw text); the history's
calls and results are rendered; reasoning is split out with --reasoning-parser; bad tools are
INVALID_ARGUMENT."""

import asyncio
import json

import grpc
import jsonschema
import pytest
from grpc import aio

from jaxserve import LLM
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.proto import generation_pb2 as pb
from jaxserve.proto import generation_pb2_grpc as pb_grpc
from jaxserve.server.request_caps import RequestCaps
from jaxserve.server.servicer import GenerationServicer
from jaxserve.server.state import Phase, ServerState

HANG_GUARD_S = 120
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [pb.Tool(name="get_weather", description="the forecast", parameters=json.dumps(WEATHER))]
USER = pb.ChatMessage(role="user", content="Weather in Oslo?")


def run(llm, body, **servicer_kw):
    """body(stub) against a servicer over an engine sharing llm's runner, on a loopback port."""
    async def main():
        state = ServerState()
        state.aengine = AsyncEngine(LLM.sharing_runner(llm).engine)
        state.aengine.start()
        state.phase = Phase.SERVING
        server = aio.server()
        pb_grpc.add_GenerationServicer_to_server(
            GenerationServicer(state, max_concurrent_streams=8, limits=RequestCaps(), **servicer_kw), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await asyncio.wait_for(body(pb_grpc.GenerationStub(channel)), HANG_GUARD_S)
        finally:
            await state.aengine.shutdown()
            await server.stop(1)
    return asyncio.run(main())


async def generate(stub, chat, **params):
    """The Chunks' text and the Complete message of a one-sample request."""
    text, complete = "", None
    async for r in stub.Generate(pb.GenerateRequest(chat=chat, sampling_params=pb.SamplingParams(**params))):
        if r.HasField("chunk"):
            text += r.chunk.text
        else:
            complete = r.complete
    return text, complete


def test_a_required_call_comes_back_on_the_complete_message(tiny_chat_llm):
    async def body(stub):
        chat = pb.Chat(messages=[USER], tools=TOOLS, tool_choice=pb.ToolChoice(mode="required"),
                       parallel_tool_calls=False)
        text, done = await generate(stub, chat, max_tokens=200, temperature=1.0, seed=7)
        assert done.finish_reason == "tool_calls" and not done.HasField("content")
        assert [c.name for c in done.tool_calls] == ["get_weather"] and done.tool_calls[0].id.startswith("call_")
        jsonschema.validate(json.loads(done.tool_calls[0].arguments), WEATHER)
        assert done.tool_calls[0].arguments in text            # the chunks stream the raw text
        # the call and its result sent back: rendered as the template writes them
        call = done.tool_calls[0]
        history = pb.Chat(messages=[USER, pb.ChatMessage(role="assistant", tool_calls=[call]),
                                    pb.ChatMessage(role="tool", tool_call_id=call.id, content="sunny")], tools=TOOLS)
        _, again = await generate(stub, history, max_tokens=1)
        return call, again.prompt_tokens
    call, prompt_tokens = run(tiny_chat_llm, body, tool_call_parser="hermes")
    tok = tiny_chat_llm.get_tokenizer()
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": USER.content},
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": call.id, "type": "function",
              "function": {"name": call.name, "arguments": json.loads(call.arguments)}}]},
         {"role": "tool", "tool_call_id": call.id, "content": "sunny"}],
        tools=[{"type": "function", "function": {"name": "get_weather", "description": "the forecast",
                                                 "parameters": WEATHER}}], add_generation_prompt=True, tokenize=False)
    assert prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))


def test_reasoning_is_split_onto_the_complete_message(tiny_chat_llm):
    tok = tiny_chat_llm.get_tokenizer()
    close = tok.convert_tokens_to_ids("</think>")
    grammar = f'start: "the moon pulls" <[{close}]> "\\n\\nThe moon."'

    async def body(stub):
        text, done = await generate(stub, pb.Chat(messages=[USER]), max_tokens=60,
                                    structured_outputs=pb.StructuredOutputs(grammar=grammar))
        return text, done
    text, done = run(tiny_chat_llm, body, reasoning_parser="qwen3")
    assert text == "the moon pulls</think>\n\nThe moon."
    assert (done.reasoning, done.content, done.finish_reason) == ("the moon pulls", "The moon.", "stop")


@pytest.mark.parametrize("chat, words", [
    (pb.Chat(messages=[USER], tool_choice=pb.ToolChoice(mode="required")), "needs tools"),
    (pb.Chat(messages=[USER], tools=TOOLS, tool_choice=pb.ToolChoice(function="absent")), "not among the tools"),
    (pb.Chat(messages=[USER], tools=TOOLS, tool_choice=pb.ToolChoice(mode="often")), "chat.tool_choice.mode"),
    (pb.Chat(messages=[USER], tools=[pb.Tool(name="f", parameters="{oops")]), "chat.tools[0].parameters"),
    (pb.Chat(messages=[USER, pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(name="f", arguments="[1]")])]),
     "chat.messages[1].tool_calls[0]"),
])
def test_bad_tools_are_invalid_argument(tiny_chat_llm, chat, words):
    async def body(stub):
        with pytest.raises(aio.AioRpcError) as e:
            await generate(stub, chat, max_tokens=4)
        return e.value
    err = run(tiny_chat_llm, body, tool_call_parser="hermes")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.details()


def test_a_template_without_tools_is_invalid_argument(tiny_llm):
    async def body(stub):
        with pytest.raises(aio.AioRpcError) as e:
            await generate(stub, pb.Chat(messages=[USER], tools=TOOLS), max_tokens=4)
        return e.value
    err = run(tiny_llm, body, tool_call_parser="hermes")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not render tools" in err.details()
