"""What an XLA:CPU executable runs, counted from its optimized HLO text: one thunk per operation of
the entry computation (a fusion, a custom call, a copy, a while loop, ...), the unit XLA:CPU's
runtime schedules and pays a fixed cost for. Parameters, constants, tuples, tuple elements and
bitcasts are not counted (no thunk runs for them); a while loop counts once here, its body's
operations separately (`body_ops`), since they run once per iteration."""

from __future__ import annotations

import collections
import re

_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all"}
# `%name = shape opcode(`: the opcode after the result's shape (shapes may hold braces and tuples)
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*.*?\s([a-z][a-z0-9_-]*)\(")


def _computations(hlo_text: str) -> dict[str, list[str]]:
    comps, name, body = {}, None, []
    for line in hlo_text.splitlines():
        head = re.match(r"^(ENTRY\s+)?%(\S+)\s.*\{\s*$", line)
        if head:
            name, body = ("ENTRY" if head.group(1) else head.group(2)), []
        elif line.startswith("}") and name is not None:
            comps[name] = body
            name = None
        elif name is not None:
            body.append(line)
    return comps


def _count(lines: list[str]) -> collections.Counter:
    ops = collections.Counter()
    for line in lines:
        m = _INSTR.match(line)
        if m and m.group(1) not in _FREE:
            ops[m.group(1)] += 1
    return ops


def entry_ops(hlo_text: str) -> collections.Counter:
    """Opcode -> count over the entry computation's thunk-running operations."""
    return _count(_computations(hlo_text).get("ENTRY", []))


def body_ops(hlo_text: str) -> collections.Counter:
    """Opcode -> count over the bodies of the entry computation's while loops (once each)."""
    comps = _computations(hlo_text)
    ops = collections.Counter()
    for line in comps.get("ENTRY", []):
        m = re.search(r"\swhile\(.*body=%?([\w.\-]+)", line)
        if m:
            ops += _count(comps.get(m.group(1), []))
    return ops
