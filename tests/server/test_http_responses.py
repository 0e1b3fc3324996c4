"""/v1/responses through the official `openai` client (responses.create, responses.stream,
create(stream=True), retrieve, delete) against the real app on loopback: greedy text equal to the
engine's on the same rendered chat, instructions and message input, max_output_tokens ->
incomplete, text.format json_schema, the typed event stream and its final response equal to the
non-streamed one, stored responses and previous_response_id, and the 400s of what is refused."""

import json

import httpx2 as httpx
import jsonschema
import openai
import pytest

from tests.server.http_harness import blocks_all_free, serving, wait_until

PROMPT = "The tide comes in"
SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": ["tide", "wave"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["kind", "n"], "additionalProperties": False,
}
JSON_FORMAT = {"format": {"type": "json_schema", "name": "t", "schema": SCHEMA, "strict": True}}

server, client = serving()


def _greedy(n):
    from jaxserve import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _reference(server, messages, n):
    """The engine's greedy answer on the chat template's rendering of `messages`."""
    def run(llm):
        ids = llm.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return llm.generate({"prompt_token_ids": ids}, _greedy(n), use_tqdm=False)[0]
    return server.reference(run)


def _comparable(response) -> dict:
    """A response without what differs between two runs of one request (ids, clocks, cache hits) and what
    the client's stream helper adds (`parsed`, its ParsedResponse's)."""
    d = response.model_dump(exclude={"id", "created_at", "completed_at"})
    d["usage"]["input_tokens_details"].pop("cached_tokens")   # a second run finds the first's prefix
    for item in d["output"]:
        item.pop("id", None)
        for part in item.get("content", []):
            part.pop("parsed", None)
    return d


def test_greedy_text_is_the_engines_on_the_rendered_prompt(server, client):
    r = client.responses.create(model=server.model, input=PROMPT, max_output_tokens=5, temperature=0,
                                extra_body={"ignore_eos": True})
    expected = _reference(server, [{"role": "user", "content": PROMPT}], 5)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == server.model and r.created_at > 0
    assert r.output_text == expected.outputs[0].text
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [c.type for c in message.content] == ["output_text"]
    # max_output_tokens reached: incomplete, as OpenAI reports it
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert message.status == "incomplete"
    assert r.usage.input_tokens == len(expected.prompt_token_ids) and r.usage.output_tokens == 5
    assert r.usage.total_tokens == r.usage.input_tokens + 5
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.temperature == 0 and r.max_output_tokens == 5 and r.store is True and r.tools == []


