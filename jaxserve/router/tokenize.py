"""The model's tokenizer at the router: a prompt's token ids, computed once, here.

Routing by prefix needs the ids. A text prompt is tokenized here exactly as the engine's door does
(`tokenizer.encode(text)`, engine/input_processor.py) and forwarded as token ids, so the replica
does not tokenize it again. A chat is rendered with the model's chat template for its routing key
but forwarded as the chat itself: the replica checks its roles and renders it with the same
template, and its errors stay the replica's own. Tokenizing runs in a thread pool so a long prompt
never stalls the router's event loop.

The tokenizer is loaded as the engine loads it (checkpoints/): the embedded SmolLM2 GGUF by
default, a GGUF file, or a directory with tokenizer files; no weights are read.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def load_tokenizer(model: str | None) -> Any:
    """The tokenizer the engine would use for `model` (None: the embedded model)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from jaxserve.checkpoints.embedded import embedded_model_path
    from jaxserve.checkpoints.tokenizer import directory_tokenizer, has_tokenizer_files

    path = embedded_model_path() if model is None else os.fspath(model)
    if os.path.isdir(path):
        if has_tokenizer_files(path):
            return directory_tokenizer(path)
        ggufs = sorted(n for n in os.listdir(path) if n.endswith(".gguf"))
        if len(ggufs) != 1:
            raise ValueError(f"--model {path!r} has no tokenizer files and not exactly one .gguf file")
        path = os.path.join(path, ggufs[0])
    if not os.path.isfile(path):
        raise ValueError(f"--model {path!r} does not exist")
    return _gguf_tokenizer(path)


def _gguf_tokenizer(path: str) -> Any:
    import gguf

    from jaxserve.checkpoints.tokenizer import gguf_tokenizer

    reader = gguf.GGUFReader(path)
    tok = gguf_tokenizer({key: field.contents() for key, field in reader.fields.items()})
    if tok is None:
        raise ValueError(f"--model {path!r}: the GGUF file carries no tokenizer")
    return tok


class PromptTokenizer:
    """Text and chat -> token ids in worker threads; bounded so a huge text is not tokenized."""

    def __init__(self, tokenizer: Any, *, max_chars: int = 1 << 22, threads: int = 2):
        self.tokenizer = tokenizer
        self.max_chars = max_chars
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="router-tokenizer")

    async def text_ids(self, text: str) -> list[int] | None:
        """None for a text too long to be worth tokenizing: the replica's door refuses it anyway."""
        if len(text) > self.max_chars:
            return None
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, lambda: list(self.tokenizer.encode(text)))

    async def chat_ids(self, messages: list[dict[str, str]]) -> list[int] | None:
        """The rendered chat's ids, or None when this router cannot render it (the replica decides)."""
        if not getattr(self.tokenizer, "chat_template", None) or \
                sum(len(m["content"]) for m in messages) > self.max_chars:
            return None

        def render() -> list[int] | None:
            try:
                ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            except Exception:   # noqa: BLE001 - the replica reports the template's error to the client
                return None
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

        return await asyncio.get_running_loop().run_in_executor(self._pool, render)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
