"""Reasoning (thinking) parsers: an answer split into its reasoning and its content (qwen3's
`<think>...</think>`), behind one interface (base.ReasoningParser)."""

from jaxserve.reasoning_parsers.base import ReasoningDelta, ReasoningParser, ReasoningSplit
from jaxserve.reasoning_parsers.registry import REASONING_PARSERS, reasoning_parser

__all__ = ["REASONING_PARSERS", "ReasoningDelta", "ReasoningParser", "ReasoningSplit", "reasoning_parser"]
