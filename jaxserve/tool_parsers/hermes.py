"""Hermes-style calls (Qwen2.5, Qwen3, Hermes): each call a JSON object between tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

with free text before, between or after them (the content; whitespace after a call is not). A block whose body is not a call
stays content; a block cut short (max_tokens) whose name is complete is a call with the
arguments written so far, as it was streamed.
"""

from __future__ import annotations

from jaxserve.tool_parsers.base import Scan, ToolParser, call_from_object, hold_back, lark_marker
from jaxserve.tool_parsers.json_scan import scan_object, skip_ws

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    arguments_key = "arguments"
    markers = (OPEN, CLOSE)

    def scan(self, text: str, final: bool) -> Scan:
        content: list[str] = []
        calls = []
        i = 0
        while True:
            j = text.find(OPEN, i)
            # the whitespace a model writes between and after its calls is not content
            start = skip_ws(text, i) if calls else i
            if j < 0:
                tail = text[start:]
                content.append(tail if final else hold_back(tail, (OPEN,)))
                break
            content.append(text[start:j])
            begin = j + len(OPEN)
            k = text.find(CLOSE, begin)
            end = k if k >= 0 else len(text)
            body = text[:end]   # the scan's offsets stay those of `text`
            call = call_from_object(body, scan_object(body, begin), ("arguments", "parameters"))
            if k < 0:          # the block is still open
                if final and (call is None or call.name is None):
                    content.append(text[j:])    # never closed and not even a named call: text
                elif call is not None:
                    calls.append(call)
                break          # an open block that is not (yet) a call holds everything after it
            if call is None or not call.complete:
                content.append(text[j:k + len(CLOSE)])
            else:
                calls.append(call)
            i = k + len(CLOSE)
        return Scan("".join(content), calls)

    @classmethod
    def calls_lark(cls, body: str, parallel: bool, marker_tokens: dict[str, int]) -> str:
        call = f'{lark_marker(OPEN, marker_tokens)} "\\n" {body} "\\n" {lark_marker(CLOSE, marker_tokens)}'
        return f"start: call{' (\"\\n\" call)*' if parallel else ''}\ncall: {call}\n"
