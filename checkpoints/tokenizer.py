"""Tokenizers for every checkpoint format, as transformers `PreTrainedTokenizerFast` objects.

A GGUF carries no tokenizer.json: its vocabulary, merges, special ids and chat template are
metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`). transformers can rebuild a tokenizer from
them, but its GGUF reader needs torch, which the runtime must not. So we read the metadata with
`gguf` ourselves and hand it to transformers' own GGUF tokenizer builders (which need no torch),
giving the same tokenizer `AutoTokenizer.from_pretrained(dir, gguf_file=...)` would.

An HF directory's tokenizer comes from AutoTokenizer; note that transformers' config module
imports torch when torch is installed, so that path pulls torch in (it never requires it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

# gguf key (after "tokenizer.") -> the name transformers' GGUF builders use, as transformers maps them.
_GGUF_TOKENIZER_KEYS = {
    "ggml.model": "tokenizer_type",
    "ggml.pre": "pre_tokenizer_type",
    "ggml.tokens": "tokens",
    "ggml.scores": "scores",
    "ggml.token_type": "token_type",
    "ggml.merges": "merges",
    "ggml.precompiled_charsmap": "precompiled_charsmap",
    "ggml.bos_token_id": "bos_token_id",
    "ggml.eos_token_id": "eos_token_id",
    "ggml.unknown_token_id": "unk_token_id",
    "ggml.padding_token_id": "pad_token_id",
    "ggml.add_space_prefix": "add_prefix_space",
}
_GGUF_TOKENIZER_CONFIG_KEYS = {
    "chat_template": "chat_template",
    "ggml.add_bos_token": "add_bos_token",
    "ggml.add_eos_token": "add_eos_token",
}
_SPECIAL_TOKEN_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def gguf_tokenizer(metadata: Mapping[str, Any]) -> "PreTrainedTokenizerFast | None":
    """The tokenizer a GGUF's metadata describes (key -> decoded value, as `gguf` reads it), or None
    when the file carries no vocabulary."""
    from transformers import PreTrainedTokenizerFast

    if "tokenizer.ggml.tokens" not in metadata:
        return None
    tokenizer_dict = {
        name: metadata[f"tokenizer.{key}"]
        for key, name in _GGUF_TOKENIZER_KEYS.items()
        if f"tokenizer.{key}" in metadata
    }
    tokenizer_config = {
        name: metadata[f"tokenizer.{key}"]
        for key, name in _GGUF_TOKENIZER_CONFIG_KEYS.items()
        if f"tokenizer.{key}" in metadata
    }
    if tokenizer_dict.get("tokenizer_type") == "llama":
        # llama.cpp adds BOS to a sentencepiece vocabulary unless the file says otherwise
        tokenizer_config.setdefault("add_bos_token", True)
    tokens = tokenizer_dict["tokens"]
    for name, key in _SPECIAL_TOKEN_IDS.items():
        token_id = metadata.get(key)
        tokenizer_config[name] = tokens[token_id] if token_id is not None else None
    backend, extra = _convert_gguf_tokenizer(metadata["general.architecture"], tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **(extra | tokenizer_config))


def _convert_gguf_tokenizer(architecture: str, tokenizer_dict: dict) -> tuple[Any, dict]:
    """(tokenizers.Tokenizer, extra constructor kwargs) from transformers' GGUF tokenizer builders.

    transformers moved them between releases: up to about 5.17 (our GPU machines) they are
    converter classes in `integrations.ggml`, later builders in `integrations.gguf`. Both take the
    same dict; the old converters also return special token strings, which we drop because we
    set them from the file's ids ourselves (some old converters mixed up bos and eos).
    """
    try:
        from transformers.integrations.ggml import convert_gguf_tokenizer
    except ImportError:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

        return convert_gguf_tokenizer(architecture, tokenizer_dict)
    backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return backend, {k: v for k, v in extra.items() if k not in _SPECIAL_TOKEN_IDS}


def has_tokenizer_files(directory: str | os.PathLike) -> bool:
    return any(os.path.isfile(os.path.join(directory, name)) for name in _TOKENIZER_FILES)


def directory_tokenizer(directory: str | os.PathLike) -> "PreTrainedTokenizerFast":
    """The tokenizer saved in a local directory (HF checkpoint or converted), never touching the hub."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.fspath(directory), local_files_only=True)
