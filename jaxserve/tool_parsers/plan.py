"""What a chat request's tools change, in one place for every front (chat completions, the
Responses API, LLM.chat):

    plan = plan_tools(function_tools(tools), ToolChoice.from_openai(tool_choice),
                      parallel_tool_calls=True, parser="hermes", tokenizer=tok)
    tok.apply_chat_template(messages, **plan.template_kwargs, ...)
    SamplingParams(structured_outputs=plan.structured_outputs, ...)   # set for required / a named tool
    parser = plan.new_parser()    # one per answer: .parse(text) or .feed(delta) ... .finish()

tool_choice "auto" leaves the model free (its calls are parsed from what it writes); "required"
and a named function constrain the answer to the parser's call syntax around a JSON schema of the
allowed calls (`{"name": const, <arguments key>: the tool's parameters}`), so the arguments always
parse and validate; "none" renders no tools and parses nothing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

from jaxserve.refusals import ConflictingFields, InvalidGrammar, TemplateRefused
from jaxserve.structured_outputs import JSON_LAYOUT, StructuredOutputs
from jaxserve.tool_parsers.base import ToolParser
from jaxserve.tool_parsers.registry import default_tool_parser, tool_parser

TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")   # a function name, whole (fullmatch; the OpenAPI document says it too)


TEMPLATE_WITHOUT_TOOLS = (
    "this model's chat template does not render tools, so the model cannot be told about them; start the "
    "server with --chat-template FILE (a Jinja template that renders `tools`), send the tools in a message "
    "instead, or serve a model whose template takes tools")


class ToolError(ValueError):
    """A bad tools / tool_choice; `param` names the request field (the 400's param), `code` a
    refusal no request schema can express (jaxserve/refusals.py)."""

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class FunctionTool:
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None    # a JSON schema of the arguments object

    def to_openai(self) -> dict[str, Any]:
        """The tool as chat templates take it (OpenAI's shape)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters if self.parameters is not None else {"type": "object", "properties": {}}
        return {"type": "function", "function": fn}


def function_tools(tools: Sequence[dict[str, Any]] | None, field_name: str = "tools") -> list[FunctionTool]:
    """OpenAI's `[{"type": "function", "function": {name, description, parameters}}]`, checked."""
    out: list[FunctionTool] = []
    for i, t in enumerate(tools or ()):
        where = f"{field_name}[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise ToolError(f"{where}: only tools of type 'function' are supported", field_name)
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f"{where}.function is required (an object with a name)", field_name)
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise ToolError(f"{where}.function.name={name!r} must be 1-64 letters, digits, '_', '-' or '.'",
                            field_name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ToolError(f"{where}.function.parameters must be a JSON schema object", field_name)
        if params is not None:
            _check_schema(params, f"{where}.function.parameters", field_name)
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise ToolError(f"{where}.function.description must be a string", field_name)
        if any(o.name == name for o in out):
            raise ToolError(f"{where}: a second tool named {name!r}", field_name, ConflictingFields.code)
        out.append(FunctionTool(name, description, params))
    return out


def _check_schema(schema: dict[str, Any], where: str, field_name: str) -> None:
    """A tool's parameters must be a valid JSON Schema whatever the tool_choice: under "auto" the
    model is only told about it, but a schema the constrained choices would refuse (a 400 there)
    must not pass here either (jsonschema checks it against its metaschema, Draft 2020-12)."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        at = "".join(f"[{p!r}]" for p in e.path)
        raise ToolError(f"{where}{at} is not a valid JSON Schema: {e.message}", field_name,
                        InvalidGrammar.code) from None


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: Literal["auto", "required", "none", "function"] = "auto"
    function: str | None = None        # the named function (mode "function")

    @classmethod
    def from_openai(cls, value: Any, field_name: str = "tool_choice") -> "ToolChoice | None":
        """"auto" | "required" | "none" | {"type": "function", "function": {"name": ...}}
        (the Responses API's flat {"type": "function", "name": ...} too); None stays None."""
        if value is None:
            return None
        if value in ("auto", "required", "none"):
            return cls(value)
        if isinstance(value, dict) and value.get("type") == "function":
            fn = value.get("function")
            name = fn.get("name") if isinstance(fn, dict) else value.get("name") if fn is None else None
            if isinstance(name, str) and name:
                return cls("function", name)
        raise ToolError(f"{field_name} must be 'auto', 'required', 'none' or "
                        f"{{'type': 'function', 'function': {{'name': ...}}}}; got {value!r}", field_name)


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What the tools change for one request (see the module's docstring)."""
    tools: tuple[FunctionTool, ...] = ()
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    structured_outputs: StructuredOutputs | None = None
    parser: type[ToolParser] | None = None     # None: nothing is parsed as a call
    # False where the parser's markers are special tokens of the tokenizer: they must stay in
    # the text to be parsed; None: the request's own setting
    skip_special_tokens: bool | None = None

    def new_parser(self) -> ToolParser | None:
        return self.parser() if self.parser is not None else None


NO_TOOLS = ToolPlan()


def template_takes_tools(template: str | None) -> bool:
    """Whether a chat template reads the `tools` variable (renders the tools it is given)."""
    if not isinstance(template, str) or not template:
        return False
    import jinja2
    from jinja2 import meta

    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateError:      # transformers' own tags: fall back to the word
        return re.search(r"\btools\b", template) is not None
    return "tools" in meta.find_undeclared_variables(tree)


def resolve_tool_parser(name: str | None, tokenizer, model_type: str | None) -> str | None:
    """The parser a request uses: the one named (checked), else the model's default."""
    if name is not None:
        tool_parser(name)
        return name
    return default_tool_parser(model_type, getattr(tokenizer, "chat_template", None))


def plan_tools(tools: Sequence[FunctionTool], choice: ToolChoice | None, *, parallel_tool_calls: bool = True,
               parser: str | None, tokenizer, chat_template: str | None = None) -> ToolPlan:
    """ToolError (with the field it is about) for a choice without tools, an unknown named
    function, a template that renders no tools, or no parser for the model. chat_template: the
    template the chat is rendered with, when not the tokenizer's."""
    tools = tuple(tools)
    if choice is None:
        choice = ToolChoice("auto")
    if not tools:
        if choice.mode in ("required", "function"):
            raise ToolError(f"tool_choice={choice.mode!r} needs tools", "tool_choice", ConflictingFields.code)
        return NO_TOOLS
    if choice.mode == "none":
        return ToolPlan(tools=tools)
    if choice.mode == "function" and not any(t.name == choice.function for t in tools):
        raise ToolError(f"tool_choice names function {choice.function!r}, which is not among the tools "
                        f"({', '.join(t.name for t in tools)})", "tool_choice", ConflictingFields.code)
    if not template_takes_tools(chat_template or getattr(tokenizer, "chat_template", None)):
        raise ToolError(TEMPLATE_WITHOUT_TOOLS, "tools", TemplateRefused.code)
    if parser is None:
        raise ToolError("no tool call parser is known for this model; start the server with "
                        "--tool-call-parser NAME (hermes, llama3_json, mistral)", "tools", TemplateRefused.code)
    cls = tool_parser(parser)
    tokens, special = marker_tokens(cls, tokenizer)
    constraint = None
    if choice.mode == "required":
        constraint = tool_calls_constraint(cls, tools, parallel=parallel_tool_calls, marker_tokens=tokens)
    elif choice.mode == "function":
        named = [t for t in tools if t.name == choice.function]
        constraint = tool_calls_constraint(cls, named, parallel=False, marker_tokens=tokens)
    return ToolPlan(tools=tools, template_kwargs={"tools": [t.to_openai() for t in tools]},
                    structured_outputs=constraint, parser=cls, skip_special_tokens=False if special else None)


def marker_tokens(cls: type[ToolParser], tokenizer) -> tuple[dict[str, int], bool]:
    """The parser's markers that are single (added) tokens of this tokenizer, with their ids,
    and whether any of them is a special token."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    by_text = {tok.content: (i, bool(getattr(tok, "special", False))) for i, tok in added.items()}
    found = {m: by_text[m] for m in cls.markers if m in by_text}
    return {m: i for m, (i, _) in found.items()}, any(s for _, s in found.values())


def tool_calls_constraint(cls: type[ToolParser], tools: Sequence[FunctionTool], *, parallel: bool,
                          marker_tokens: dict[str, int] | None = None) -> StructuredOutputs:
    """The grammar of the parser's calls of these tools: each call `{"name": <a tool's name>,
    <arguments key>: <that tool's parameters>}`, one, or (parallel) one or more."""
    key = cls.arguments_key
    defs: dict[str, Any] = {}
    options = []
    for t in tools:
        params = dict(t.parameters) if t.parameters is not None else {"type": "object"}
        for defs_key in ("$defs", "definitions"):   # a tool's references point at the root: move them there
            for name, d in (params.pop(defs_key, None) or {}).items():
                if name in defs and defs[name] != d:
                    raise ToolError(f"tools: two tools define ${defs_key} {name!r} differently; "
                                    f"a constrained call needs one meaning per name", "tools")
                defs[name] = d
        options.append({"type": "object", "properties": {"name": {"const": t.name}, key: params},
                        "required": ["name", key], "additionalProperties": False})
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    schema = dict(schema, **({"$defs": defs} if defs else {}))
    schema["x-guidance"] = JSON_LAYOUT
    body = "call_json"
    lark = cls.calls_lark(body, parallel, marker_tokens or {}) + f"{body}: %json {json.dumps(schema)}\n"
    return StructuredOutputs(grammar=lark)
