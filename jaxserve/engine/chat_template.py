"""`EngineConfig.chat_template`: a Jinja chat template used instead of the checkpoint's own (vLLM's
`--chat-template`), for a model whose template lacks something a client needs (tools, a system
role) or a checkpoint without one. Given as a file path or as the template text itself."""

from __future__ import annotations

import os

# The embedded SmolLM2-Instruct's own template renders no tools, so a newcomer's first tools=
# request was a 400. This one renders exactly what the checkpoint's does without tools, and with
# them lists the tools and asks for Hermes-style <tool_call> blocks (the hermes parser's format).
EMBEDDED_TOOLS_TEMPLATE = os.path.join(os.path.dirname(__file__), "templates", "smollm2_tools.jinja")


def default_chat_template(source: str | None, configured: str | None) -> str | None:
    """The template an engine renders chats with in place of its checkpoint's: the configured
    one, else for the embedded default model (`source`, the checkpoint's file, is the embedded
    GGUF) the shipped tool-rendering one; None: the checkpoint's own."""
    if configured:
        return configured
    from jaxserve.checkpoints.embedded import embedded_model_path

    try:
        embedded = embedded_model_path()
    except Exception:   # noqa: BLE001 - the embedded model's package is not installed
        return None
    same = source is not None and os.path.realpath(source) == os.path.realpath(embedded)
    return EMBEDDED_TOOLS_TEMPLATE if same else None


def load_chat_template(value: str) -> str:
    """The template text of `value` (a path to a file, or Jinja text); ValueError when it is
    neither, or does not parse, so a bad template fails the start, not every chat request."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            text = f.read()
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"chat_template={value!r} is neither a file nor Jinja template text")
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment   # the environment transformers renders in

    try:
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template does not parse (line {e.lineno}): {e.message}") from None
    return text


def apply_chat_template_override(tokenizer, value: str | None):
    """The engine's tokenizer with the configured template in place of its own (the tokenizer is
    this engine's: loaded with its checkpoint, shared only with engines on the same runner)."""
    if not value:
        return tokenizer
    if tokenizer is None:
        raise ValueError("chat_template needs a model with a tokenizer")
    tokenizer.chat_template = load_chat_template(value)
    return tokenizer
