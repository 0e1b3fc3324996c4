"""Logprobs of tokens inside a multi-byte character: chat's `bytes` are the token's own bytes (a
byte-level BPE token's from the byte-to-unicode table, not its vocabulary string's UTF-8), and
completions' text_offset does not drift after such a token."""

from jaxserve.outputs import Logprob
from jaxserve.server.http.logprobs import TokenText, chat_logprobs, completion_logprobs
from jaxserve.testing.tiny_models import make_tokenizer
from tests.server.http_harness import serving

TEXT = "café 東京 🙂 ok"

server, client = serving()


def _entries(ids):
    return [{t: Logprob(-0.5, 1)} for t in ids]


def test_chat_bytes_are_the_tokens_own_bytes():
    tok = make_tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([t]) for t in ids)   # some tokens are parts of a character
    content = chat_logprobs(ids, _entries(ids), 1, TokenText(tok)).content
    assert b"".join(bytes(c.bytes) for c in content) == TEXT.encode()
    assert all(bytes(c.top_logprobs[0].bytes) == bytes(c.bytes) for c in content)


def test_a_tokenizers_token_text_is_built_once_and_reads_the_decoder_only_when_a_token_needs_it(monkeypatch):
    # reading the decoder serializes the whole tokenizer (~40 ms for SmolLM2's): it once ran for
    # every HTTP request, logprobs or not
    from jaxserve.server.http import token_bytes

    reads = []
    read = token_bytes._decoder_kinds
    monkeypatch.setattr(token_bytes, "_decoder_kinds", lambda t: reads.append(1) or read(t))
    tok = make_tokenizer()
    shared = TokenText.of(tok)
    assert TokenText.of(tok) is shared and TokenText.of(make_tokenizer()) is not shared
    ascii_ids = tok.encode("ok", add_special_tokens=False)
    assert [shared.bytes(t) for t in ascii_ids] == [tok.decode([t]).encode() for t in ascii_ids]
    assert reads == []                       # whole tokens: their text's bytes, no decoder read
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert b"".join(shared.bytes(t) for t in ids) == TEXT.encode()
    assert reads == [1]                      # a split character's token read it, once


def test_text_offsets_follow_the_characters_not_the_token_names():
    tok = make_tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    lp = completion_logprobs(ids, _entries(ids), 1, TokenText(tok), 7)
    # each offset is where the token's text starts: the characters whole before it
    for i, offset in enumerate(lp.text_offset):
        before = tok.decode(ids[:i])
        assert offset == 7 + len(before.rstrip("\ufffd")), (i, offset, before)
    assert lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[-1] == 7 + len(TEXT) - len(tok.decode(ids[-1:]))   # no drift by the end


def test_served_chat_logprobs_bytes_make_up_the_answer(server, client):
    r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "1, 2, 3, 4,"}],
                                       max_tokens=12, temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True, "skip_special_tokens": False})
    choice = r.choices[0]
    got = b"".join(bytes(t.bytes) for t in choice.logprobs.content)
    assert got.decode("utf-8", errors="replace") == choice.message.content
