"""/v1/responses with function tools and reasoning, through the openai client, on the tiny Qwen3 of
tests/server/tiny_chat_model.py (a Hermes-style template that renders tools and opens `<think>`)
served with --tool-call-parser hermes and --reasoning-parser qwen3: required and named calls are
function_call items whose arguments validate, streamed as the non-streamed answer has them; a
call's result sent back (as items, or after previous_response_id) renders as the chat template's
tool turn; a free answer's reasoning is a reasoning item."""

import json

import jsonschema
import openai
import pytest

from tests.server.http_harness import serving

PARAMS = {"type": "object", "properties": {"place": {"enum": ["north", "south"]},
                                           "hour": {"type": "integer", "minimum": 0, "maximum": 23}},
          "required": ["place", "hour"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_tide", "description": "The tide at a place and hour", "parameters": PARAMS},
         {"type": "function", "name": "get_wind", "parameters": {"type": "object", "properties": {}}}]
QUESTION = "When is high tide?"


server, client = serving("tiny_chat_llm", reasoning_parser="qwen3", tool_call_parser="hermes")


def _comparable(response) -> dict:
    """Without what differs between two runs of one request: ids (call ids included), clocks, cache hits, and
    the stream helper's `parsed` / `parsed_arguments`."""
    d = response.model_dump(exclude={"id", "created_at", "completed_at"})
    d["usage"]["input_tokens_details"].pop("cached_tokens")   # a second run finds the first's prefix
    for item in d["output"]:
        for key in ("id", "call_id", "parsed_arguments"):
            item.pop(key, None)
        for part in item.get("content") or []:
            part.pop("parsed", None)
    return d


def _reference(server, messages, n, tools=None):
    """The engine's greedy answer on the chat template's rendering (with the tools) of `messages`."""
    from jaxserve import SamplingParams

    def run(llm):
        ids = llm.engine.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)[0]
    return server.reference(run)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_tide"}])
def test_a_constrained_call_is_a_function_call_item_streamed_and_not(server, client, tool_choice):
    kw = dict(model=server.model, input=QUESTION, tools=TOOLS, tool_choice=tool_choice, max_output_tokens=80,
              temperature=0, parallel_tool_calls=False)
    r = client.responses.create(**kw)
    assert r.status == "completed"
    calls = [item for item in r.output if item.type == "function_call"]
    assert [item.type for item in r.output] == ["function_call"] and len(calls) == 1
    call = calls[0]
    assert call.id.startswith("fc_") and call.call_id and call.status == "completed"
    if isinstance(tool_choice, dict):
        assert call.name == "get_tide"
    if call.name == "get_tide":
        jsonschema.validate(json.loads(call.arguments), PARAMS)
    assert [t.name for t in r.tools] == ["get_tide", "get_wind"] and r.parallel_tool_calls is False
    assert (r.tool_choice == tool_choice if isinstance(tool_choice, str) else
            (r.tool_choice.type, r.tool_choice.name) == ("function", "get_tide"))

    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    n = types.count("response.function_call_arguments.delta")
    assert types == (["response.created", "response.in_progress", "response.output_item.added"]
                     + ["response.function_call_arguments.delta"] * n
                     + ["response.function_call_arguments.done", "response.output_item.done", "response.completed"])
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert _comparable(final) == _comparable(r)


