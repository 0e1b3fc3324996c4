"""Incremental detokenization and stop strings, on the engine side (sched has no tokenizer).

Decoding only a short window of recent tokens each step keeps the cost per token constant; text
is emitted only once it is stable (no trailing U+FFFD from a split multi-byte character). With a
byte-level tokenizer (GPT-2's decoder: SmolLM2, Llama 3, Qwen) the window lives in the
`tokenizers` library's own `DecodeStream` (one call per token, the same algorithm in Rust: the
same text, checked against the Python window in the tests); otherwise, and while the window's
ids end inside a split character (a prompt's tail, say), the window is kept here.

A stop string can span several tokens, so text that might be its beginning is not yet sendable:
`releasable` holds back the tail of the text that is a prefix of a stop string (and the tokens
that produced it), until the next tokens either complete the stop string (the text is cut there)
or move past it. Streams (DELTA outputs) send only what is releasable, so no consumer ever sees
a part of a stop string that the final text does not have.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any, Callable


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], *, skip_special_tokens: bool = True,
                 stop: tuple[str, ...] | None = None, include_stop_str_in_output: bool = False):
        self._tok = tokenizer
        self._decode_ids = _decoder(tokenizer)
        self._skip = skip_special_tokens
        self._stop = tuple(stop or ())
        self._include_stop = include_stop_str_in_output
        # Context: the tail of the prompt, so the first output token decodes as it would mid-text.
        self._ids: list[int] = list(prompt_ids[-6:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""
        self.stopped_by: str | None = None
        self.num_consumed = 0   # tokens the last append() took (fewer than given after a stop string)
        # len(text) after each token taken: which tokens produced the text up to a given length
        self._text_ends: list[int] = []
        # the library's stream, where the tokenizer allows one (None: the Python window)
        self._backend = _stream_backend(tokenizer)
        self._stream = None
        if self._backend is not None:
            self._take_stream()

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, self._skip)

    def append(self, token_ids) -> str:
        """Add sampled tokens; returns the new text. Sets `stopped_by` when a stop string appears
        (the text is then cut at it)."""
        if self.stopped_by is not None:
            self.num_consumed = 0
            return ""
        before = len(self.text)
        self.num_consumed = 0   # of token_ids, up to and including the one that completed a stop string
        for t in token_ids:
            self.num_consumed += 1
            self._ids.append(t)
            if self._stream is not None:
                self._stream_step(t)
            else:
                self._window_step()
            self._text_ends.append(len(self.text))
            if self._stop and self._check_stop(before):
                break
        return self.text[before:]

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._stop)

    def append_one(self, token_id: int) -> str:
        """append([token_id]) for a detokenizer without stop strings: the output processor's
        common step, without the general loop."""
        if self._stop:
            return self.append((token_id,))
        self._ids.append(token_id)
        self.num_consumed = 1
        stream = self._stream
        if stream is not None:
            try:
                chunk = stream.step(self._backend[0], token_id)
            except Exception:   # noqa: BLE001  (as in _stream_step: handled below)
                stream = None
            if stream is not None:   # _stream_step's work, inline
                if chunk is not None:
                    self.text += chunk
                    self._prefix_offset = self._read_offset
                    self._read_offset = len(self._ids)
                self._text_ends.append(len(self.text))
                return chunk or ""
        before = len(self.text)
        if self._stream is not None:
            self._stream_refused()
        else:
            self._window_step()
        self._text_ends.append(len(self.text))
        return self.text[before:]

    def _window_step(self) -> None:
        """The last id of _ids was added: emit the text it made stable, if any."""
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            if self._backend is not None:
                self._take_stream()

    def _take_stream(self) -> None:
        """Move the window into a DecodeStream if it can hold it exactly: primed with the ids the
        next step's prefix decodes (ids[prefix_offset:read_offset]), a stream decodes the same two
        strings as the Python window from then on. It cannot while those ids end inside a split
        character (priming yields nothing: the stream would emit their bytes later, the Python
        window never does); the Python window then goes on and tries again at its next text."""
        window = self._ids[self._prefix_offset:self._read_offset]
        try:
            stream = self._backend[1](skip_special_tokens=self._skip)
            primed = not window or stream.step(self._backend[0], window) is not None
        except Exception:   # noqa: BLE001  (a `tokenizers` whose step takes no list of ids)
            self._backend = None   # the Python window, for good
            return
        if primed:
            self._stream = stream

    def _stream_step(self, t: int) -> None:
        try:
            chunk = self._stream.step(self._backend[0], t)
        except Exception:   # noqa: BLE001  (the library refuses a window it cannot extend)
            self._stream_refused()
            return
        if chunk is not None:
            self.text += chunk
            # the Python window's state after the same token: kept so a fallback resumes exactly
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)

    def _stream_refused(self) -> None:
        """The stream refused the last id: go on in Python from the same window (the offsets are
        kept equal to the stream's), for good: a tokenizer that refused once is not trusted with
        a stream again. The window's step adds what text the id made."""
        self._stream = self._backend = None
        self._window_step()

    def releasable(self) -> tuple[int, int]:
        """(tokens, characters) of the output so far that can be sent: all of it, except a tail of
        the text that could be the start of a stop string, with the tokens that produced it (so
        the tokens sent always produced exactly the text sent). Once a stop string was found
        everything is releasable (the text was cut at it)."""
        if not self._stop:
            return len(self._text_ends), len(self.text)
        hold = self._stop_prefix_len() if self.stopped_by is None else 0
        if not hold:
            return len(self._text_ends), len(self.text)
        k = bisect_right(self._text_ends, len(self.text) - hold)
        return k, (self._text_ends[k - 1] if k else 0)

    def _stop_prefix_len(self) -> int:
        """The longest tail of the text that is a proper prefix of a stop string (0 if none)."""
        text, longest = self.text, 0
        if not text:
            return 0
        last = text[-1]
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if s[n - 1] == last and text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def _check_stop(self, before: int) -> bool:
        longest = max(len(s) for s in self._stop)
        start = max(0, before - longest)
        for s in self._stop:
            i = self.text.find(s, start)
            if i >= 0:
                self.stopped_by = s
                self.text = self.text[: i + len(s)] if self._include_stop else self.text[:i]
                return True
        return False


def _decoder(tok) -> Callable[[list[int], bool], str]:
    """How to decode ids with `tok` (found when a detokenizer starts). A transformers fast tokenizer
    whose decode is the library's own decodes with its `tokenizers` backend directly: what its
    decode returns with clean-up off, without the per-call argument conversion (about 3/4 of a
    decode's time, twice per token). Anything else goes through its `decode`."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None and _library_decode(tok):
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def _stream_backend(tok) -> tuple[Any, Any] | None:
    """(the `tokenizers` backend, DecodeStream) for a library fast tokenizer with a byte-level
    decoder (whose decoded windows always extend each other: the stream never refuses one), None
    where the Python window is used: another decoder, or no DecodeStream in this `tokenizers`."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel" or not _library_decode(tok):
        return None
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    return backend, DecodeStream


def _library_decode(tok) -> bool:
    """Whether tok's decode and _decode are transformers' fast-tokenizer ones (no override that
    could change the text)."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return False
    cls = type(tok)
    return (isinstance(tok, PreTrainedTokenizerFast)
            and getattr(cls, "decode", None) is getattr(PreTrainedTokenizerFast, "decode", None)
            and getattr(cls, "_decode", None) is getattr(PreTrainedTokenizerFast, "_decode", None))
