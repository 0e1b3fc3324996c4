"""Tool calling on /v1/chat/completions through the openai client, on the tiny Qwen3 whose
template renders tools (tests/server/tiny_chat_model.py). The random model never calls a tool by
itself, so: `required` and a named function are the model's own constrained output (every call's
arguments validated with jsonschema, greedy and at temperature 1, streamed and not, one call or
parallel ones, with each parser's syntax); `auto` and `none` are checked on output the model was
forced to write by a grammar (the text of a call), which the route then parses, or not."""

import json

import httpx2 as httpx
import jsonschema
import openai
import pytest

from jaxserve import SamplingParams
from tests.server.http_harness import HTTPServer

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]
FORCED_ARGS = '{"city": "Oslo", "days": 2}'
FORCED_CALL = f'<tool_call>\n{{"name": "get_weather", "arguments": {FORCED_ARGS}}}\n</tool_call>'


def _forcing(tiny_chat_llm, before: str = "") -> dict:
    """A grammar that makes the model write `before` then FORCED_CALL, the tags as the tokens they
    are in this vocabulary (as a real Qwen writes them; llguidance matches an added token by id)."""
    tok = tiny_chat_llm.get_tokenizer()
    open_id, close_id = tok.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    body = json.dumps('\n{"name": "get_weather", "arguments": ' + FORCED_ARGS + '}\n')
    return {"structured_outputs": {"grammar": f"start: {json.dumps(before)} <[{open_id}]> {body} <[{close_id}]>"}}


@pytest.fixture(scope="module")
def servers(tiny_chat_llm):
    """One server per parser, on the one compiled tiny Qwen3 (the parser only changes the syntax
    the grammar writes and the route reads)."""
    made: dict[str, HTTPServer] = {}

    def get(parser: str = "hermes") -> HTTPServer:
        if parser not in made:
            made[parser] = HTTPServer(tiny_chat_llm, tool_call_parser=parser)
        return made[parser]
    yield get
    for s in made.values():
        s.close()


@pytest.fixture(scope="module")
def server(servers):
    return servers("hermes")


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


def _check_calls(calls, *, names=SCHEMAS):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id
        assert c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def _streamed(chunks):
    """content, {index: [id, name, arguments]}, finish_reason of choice 0; each call's first
    delta must carry id, type and name with arguments "", the later ones fragments only."""
    content, calls, finish = "", {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        c = ch.choices[0]
        content += c.delta.content or ""
        for tc in c.delta.tool_calls or ():
            if tc.index not in calls:
                assert tc.id and tc.type == "function" and tc.function.name and tc.function.arguments == ""
                calls[tc.index] = [tc.id, tc.function.name, ""]
            else:
                assert tc.id is None and tc.function.name is None
                calls[tc.index][2] += tc.function.arguments
        finish = c.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_without_parallel_calls_is_one_valid_call(server, client, temperature):
    r = client.chat.completions.create(model=server.model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=300, n=2, seed=3,
                                       temperature=temperature)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        _check_calls(choice.message.tool_calls)
        assert choice.message.tool_calls[0].id.startswith("call_")


def test_required_parallel_calls_at_temperature_1_validate(server, client):
    r = client.chat.completions.create(model=server.model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       max_tokens=300, n=2, seed=3, temperature=1.0)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        _check_calls(choice.message.tool_calls)


def test_greedy_parallel_calls_go_on_until_max_tokens_each_complete_one_valid(server, client):
    # this random model, greedy, keeps choosing another call over stopping: the answer is cut
    # inside a call, and every call before it is whole and valid; streamed, the same calls
    kw = dict(model=server.model, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=300,
              temperature=0.0)
    r = client.chat.completions.create(**kw)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "length" and len(calls) >= 3
    _check_calls(calls[:-1])
    assert len({c.id for c in calls}) == len(calls)
    content, streamed, finish = _streamed(client.chat.completions.create(stream=True, **kw))
    assert finish == "length" and content == (r.choices[0].message.content or "")   # a call cut before its name
    assert [(n, a) for _, n, a in streamed.values()] == [(c.function.name, c.function.arguments) for c in calls]


@pytest.mark.parametrize("temperature, parallel", [(0.0, False), (1.0, True)])
def test_required_calls_streamed_in_openais_delta_shape(server, client, temperature, parallel):
    kw = dict(model=server.model, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=300, seed=3,
              temperature=temperature, parallel_tool_calls=parallel)
    content, calls, finish = _streamed(client.chat.completions.create(stream=True, **kw))
    assert finish == "tool_calls" and content == ""
    for _, name, args in calls.values():
        jsonschema.validate(json.loads(args), SCHEMAS[name])
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls   # the same seed: the same calls
    assert [(c.function.name, c.function.arguments) for c in whole] == [(n, a) for _, n, a in calls.values()]


def test_a_named_function_is_the_one_called(server, client):
    for temperature in (0.0, 1.0):
        r = client.chat.completions.create(
            model=server.model, messages=MESSAGES, tools=TOOLS, max_tokens=200, seed=1, temperature=temperature,
            tool_choice={"type": "function", "function": {"name": "get_time"}})
        calls = r.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "get_time" and r.choices[0].finish_reason == "tool_calls"
        _check_calls(calls, names={"get_time"})


@pytest.mark.parametrize("parser", ["llama3_json", "mistral"])
def test_required_calls_in_each_parsers_syntax(servers, parser):
    s = servers(parser)
    with s.client() as c:
        r = c.chat.completions.create(model=s.model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                      max_tokens=300, seed=2, temperature=1.0, parallel_tool_calls=False)
        _check_calls(r.choices[0].message.tool_calls)
        assert r.choices[0].finish_reason == "tool_calls"
        _, calls, finish = _streamed(c.chat.completions.create(
            model=s.model, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=300, seed=2,
            temperature=1.0, parallel_tool_calls=False, stream=True))
        assert finish == "tool_calls"
        assert [(n, a) for _, n, a in calls.values()] == [
            (t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls]


def test_auto_parses_a_call_the_model_was_forced_to_write_by_a_grammar(server, client, tiny_chat_llm):
    kw = dict(model=server.model, messages=MESSAGES, tools=TOOLS, max_tokens=200,
              extra_body=_forcing(tiny_chat_llm, "Let me look. "))
    r = client.chat.completions.create(tool_choice="auto", **kw)
    m = r.choices[0].message
    assert m.content == "Let me look. " and r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [
        ("get_weather", {"city": "Oslo", "days": 2})]
    content, calls, finish = _streamed(client.chat.completions.create(stream=True, **kw))   # auto by default
    assert content == "Let me look. " and finish == "tool_calls"
    assert [(n, json.loads(a)) for _, n, a in calls.values()] == [("get_weather", {"city": "Oslo", "days": 2})]


def test_none_renders_no_tools_and_parses_no_calls(server, client, tiny_chat_llm):
    r = client.chat.completions.create(model=server.model, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                       max_tokens=200, extra_body=_forcing(tiny_chat_llm))
    assert r.choices[0].message.content == FORCED_CALL and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    bare = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=1)
    with_tools = client.chat.completions.create(model=server.model, messages=MESSAGES, tools=TOOLS, max_tokens=1)
    assert r.usage.prompt_tokens == bare.usage.prompt_tokens < with_tools.usage.prompt_tokens


def test_a_multi_turn_exchange_renders_the_calls_and_results_back(server, client, tiny_chat_llm):
    first = client.chat.completions.create(model=server.model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=200, seed=0)
    call = first.choices[0].message.tool_calls[0]
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"}]
    # one call, as in the first turn: with parallel calls allowed the random model may keep calling
    # until max_tokens cuts its last call short, its arguments ending where it was cut (the likely
    # cause of empty arguments seen once in a full run, where earlier tests' prefix-cache state
    # moves the logits a little; probing seeds here, one of six already made two calls)
    second = client.chat.completions.create(model=server.model, messages=history, tools=TOOLS,
                                            tool_choice="required", parallel_tool_calls=False, max_tokens=200,
                                            seed=0)
    _check_calls(second.choices[0].message.tool_calls)
    # the prompt is the template's rendering of the whole exchange, the call's arguments as an object
    tok = tiny_chat_llm.get_tokenizer()
    rendered = tok.apply_chat_template(
        MESSAGES + [{"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"}],
        tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert call.id in rendered and "sunny, 21C" in rendered and call.function.arguments in rendered
    assert second.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))


