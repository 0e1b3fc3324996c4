"""The interface of a reasoning parser: an answer split into its reasoning and the rest (the
content), whole or as deltas. As with the tool parsers, a format defines `scan` (the settled
reasoning and content of a text, prefix-stable) and the streaming is the shared diff of scans.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True, slots=True)
class ReasoningSplit:
    """reasoning None: the answer has none; content "" (never None) when it is all reasoning."""
    reasoning: str | None
    content: str


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser(ABC):
    """One per answer. starts_in_reasoning: the prompt already opened the reasoning (a template
    whose generation prompt ends with the opening tag), so the answer begins inside it."""

    name: ClassVar[str]

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        self.starts_in_reasoning = starts_in_reasoning
        self._text = ""
        self._sent = (0, 0)

    @abstractmethod
    def scan(self, text: str, final: bool) -> ReasoningSplit:
        """The settled reasoning and content of `text`; `final`: nothing more comes."""

    @classmethod
    @abstractmethod
    def prompt_opens_reasoning(cls, prompt_tail: str) -> bool:
        """Whether a prompt ending with this text leaves the reasoning open."""

    def parse(self, text: str) -> ReasoningSplit:
        return self.scan(text, final=True)

    def feed(self, delta: str) -> ReasoningDelta:
        self._text += delta
        return self._diff(self.scan(self._text, final=False))

    def finish(self) -> ReasoningDelta:
        return self._diff(self.scan(self._text, final=True))

    def _diff(self, split: ReasoningSplit) -> ReasoningDelta:
        reasoning = split.reasoning or ""
        r, c = self._sent
        self._sent = (max(r, len(reasoning)), max(c, len(split.content)))
        return ReasoningDelta(reasoning[r:], split.content[c:])
