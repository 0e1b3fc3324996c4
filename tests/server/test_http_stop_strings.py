"""A stop string that spans several tokens never leaks into streamed output: the engine holds back
the tail of the text that could begin a stop string (and the tokens that produced it) until it is
known, so HTTP (streamed and not), gRPC streams and the AsyncEngine all end with LLM.generate's
text. Held-back text that turns out not to be a stop string is released."""

import asyncio

from jaxserve import LLM, SamplingParams
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.testing.tiny_models import make_tokenizer
from tests.server.http_harness import serving

PROMPT = "1, 2, 3, 4,"
MAX_TOKENS = 16

server, client = serving()


def test_the_detokenizer_releases_nothing_that_may_begin_a_stop_string():
    tok = make_tokenizer()
    ids = tok.encode(" 5, 6, 7, 8", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, tok.encode(PROMPT, add_special_tokens=False), stop=("6, 7",))
    released = []
    for t in ids:
        d.append([t])
        released.append(d.text[:d.releasable()[1]])
        if d.stopped_by:
            break
    assert d.stopped_by == "6, 7" and d.text == " 5, "
    assert all(" 5, ".startswith(r) for r in released)        # never a character the end cuts
    tokens, chars = d.releasable()
    assert tokens == len(d._text_ends) and chars == len(d.text)   # found: everything goes


def test_held_back_tokens_produced_exactly_the_held_back_text():
    tok = make_tokenizer()
    d = IncrementalDetokenizer(tok, [], stop=("5, 6!",))
    ids = tok.encode(" 4, 5, 6, 7", add_special_tokens=False)
    for t in ids:
        d.append([t])
        k, chars = d.releasable()
        assert tok.decode(ids[:k]) == d.text[:chars]
    assert d.releasable() == (len(ids), len(d.text))   # the stop never came: nothing is held at the end


def _stop_spanning_two_tokens(token_ids, tok):
    """A stop string made of two tokens' text in the middle of the greedy output, and the text
    before it (what the answer must be)."""
    texts = [tok.decode(token_ids[:j]) for j in range(len(token_ids) + 1)]
    for i in range(1, len(token_ids) - 2):
        before, first, both = texts[i], texts[i + 1], texts[i + 2]
        stop = both[len(before):]
        if ("\ufffd" in stop or not first.startswith(before) or not both.startswith(first)
                or len(first) == len(before) or len(both) == len(first) or stop in before
                or not texts[-1].startswith(both)):
            continue
        return stop, before
    raise AssertionError(f"no two-token stop string in {texts[-1]!r}")


def _greedy(**kw):
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **kw)


def _case(server):
    """(stop string, LLM.generate's text with it, LLM.generate's text without it)."""
    plain = server.reference(lambda llm: llm.generate(PROMPT, _greedy(), use_tqdm=False)[0].outputs[0])
    stop, before = _stop_spanning_two_tokens(plain.token_ids, server.engine.tokenizer)
    stopped = server.reference(lambda llm: llm.generate(PROMPT, _greedy(stop=(stop,)), use_tqdm=False)[0].outputs[0])
    assert stopped.text == before and stopped.finish_reason == "stop"
    return stop, stopped.text, plain.text


def test_completions_streamed_and_not_end_before_the_stop_string(server, client):
    stop, expected, _ = _case(server)
    kw = dict(model=server.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=[stop],
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected


def test_chat_streamed_ends_before_the_stop_string(server, client):
    stop, _, _ = _case(server)
    messages = [{"role": "user", "content": PROMPT}]
    kw = dict(model=server.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
              extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(**kw).choices[0].message.content
    if stop not in plain:   # the chat prompt's greedy answer is another text: take its own stop string
        ids = server.engine.tokenizer.encode(plain, add_special_tokens=False)
        stop, _ = _stop_spanning_two_tokens(ids, server.engine.tokenizer)
    whole = client.chat.completions.create(stop=[stop], **kw).choices[0].message.content
    assert stop not in whole and plain.startswith(whole + stop)
    chunks = list(client.chat.completions.create(stop=[stop], stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole


def test_a_held_back_prefix_that_is_no_stop_string_is_released(server, client):
    stop, expected, plain = _case(server)
    never = stop + "\x01never"   # starts like the real text, never completes
    kw = dict(model=server.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=[never],
              extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_streamed_tokens_and_logprobs_go_with_the_text_they_produced(server, client):
    stop, expected, _ = _case(server)
    kw = dict(model=server.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=[stop], logprobs=1,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    streamed = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    assert streamed == whole.logprobs.tokens      # every token once, the stop string's too
    # the stop string's two tokens waited with their text: both come in the chunk that ends it
    end = next(c for c in chunks if c.finish_reason is not None)
    assert end.finish_reason == "stop" and end.logprobs.tokens[-2:] == whole.logprobs.tokens[-2:]
    assert "".join(c.text for c in chunks) == expected


def test_the_grpc_stream_ends_before_the_stop_string(server, tiny_llm):
    from tests.server.test_servicer_in_process import serve

    stop, expected, _ = _case(server)
    engine = LLM.sharing_runner(tiny_llm).engine

    async def body(client, state):
        texts = [c.text async for c in client.stream_chunks(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                                             ignore_eos=True, stop=[stop])]
        return "".join(texts)

    tiny_llm.engine.reset_prefix_cache()
    try:
        assert asyncio.run(serve(engine, body)) == expected
    finally:
        tiny_llm.engine.reset_prefix_cache()
        server.run(server.state.aengine.call(lambda e: e.reset_prefix_cache()))


def test_async_engine_delta_outputs_end_before_the_stop_string(server):
    from jaxserve.sampling_params import OutputKind

    stop, expected, _ = _case(server)

    async def run():
        params = _greedy(stop=(stop,), output_kind=OutputKind.DELTA)
        return "".join([o.outputs[0].text async for o in server.state.aengine.generate(PROMPT, params,
                                                                                       request_id="stop-delta")])
    assert server.run(run()) == expected
