"""A chat (role/content messages) -> prompt token ids through the model's chat template, shared by
the gRPC and HTTP fronts. Rendering runs in the AsyncEngine's tokenizer threads, like tokenizing a
text prompt, so a long chat never stalls the step thread or the event loop."""

from __future__ import annotations

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.server.chat_content_tokens import holds_special_text, special_token_texts, tokenize_contents_as_text
from jaxserve.server.chat_roles import chat_roles

def check_roles(messages: list[dict[str, str]], allowed_roles: frozenset[str], field: str) -> None:
    """Every role must be one the template takes; `field` names the messages in the error."""
    if not messages:
        raise ValueError(f"{field} is empty")
    for i, m in enumerate(messages):
        if m["role"] not in allowed_roles:
            raise ValueError(f"{field}[{i}].role={m['role']!r} is not a role this model's chat template "
                             f"takes; allowed: {', '.join(sorted(allowed_roles))}")


async def render_chat(aengine: AsyncEngine, messages: list[dict], *, field: str = "messages",
                      cache_salt: str | None = None, template_kwargs: dict | None = None,
                      content_special_tokens: bool = False) -> dict:
    """The engine prompt ({"prompt_token_ids": ..., "cache_salt": ...}) of a chat, with the
    generation prompt added; ValueError for a model without a template, an unknown role, a chat too
    long for max_model_len or one the template refuses. template_kwargs: more variables for the
    template (`tools`: tool_parsers.ToolPlan.template_kwargs). Special-token text typed into a
    content is tokenized as text (chat_content_tokens.py) unless `content_special_tokens`."""
    tok = aengine.engine.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise ValueError(f"{field}: the model has no chat template; send text or token ids")
    check_roles(messages, chat_roles(tok.chat_template), field)
    extra = template_kwargs or {}
    aengine.check_prompt_chars(sum(len(m["content"]) for m in messages) + len(repr(extra.get("tools") or "")))

    def render(tokenizer):   # in a tokenizer thread, like a text prompt
        try:
            specials = [] if content_special_tokens else special_token_texts(tokenizer)
            if specials and holds_special_text(messages, specials):
                return tokenize_contents_as_text(
                    tokenizer, messages, lambda ms: tokenizer.apply_chat_template(
                        ms, add_generation_prompt=True, tokenize=False, **extra), specials)
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
        except Exception as e:   # a template that rejects these messages (roles, order)
            raise ValueError(f"{field}: the model's chat template failed on these messages: {e}") from e
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return list(ids)

    prompt = {"prompt_token_ids": await aengine.run_tokenizer(render)}
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    return prompt
