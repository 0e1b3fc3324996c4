"""Refusals of requests whose every field is valid on its own: what no request schema can say.

Each is a ValueError (the door's refusals are) with a `code` the HTTP front puts in the 400's
`error.code` (OpenAI's `context_length_exceeded` among them), so a client, and the OpenAPI
conformance run of the slow tests, can tell such a refusal from a malformed request
(server/http/openapi.py lists them).
"""

from __future__ import annotations

from jaxserve.sched.limits import ContextLengthExceeded


class Refusal(ValueError):
    code: str = ""


class ConflictingFields(Refusal):
    """Fields valid alone that this server refuses together (best_of other than n, stream_options
    without stream, min_tokens above max_tokens, ...)."""
    code = "conflicting_fields"


class InputTokensExceeded(Refusal):
    """A request whose prompts together pass --max-input-tokens (server/input_tokens.py)."""
    code = "input_tokens_exceeded"


class FeatureDisabled(Refusal):
    """What this engine was built without (prompt logprobs: echo with logprobs asks for them)."""
    code = "feature_disabled"


class InvalidJSONText(Refusal):
    """A string that must hold JSON text (a tool call's arguments) that does not parse."""
    code = "invalid_json_text"


class InvalidGrammar(Refusal):
    """A structured-output grammar, regex or JSON schema (a tool's parameters too) that does not compile."""
    code = "invalid_grammar"


class TemplateRefused(Refusal):
    """Messages or tools the model's chat template does not take (a role it lacks, its own raise)."""
    code = "template_refused"


class PrefillRefused(Refusal):
    """A conversation that ends with an assistant turn (Anthropic's prefill: continue that partial
    answer), which this server does not continue."""
    code = "prefill_unsupported"


__all__ = ["ConflictingFields", "ContextLengthExceeded", "FeatureDisabled", "InputTokensExceeded", "InvalidGrammar", "InvalidJSONText",
           "PrefillRefused", "Refusal", "TemplateRefused"]
