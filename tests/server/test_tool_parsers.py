"""The tool-call parsers on text (no model): each format's whole-text parse, and its streamed
deltas, fed in chunks of every size from 1 character, adding up to the whole parse; the
grammar of constrained calls accepts the format's own calls and only those; plan_tools' refusals."""

import json

import pytest

from jaxserve.tool_parsers import (TOOL_PARSERS, FunctionTool, ToolChoice, ToolError, default_tool_parser,
                                   function_tools, plan_tools, template_takes_tools, tool_calls_constraint)
from jaxserve.tool_parsers.hermes import HermesToolParser
from jaxserve.tool_parsers.llama3_json import Llama3JsonToolParser
from jaxserve.tool_parsers.mistral import MistralToolParser

ARGS = {"city": "Par}is \"x\"", "days": [1, {"n": 2}]}
A = json.dumps(ARGS)

# (parser, text, expected content, expected [(name, arguments)])
CASES = [
    (HermesToolParser, f'<tool_call>\n{{"name": "f", "arguments": {A}}}\n</tool_call>', None, [("f", A)]),
    (HermesToolParser, f'Let me check.\n<tool_call>\n{{"name": "f", "arguments": {A}}}\n</tool_call>\n'
                       '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>\n', "Let me check.\n",
     [("f", A), ("g", "{}")]),
    (HermesToolParser, '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call> done', "done",
     [("f", '{"x": 1}')]),
    (HermesToolParser, "no calls < here <tool", "no calls < here <tool", []),
    (HermesToolParser, "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    (HermesToolParser, '<tool_call>{"name": "f", "argu', None, [("f", "")]),            # cut by max_tokens
    (HermesToolParser, '<tool_call>{"na', '<tool_call>{"na', []),
    (MistralToolParser, '[TOOL_CALLS][{"name": "f", "arguments": {"x": ', None, [("f", '{"x": ')]),
    (Llama3JsonToolParser, f'{{"name": "f", "parameters": {A}}}', None, [("f", A)]),
    (Llama3JsonToolParser, f'<|python_tag|>{{"name": "f", "parameters": {A}}}; {{"name": "g", "parameters": {{}}}}',
     None, [("f", A), ("g", "{}")]),
    (Llama3JsonToolParser, ' {"name": "f", "arguments": "{\\"x\\": 1}"}', None, [("f", '{"x": 1}')]),
    (Llama3JsonToolParser, 'The answer is {"name": "f"}', 'The answer is {"name": "f"}', []),
    (Llama3JsonToolParser, '{"city": "Paris"}', '{"city": "Paris"}', []),
    (MistralToolParser, f'[TOOL_CALLS][{{"name": "f", "arguments": {A}}}, {{"name": "g", "arguments": {{}}}}]</s>',
     None, [("f", A), ("g", "{}")]),
    (MistralToolParser, f'Sure [TOOL_CALLS]f[ARGS]{A}[TOOL_CALLS]g[ARGS]{{}}</s>', "Sure ", [("f", A), ("g", "{}")]),
    (MistralToolParser, "just text [TOOL</s>", "just text [TOOL", []),
]


def _streamed(cls, text, size):
    p = cls()
    deltas = [p.feed(text[i:i + size]) for i in range(0, len(text), size)] + [p.finish()]
    content = "".join(d.content for d in deltas)
    calls: dict[int, list] = {}
    for d in deltas:
        for c in d.tool_calls:
            if c.id is not None:                 # a header: first, with the name and no arguments
                assert c.index not in calls and c.name and c.arguments == ""
                calls[c.index] = [c.id, c.name, ""]
            else:
                assert c.name is None
                calls[c.index][2] += c.arguments
    return content, [calls[i] for i in sorted(calls)], p.called


@pytest.mark.parametrize("cls, text, content, calls", CASES)
def test_a_whole_answer_parses_into_content_and_calls(cls, text, content, calls):
    got = cls().parse(text)
    assert got.content == content
    assert [(c.name, c.arguments) for c in got.tool_calls] == calls
    for c in got.tool_calls:
        assert c.id.startswith("call_") if cls is not MistralToolParser else (len(c.id) == 9 and c.id.isalnum())
    assert len({c.id for c in got.tool_calls}) == len(calls)


@pytest.mark.parametrize("cls, text, content, calls", CASES)
@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streamed_deltas_add_up_to_the_whole_parse(cls, text, content, calls, size):
    got_content, got_calls, called = _streamed(cls, text, size)
    assert got_content == (content or "")
    assert [(name, args) for _, name, args in got_calls] == calls
    assert called == bool(calls)


def test_content_before_a_call_streams_before_the_call_is_complete():
    p = HermesToolParser()
    assert p.feed("Hello <tool").content == "Hello "          # the tag's beginning is held back
    d = p.feed('_call>\n{"name": "f", "arguments": {"x"')
    assert d.content == "" and [(c.index, c.name, c.arguments) for c in d.tool_calls] == [
        (0, "f", ""), (0, None, '{"x"')]
    d = p.feed(': 1}}\n</tool_call>')
    assert [c.arguments for c in d.tool_calls] == [": 1}"]


SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
TOOLS = [FunctionTool("get_weather", "the weather", SCHEMA), FunctionTool("noop")]
GOOD = {"hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>\n'
                   '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'),
        "llama3_json": '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 3}}; {"name": "noop", "parameters": {}}',
        "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}, '
                    '{"name": "noop", "arguments": {}}]')}


@pytest.fixture(scope="module")
def ll_tokenizer():
    import llguidance.hf

    from jaxserve.testing.tiny_models import make_tokenizer
    tok = make_tokenizer(320)
    return tok, llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=tok.eos_token_id)


