"""Qwen3's (and QwQ's, DeepSeek-R1's) reasoning: `<think>...</think>` before the answer. The
opening tag is either written by the model or already at the end of the prompt (thinking
templates that open it for the model); the answer then starts inside the reasoning. Whitespace
between `</think>` and the answer is not content.
"""

from __future__ import annotations

from jaxserve.reasoning_parsers.base import ReasoningParser, ReasoningSplit
from jaxserve.tool_parsers.base import hold_back

OPEN, CLOSE = "<think>", "</think>"


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def scan(self, text: str, final: bool) -> ReasoningSplit:
        if self.starts_in_reasoning:
            begin = 0
        else:
            rest = text.lstrip()
            if rest.startswith(OPEN):
                begin = len(text) - len(rest) + len(OPEN)
            elif not final and OPEN.startswith(rest):
                return ReasoningSplit(None, "")     # the tag may be arriving
            else:
                return ReasoningSplit(None, text)
        end = text.find(CLOSE, begin)
        if end < 0:
            inside = text[begin:]
            return ReasoningSplit(inside if final else hold_back(inside, (CLOSE,)), "")
        return ReasoningSplit(text[begin:end], text[end + len(CLOSE):].lstrip())

    @classmethod
    def prompt_opens_reasoning(cls, prompt_tail: str) -> bool:
        return prompt_tail.rfind(OPEN) > prompt_tail.rfind(CLOSE)
