"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the official `anthropic`
client, on the tiny Qwen3 of tests/server/tiny_chat_model.py (a Hermes-style template that renders
tools and opens `<think>`) served with --tool-call-parser hermes and --reasoning-parser qwen3:
answers are the chat template's greedy answers (thinking blocks while the template thinks, text
with thinking disabled), a stream accumulates to the whole answer, forced calls are tool_use blocks
whose input validates, a tool_result renders as the template's tool turn, stop sequences and
max_tokens end an answer with their stop_reason, and errors are Anthropic's."""

import json

import anthropic
import httpx2 as httpx
import jsonschema
import pytest

from jaxserve import SamplingParams
from tests.sched.sched_testkit import check_invariants
from tests.server.http_harness import API_KEY, blocks_all_free, serving, wait_until

TIDE = {"type": "object", "properties": {"place": {"enum": ["north", "south"]},
                                         "hour": {"type": "integer", "minimum": 0, "maximum": 23}},
        "required": ["place", "hour"], "additionalProperties": False}
TOOLS = [{"name": "get_tide", "description": "The tide at a place and hour", "input_schema": TIDE},
         {"name": "get_wind", "input_schema": {"type": "object", "properties": {}}}]
TEMPLATE_TOOLS = [{"type": "function", "function": {"name": t["name"], **({"description": t["description"]}
                                                                            if "description" in t else {}),
                                                     "parameters": t["input_schema"]}} for t in TOOLS]
SYSTEM = "Answer briefly."
QUESTION = "When is high tide?"
GREEDY = {"temperature": 0}       # the installed client no longer names temperature: sent as a body field
NO_THINKING = {"type": "disabled"}


server, client = serving("tiny_chat_llm", reasoning_parser="qwen3", tool_call_parser="hermes")


@pytest.fixture(scope="module")
def claude(server):
    with server.anthropic_client() as c:
        yield c


def _reference(server, messages, n, *, tools=None, **template_kwargs):
    """The engine's greedy answer on the chat template's rendering of `messages` (the prompt ids
    too: their count is the input the route must report)."""
    def run(llm):
        ids = llm.engine.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                       tokenize=True, **template_kwargs)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=n, temperature=0.0),
                            use_tqdm=False)[0]
    return server.reference(run)


def _input_tokens(usage) -> int:
    """The whole prompt: Anthropic's input_tokens leave out what the prefix cache served."""
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def _comparable(message) -> dict:
    """Without what differs between two runs of one request: ids and the prefix cache's share."""
    d = message.model_dump(exclude={"id"})
    d["usage"] = {"input": _input_tokens(message.usage), "output": message.usage.output_tokens}
    for block in d["content"]:
        block.pop("id", None)
    return d


def _stream(claude, **kw):
    with claude.messages.stream(**kw) as s:
        events = [e.type for e in s]
        return events, s.get_final_message()


def test_an_answer_is_the_templates_greedy_text_and_its_stream_the_same(server, claude):
    kw = dict(model=server.model, system=SYSTEM, max_tokens=12, thinking=NO_THINKING, extra_body=GREEDY,
              messages=[{"role": "user", "content": QUESTION}])
    m = claude.messages.create(**kw)
    expected = _reference(server, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}], 12,
                          enable_thinking=False)
    out = expected.outputs[0]
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == server.model
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == out.text
    assert m.stop_reason == ("max_tokens" if out.finish_reason == "length" else "end_turn")
    assert m.stop_sequence is None
    assert _input_tokens(m.usage) == len(expected.prompt_token_ids) and m.usage.output_tokens == len(out.token_ids)

    events, final = _stream(claude, **kw)
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    assert events.count("content_block_start") == events.count("content_block_stop") == 1
    assert _comparable(final) == _comparable(m)


def test_the_templates_opened_think_is_a_thinking_block_streamed_and_not(server, claude):
    kw = dict(model=server.model, max_tokens=6, messages=[{"role": "user", "content": QUESTION}], extra_body=GREEDY)
    expected = _reference(server, [{"role": "user", "content": QUESTION}], 6)
    assert "</think>" not in expected.outputs[0].text     # the tiny model never closes it
    m = claude.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking"]
    assert m.content[0].thinking == expected.outputs[0].text and m.content[0].signature == ""
    assert _comparable(claude.messages.create(thinking={"type": "adaptive"}, **kw)) == _comparable(m)
    # enabled: its budget must stay below max_tokens (the budget itself bounds nothing: max_tokens does)
    r = _post(server, "/v1/messages", {"model": server.model, "max_tokens": 6, "messages": kw["messages"],
                                       "thinking": {"type": "enabled", "budget_tokens": 1024}})
    _error(r, 400, "invalid_request_error")
    assert r.json()["error"]["code"] == "conflicting_fields"
    events, final = _stream(claude, **kw)
    assert "thinking" in events
    assert _comparable(final) == _comparable(m)


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_tide"}])
def test_a_forced_call_is_a_tool_use_block_whose_input_validates(server, claude, tool_choice):
    kw = dict(model=server.model, max_tokens=80, tools=TOOLS, messages=[{"role": "user", "content": QUESTION}],
              tool_choice=dict(tool_choice, disable_parallel_tool_use=True), extra_body=GREEDY)
    m = claude.messages.create(**kw)
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    call = m.content[0]
    assert call.id.startswith("toolu_") and call.name in {"get_tide", "get_wind"}
    if tool_choice["type"] == "tool":
        assert call.name == "get_tide"
    jsonschema.validate(call.input, TIDE if call.name == "get_tide" else TOOLS[1]["input_schema"])
    events, final = _stream(claude, **kw)
    assert "input_json" in events
    assert _comparable(final) == _comparable(m)


