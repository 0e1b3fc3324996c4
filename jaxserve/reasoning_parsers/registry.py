"""The reasoning parsers by name (`--reasoning-parser NAME`)."""

from __future__ import annotations

from jaxserve.reasoning_parsers.base import ReasoningParser
from jaxserve.reasoning_parsers.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (Qwen3ReasoningParser,)}


def reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"reasoning_parser={name!r} is not one of {', '.join(sorted(REASONING_PARSERS))}") from None
