"""StructuredOutputs: what a request's output must match (vLLM's `structured_outputs`): a JSON
schema, any JSON object, a regex, one of a list of strings, or a Lark grammar. Exactly one.

`to_grammar()` turns it into an llguidance grammar; whether that grammar compiles is checked at
the engine's door against the model's tokenizer (engine/grammar.py), so a bad schema or regex is a
ValueError there, never a failure mid-generation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from jaxserve.refusals import InvalidGrammar, InvalidJSONText

_KINDS = ("json", "json_object", "regex", "choice", "grammar")
# JSON as json.dumps writes it, one space after , and :, no other whitespace: llguidance's default
# allows any run of whitespace between tokens, where a weak model can spend its whole budget (a
# schema's own "x-guidance" options override this)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    json: str | dict[str, Any] | None = None     # a JSON schema (a dict or its text)
    json_object: bool = False                    # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None                   # Lark, llguidance's dialect

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.json, dict):   # frozen and hashable: keep the schema as canonical text
            try:
                object.__setattr__(self, "json", json.dumps(self.json, sort_keys=True))
            except RecursionError:
                raise InvalidGrammar("SamplingParams.structured_outputs.json is nested too deeply") from None
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"SamplingParams.structured_outputs must set exactly one of {', '.join(_KINDS)}; "
                             f"got {given or 'none'}")
        if self.json is not None:
            try:
                schema = json.loads(self.json)
            except ValueError as e:
                raise InvalidJSONText(f"SamplingParams.structured_outputs.json is not valid JSON: {e}") from None
            except RecursionError:   # Python's decoder recurses per level; a 400, not a crash
                raise InvalidGrammar("SamplingParams.structured_outputs.json is nested too deeply") from None
            if not isinstance(schema, dict):
                raise InvalidGrammar("SamplingParams.structured_outputs.json must be a JSON schema object")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("SamplingParams.structured_outputs.choice must be non-empty strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"SamplingParams.structured_outputs.{name} must be a non-empty string")

    @classmethod
    def coerce(cls, value: "StructuredOutputs | dict | None") -> "StructuredOutputs | None":
        if value is None or isinstance(value, StructuredOutputs):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(_KINDS)
            if unknown:
                raise ValueError(f"SamplingParams.structured_outputs has unknown field(s) {sorted(unknown)}; "
                                 f"the fields are {', '.join(_KINDS)}")
            return cls(**value)
        raise ValueError(f"SamplingParams.structured_outputs must be a StructuredOutputs or a dict, "
                         f"got {type(value).__name__}")

    def to_grammar(self) -> str:
        """The llguidance grammar (not yet checked: LLMatcher.validate_grammar does that)."""
        from llguidance import LLMatcher

        if self.json is not None:
            return LLMatcher.grammar_from_json_schema(self.json, defaults=JSON_LAYOUT)
        if self.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        return LLMatcher.grammar_from_lark(self.grammar)
