"""Mistral calls after the `[TOOL_CALLS]` marker: a JSON array of calls (v3 tokenizers),

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

or, in later tokenizers, `[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}` per call. Text before
the marker is content. Both markers are special tokens in Mistral's tokenizers, so they are kept
in the text (skip_special_tokens off, tool_parsers/plan.py), and with them the end-of-sequence
`</s>`, which is dropped here.
"""

from __future__ import annotations

import json
import random
import string

from jaxserve.tool_parsers.base import PartialCall, Scan, ToolParser, call_from_object, hold_back, lark_marker
from jaxserve.tool_parsers.json_scan import scan_object, skip_ws

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
EOS = "</s>"


class MistralToolParser(ToolParser):
    name = "mistral"
    arguments_key = "arguments"
    markers = (MARKER, ARGS)

    @classmethod
    def new_call_id(cls) -> str:
        # Mistral's chat templates refuse a tool call id that is not 9 letters and digits
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))

    def scan(self, text: str, final: bool) -> Scan:
        if text.endswith(EOS):
            text = text[:-len(EOS)]
        j = text.find(MARKER)
        if j < 0:
            return Scan(text if final else hold_back(text, (MARKER, EOS)))
        content, calls = text[:j], []
        while j >= 0:
            i = skip_ws(text, j + len(MARKER))
            if i >= len(text):
                break
            got, i, ok = (self._array(text, i, final) if text[i] == "[" else self._named(text, i, final))
            calls += got
            if not ok:
                if final and not got:     # what did not parse is text (a cut call is a call)
                    content += text[i:]
                break
            j = text.find(MARKER, i)
            tail = text[i:j] if j >= 0 else text[i:]
            content += tail if final or j >= 0 else hold_back(tail, (MARKER, EOS))
        return Scan(content, calls)

    @staticmethod
    def _array(text: str, i: int, final: bool) -> tuple[list[PartialCall], int, bool]:
        """Calls of the array at text[i]; the index after it; whether it ended well."""
        calls, start = [], i
        i = skip_ws(text, i + 1)
        while i < len(text):
            obj = scan_object(text, i)
            call = call_from_object(text, obj, ("arguments", "parameters"))
            if call is None:
                return calls, start, False
            calls.append(call)
            if not call.complete:
                return calls if call.name is not None or not final else calls[:-1], start, False
            i = skip_ws(text, obj.end)
            if i < len(text) and text[i] == ",":
                i = skip_ws(text, i + 1)
            elif i < len(text) and text[i] == "]":
                return calls, i + 1, True
            elif i < len(text):
                return calls, i, False
        return calls, start, False

    @staticmethod
    def _named(text: str, i: int, final: bool) -> tuple[list[PartialCall], int, bool]:
        """`name[ARGS]{...}` at text[i]."""
        k = text.find(ARGS, i)
        if k < 0:
            return [], i, False
        name = text[i:k].strip()
        obj = scan_object(text, k + len(ARGS))
        if obj.broken:
            return [], i, False
        if obj.end is None:
            return [PartialCall(name, text[obj.start:], complete=False)], i, False
        try:
            json.loads(text[obj.start:obj.end])
        except ValueError:
            return [], i, False
        return [PartialCall(name, text[obj.start:obj.end], complete=True)], obj.end, True

    @classmethod
    def calls_lark(cls, body: str, parallel: bool, marker_tokens: dict[str, int]) -> str:
        marker = lark_marker(MARKER, marker_tokens)
        return f"start: {marker} \"[\" {body}{' (\", \" ' + body + ')*' if parallel else ''} \"]\"\n"
