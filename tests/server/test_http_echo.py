"""/v1/completions with echo (the prompt's tokens and logprobs before the completion's, OpenAI's
legacy shape), max_tokens 0 (the prompt alone), vLLM's prompt_logprobs field, and vLLM's
/tokenize, /detokenize and /tokenizer_info, on an engine that computes prompt logprobs."""

import httpx2 as httpx
import pytest

from jaxserve import SamplingParams
from tests.server.http_harness import HTTPServer

PROMPT = "The tide comes in twice a day"


@pytest.fixture(scope="module")
def server(prompt_logprobs_llm):
    s = HTTPServer(prompt_logprobs_llm)
    yield s
    s.close()


def post(server, path, body, base=None):
    url = (base or server.base_url) + path
    r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {server.api_key}"}, timeout=60)
    return r.status_code, r.json()


def root(server):
    return server.base_url.removesuffix("/v1")


def completion(server, **body):
    code, j = post(server, "/completions", {"model": server.model, "prompt": PROMPT, "temperature": 0,
                                            "ignore_eos": True, **body})
    assert code == 200, j
    return j


def reference(server, **params):
    return server.reference(lambda llm: llm.generate(PROMPT, SamplingParams(temperature=0, ignore_eos=True, **params),
                                                     use_tqdm=False)[0])


def test_echo_puts_the_prompt_and_its_logprobs_before_the_completion(server):
    ref = reference(server, max_tokens=3, logprobs=2, prompt_logprobs=2)
    ids = ref.prompt_token_ids
    plain = completion(server, max_tokens=3, logprobs=2)["choices"][0]
    echo = completion(server, max_tokens=3, logprobs=2, echo=True)
    c = echo["choices"][0]
    assert c["text"] == PROMPT + plain["text"]
    lp = c["logprobs"]
    n = len(ids) + 3
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    # the first prompt token has nothing before it
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for pos in range(1, len(ids)):
        want = ref.prompt_logprobs[pos][ids[pos]].logprob
        assert lp["token_logprobs"][pos] == pytest.approx(want, abs=1e-5)
        top = lp["top_logprobs"][pos]
        assert len(top) in (2, 3) and top[lp["tokens"][pos]] == pytest.approx(want, abs=1e-5)
    # then the completion's own entries, as without echo
    assert lp["tokens"][len(ids):] == plain["logprobs"]["tokens"]
    assert lp["token_logprobs"][len(ids):] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-5)
    # each token's offset: the characters whole before it (a token inside one shares its offset)
    tok, every = server.engine.tokenizer, list(ids) + list(ref.outputs[0].token_ids)
    assert lp["text_offset"] == [len(tok.decode(every[:i]).rstrip("\ufffd")) for i in range(n)]
    assert echo["usage"]["completion_tokens"] == 3


def test_max_tokens_zero_with_echo_is_the_prompt_alone(server):
    j = completion(server, max_tokens=0, logprobs=1, echo=True)
    c = j["choices"][0]
    assert c["text"] == PROMPT
    n = j["usage"]["prompt_tokens"]
    assert len(c["logprobs"]["tokens"]) == n and c["logprobs"]["token_logprobs"][0] is None
    assert all(x is not None for x in c["logprobs"]["token_logprobs"][1:])
    assert j["usage"]["completion_tokens"] == 0
    code, err = post(server, "/completions", {"model": server.model, "prompt": PROMPT, "max_tokens": 0})
    assert code == 400 and err["error"]["param"] == "max_tokens"


def test_streamed_echo_is_the_whole_echo_in_pieces(server):
    whole = completion(server, max_tokens=4, logprobs=1, echo=True)["choices"][0]
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, "echo": True, "stream": True}
    import json

    with httpx.stream("POST", server.base_url + "/completions", json=body,
                      headers={"Authorization": f"Bearer {server.api_key}"}, timeout=60) as r:
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == whole["text"]
    tokens = [t for ch in chunks for t in ch["choices"][0]["logprobs"]["tokens"]]
    assert tokens == whole["logprobs"]["tokens"]
    first = chunks[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"][0] is None and chunks[0]["choices"][0]["text"].startswith(PROMPT)


def test_prompt_logprobs_field_is_vllms(server):
    ref = reference(server, max_tokens=1, prompt_logprobs=3)
    c = completion(server, max_tokens=1, prompt_logprobs=3)["choices"][0]
    pl = c["prompt_logprobs"]
    assert len(pl) == len(ref.prompt_token_ids) and pl[0] is None
    for got, want in zip(pl[1:], ref.prompt_logprobs[1:]):
        assert {int(t): e["rank"] for t, e in got.items()} == {t: lp.rank for t, lp in want.items()}
        assert [got[str(t)]["logprob"] for t in want] == pytest.approx([lp.logprob for lp in want.values()])
        assert all(isinstance(e["decoded_token"], str) for e in got.values())
    assert c["logprobs"] is None and not c["text"].startswith(PROMPT)
    code, err = post(server, "/completions", {"model": server.model, "prompt": PROMPT, "prompt_logprobs": 1,
                                              "stream": True})
    assert code == 400 and err["error"]["param"] == "prompt_logprobs"
    code, err = post(server, "/completions", {"model": server.model, "prompt": PROMPT, "prompt_logprobs": 21})
    assert code == 400 and err["error"]["param"] == "prompt_logprobs"


def test_tokenize_detokenize_and_tokenizer_info(server):
    tok = server.engine.tokenizer
    code, j = post(server, "/tokenize", {"model": server.model, "prompt": PROMPT, "return_token_strs": True},
                   base=root(server))
    assert code == 200
    assert j["tokens"] == tok.encode(PROMPT) and j["count"] == len(j["tokens"])
    assert j["max_model_len"] == server.engine.max_model_len
    assert j["token_strs"] == tok.convert_ids_to_tokens(j["tokens"])
    code, d = post(server, "/detokenize", {"model": server.model, "tokens": j["tokens"]}, base=root(server))
    assert code == 200 and d == {"prompt": tok.decode(j["tokens"])}
    # messages: the ids a chat completion's prompt has
    messages = [{"role": "user", "content": PROMPT}]
    code, m = post(server, "/tokenize", {"messages": messages}, base=root(server))
    want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert code == 200 and m["tokens"] == list(want) and m["token_strs"] is None
    for body, param in (({"prompt": PROMPT, "messages": messages}, "prompt"), ({}, "prompt"),
                        ({"prompt": PROMPT, "model": "other"}, None)):
        code, err = post(server, "/tokenize", body, base=root(server))
        assert code in (400, 404) and (param is None or err["error"]["param"] == param), err
    code, err = post(server, "/detokenize", {"tokens": [1, 10**6]}, base=root(server))
    assert code == 400 and err["error"]["param"] == "tokens"
    r = httpx.get(root(server) + "/tokenizer_info", headers={"Authorization": f"Bearer {server.api_key}"}, timeout=60)
    info = r.json()
    assert r.status_code == 200 and info["tokenizer_class"] == type(tok).__name__
    assert info["chat_template"] == tok.chat_template
    assert httpx.post(root(server) + "/tokenize", json={"prompt": "x"}, timeout=60).status_code == 401