def test_a_tool_result_renders_as_the_templates_tool_turn(server, claude):
    first = claude.messages.create(model=server.model, max_tokens=80, tools=TOOLS, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": QUESTION}],
                                   tool_choice={"type": "tool", "name": "get_tide", "disable_parallel_tool_use": True})
    [call] = first.content
    turns = [{"role": "user", "content": QUESTION},
             {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "at 14:00"},
                                          {"type": "text", "text": "And low tide?"}]}]
    m = claude.messages.create(model=server.model, max_tokens=4, tools=TOOLS, messages=turns, extra_body=GREEDY)
    expected = _reference(server, [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "get_tide", "arguments": call.input}}]},
        {"role": "tool", "tool_call_id": call.id, "name": "get_tide", "content": "at 14:00"},
        {"role": "user", "content": "And low tide?"}], 4, tools=TEMPLATE_TOOLS)
    assert _input_tokens(m.usage) == len(expected.prompt_token_ids)
    assert [b.type for b in m.content] == ["thinking"] and m.content[0].thinking == expected.outputs[0].text
    counted = claude.messages.count_tokens(model=server.model, tools=TOOLS, messages=turns)
    assert counted.input_tokens == len(expected.prompt_token_ids)


def test_count_tokens_is_the_prompt_create_runs(server, claude):
    kw = dict(model=server.model, system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
              messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}], thinking=NO_THINKING)
    counted = claude.messages.count_tokens(**kw).input_tokens
    m = claude.messages.create(max_tokens=1, extra_body=GREEDY, **kw)
    assert counted == _input_tokens(m.usage) > 0
    with_tools = claude.messages.count_tokens(tools=TOOLS, **kw).input_tokens
    assert with_tools > counted      # the template renders the tools into the prompt


def test_a_stop_sequence_cuts_the_text_before_it_and_is_named(server, claude):
    kw = dict(model=server.model, max_tokens=24, thinking=NO_THINKING, extra_body=GREEDY,
              messages=[{"role": "user", "content": QUESTION}])
    whole = claude.messages.create(**kw).content[0].text
    stop = next(whole[i:i + 2] for i in range(4, len(whole) - 2) if whole[i:i + 2].strip() and
                whole.find(whole[i:i + 2]) == i)
    for m in (claude.messages.create(stop_sequences=["never written", stop], **kw),
              _stream(claude, stop_sequences=["never written", stop], **kw)[1]):
        assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
        assert m.content[0].text == whole[:whole.find(stop)]


def test_max_tokens_ends_an_answer_with_stop_reason_max_tokens(server, claude):
    kw = dict(model=server.model, max_tokens=3, thinking=NO_THINKING, extra_body=GREEDY,
              messages=[{"role": "user", "content": QUESTION}])
    expected = _reference(server, [{"role": "user", "content": QUESTION}], 3, enable_thinking=False).outputs[0]
    assert expected.finish_reason == "length"   # the tiny model does not end its turn within 3 tokens
    m = claude.messages.create(**kw)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3
    assert _stream(claude, **kw)[1].stop_reason == "max_tokens"