def _accepts(ll_tokenizer, grammar, text) -> bool:
    from llguidance import LLMatcher

    tok, ll = ll_tokenizer
    assert LLMatcher.validate_grammar(grammar, ll) == ""
    m = LLMatcher(ll, grammar, log_level=0)
    return m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.is_accepting()


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_the_constraint_accepts_the_formats_calls_and_refuses_bad_arguments(ll_tokenizer, name):
    cls = TOOL_PARSERS[name]
    parallel = tool_calls_constraint(cls, TOOLS, parallel=True).to_grammar()
    single = tool_calls_constraint(cls, TOOLS, parallel=False).to_grammar()
    text = GOOD[name]
    assert _accepts(ll_tokenizer, parallel, text)
    assert [c.name for c in cls().parse(text).tool_calls] == ["get_weather", "noop"]
    assert not _accepts(ll_tokenizer, single, text)                        # two calls
    assert not _accepts(ll_tokenizer, parallel, text.replace("Oslo", "Rome"))   # not in the enum
    assert not _accepts(ll_tokenizer, parallel, text.replace("noop", "nope"))   # not a tool


class _Tok:
    def __init__(self, template):
        self.chat_template = template
        self.added_tokens_decoder = {}


TOOL_TEMPLATE = "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_plan_tools_per_tool_choice():
    tok = _Tok(TOOL_TEMPLATE)
    auto = plan_tools(TOOLS, ToolChoice("auto"), parser="hermes", tokenizer=tok)
    assert auto.structured_outputs is None and auto.parser is HermesToolParser
    assert [t["function"]["name"] for t in auto.template_kwargs["tools"]] == ["get_weather", "noop"]
    required = plan_tools(TOOLS, ToolChoice("required"), parser="hermes", tokenizer=tok)
    assert required.structured_outputs.grammar.startswith("start: call (")
    named = plan_tools(TOOLS, ToolChoice("function", "noop"), parser="hermes", tokenizer=tok)
    assert '"noop"' in named.structured_outputs.grammar and "get_weather" not in named.structured_outputs.grammar
    none = plan_tools(TOOLS, ToolChoice("none"), parser="hermes", tokenizer=tok)
    assert none.template_kwargs == {} and none.parser is None and none.structured_outputs is None


@pytest.mark.parametrize("tools, choice, template, parser, param", [
    ([], ToolChoice("required"), TOOL_TEMPLATE, "hermes", "tool_choice"),
    (TOOLS, ToolChoice("function", "absent"), TOOL_TEMPLATE, "hermes", "tool_choice"),
    (TOOLS, ToolChoice("auto"), "{% for m in messages %}{{ m['content'] }}{% endfor %}", "hermes", "tools"),
    (TOOLS, ToolChoice("auto"), TOOL_TEMPLATE, None, "tools"),
])
def test_plan_tools_refusals_name_the_field(tools, choice, template, parser, param):
    with pytest.raises(ToolError) as e:
        plan_tools(tools, choice, parser=parser, tokenizer=_Tok(template))
    assert e.value.param == param


def test_openai_shapes_are_checked():
    assert function_tools([{"type": "function", "function": {"name": "f"}}]) == [FunctionTool("f")]
    for bad in ([{"type": "retrieval"}], [{"type": "function", "function": {"name": "a b"}}],
                [{"type": "function", "function": {"name": "f", "parameters": []}}],
                [{"type": "function", "function": {"name": "f", "parameters": {"type": 12}}}],
                [{"type": "function", "function": {"name": "f", "parameters": {
                    "type": "object", "properties": {"x": {"type": "integer", "minimum": "zero"}}}}}],
                [{"type": "function", "function": {"name": "f"}}] * 2):
        with pytest.raises(ToolError):
            function_tools(bad)
    assert ToolChoice.from_openai({"type": "function", "function": {"name": "f"}}) == ToolChoice("function", "f")
    assert ToolChoice.from_openai({"type": "function", "name": "f"}) == ToolChoice("function", "f")
    with pytest.raises(ToolError):
        ToolChoice.from_openai("sometimes")


def test_defaults_from_the_template_then_the_architecture():
    assert default_tool_parser("llama", "... <tool_call> ...") == "hermes"
    assert default_tool_parser("qwen3", None) == "hermes"
    assert default_tool_parser("mistral", "") == "mistral"
    assert default_tool_parser("gemma2", "plain") is None
    assert template_takes_tools(TOOL_TEMPLATE) and not template_takes_tools("{{ messages }}")


class _Added:
    def __init__(self, content, special):
        self.content, self.special = content, special


@pytest.mark.parametrize("parser, added, token_refs, skip", [
    ("mistral", {7: _Added("[TOOL_CALLS]", True)}, ["<[7]>"], False),          # special: kept in the text
    ("hermes", {5: _Added("<tool_call>", False), 6: _Added("</tool_call>", False)}, ["<[5]>", "<[6]>"], None),
    ("hermes", {}, [], None),                                                  # no such tokens: the text
])
def test_markers_the_vocabulary_holds_are_written_as_tokens(parser, added, token_refs, skip):
    tok = _Tok(TOOL_TEMPLATE)
    tok.added_tokens_decoder = added
    plan = plan_tools(TOOLS, ToolChoice("required"), parser=parser, tokenizer=tok)
    assert plan.skip_special_tokens is skip
    assert all(ref in plan.structured_outputs.grammar for ref in token_refs)
    if not token_refs:
        assert '"<tool_call>"' in plan.structured_outputs.grammar
