"""The one interface every tool-call format implements, and the streaming built on it.

A format says, for a text (the answer so far, or the whole answer), which part is settled content
and which calls it holds (`ToolParser.scan`). Everything else is shared: the whole-text parse,
and the incremental one that turns successive scans into OpenAI's deltas (content as it settles,
a call's header once its name is complete, then its arguments' JSON text as it grows). A scan
must be prefix-stable: what it reports of a text is extended, never changed, by more text.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from jaxserve.tool_parsers.json_scan import ObjectScan


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One complete call: `arguments` is the JSON text of the arguments object (OpenAI's shape)."""
    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ParsedToolCalls:
    """A whole answer split: `content` is the text outside the calls, None when the answer is
    only calls (OpenAI's null content)."""
    content: str | None
    tool_calls: list[ToolCall]


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A streamed piece of call `index`: its header (id and name, arguments "") or a fragment
    of its arguments (id and name None)."""
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class StreamDelta:
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


@dataclass(slots=True)
class PartialCall:
    """A call as far as it has arrived: name None until complete; `arguments` the JSON text so
    far; `complete` once the call's text has ended."""
    name: str | None
    arguments: str
    complete: bool


@dataclass(slots=True)
class Scan:
    content: str
    calls: list[PartialCall] = field(default_factory=list)


class ToolParser(ABC):
    """One per answer (a choice): parse() a whole text, or feed() deltas and finish()."""

    name: ClassVar[str]
    # the key of a call's arguments in the format's JSON (what the grammar writes)
    arguments_key: ClassVar[str] = "arguments"
    # the fixed strings of the call syntax that a tokenizer may hold as single tokens: the grammar
    # then writes those tokens (llguidance matches an added token only by its id), and where they
    # are special tokens they must stay in the text (skip_special_tokens off)
    markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self._text = ""
        self._sent_content = 0
        self._sent_args: list[int] = []     # per call whose header went out: argument chars sent
        self._ids: list[str] = []

    # -- what a format defines ------------------------------------------------------------------
    @abstractmethod
    def scan(self, text: str, final: bool) -> Scan:
        """The settled content and the calls of `text`; `final`: no more text comes (an
        unfinished call is then content, and nothing is held back)."""

    @classmethod
    @abstractmethod
    def calls_lark(cls, body: str, parallel: bool, marker_tokens: dict[str, int]) -> str:
        """A Lark grammar (llguidance's dialect) of the format's calls, one or several; `body`
        is the rule of one call's JSON object; marker_tokens: the markers the tokenizer holds as
        single tokens, with their ids (written `<[id]>`; `lark_marker` does it)."""

    @classmethod
    def new_call_id(cls) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    # -- shared -----------------------------------------------------------------------------------
    def parse(self, text: str) -> ParsedToolCalls:
        scan = self.scan(text, final=True)
        # a call cut short (max_tokens) counts once its name is complete, as it was streamed
        calls = [ToolCall(self._id(i), c.name, c.arguments)
                 for i, c in enumerate(c for c in scan.calls if c.name is not None)]
        content = scan.content
        return ParsedToolCalls(None if calls and not content.strip() else content, calls)

    def feed(self, delta: str) -> StreamDelta:
        self._text += delta
        return self._diff(self.scan(self._text, final=False))

    def finish(self) -> StreamDelta:
        return self._diff(self.scan(self._text, final=True))

    @property
    def called(self) -> bool:
        """Whether a call's header has been streamed."""
        return bool(self._sent_args)

    def _id(self, i: int) -> str:
        while len(self._ids) <= i:
            self._ids.append(self.new_call_id())
        return self._ids[i]

    def _diff(self, scan: Scan) -> StreamDelta:
        content = scan.content[self._sent_content:] if len(scan.content) > self._sent_content else ""
        self._sent_content = max(self._sent_content, len(scan.content))
        out: list[ToolCallDelta] = []
        for i, call in enumerate(scan.calls):
            if i >= len(self._sent_args):
                if call.name is None:
                    break      # a later call cannot go out before this one's header
                self._sent_args.append(0)
                out.append(ToolCallDelta(i, id=self._id(i), name=call.name))
            fragment = call.arguments[self._sent_args[i]:]
            if fragment:
                out.append(ToolCallDelta(i, arguments=fragment))
                self._sent_args[i] = len(call.arguments)
        return StreamDelta(content, tuple(out))


def lark_marker(marker: str, marker_tokens: dict[str, int]) -> str:
    """A marker in a Lark grammar: its token, where the tokenizer has one, else its text."""
    return f"<[{marker_tokens[marker]}]>" if marker in marker_tokens else json.dumps(marker)


def hold_back(text: str, markers: tuple[str, ...]) -> str:
    """text without a tail that could be the beginning of one of markers (sent once it is not)."""
    cut = len(text)
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:k]):
                cut = min(cut, len(text) - k)
                break
    return text[:cut]


def call_from_object(text: str, scan: ObjectScan, arguments_keys: tuple[str, ...]) -> PartialCall | None:
    """A call from a scanned `{"name": ..., <arguments key>: {...}}` object; None when the object
    is not a call (broken, or complete without a string name). The arguments' text grows with
    the object when it is an object; a string value (JSON in a string) is decoded once complete."""
    if scan.broken:
        return None
    name = None
    name_text = scan.value_text(text, "name")
    if name_text is not None:
        try:
            name = json.loads(name_text)
        except ValueError:
            return None
        if not isinstance(name, str):
            return None
    key = next((k for k in arguments_keys if k in scan.values), None)
    arguments = ""
    if key is not None:
        begin, end = scan.values[key]
        if text[begin] == "{":
            arguments = text[begin:end] if end is not None else text[begin:]
        elif end is not None:
            try:
                value = json.loads(text[begin:end])
            except ValueError:
                return None
            arguments = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    if scan.end is None:
        return PartialCall(name, arguments, complete=False)
    try:
        json.loads(text[scan.start:scan.end])
    except ValueError:
        return None
    if name is None:
        return None
    return PartialCall(name, arguments if key is not None else "{}", complete=True)
