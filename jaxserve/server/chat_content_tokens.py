"""A chat's message contents tokenized as text: special-token text typed into a message
(`<|im_start|>system ...`, `</s>`) stays those characters, never the control token, so a user
cannot forge a turn of another role or end the prompt early.

A template renders the chat to text, and tokenizing that text maps every special token's text
to its id, the template's own and a user's alike. Here each special token's text in a content is
first replaced by a private-use character that no content or template holds, the chat rendered
(so whatever the template does with a content, trimming or splitting, it does the same), and
the rendered text split at the special tokens that are left (the template's own). Each piece
between them is tokenized with the placeholders turned back into the typed text and special
tokens not matched (`split_special_tokens`), and the template's specials are their ids: the same
split the tokenizer itself makes at special tokens, so a chat without such text tokenizes as
before (and takes the ordinary path anyway).
"""

from __future__ import annotations

import re
from typing import Callable

_PRIVATE_USE = 0xE000


def special_token_texts(tokenizer) -> list[str]:
    """The texts of the tokenizer's special added tokens, longest first (so a longer one that
    starts like a shorter one matches first)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return sorted({t.content for t in decoder.values() if getattr(t, "special", False) and t.content},
                  key=len, reverse=True)


def holds_special_text(messages: list[dict], specials: list[str]) -> bool:
    return any(isinstance(m.get("content"), str) and any(s in m["content"] for s in specials) for m in messages)


def tokenize_contents_as_text(tokenizer, messages: list[dict], render_text: Callable[[list[dict]], str],
                              specials: list[str]) -> list[int]:
    """The chat's prompt ids with special-token text in contents tokenized as text.
    `render_text(messages)`: the chat template's rendered text of these messages."""
    pattern = re.compile("|".join(map(re.escape, specials)))
    used = set(getattr(tokenizer, "chat_template", None) or "")
    for m in messages:
        if isinstance(m.get("content"), str):
            used.update(m["content"])
    placeholder, code = {}, _PRIVATE_USE
    for s in specials:
        while chr(code) in used:
            code += 1
        placeholder[s] = chr(code)
        code += 1
    masked = [dict(m, content=pattern.sub(lambda x: placeholder[x.group()], m["content"]))
              if isinstance(m.get("content"), str) else m for m in messages]
    text = render_text(masked)
    typed = str.maketrans({ph: s for s, ph in placeholder.items()})

    ids: list[int] = []

    def as_text(piece: str) -> None:
        if piece:
            ids.extend(tokenizer(piece.translate(typed), add_special_tokens=False,
                                 split_special_tokens=True)["input_ids"])

    start = 0
    for m in pattern.finditer(text):   # the template's own special tokens
        as_text(text[start:m.start()])
        ids.append(tokenizer.convert_tokens_to_ids(m.group()))
        start = m.end()
    as_text(text[start:])
    return ids
