"""The qwen3 reasoning parser on text (no model): whole answers, streamed in chunks of every size
(a tag split across chunks included) adding up to the whole split; and the chat output parser,
where a call written inside the reasoning is not a call."""

import pytest

from jaxserve.chat_output import ChatOutputSpec, chat_finish_reason
from jaxserve.reasoning_parsers import reasoning_parser
from jaxserve.reasoning_parsers.qwen3 import Qwen3ReasoningParser
from jaxserve.tool_parsers.hermes import HermesToolParser

CASES = [   # (starts_in_reasoning, text, reasoning, content)
    (False, "<think>\nhmm, tides</think>\n\nThe moon.", "\nhmm, tides", "The moon."),
    (False, "  <think>a < b </thi</think>x", "a < b </thi", "x"),
    (False, "No thinking here.", None, "No thinking here."),
    (False, "<thinking is not a tag", None, "<thinking is not a tag"),
    (False, "<think>cut by max_tokens", "cut by max_tokens", ""),
    (True, "already thinking</think>answer", "already thinking", "answer"),
    (True, "cut inside </thi", "cut inside </thi", ""),
    (True, "", "", ""),
]


@pytest.mark.parametrize("starts, text, reasoning, content", CASES)
def test_a_whole_answer_splits(starts, text, reasoning, content):
    got = Qwen3ReasoningParser(starts).parse(text)
    assert (got.reasoning, got.content) == (reasoning, content)


@pytest.mark.parametrize("starts, text, reasoning, content", CASES)
@pytest.mark.parametrize("size", [1, 2, 3, 5, 1000])
def test_streamed_deltas_add_up_to_the_whole_split(starts, text, reasoning, content, size):
    p = Qwen3ReasoningParser(starts)
    deltas = [p.feed(text[i:i + size]) for i in range(0, len(text), size)] + [p.finish()]
    assert "".join(d.reasoning for d in deltas) == (reasoning or "")
    assert "".join(d.content for d in deltas) == content


def test_a_closing_tag_split_across_chunks_is_not_streamed_as_reasoning():
    p = Qwen3ReasoningParser(True)
    assert p.feed("abc </th").reasoning == "abc "
    d = p.feed("ink>\n\nok")
    assert (d.reasoning, d.content) == ("", "ok")


def test_the_prompt_tail_says_whether_reasoning_is_open():
    assert Qwen3ReasoningParser.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not Qwen3ReasoningParser.prompt_opens_reasoning("assistant\n<think>\n\n</think>\n\n")
    assert not Qwen3ReasoningParser.prompt_opens_reasoning("assistant\n")
    assert reasoning_parser("qwen3") is Qwen3ReasoningParser
    with pytest.raises(ValueError):
        reasoning_parser("nope")


CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_a_call_inside_the_reasoning_is_not_a_call(size):
    spec = ChatOutputSpec(HermesToolParser, Qwen3ReasoningParser)
    text = f"<think>maybe {CALL}?</think>\n\nDone. {CALL}"
    whole = spec.new().parse(text)
    assert whole.reasoning == f"maybe {CALL}?" and whole.content == "Done. "
    assert [(c.name, c.arguments) for c in whole.tool_calls] == [("f", '{"x": 1}')]
    p = spec.new()
    deltas = [p.feed(text[i:i + size]) for i in range(0, len(text), size)] + [p.finish()]
    assert "".join(d.reasoning for d in deltas) == whole.reasoning
    assert "".join(d.content for d in deltas) == whole.content
    calls = [c for d in deltas for c in d.tool_calls]
    assert [c.name for c in calls if c.name] == ["f"] and "".join(c.arguments for c in calls) == '{"x": 1}'
    assert chat_finish_reason("stop", p.called) == "tool_calls"
    assert chat_finish_reason("length", p.called) == "length"


def test_only_reasoning_cut_by_length_has_empty_content():
    out = ChatOutputSpec(HermesToolParser, Qwen3ReasoningParser).new(True).parse("thinking about " + CALL)
    assert out.content == "" and out.tool_calls == [] and out.reasoning == "thinking about " + CALL