def test_a_call_result_sent_back_renders_as_the_templates_tool_turn(server, client):
    first = client.responses.create(model=server.model, input=QUESTION, tools=TOOLS, temperature=0,
                                    tool_choice={"type": "function", "name": "get_tide"}, max_output_tokens=80)
    [call] = first.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "at 14:00"}
    kw = dict(model=server.model, tools=TOOLS, max_output_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    by_items = client.responses.create(input=[{"role": "user", "content": QUESTION},
                                              call.model_dump(exclude_none=True), result], **kw)
    by_previous = client.responses.create(input=[result], previous_response_id=first.id, **kw)
    template_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
    expected = _reference(server, [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": "get_tide", "arguments": json.loads(call.arguments)}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "at 14:00"}], 6, tools=template_tools)
    assert by_items.usage.input_tokens == by_previous.usage.input_tokens == len(expected.prompt_token_ids)
    assert _comparable(by_items)["output"] == _comparable(by_previous)["output"]
    listed = client.responses.input_items.list(by_items.id, order="asc").data
    assert [i.type for i in listed] == ["message", "function_call", "function_call_output"]
    assert listed[1].call_id == listed[2].call_id == call.call_id and listed[1].id == call.id
    assert [i.type for i in client.responses.input_items.list(by_previous.id).data] == ["function_call_output"]
    # the template opened <think> and the tiny model never closes it: the answer is its reasoning
    assert "</think>" not in expected.outputs[0].text
    assert [item.type for item in by_items.output] == ["reasoning"]
    assert by_items.output[0].content[0].text == expected.outputs[0].text


def test_a_free_answer_inside_the_opened_think_is_a_reasoning_item(server, client):
    kw = dict(model=server.model, input=QUESTION, max_output_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    r = client.responses.create(**kw)
    expected = _reference(server, [{"role": "user", "content": QUESTION}], 6)
    assert "</think>" not in expected.outputs[0].text    # so the whole answer is reasoning
    assert [item.type for item in r.output] == ["reasoning"]
    assert r.output[0].content[0].text == expected.outputs[0].text and r.output[0].status == "incomplete"
    assert r.status == "incomplete"
    events = list(client.responses.create(stream=True, **kw))
    assert [e.type for e in events][2:4] == ["response.output_item.added", "response.content_part.added"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == expected.outputs[0].text
    assert events[-1].type == "response.incomplete" and _comparable(events[-1].response) == _comparable(r)
    # sent back, the reasoning item is the assistant turn's reasoning
    again = client.responses.create(model=server.model, max_output_tokens=2, temperature=0,
                                    input=[{"role": "user", "content": QUESTION}, r.output[0].model_dump(exclude_none=True),
                                           {"role": "user", "content": "Go on."}])
    template = _reference(server, [{"role": "user", "content": QUESTION},
                                   {"role": "assistant", "content": "", "reasoning_content": expected.outputs[0].text},
                                   {"role": "user", "content": "Go on."}], 2)
    assert again.usage.input_tokens == len(template.prompt_token_ids)


def test_logprobs_of_a_parsed_answer_are_refused(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=server.model, input=QUESTION, include=["message.output_text.logprobs"])
    assert e.value.response.json()["error"]["param"] == "include"


def test_a_streamed_answer_of_reasoning_text_and_two_calls_has_the_whole_answers_items():
    """The event stream's items against the whole-text parse, on a text the tiny model would not
    write: reasoning, text, two calls, fed a few characters at a time; every event is one of the
    openai package's event types."""
    from pydantic import TypeAdapter
    from openai.types.responses import ResponseStreamEvent

    from jaxserve.chat_output import ChatOutputSpec
    from jaxserve.reasoning_parsers import reasoning_parser
    from jaxserve.server.http.responses_events import EventNumbers, OutputStream
    from jaxserve.server.http.responses_output import AnswerText, ResponseBuilder
    from jaxserve.server.http.responses_schemas import ResponsesRequest
    from jaxserve.tool_parsers import tool_parser

    text = ('tides are lunar</think>Let me look. <tool_call>{"name": "get_tide", "arguments": {"place": "north", '
            '"hour": 3}}</tool_call><tool_call>{"name": "get_wind", "arguments": {}}</tool_call>')
    spec = ChatOutputSpec(tool_parser("hermes"), reasoning_parser("qwen3"))
    builder = ResponseBuilder(ResponsesRequest(input="x", tools=TOOLS), "m")
    answer = AnswerText(None, None, finish_reason="stop")
    event = EventNumbers()
    stream, parser = OutputStream(builder, answer, event), spec.new(True)
    events = []
    for i in range(0, len(text), 3):
        events += stream.delta(parser.feed(text[i:i + 3]), [])
    events += stream.delta(parser.finish(), [])
    events += stream.finish()
    whole = builder.items(spec.new(True).parse(text), answer)
    strip = lambda items: [{k: v for k, v in item.model_dump().items() if k not in ("id", "call_id")} for item in items]
    assert strip(stream.items) == strip(whole)
    assert [item.type for item in whole] == ["reasoning", "message", "function_call", "function_call"]
    assert whole[1].content[0].text == "Let me look. " and json.loads(whole[2].arguments) == {"place": "north", "hour": 3}

    adapter = TypeAdapter(ResponseStreamEvent)
    parsed = [adapter.validate_python(json.loads(e.split("\ndata: ", 1)[1])) for e in events]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    assert all(e.split("\n", 1)[0] == f"event: {p.type}" for e, p in zip(events, parsed))
    added = [p.output_index for p in parsed if p.type == "response.output_item.added"]
    done = [p.output_index for p in parsed if p.type == "response.output_item.done"]
    assert added == [0, 1, 2, 3] and sorted(done) == [0, 1, 2, 3]
    for p in parsed:   # nothing of an item before it is added or after it is done
        if hasattr(p, "output_index") and p.type not in ("response.output_item.added", "response.output_item.done"):
            i = parsed.index(p)
            assert any(q.type == "response.output_item.added" and q.output_index == p.output_index for q in parsed[:i])
            assert not any(q.type == "response.output_item.done" and q.output_index == p.output_index
                           for q in parsed[:i])
    assert done.index(0) < done.index(1)   # the reasoning closes when the text begins