def _post(server, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(server.base_url.removesuffix("/v1") + path, json=body, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"} if headers is None else headers)


def _error(r: httpx.Response, status: int, type: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == type, body
    return body["error"]["message"]


def test_errors_are_anthropics(server, claude):
    hi = [{"role": "user", "content": "Hi"}]
    with pytest.raises(anthropic.BadRequestError) as e:   # a misspelled field
        claude.messages.create(model=server.model, max_tokens=4, messages=hi, extra_body={"stop_sequence": ["x"]})
    assert e.value.body["error"] == {"type": "invalid_request_error",
                                     "message": "stop_sequence: Extra inputs are not permitted"}
    assert "max_tokens" in _error(_post(server, "/v1/messages", {"model": server.model, "messages": hi}),
                                  400, "invalid_request_error")
    for bad in ({"temperature": 1.5}, {"top_k": -1}, {"max_tokens": 0}, {"messages": []}):
        _error(_post(server, "/v1/messages", {"model": server.model, "max_tokens": 4, "messages": hi} | bad),
               400, "invalid_request_error")
    image = [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": "AAAA"}}]}]
    assert "image content is not supported" in _error(
        _post(server, "/v1/messages", {"model": server.model, "max_tokens": 4, "messages": image}), 400,
        "invalid_request_error")
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="no-such-model", max_tokens=4, messages=hi)
    assert e.value.body["error"]["type"] == "not_found_error"
    with server.anthropic_client(api_key="wrong") as wrong, pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model=server.model, max_tokens=4, messages=hi)
    assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"
    body = {"model": server.model, "messages": hi}
    _error(_post(server, "/v1/messages/count_tokens", body, headers={"x-api-key": "wrong"}), 401, "authentication_error")
    assert _post(server, "/v1/messages/count_tokens", body, headers={"x-api-key": API_KEY,
                                                                     "anthropic-version": "2023-06-01"}).status_code == 200
    prefill = hi + [{"role": "assistant", "content": "The answer is"}]
    r = _post(server, "/v1/messages", {"model": server.model, "max_tokens": 4, "messages": prefill})
    _error(r, 400, "invalid_request_error")
    assert r.json()["error"]["code"] == "prefill_unsupported"
    too_long = _post(server, "/v1/messages", {"model": server.model, "max_tokens": server.engine.max_model_len,
                                              "messages": hi})
    _error(too_long, 400, "invalid_request_error")
    assert too_long.json()["error"]["code"] == "context_length_exceeded"


def test_a_client_leaving_mid_stream_aborts_the_message(server):
    body = {"model": server.model, "max_tokens": 64, "stream": True, "messages": [{"role": "user", "content": QUESTION}]}
    server.gate.close()
    try:
        with httpx.stream("POST", server.base_url + "/messages", json=body, headers={"x-api-key": API_KEY},
                          timeout=120) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = r.iter_lines()   # kept: a line iterator dropped early closes the connection
            assert next(lines) == "event: message_start"
            start = json.loads(next(lines).removeprefix("data: "))
            assert start["message"]["content"] == [] and server.stats().scheduler.num_running == 1
            usage = start["message"]["usage"]     # the prompt is known when the stream starts
            assert usage["input_tokens"] + usage["cache_read_input_tokens"] > 0 and usage["output_tokens"] == 0
        # held mid-generation by the gate: only the disconnect can end it
        wait_until(lambda: server.stats().scheduler.num_running == 0, "the request to be aborted")
        wait_until(lambda: server.state.active_streams == 0, "the stream slot to be released")
    finally:
        server.gate.open()


def test_the_block_accounting_holds_after_the_workloads(server):
    server.wait_idle()
    assert blocks_all_free(server.stats())
    check_invariants(server.engine.scheduler)


def test_turns_become_the_chat_templates_messages():
    from jaxserve.server.http.messages_input import chat_conversation
    from jaxserve.server.http.messages_schemas import MessagesRequest

    req = MessagesRequest.model_validate({"max_tokens": 4, "system": [{"type": "text", "text": "Be "},
                                                                      {"type": "text", "text": "brief."}],
                                          "messages": [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""},
                                          {"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_tide",
                                           "input": {"place": "north", "hour": 3}}]},
        {"role": "user", "content": [{"type": "text", "text": "(before)"},
                                     {"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "at "}, {"type": "text", "text": "14:00"}]},
                                     {"type": "text", "text": "Thanks."}]}]})
    assert chat_conversation(req) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "hm", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_tide", "arguments": {"place": "north",
                                                                                                "hour": 3}}}]},
        {"role": "user", "content": "(before)"},
        {"role": "tool", "tool_call_id": "toolu_1", "name": "get_tide", "content": "at 14:00"},
        {"role": "user", "content": "Thanks."}]


def test_thinking_without_a_reasoning_parser_is_refused_and_disabled_tells_the_template():
    from jaxserve.server.http.errors import APIError
    from jaxserve.server.http.messages_input import thinking_template_kwargs
    from jaxserve.server.http.messages_schemas import MessagesRequest

    def req(thinking):
        return MessagesRequest.model_validate({"max_tokens": 2048, "messages": [{"role": "user", "content": "a"}],
                                               "thinking": thinking})
    assert thinking_template_kwargs(req({"type": "disabled"}), None) == {"enable_thinking": False}
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"}):
        with pytest.raises(APIError) as e:
            thinking_template_kwargs(req(thinking), None)
        assert e.value.status == 400 and e.value.code == "feature_disabled" and "--reasoning-parser" in e.value.message
