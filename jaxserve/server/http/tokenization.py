"""vLLM's tokenizer routes: POST /tokenize (a prompt, or chat messages through the model's chat
template -> token ids), POST /detokenize (token ids -> text) and GET /tokenizer_info (the
tokenizer's configuration, as tokenizer_config.json holds it). The field names are vLLM's, so
clients written for it (lm-eval's API models among them) work unchanged. Tokenizing runs in the
engine's tokenizer threads, as a prompt's does; a text too long for max_model_len is refused
before it is tokenized.
"""

from __future__ import annotations

import json
from typing import Any

from jaxserve.server.chat_roles import chat_roles
from jaxserve.server.chat_content_tokens import holds_special_text, special_token_texts, tokenize_contents_as_text
from jaxserve.server.chat_prompt import check_roles
from jaxserve.server.http import errors
from jaxserve.server.http.sampling import chat_messages
from jaxserve.server.http.schemas import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from jaxserve.tool_parsers import ToolError, function_tools, template_takes_tools
from jaxserve.refusals import ContextLengthExceeded, TemplateRefused
from jaxserve.tool_parsers.plan import TEMPLATE_WITHOUT_TOOLS


def _tokenizer(aengine):
    tok = aengine.engine.tokenizer
    if tok is None:
        raise errors.bad_request("this model has no tokenizer (it serves token ids only)")
    return tok


async def tokenize(aengine, req: TokenizeRequest, *, content_special_tokens: bool = False) -> TokenizeResponse:
    tok = _tokenizer(aengine)
    if (req.prompt is None) == (req.messages is None):
        raise errors.bad_request("send exactly one of prompt and messages", "prompt")
    engine = aengine.engine
    if req.tools is not None and req.messages is None:
        raise errors.bad_request("tools are rendered into chat messages: send messages with them", "tools")
    if req.messages is not None:
        messages = chat_messages(req.messages)
        if not getattr(tok, "chat_template", None):
            raise errors.bad_request("the model has no chat template; send a prompt", "messages")
        extra = _tool_kwargs(req, tok)
        try:
            check_roles(messages, chat_roles(tok.chat_template), "messages")
            aengine.check_prompt_chars(sum(len(m["content"]) for m in messages))
        except ValueError as e:
            raise errors.refused(e, "messages") from e
        special = False if req.add_special_tokens is None else req.add_special_tokens

        def run(t):
            def render(ms):
                return t.apply_chat_template(ms, add_generation_prompt=req.add_generation_prompt, tokenize=False,
                                             **extra)
            try:
                # special-token text in contents is text, as the chat route tokenizes it
                specials = [] if content_special_tokens or special else special_token_texts(t)
                if specials and holds_special_text(messages, specials):
                    return tokenize_contents_as_text(t, messages, render, specials)
                text = render(messages)
            except Exception as e:   # a template that refuses these messages
                raise ValueError(f"messages: the model's chat template failed on these messages: {e}") from e
            return list(t.encode(text, add_special_tokens=special))
        field = "messages"
    else:
        try:
            aengine.check_prompt_chars(len(req.prompt))
        except ValueError as e:
            raise errors.refused(e, "prompt") from e
        special = True if req.add_special_tokens is None else req.add_special_tokens

        def run(t):
            return list(t.encode(req.prompt, add_special_tokens=special))
        field = "prompt"
    try:
        ids = await aengine.run_tokenizer(run)
    except ValueError as e:
        raise errors.refused(e, field) from e
    if len(ids) > engine.max_model_len:
        raise errors.bad_request(f"the {field} is {len(ids)} tokens, more than max_model_len={engine.max_model_len}",
                                 field, ContextLengthExceeded.code)
    strs = await aengine.run_tokenizer(lambda t: list(t.convert_ids_to_tokens(ids))) if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=strs)


def _tool_kwargs(req: TokenizeRequest, tok) -> dict:
    """The template variables a chat with `req.tools` renders with (its tools in OpenAI's shape,
    checked as the chat route checks them), so the count is the chat's."""
    if not req.tools:
        return {}
    try:
        tools = function_tools([t.model_dump(exclude_none=True) for t in req.tools])
    except ToolError as e:
        raise errors.bad_request(str(e), e.param, e.code) from None
    if not template_takes_tools(tok.chat_template):
        raise errors.bad_request(TEMPLATE_WITHOUT_TOOLS, "tools", TemplateRefused.code)
    return {"tools": [t.to_openai() for t in tools]}


async def detokenize(aengine, req: DetokenizeRequest) -> DetokenizeResponse:
    _tokenizer(aengine)
    vocab = aengine.engine.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise errors.bad_request(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens")
    if len(req.tokens) > aengine.engine.max_model_len:
        raise errors.bad_request(f"{len(req.tokens)} tokens, more than max_model_len={aengine.engine.max_model_len}",
                                 "tokens")
    return DetokenizeResponse(prompt=await aengine.run_tokenizer(lambda t: t.decode(req.tokens)))


def tokenizer_info(aengine) -> dict[str, Any]:
    """The tokenizer's configuration (its init arguments, as tokenizer_config.json holds them),
    with its special tokens, `tokenizer_class` and the chat template, every value made JSON
    (special tokens as their text). lm-eval's remote tokenizer reads eos_token here."""
    tok = _tokenizer(aengine)
    info = {k: _jsonable(v) for k, v in getattr(tok, "init_kwargs", {}).items()}
    for name, value in getattr(tok, "special_tokens_map", {}).items():   # eos_token, bos_token, ... as text
        info.setdefault(name, _jsonable(value))
    info["tokenizer_class"] = type(tok).__name__
    if getattr(tok, "chat_template", None):
        info["chat_template"] = tok.chat_template
    return info


def _jsonable(v):
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    content = getattr(v, "content", None)      # tokenizers' AddedToken
    if isinstance(content, str):
        return content
    try:
        json.dumps(v)
        return v
    except TypeError:
        return str(v)