def test_llm_chat_takes_tools(tiny_chat_llm):
    out = tiny_chat_llm.chat(MESSAGES, SamplingParams(max_tokens=200, seed=4, temperature=1.0), use_tqdm=False,
                             tools=TOOLS, tool_choice="required", tool_call_parser="hermes")
    m = out[0].outputs[0].message
    assert m.content is None and m.tool_calls
    for c in m.tool_calls:
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
    plain = tiny_chat_llm.chat(MESSAGES, SamplingParams(max_tokens=4), use_tqdm=False)
    assert plain[0].outputs[0].message is None


@pytest.mark.parametrize("body, param", [
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "absent"}}), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}],
          tool_choice="required"), "tools"),
    # under every tool_choice, auto (the default) and none included: the schema is checked at the door
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 12}}}]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 12}}}],
          tool_choice="none"), "tools"),
    (dict(messages=MESSAGES + [{"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]),
     "messages[1].tool_calls[0]"),
])
def test_bad_tool_requests_are_400s_naming_the_field(server, client, body, param):
    body = dict(dict(model=server.model, messages=MESSAGES, max_tokens=4), **body)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**body)
    assert e.value.response.json()["error"]["param"] == param


def test_a_template_without_tools_is_a_400(tiny_llm):
    s = HTTPServer(tiny_llm, tool_call_parser="hermes")
    try:
        with s.client() as c, pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=s.model, messages=MESSAGES, tools=TOOLS, max_tokens=4)
        err = e.value.response.json()["error"]
        assert err["param"] == "tools" and "does not render tools" in err["message"]
        assert "--chat-template" in err["message"]      # what the operator can do about it
    finally:
        s.close()


def test_tokenize_counts_a_chat_with_tools_as_the_chat_renders_it(server, client):
    """/tokenize takes tools (vLLM's field): a chat's prompt can be counted before it is sent."""
    root = server.base_url.removesuffix("/v1")
    headers = {"Authorization": f"Bearer {server.api_key}"}
    counted = httpx.post(root + "/tokenize", json={"model": server.model, "messages": MESSAGES, "tools": TOOLS},
                         headers=headers, timeout=60)
    assert counted.status_code == 200, counted.text
    without = httpx.post(root + "/tokenize", json={"model": server.model, "messages": MESSAGES},
                         headers=headers, timeout=60).json()["count"]
    sent = client.chat.completions.create(model=server.model, messages=MESSAGES, tools=TOOLS, max_tokens=1)
    assert counted.json()["count"] == sent.usage.prompt_tokens > without
    for body, param in (({"prompt": "hi", "tools": TOOLS}, "tools"),
                        ({"messages": MESSAGES, "tools": [{"type": "function", "function": {
                            "name": "f", "parameters": {"type": 12}}}]}, "tools")):
        r = httpx.post(root + "/tokenize", json={"model": server.model, **body}, headers=headers, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
