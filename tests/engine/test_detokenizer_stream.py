"""The detokenizer's two windows give the same text: the `tokenizers` library's DecodeStream
(used for byte-level tokenizers, from the first window it can hold exactly) and the Python
prefix/read window (used otherwise), token by
token on random ids (which split multi-byte characters often), with special tokens skipped or
kept, with and without a prompt, and with several tokens per append (speculation); a stream
that raises mid-output goes on in the Python window without losing or repeating text."""

from __future__ import annotations

import random

import pytest

from jaxserve.engine import detokenizer
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.testing.tiny_models import make_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def _python_window(tok, prompt, skip):
    d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    d._stream = d._backend = None      # the Python window, as for a tokenizer without a byte-level decoder
    return d


def test_the_tests_tokenizer_takes_the_stream(tok):
    assert IncrementalDetokenizer(tok, [])._stream is not None


@pytest.mark.parametrize("seed", range(4))
def test_stream_and_python_window_emit_the_same_text(tok, seed):
    rng = random.Random(seed)
    vocab = len(tok)
    streamed = started_in_python = 0
    for _ in range(60):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 9))]
        out = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        skip = rng.random() < 0.5
        a = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        b = _python_window(tok, prompt, skip)
        started_in_python += a._stream is None
        i = 0
        while i < len(out):
            k = rng.randrange(1, 4)
            assert a.append(out[i:i + k]) == b.append(out[i:i + k])
            assert a.releasable() == b.releasable()
            i += k
        assert a.text == b.text
        streamed += a._stream is not None
    # most requests end on the stream, some of them after starting in the Python window (a
    # prompt ending inside a split character)
    assert streamed > 40 and started_in_python > 3


def test_a_stream_that_raises_goes_on_in_the_python_window(tok, monkeypatch):
    rng = random.Random(7)
    out = tok.encode("Hello there, héllo wörld! 12345 — done.", add_special_tokens=False)
    out += [rng.randrange(len(tok)) for _ in range(20)]
    want = _python_window(tok, [], True)
    want.append(out)
    d = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    d.append(out[:9])

    class Broken:
        def step(self, backend, t):
            raise Exception("Invalid prefix encountered")

    d._stream = Broken()
    d.append(out[9:])
    assert d._stream is None and d._backend is None and d.text == want.text


@pytest.mark.parametrize("python_window", [False, True])
def test_append_one_equals_append(tok, python_window):
    """The output processor's one-token step gives append's text, releasable counts and state,
    on the stream and on the Python window."""
    rng = random.Random(11)
    for _ in range(40):
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 9))]
        out = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 30))]
        a = _python_window(tok, prompt, True) if python_window else IncrementalDetokenizer(tok, prompt)
        b = _python_window(tok, prompt, True) if python_window else IncrementalDetokenizer(tok, prompt)
        for t in out:
            assert a.append_one(t) == b.append([t])
            assert a.releasable() == b.releasable() and a.num_consumed == b.num_consumed == 1
        assert a.text == b.text


def test_append_one_after_a_stream_raises_goes_on_in_the_python_window(tok):
    out = tok.encode("Hello there, héllo wörld! 12345 — done.", add_special_tokens=False)
    want = _python_window(tok, [], True)
    want.append(out)
    d = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    got = "".join(d.append_one(t) for t in out[:9])

    class Broken:
        def step(self, backend, t):
            raise Exception("Invalid prefix encountered")

    d._stream = Broken()
    got += "".join(d.append_one(t) for t in out[9:])
    assert d._stream is None and got == d.text == want.text
