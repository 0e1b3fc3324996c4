"""The engine's logprobs (per token: {token id: Logprob(logprob, rank)}, the sampled token always
in it) in the two shapes of the OpenAI API: the legacy completions shape (parallel lists) and the
chat shape (one object per token with its top alternatives)."""

from __future__ import annotations

import weakref

from jaxserve.outputs import Logprob
from jaxserve.server.http.schemas import ChatLogprobs, CompletionLogprobs, PromptLogprob, TokenLogprob, TopLogprob
from jaxserve.server.http.token_bytes import TokenBytes, text_offsets


class TokenText:
    """Each token id's own text, decoded alone (cached: the same ids come back again and again).
    A token that is part of a UTF-8 character decodes to U+FFFD alone, and several such tokens
    would share one key in a top-logprobs map: those are named by their vocabulary string
    (`convert_ids_to_tokens`, unique per id) instead; `bytes` gives a token's real bytes."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self.bytes = TokenBytes(tokenizer)

    @classmethod
    def of(cls, tokenizer) -> "TokenText":
        """The one TokenText of `tokenizer` (its caches shared by every request the front serves;
        a server's tokenizer does not change)."""
        if tokenizer is None:
            return cls(None)
        try:
            shared = _SHARED.get(tokenizer)
        except TypeError:          # not weakly referenceable: one per call
            return cls(tokenizer)
        if shared is None:
            shared = _SHARED[tokenizer] = cls(tokenizer)
        return shared

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id]) if self._tokenizer is not None else str(token_id)
            if "\ufffd" in text:
                text = self._tokenizer.convert_ids_to_tokens(token_id)
            self._cache[token_id] = text
        return text


_SHARED: "weakref.WeakKeyDictionary[object, TokenText]" = weakref.WeakKeyDictionary()


# A token outside the distribution it was drawn from has logprob -inf (logprobs_mode="processed":
# cut by top-k/top-p/min-p or masked). JSON has no infinity (the responses refuse it), so the API
# reports it as this floor, as vLLM's does.
LOGPROB_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def _ranked(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely tokens. The entry holds the top k plus the sampled token (whose rank the
    engine leaves unset), so the best k by logprob are exactly the top k."""
    return sorted(entry.items(), key=lambda x: -x[1].logprob)[:k]


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob] | None], k: int, text: TokenText,
                        offset: int) -> CompletionLogprobs:
    """`offset`: characters of this choice's text before these tokens (text_offset counts from there).
    An entry None (an echoed prompt's first token: nothing before it) lists the token with null
    token_logprobs and top_logprobs, as OpenAI's and vLLM's echo do."""
    out = CompletionLogprobs()
    pairs = list(zip(token_ids, entries))
    # offsets from the tokens' bytes, not their names' lengths ('Ã©' names one byte of 'é')
    out.text_offset = text_offsets([text.bytes(t) for t, _ in pairs], offset)
    for t, entry in pairs:
        s = text(t)
        out.tokens.append(s)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_finite(entry[t].logprob))
        top = {text(tid): _finite(lp.logprob) for tid, lp in _ranked(entry, k)}
        top.setdefault(s, _finite(entry[t].logprob))   # the sampled token is always listed
        out.top_logprobs.append(top)
    return out


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], k: int, text: TokenText) -> ChatLogprobs:
    content = []
    for t, entry in zip(token_ids, entries):
        s = text(t)
        top = [TopLogprob(token=text(tid), logprob=_finite(lp.logprob), bytes=list(text.bytes(tid)))
               for tid, lp in _ranked(entry, k)]
        content.append(TokenLogprob(token=s, logprob=_finite(entry[t].logprob), bytes=list(text.bytes(t)),
                                    top_logprobs=top))
    return ChatLogprobs(content=content)


def prompt_logprobs_field(entries: list[dict[int, Logprob] | None], text: TokenText) -> list:
    """RequestOutput.prompt_logprobs in vLLM's JSON shape: per prompt token None (the first) or
    {token id: {logprob, rank, decoded_token}}."""
    return [None if e is None else {str(tid): PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=text(tid))
                                    for tid, lp in e.items()}
            for e in entries]