def test_instructions_and_message_items_render_as_the_chat(server, client):
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Waves"}, {"type": "input_text", "text": " rise"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "and fall", "annotations": []}]},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": PROMPT},
    ]
    r = client.responses.create(model=server.model, instructions="You are the sea.", input=items,
                                max_output_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    expected = _reference(server, [{"role": "system", "content": "You are the sea."},
                                   {"role": "user", "content": "Waves rise"},
                                   {"role": "assistant", "content": "and fall"},
                                   {"role": "system", "content": "Be brief."},   # developer: the template's system
                                   {"role": "user", "content": PROMPT}], 6)
    assert r.output_text == expected.outputs[0].text
    assert r.usage.input_tokens == len(expected.prompt_token_ids)
    assert r.instructions == "You are the sea."
    # the stored input items: ids (the one given kept), statuses, text parts; newest first by default
    listed = client.responses.input_items.list(r.id)
    assert [(i.type, i.role) for i in listed.data] == [("message", "user"), ("message", "developer"),
                                                       ("message", "assistant"), ("message", "user")]
    assert listed.data[2].id == "msg_1" and all(i.id and i.status == "completed" for i in listed.data)
    assert listed.data[0].content[0].type == "input_text" and listed.data[0].content[0].text == PROMPT
    page = client.responses.input_items.list(r.id, order="asc", limit=2)
    assert [i.id for i in page.data] == [i.id for i in listed.data[::-1][:2]] and page.has_more
    rest = client.responses.input_items.list(r.id, order="asc", after=page.data[-1].id)
    assert [i.id for i in rest.data] == [i.id for i in listed.data[::-1][2:]] and not rest.has_more


def test_json_schema_output_parses_and_validates_streamed_and_not(server, client):
    r = client.responses.create(model=server.model, input=PROMPT, max_output_tokens=60, text=JSON_FORMAT)
    assert r.status == "completed" and r.incomplete_details is None and r.output[0].status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema" and r.text.format.name == "t"
    with client.responses.stream(model=server.model, input=PROMPT, max_output_tokens=60, temperature=0,
                                 text=JSON_FORMAT) as stream:
        final = stream.get_final_response()
    jsonschema.validate(json.loads(final.output_text), SCHEMA)
    obj = client.responses.create(model=server.model, input=PROMPT, max_output_tokens=60,
                                  text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(obj.output_text), dict)


def test_the_parse_helper_reads_a_pydantic_model(server, client):
    from typing import Literal

    from pydantic import BaseModel

    class Tide(BaseModel):
        kind: Literal["tide", "wave"]
        n: int

    r = client.responses.parse(model=server.model, input=PROMPT, max_output_tokens=60, text_format=Tide)
    assert isinstance(r.output_parsed, Tide)


def test_the_event_stream_is_in_order_and_ends_with_the_non_streamed_response(server, client):
    kw = dict(model=server.model, input=PROMPT, max_output_tokens=40, temperature=0, text=JSON_FORMAT)
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    deltas = types.count("response.output_text.delta")
    assert deltas >= 1
    assert types == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * deltas +
                     ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                      "response.completed"])
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-4].text == whole.output_text
    assert final.status == "completed" and final.id == events[0].response.id
    assert _comparable(final) == _comparable(whole)


