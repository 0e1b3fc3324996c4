"""Reasoning on /v1/chat/completions (--reasoning-parser qwen3) through the openai client, on the
tiny Qwen3 whose template opens `<think>` in the generation prompt (tests/server/tiny_chat_model.py).
The random model never closes its reasoning by itself: unforced, an answer is reasoning cut by
max_tokens; the split into reasoning and content is checked on answers the model was forced to
write by a grammar (reasoning, `</think>`, an answer), streamed and not."""

import json

import pytest

from tests.server.http_harness import HTTPServer, serving

MESSAGES = [{"role": "user", "content": "Why are there tides?"}]
TOOLS = [{"type": "function", "function": {"name": "moon", "parameters": {
    "type": "object", "properties": {"phase": {"enum": ["new", "full"]}}, "required": ["phase"]}}}]


server, client = serving("tiny_chat_llm", reasoning_parser="qwen3", tool_call_parser="hermes")


@pytest.fixture(scope="module")
def plain(tiny_chat_llm):
    """The same model without a reasoning parser: the raw text of the same request."""
    s = HTTPServer(tiny_chat_llm)
    yield s
    s.close()


def _forcing(tiny_chat_llm, *parts) -> dict:
    """A grammar of literal parts; a part naming a tag of the vocabulary is that token."""
    tok = tiny_chat_llm.get_tokenizer()
    tags = {"<think>", "</think>", "<tool_call>", "</tool_call>"}
    items = [f"<[{tok.convert_tokens_to_ids(p)}]>" if p in tags else json.dumps(p) for p in parts]
    return {"structured_outputs": {"grammar": "start: " + " ".join(items)}}


def _streamed(chunks):
    reasoning, reasoning_content, content, finish, calls = "", "", "", None, {}
    for ch in chunks:
        if not ch.choices:
            continue
        c = ch.choices[0]
        d = c.delta
        reasoning += getattr(d, "reasoning", None) or ""
        reasoning_content += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
        for tc in d.tool_calls or ():
            calls.setdefault(tc.index, ["", ""])
            calls[tc.index][0] += tc.function.name or ""
            calls[tc.index][1] += tc.function.arguments or ""
        finish = c.finish_reason or finish
    assert reasoning == reasoning_content     # the two names carry the same text
    return reasoning, content, finish, calls


def test_an_answer_cut_inside_the_reasoning_is_all_reasoning(server, client, plain):
    kw = dict(messages=MESSAGES, max_tokens=12, temperature=0.0)
    with plain.client() as p:
        raw = p.chat.completions.create(model=plain.model, **kw).choices[0].message.content
    assert raw and "</think>" not in raw
    r = client.chat.completions.create(model=server.model, **kw)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "length"
    assert m.content == "" and m.reasoning == m.reasoning_content == raw
    reasoning, content, finish, _ = _streamed(client.chat.completions.create(model=server.model, stream=True, **kw))
    assert (reasoning, content, finish) == (raw, "", "length")


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_then_an_answer_split_apart(server, client, tiny_chat_llm, stream):
    forced = _forcing(tiny_chat_llm, "the moon pulls", "</think>", "\n\nThe moon.")
    kw = dict(model=server.model, messages=MESSAGES, max_tokens=60, extra_body=forced)
    if stream:
        reasoning, content, finish, _ = _streamed(client.chat.completions.create(stream=True, **kw))
    else:
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        assert m.reasoning == m.reasoning_content
        reasoning, content, finish = m.reasoning, m.content, r.choices[0].finish_reason
    assert (reasoning, content, finish) == ("the moon pulls", "The moon.", "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_inside_the_reasoning_is_not_a_call(server, client, tiny_chat_llm, stream):
    thought = '<tool_call>\n{"name": "moon", "arguments": {"phase": "new"}}\n</tool_call>'
    forced = _forcing(tiny_chat_llm, "maybe ", "<tool_call>", '\n{"name": "moon", "arguments": {"phase": "new"}}\n',
                      "</tool_call>", "</think>", "\n\n", "<tool_call>",
                      '\n{"name": "moon", "arguments": {"phase": "full"}}\n', "</tool_call>")
    kw = dict(model=server.model, messages=MESSAGES, tools=TOOLS, max_tokens=200, extra_body=forced)
    if stream:
        reasoning, content, finish, calls = _streamed(client.chat.completions.create(stream=True, **kw))
        calls = [tuple(c) for c in calls.values()]
    else:
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        reasoning, content, finish = m.reasoning, m.content or "", r.choices[0].finish_reason
        calls = [(c.function.name, c.function.arguments) for c in m.tool_calls]
    assert reasoning == "maybe " + thought and content == "" and finish == "tool_calls"
    assert calls == [("moon", '{"phase": "full"}')]


def test_reasoning_in_the_history_is_rendered_under_either_name(server, client, tiny_chat_llm):
    def prompt_tokens(extra):
        history = MESSAGES + [dict({"role": "assistant", "content": "The moon."}, **extra),
                              {"role": "user", "content": "More?"}]
        return client.chat.completions.create(model=server.model, messages=history, max_tokens=1).usage.prompt_tokens
    bare = prompt_tokens({})
    by_old_name = prompt_tokens({"reasoning_content": "it pulls the sea"})
    assert prompt_tokens({"reasoning": "it pulls the sea"}) == by_old_name > bare
    tok = tiny_chat_llm.get_tokenizer()
    rendered = tok.apply_chat_template(MESSAGES + [
        {"role": "assistant", "content": "The moon.", "reasoning_content": "it pulls the sea"},
        {"role": "user", "content": "More?"}], add_generation_prompt=True, tokenize=False)
    assert "<think>it pulls the sea</think>" in rendered
    assert by_old_name == len(tok.encode(rendered, add_special_tokens=False))
