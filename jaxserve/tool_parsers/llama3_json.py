"""Llama 3.1-3.3 JSON calls: the answer is the call, a JSON object, optionally after the
`<|python_tag|>` token, several separated by `;`:

    {"name": "get_weather", "parameters": {"city": "Paris"}}

An answer that does not start with `{` (after whitespace and the tag) is content, and so is one
whose first object is not a call. The tag is a special token: with skip_special_tokens it is
simply absent from the text, which parses the same (so it is not among the markers whose
special tokens are kept: that would keep the end-of-turn token's text too).
"""

from __future__ import annotations

from jaxserve.tool_parsers.base import PartialCall, Scan, ToolParser, call_from_object
from jaxserve.tool_parsers.json_scan import scan_object, skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    arguments_key = "parameters"

    def scan(self, text: str, final: bool) -> Scan:
        i = skip_ws(text, 0)
        rest = text[i:]
        if not final and (not rest or (PYTHON_TAG.startswith(rest) and rest != PYTHON_TAG)):
            return Scan("")                       # not yet known whether this is a call
        if rest.startswith(PYTHON_TAG):
            i = skip_ws(text, i + len(PYTHON_TAG))
            if i >= len(text) and not final:
                return Scan("")
        if i >= len(text) or text[i] != "{":
            return Scan(text)                     # plain content
        calls: list[PartialCall] = []
        while True:
            obj = scan_object(text, i)
            call = call_from_object(text, obj, ("parameters", "arguments"))
            if call is None or (final and call.name is None):
                # not a call: the whole answer is content if it is the first, else its remainder
                return Scan(text if not calls else text[i:], calls)
            calls.append(call)
            if not call.complete:
                return Scan("", calls)
            j = skip_ws(text, obj.end)
            if j >= len(text):
                return Scan("", calls)
            if text[j] != ";":
                return Scan(text[obj.end:], calls)     # text after the calls
            i = skip_ws(text, j + 1)
            if i >= len(text):
                return Scan("", calls)
            if text[i] != "{":
                return Scan(text[j:], calls)

    @classmethod
    def calls_lark(cls, body: str, parallel: bool, marker_tokens: dict[str, int]) -> str:
        return f"start: {body}{' (\"; \" ' + body + ')*' if parallel else ''}\n"
