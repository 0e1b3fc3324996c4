"""Where the top-level values of a JSON object are in a text that may still be arriving.

A streamed tool call is JSON that grows a few characters at a time: the parsers need to know, at
every step, whether the `name` is complete and where the `arguments` value starts and (once it
has) ends, without waiting for the object to close. json.loads answers only for whole texts, so
this walks the object's first level by hand; each value's span is then decoded with json (the
scan itself does not validate what is inside a value).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

_WS = " \t\n\r"


@dataclass(slots=True)
class ObjectScan:
    """The first level of the object starting at `start`: each key's value span [begin, end),
    end None while the value is still arriving; `end` is past the closing brace, None until it
    came. `broken`: the text cannot be the beginning of a JSON object."""
    start: int
    values: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    end: int | None = None
    broken: bool = False

    def value_text(self, text: str, key: str) -> str | None:
        """The complete value's JSON text, or None (absent or still arriving)."""
        span = self.values.get(key)
        if span is None or span[1] is None:
            return None
        return text[span[0]:span[1]]


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """text[i] is a quote: the index past the closing quote, or None if the string has not ended."""
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def _value_end(text: str, i: int) -> int | None:
    """The index past the JSON value starting at text[i], or None if it has not ended yet (a
    number or literal ends only where something follows it)."""
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth = 0
        while i < len(text):
            c = text[i]
            if c == '"':
                end = _string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    while i < len(text) and text[i] not in _WS + ",}]":   # a number, true, false or null
        i += 1
    return i if i < len(text) else None


def scan_object(text: str, start: int = 0) -> ObjectScan:
    """Scan the object whose `{` is the first non-space character at or after `start`."""
    i = skip_ws(text, start)
    scan = ObjectScan(start=i)
    if i >= len(text):
        return scan
    if text[i] != "{":
        scan.broken = True
        return scan
    i += 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return scan
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if text[i] == ",":
            i = skip_ws(text, i + 1)
            if i >= len(text):
                return scan
        if text[i] != '"':
            scan.broken = True
            return scan
        key_end = _string_end(text, i)
        if key_end is None:
            return scan
        try:
            key = json.loads(text[i:key_end])
        except ValueError:
            scan.broken = True
            return scan
        i = skip_ws(text, key_end)
        if i >= len(text):
            return scan
        if text[i] != ":":
            scan.broken = True
            return scan
        i = skip_ws(text, i + 1)
        if i >= len(text):
            return scan
        end = _value_end(text, i)
        scan.values[key] = (i, end)
        if end is None:
            return scan
        i = end
