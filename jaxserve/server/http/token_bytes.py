"""A token's own bytes (chat logprobs' `bytes`, and the character offsets of completions logprobs).

A token inside a multi-byte UTF-8 character decodes to U+FFFD alone, so its bytes are not its
decoded text's. They come from its vocabulary string: a byte-level BPE (GPT-2's, Llama 3's,
Qwen's) spells each byte as one printable character (GPT-2's byte-to-unicode table, 'Ġ' for a
space); a SentencePiece vocabulary with byte fallback names a lone byte `<0xE9>`. A token whose
text is whole is its text's UTF-8.
"""

from __future__ import annotations

import codecs
import json
import re

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_level_table() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def _decoder_kinds(tokenizer) -> set[str]:
    """The `type`s in a fast tokenizer's decoder (a Sequence names several)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except (ValueError, AttributeError):
        return set()
    kinds, stack = set(), [decoder]
    while stack:
        d = stack.pop()
        if isinstance(d, dict):
            kinds.add(d.get("type"))
            stack.extend(d.get("decoders") or ())
    return kinds


_UNKNOWN = object()


class TokenBytes:
    """token id -> its bytes (cached per id). The decoder's kind is read only when a token first
    needs it (one that decodes to U+FFFD alone): reading it serializes the whole tokenizer (~40 ms
    for SmolLM2's), which once ran for every HTTP request, logprobs or not."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[int, bytes] = {}
        self._byte_level_table = _UNKNOWN

    @property
    def _byte_level(self) -> dict[str, int] | None:
        if self._byte_level_table is _UNKNOWN:
            kinds = _decoder_kinds(self._tokenizer) if self._tokenizer is not None else set()
            self._byte_level_table = _byte_level_table() if "ByteLevel" in kinds else None
        return self._byte_level_table

    def __call__(self, token_id: int) -> bytes:
        got = self._cache.get(token_id)
        if got is None:
            got = self._cache[token_id] = self._bytes(token_id)
        return got

    def _bytes(self, token_id: int) -> bytes:
        tok = self._tokenizer
        if tok is None:
            return str(token_id).encode()
        text = tok.decode([token_id])
        if "\ufffd" not in text:
            return text.encode()
        piece = tok.convert_ids_to_tokens(token_id)
        if self._byte_level is not None and all(c in self._byte_level for c in piece):
            return bytes(self._byte_level[c] for c in piece)
        m = _BYTE_TOKEN.match(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        return text.encode()


def text_offsets(token_bytes: list[bytes], start: int) -> list[int]:
    """The character offset at which each token begins in the text the tokens decode to, from
    `start`: the characters whole before it (UTF-8 decoded with replacement, as the text was), so a
    token inside a multi-byte character shares that character's offset and none drifts after it."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offsets, chars = [], start
    for b in token_bytes:
        offsets.append(chars)
        chars += len(decoder.decode(b))
    return offsets
