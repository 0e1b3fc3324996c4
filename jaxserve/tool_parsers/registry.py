"""The tool-call parsers by name (`--tool-call-parser NAME`) and the default for a model."""

from __future__ import annotations

from jaxserve.tool_parsers.base import ToolParser
from jaxserve.tool_parsers.hermes import HermesToolParser
from jaxserve.tool_parsers.llama3_json import Llama3JsonToolParser
from jaxserve.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}

# what a chat template writes in its instructions or examples -> the format its model answers in
_TEMPLATE_MARKERS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"))
# the HF model_type's usual format, for templates that name none of the markers
_MODEL_TYPES = {"qwen2": "hermes", "qwen3": "hermes", "qwen2_moe": "hermes", "qwen3_moe": "hermes",
                "llama": "llama3_json", "mistral": "mistral", "mixtral": "mistral"}


def tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"tool_call_parser={name!r} is not one of {', '.join(sorted(TOOL_PARSERS))}") from None


def default_tool_parser(model_type: str | None, chat_template: str | None) -> str | None:
    """The parser of a model's format: the marker its template writes, else its architecture's
    usual one; None when neither says."""
    for marker, name in _TEMPLATE_MARKERS:
        if chat_template and marker in chat_template:
            return name
    return _MODEL_TYPES.get(model_type or "")
