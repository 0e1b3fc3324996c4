"""The OpenAI-compatible HTTP API through the official `openai` client, against the real app and
uvicorn on loopback: completions and chat, streamed and not, n > 1, logprobs, usage with cached
tokens, /v1/models, /health and /metrics."""

import httpx2 as httpx
import pytest

from tests.server.http_harness import serving

PROMPT = "The tide comes in"


server, client = serving()


def test_models_lists_the_served_model_with_max_model_len(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    assert models.data[0].max_model_len == server.engine.max_model_len


def test_completion_has_text_usage_ids_and_finish_reason(server, client, tiny_llm):
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    expected = server.reference(lambda llm: llm.generate(PROMPT, _greedy(5), use_tqdm=False)[0])
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.created > 0
    assert r.model == server.model
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.choices[0].text == expected.outputs[0].text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert r.usage.completion_tokens == 5 and r.usage.total_tokens == r.usage.prompt_tokens + 5
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def _greedy(n):
    from jaxserve import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_streamed_completion_equals_the_whole_one_and_ends_with_usage(server, client):
    kw = dict(model=server.model, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_the_raw_event_stream_ends_with_done(server):
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.base_url + "/completions", json=body,
                      headers={"Authorization": f"Bearer {server.api_key}"}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]" and len(events) >= 2


def test_chat_uses_the_chat_template_streamed_and_not(server, client, tiny_llm):
    messages = [{"role": "user", "content": PROMPT}]
    r = client.chat.completions.create(model=server.model, messages=messages, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    expected = server.reference(lambda llm: llm.chat(messages, _greedy(5), use_tqdm=False)[0])
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected.outputs[0].text
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    chunks = list(client.chat.completions.create(model=server.model, messages=messages, max_tokens=5, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_samples_and_several_prompts_are_choices_by_index(server, client):
    kw = dict(model=server.model, max_tokens=4, temperature=1.0, seed=7, n=2, extra_body={"ignore_eos": True})
    whole = client.completions.create(prompt=[PROMPT, "Numbers: 1 2"], **kw)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in whole.choices)
    assert whole.usage.completion_tokens == 16
    streamed = {}
    for chunk in client.completions.create(prompt=[PROMPT, "Numbers: 1 2"], stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    # a seeded request samples the same tokens whatever shares its batch
    assert streamed == {c.index: c.text for c in whole.choices}


def test_completion_logprobs_list_each_token_with_its_top_alternatives(server, client):
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    # (their join may differ from the text: a token can be part of one UTF-8 character)
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) >= 3 and chosen <= 0
        assert top[tok] == pytest.approx(max(top.values()))   # greedy: the sampled token is the best
    # each token's offset: the characters whole before it (a token inside one shares its offset)
    ref = server.reference(lambda llm: llm.generate(PROMPT, _greedy(4), use_tqdm=False)[0].outputs[0])
    tok = server.engine.tokenizer
    assert lp.text_offset == [len(tok.decode(ref.token_ids[:i]).rstrip("\ufffd")) for i in range(4)]


def test_chat_logprobs_with_top_logprobs(server, client):
    r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": PROMPT}],
                                       max_tokens=3, temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob)
        # a token's own bytes: its text's, unless it is part of a UTF-8 character
        assert bytes(t.bytes).decode("utf-8", errors="replace") == t.token or not bytes(t.bytes).isascii()
    assert b"".join(bytes(t.bytes) for t in content).decode("utf-8", errors="replace") == r.choices[0].message.content


def test_a_second_request_with_the_same_prefix_reports_cached_tokens(server, client):
    prompt = "A paged KV cache stores keys and values in fixed-size blocks. " * 2
    kw = dict(model=server.model, prompt=prompt, max_tokens=2, extra_body={"cache_salt": "cached-tokens-test"})
    first = client.completions.create(**kw)
    second = client.completions.create(**kw)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    block = server.engine.scheduler.config.block_size
    cached = second.usage.prompt_tokens_details.cached_tokens
    # every full block but the one holding the last prompt token, which must be computed
    assert cached == (second.usage.prompt_tokens - 1) // block * block > 0


def test_health_and_metrics_are_open_and_metrics_count_the_requests(server):
    assert httpx.get(server.base_url.removesuffix("/v1") + "/health").status_code == 200
    text = httpx.get(server.base_url.removesuffix("/v1") + "/metrics").text
    assert "jaxserve_kv_blocks_total" in text
    count = [line for line in text.splitlines() if line.startswith("jaxserve_e2e_request_latency_seconds_count")]
    assert count and float(count[0].split()[-1]) >= 1


def test_penalties_and_logit_bias_are_applied_as_the_python_api_applies_them(server, client, tiny_llm):
    from jaxserve import SamplingParams

    kw = dict(max_tokens=8, temperature=0.0, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.5,
              repetition_penalty=1.3)
    expected = server.reference(
        lambda llm: llm.generate(PROMPT, SamplingParams(**kw), use_tqdm=False)[0].outputs[0].text)
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=8, temperature=0,
                                  presence_penalty=1.5, frequency_penalty=0.5,
                                  extra_body={"ignore_eos": True, "repetition_penalty": 1.3})
    assert r.choices[0].text == expected
    forced = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5, temperature=1.0,
                                       logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == tiny_llm.get_tokenizer().decode([42] * 5)


def test_echo_without_logprobs_runs_anywhere_and_with_them_needs_prompt_logprobs(server, client):
    kw = dict(model=server.model, prompt=PROMPT, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw)
    echo = client.completions.create(echo=True, **kw)
    assert echo.choices[0].text == PROMPT + plain.choices[0].text
    # this engine was built without enable_prompt_logprobs: the echoed prompt's logprobs are refused
    r = httpx.post(server.base_url + "/completions", json={"model": server.model, "prompt": PROMPT, "echo": True,
                                                          "logprobs": 1},
                   headers={"Authorization": f"Bearer {server.api_key}"}, timeout=60)
    assert r.status_code == 400 and "enable-prompt-logprobs" in r.json()["error"]["message"]