def test_a_streamed_response_cut_at_max_output_tokens_ends_incomplete(server, client):
    kw = dict(model=server.model, input=PROMPT, max_output_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    assert events[-1].type == "response.incomplete"
    last = events[-1].response
    assert last.status == "incomplete" and last.incomplete_details.reason == "max_output_tokens"
    assert last.usage.output_tokens == 4 and _comparable(last) == _comparable(whole)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text


def test_logprobs_are_included_when_asked(server, client):
    r = client.responses.create(model=server.model, input=PROMPT, max_output_tokens=4, temperature=0,
                                include=["message.output_text.logprobs"], top_logprobs=2,
                                extra_body={"ignore_eos": True})
    lps = r.output[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens == 4
    assert all(len(lp.top_logprobs) == 2 and lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob for lp in lps)
    # greedy: the chosen token is the most likely one
    assert all(lp.logprob == pytest.approx(lp.top_logprobs[0].logprob) for lp in lps)
    plain = client.responses.create(model=server.model, input=PROMPT, max_output_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == r.output_text


def test_stored_responses_are_retrieved_continued_and_deleted(server, client):
    first = client.responses.create(model=server.model, input=PROMPT, max_output_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert client.responses.retrieve(first.id) == first
    second = client.responses.create(model=server.model, input="And then?", previous_response_id=first.id,
                                     instructions="Speak.", max_output_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert second.previous_response_id == first.id
    expected = _reference(server, [{"role": "system", "content": "Speak."}, {"role": "user", "content": PROMPT},
                                   {"role": "assistant", "content": first.output_text},
                                   {"role": "user", "content": "And then?"}], 5)
    assert second.output_text == expected.outputs[0].text
    assert second.usage.input_tokens == len(expected.prompt_token_ids)
    # the earlier instructions are not carried over (OpenAI's rule), the conversation is
    third = client.responses.create(model=server.model, input="Go on.", previous_response_id=second.id,
                                    max_output_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    expected = _reference(server, [{"role": "user", "content": PROMPT},
                                   {"role": "assistant", "content": first.output_text},
                                   {"role": "user", "content": "And then?"},
                                   {"role": "assistant", "content": second.output_text},
                                   {"role": "user", "content": "Go on."}], 3)
    assert third.output_text == expected.outputs[0].text
    with pytest.raises(openai.ConflictError) as e:   # nothing runs in the background to cancel: 409
        client.responses.cancel(first.id)
    assert "background" in e.value.response.json()["error"]["message"]
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=server.model, input="x", previous_response_id=first.id)
    assert e.value.response.json()["error"]["param"] == "previous_response_id"


def test_a_streamed_response_is_stored_and_store_false_is_not(server, client):
    with client.responses.stream(model=server.model, input=PROMPT, max_output_tokens=30, text=JSON_FORMAT) as s:
        final = s.get_final_response()
    assert _comparable(client.responses.retrieve(final.id)) == _comparable(final)
    unstored = client.responses.create(model=server.model, input=PROMPT, max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_client_leaving_mid_stream_aborts_the_response_and_it_is_not_stored(server, client):
    body = {"model": server.model, "input": PROMPT, "max_output_tokens": 64, "ignore_eos": True, "stream": True}
    server.gate.close()
    try:
        with httpx.stream("POST", server.base_url + "/responses", json=body,
                          headers={"Authorization": f"Bearer {server.api_key}"}, timeout=120) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = r.iter_lines()   # kept: a line iterator dropped early closes the connection
            assert next(lines) == "event: response.created"
            created = json.loads(next(lines).removeprefix("data: "))
            assert created["sequence_number"] == 0 and server.stats().scheduler.num_running == 1
        # held mid-generation by the gate: only the disconnect can end it
        wait_until(lambda: server.stats().scheduler.num_running == 0, "the request to be aborted")
        assert blocks_all_free(server.stats())
        wait_until(lambda: server.state.active_streams == 0, "the stream slot to be released")
    finally:
        server.gate.open()
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created["response"]["id"])


# what the Open Responses ResponseResource requires of every Response (its compliance suite's schema)
REQUIRED_FIELDS = {"id", "object", "created_at", "completed_at", "status", "incomplete_details", "model",
                   "previous_response_id", "instructions", "output", "error", "tools", "tool_choice", "truncation",
                   "parallel_tool_calls", "text", "top_p", "presence_penalty", "frequency_penalty", "top_logprobs",
                   "temperature", "reasoning", "usage", "max_output_tokens", "max_tool_calls", "store", "background",
                   "service_tier", "metadata", "safety_identifier", "prompt_cache_key"}


def test_a_response_has_every_field_open_responses_requires_at_its_effective_value(server, client):
    r = client.post("/responses", cast_to=object, body={"model": server.model, "input": PROMPT, "max_output_tokens": 2})
    assert REQUIRED_FIELDS <= r.keys(), REQUIRED_FIELDS - r.keys()
    assert (r["presence_penalty"], r["frequency_penalty"], r["top_logprobs"], r["max_tool_calls"]) == (0, 0, 0, None)
    events = list(client.responses.create(model=server.model, input=PROMPT, max_output_tokens=2, max_tool_calls=3,
                                          include=["message.output_text.logprobs"], top_logprobs=2, stream=True,
                                          extra_body={"presence_penalty": 0.5, "frequency_penalty": -0.25}))
    r = events[-1].response.model_dump(mode="json")     # the streamed answer's last snapshot
    assert REQUIRED_FIELDS <= r.keys(), REQUIRED_FIELDS - r.keys()
    assert (r["presence_penalty"], r["frequency_penalty"], r["top_logprobs"], r["max_tool_calls"]) == (0.5, -0.25, 2, 3)


def test_a_function_tool_is_echoed_with_every_field(server, client):
    """OpenAI's FunctionTool: description, parameters and strict are null when unset (tool_choice none: the tiny
    Llama's template renders no tools, and none renders none)."""
    tools = [{"type": "function", "name": "f"},
             {"type": "function", "name": "g", "description": "G", "parameters": {"type": "object"}, "strict": False}]
    r = client.post("/responses", cast_to=object, body={"model": server.model, "input": PROMPT, "max_output_tokens": 2,
                                                         "tools": tools, "tool_choice": "none"})
    assert r["tools"] == [{"type": "function", "name": "f", "description": None, "parameters": None, "strict": None},
                          tools[1]]


def test_the_penalties_are_the_samplers(server, client):
    from jaxserve import SamplingParams

    items = [{"role": "user", "content": "Say one two one two one two one two"}]
    r = client.responses.create(model=server.model, input=items, max_output_tokens=12, temperature=0,
                                extra_body={"ignore_eos": True, "presence_penalty": 2.0, "frequency_penalty": 1.5})
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, presence_penalty=2.0,
                            frequency_penalty=1.5)

    def run(llm):
        ids = llm.engine.tokenizer.apply_chat_template(items, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    assert r.output_text == server.reference(run).outputs[0].text
    assert (r.presence_penalty, r.frequency_penalty) == (2.0, 1.5)


def test_the_store_keeps_the_most_recent():
    from jaxserve.server.http.responses_store import ResponseStore, StoredResponse
    from jaxserve.server.http.responses_schemas import ResponseObject

    store = ResponseStore(2)
    entries = [StoredResponse(ResponseObject(id=f"resp_{i}", created_at=0, status="completed", model="m", text={}), [], [])
               for i in range(3)]
    store.put(entries[0])
    store.put(entries[1])
    assert store.get("resp_0") is entries[0]    # read: now the most recent
    store.put(entries[2])
    assert store.get("resp_1") is None and store.get("resp_0") is entries[0] and len(store) == 2
    nothing = ResponseStore(0)      # --responses-store-size 0: store=true keeps nothing
    nothing.put(entries[0])
    assert nothing.get("resp_0") is None


def test_the_store_size_is_a_server_setting():
    import argparse

    from jaxserve.server.cli import add_server_parsers, server_config_from_args
    from jaxserve.server.server import ServerConfig

    parser = argparse.ArgumentParser()
    add_server_parsers(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", "m", "--responses-store-size", "7"])
    assert server_config_from_args(args).responses_store_size == 7
    with pytest.raises(ValueError, match="responses_store_size"):
        ServerConfig(responses_store_size=-1)


@pytest.mark.parametrize("extra, param, words", [
    ({"frobnicate": 1}, "frobnicate", "Extra inputs"),
    ({"tools": [{"type": "web_search"}]}, "tools", "not available on this server"),
    # the tiny Llama's template renders no tools (tests/server/test_http_responses_tools.py has one that does)
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools", "does not render tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": "sometimes"}, "tool_choice", "not supported"),
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice", "allowed_tools"),
    ({"background": True}, "background", "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning"),
    ({"truncation": "auto"}, "truncation", "refused, not cut"),
    ({"include": ["file_search_call.results"]}, "include[0]", "not supported"),
    ({"top_logprobs": 2}, "top_logprobs", "include"),
    ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
    ({"text": {"format": {"type": "json_schema", "name": "t", "schema": {"type": "wat"}}}}, "text.format", "wat"),
    ({"text": {"format": {"type": "json_schema", "name": "t"}}}, "text.format.schema", "required"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_tokens"),
    ({"temperature": -1}, "temperature", "temperature"),
    ({"presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]", "only text parts"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, "input[0].arguments",
     "not valid JSON"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]}, "input[0].encrypted_content",
     "Input should be None"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "previous_response_id"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role", "Input should be"),
    ({"input": []}, "input", "empty"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options", "stream=true"),
])
def test_refused_fields_are_400s_naming_the_field(server, client, extra, param, words):
    body = dict({"model": server.model, "input": PROMPT, "max_output_tokens": 2}, **extra)
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/responses", cast_to=object, body=body)
    err = e.value.response.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_a_lone_surrogate_in_an_input_item_is_a_400_naming_it(server):
    body = ('{"model": "%s", "input": [{"role": "user", "content": [{"type": "input_text", "text": "a\\ud800"}]}]}'
            % server.model).encode()
    r = httpx.post(server.base_url + "/responses", content=body, timeout=60,
                   headers={"Authorization": f"Bearer {server.api_key}", "content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "surrogate" in err["message"] and "input[0].content[0].text" in err["message"], err
