"""A chat answer's text -> its reasoning, content and tool calls, whole or as deltas.

The reasoning parser (if any) goes first: calls are looked for only in what follows the
reasoning, so a call written while thinking is not a call. Shared by the HTTP chat route, the
Responses API and LLM.chat:

    spec = ChatOutputSpec(tool_plan.parser, reasoning_parser_cls)
    out = spec.new(starts_in_reasoning).parse(text)             # ChatMessageOut
    p = spec.new(starts_in_reasoning); p.feed(delta) ...; p.finish()   # ChatDelta each
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.reasoning_parsers.base import ReasoningParser
from jaxserve.tool_parsers.base import StreamDelta, ToolCall, ToolCallDelta, ToolParser


@dataclass(frozen=True, slots=True)
class ChatMessageOut:
    """content None: the answer is only calls; "" when it ended inside the reasoning."""
    content: str | None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChatOutputParser:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self.reasoning = reasoning
        self.tools = tools

    @property
    def called(self) -> bool:
        """Whether a tool call has been streamed (finish_reason then becomes "tool_calls")."""
        return self.tools is not None and self.tools.called

    def parse(self, text: str) -> ChatMessageOut:
        reasoning, content = None, text
        if self.reasoning is not None:
            split = self.reasoning.parse(text)
            reasoning, content = split.reasoning, split.content
        if self.tools is None:
            return ChatMessageOut(content, reasoning)
        parsed = self.tools.parse(content)
        return ChatMessageOut(parsed.content, reasoning, parsed.tool_calls)

    def feed(self, delta: str) -> ChatDelta:
        if self.reasoning is None:
            return self._with(ChatDelta(), self._tools(delta, final=False))
        r = self.reasoning.feed(delta)
        return self._with(ChatDelta(reasoning=r.reasoning), self._tools(r.content, final=False))

    def finish(self) -> ChatDelta:
        if self.reasoning is None:
            return self._with(ChatDelta(), self._tools("", final=True))
        r = self.reasoning.finish()
        return self._with(ChatDelta(reasoning=r.reasoning), self._tools(r.content, final=True))

    def _tools(self, content: str, *, final: bool) -> StreamDelta:
        if self.tools is None:
            return StreamDelta(content)
        got = self.tools.feed(content) if content else StreamDelta()
        if final:
            end = self.tools.finish()
            got = StreamDelta(got.content + end.content, got.tool_calls + end.tool_calls)
        return got

    @staticmethod
    def _with(d: ChatDelta, s: StreamDelta) -> ChatDelta:
        return ChatDelta(d.reasoning, s.content, s.tool_calls)


@dataclass(frozen=True, slots=True)
class ChatOutputSpec:
    """Which parsers a request's answers go through (None: that part is not parsed)."""
    tool_parser: type[ToolParser] | None = None
    reasoning_parser: type[ReasoningParser] | None = None

    @property
    def active(self) -> bool:
        return self.tool_parser is not None or self.reasoning_parser is not None

    def new(self, starts_in_reasoning: bool = False) -> ChatOutputParser:
        return ChatOutputParser(
            self.reasoning_parser(starts_in_reasoning) if self.reasoning_parser is not None else None,
            self.tool_parser() if self.tool_parser is not None else None)

    def opens_reasoning(self, prompt_tail: str) -> bool:
        """Whether a prompt ending with this text leaves the reasoning open."""
        return self.reasoning_parser is not None and self.reasoning_parser.prompt_opens_reasoning(prompt_tail)

    def prompt_opens_reasoning(self, tokenizer, prompt_ids: list[int]) -> bool:
        """Whether this prompt leaves the reasoning open (a thinking template's generation
        prompt ends with the opening tag): read from its last few tokens, enough for a tag and
        the newlines around it."""
        if self.reasoning_parser is None:
            return False
        return self.opens_reasoning(tokenizer.decode(list(prompt_ids[-PROMPT_TAIL_TOKENS:])))


PROMPT_TAIL_TOKENS = 8


def chat_finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" for an answer that ended (not cut) with calls."""
    return "tool_calls" if called and reason == "stop" else reason
