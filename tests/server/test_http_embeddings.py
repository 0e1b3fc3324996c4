"""POST /v1/embeddings through the official openai client (float and base64) and raw HTTP: HF's
embeddings for every input form (a string, strings, token ids, lists of them), usage, the
`normalize` extra, the refusals (dimensions, empty or too long input, unknown fields, a server
without embeddings), and AsyncEngine.embed under it."""

import asyncio

import httpx2 as httpx
import numpy as np
import pytest

from jaxserve import PoolingParams
from jaxserve.engine.async_engine import EmbeddingAborted
from tests.engine.test_embeddings import PROMPTS, RTOL, hf_embedding
from tests.server.http_harness import HTTPServer


@pytest.fixture(scope="module")
def server(embedding_llm):
    s = HTTPServer(embedding_llm)
    yield s
    s.close()


def post(server, body):
    r = httpx.post(server.base_url + "/embeddings", json=body,
                   headers={"Authorization": f"Bearer {server.api_key}"}, timeout=60)
    return r.status_code, r.json()


def token_ids(server, text):
    return server.engine.tokenizer.encode(text)


def assert_hf(path, ids, vector, pooling="last", normalize=True):
    want = hf_embedding(path, ids, pooling, normalize)
    got = np.asarray(vector, np.float64)
    assert got.shape == want.shape
    assert np.linalg.norm(got - want) <= RTOL * np.linalg.norm(want)


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_the_openai_client_gets_hf_s_embeddings(server, tiny_llama_dir, encoding_format):
    client = server.client()
    # the client asks for base64 when it is not told otherwise, and decodes it
    kw = {"encoding_format": "float"} if encoding_format == "float" else {}
    got = client.embeddings.create(input=PROMPTS, model=server.model, user="someone", **kw)
    assert got.object == "list" and got.model == server.model
    assert [d.index for d in got.data] == [0, 1, 2] and all(d.object == "embedding" for d in got.data)
    ids = [token_ids(server, p) for p in PROMPTS]
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(map(len, ids))
    for d, prompt_ids in zip(got.data, ids):
        assert_hf(tiny_llama_dir, prompt_ids, d.embedding)
    assert server.stats().steps.num_compilations_after_warmup == 0


def test_base64_is_the_float32_bytes_of_the_floats(server):
    body = {"model": server.model, "input": PROMPTS[0]}
    code, as_float = post(server, body)
    code64, as_b64 = post(server, {**body, "encoding_format": "base64"})
    assert code == code64 == 200
    import base64

    decoded = np.frombuffer(base64.b64decode(as_b64["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == as_float["data"][0]["embedding"]


def test_token_ids_lists_of_them_and_normalize_false(server, tiny_llama_dir):
    ids = [token_ids(server, p) for p in PROMPTS[:2]]
    code, one = post(server, {"input": ids[0]})
    assert code == 200 and len(one["data"]) == 1 and one["usage"]["prompt_tokens"] == len(ids[0])
    assert_hf(tiny_llama_dir, ids[0], one["data"][0]["embedding"])
    code, two = post(server, {"input": ids, "normalize": False, "dimensions": 64})
    assert code == 200, two
    for d, prompt_ids in zip(two["data"], ids):
        assert_hf(tiny_llama_dir, prompt_ids, d["embedding"], normalize=False)
    assert np.linalg.norm(two["data"][0]["embedding"]) != pytest.approx(1.0)


@pytest.mark.parametrize("body, param, status", [
    ({"input": "hi", "dimensions": 32}, "dimensions", 400),
    ({"input": ""}, "input", 400),
    ({"input": []}, "input", 400),
    ({"input": ["a", ""]}, "input", 400),
    ({"input": [[1, 2], []]}, "input", 400),
    ({"input": [1] * 128}, "input", 400),                 # no room left in max_model_len=128
    ({"input": [5, 100000]}, "input", 400),               # outside the vocabulary
    ({"input": "hi", "pooling": "max"}, "pooling", 400),
    ({"input": "hi", "poolin": "mean"}, "poolin", 400),    # unknown fields are refused
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", 400),
    ({"input": "hi", "model": "other"}, "model", 404),
    ({"input": ["a"] * 4097}, "input", 400),              # over --max-embedding-inputs (4096)
])
def test_refusals(server, body, param, status):
    code, j = post(server, body)
    assert code == status, j
    assert j["error"]["param"] == param, j


def test_too_many_inputs_are_refused_naming_the_cap_before_any_is_queued(server):
    code, j = post(server, {"input": ["hello there"] * 10_000})
    assert code == 400 and "--max-embedding-inputs" in j["error"]["message"] and "4096" in j["error"]["message"]
    stats = server.stats()
    assert stats.scheduler.num_running == stats.scheduler.num_waiting == 0


def test_inputs_past_the_input_token_cap_are_refused_naming_it(server):
    # the default cap: --max-prompts (64) prompts of the longest runnable prompt (max_model_len 128)
    cap = 64 * server.engine.max_model_len
    body = [[7] * 100] * (cap // 100 + 1)        # every input runnable, their sum past the cap
    assert len(body) < 4096
    code, j = post(server, {"input": body})
    assert code == 400 and j["error"]["param"] == "input", j
    assert "--max-input-tokens" in j["error"]["message"] and f"limit is {cap}" in j["error"]["message"]
    stats = server.stats()
    assert stats.scheduler.num_running == stats.scheduler.num_waiting == 0
    code, j = post(server, {"input": [[7] * 100] * (cap // 100)})    # at the cap: served
    assert code == 200 and j["usage"]["prompt_tokens"] == 100 * (cap // 100)


def test_a_refused_input_leaves_nothing_queued(server):
    code, _ = post(server, {"input": [[1, 2, 3], [1] * 128]})
    assert code == 400
    stats = server.stats()
    assert stats.scheduler.num_running == stats.scheduler.num_waiting == 0


def test_mean_pooling_over_http(server, tiny_llama_dir):
    ids = token_ids(server, PROMPTS[0])
    code, j = post(server, {"input": ids, "pooling": "mean", "normalize": False})
    assert code == 200, j
    assert_hf(tiny_llama_dir, ids, j["data"][0]["embedding"], "mean", normalize=False)
    code, last = post(server, {"input": ids, "normalize": False})
    assert not np.allclose(last["data"][0]["embedding"], j["data"][0]["embedding"])


def test_async_engine_embed(server, tiny_llama_dir):
    out = server.run(server.state.aengine.embed(PROMPTS[1], PoolingParams("mean", normalize=False)))
    assert_hf(tiny_llama_dir, out.prompt_token_ids, out.outputs.embedding, "mean", normalize=False)
    with pytest.raises(ValueError, match="PoolingParams"):
        server.run(server.state.aengine.embed(PROMPTS[1], params="mean"))


def test_an_aborted_embedding_raises_embedding_aborted(server):
    aengine = server.state.aengine

    async def go():
        await aengine.pause("keep")              # requests added now are held: nothing races the abort
        try:
            task = asyncio.ensure_future(aengine.embed(PROMPTS[0], request_id="held"))
            while (await aengine.stats()).requests.num_held == 0:
                await asyncio.sleep(0.01)
            await aengine.abort("held")
            with pytest.raises(EmbeddingAborted):
                await task
        finally:
            await aengine.resume()
        return await aengine.stats()

    stats = server.run(go())
    assert stats.requests.num_held == stats.scheduler.num_running == stats.scheduler.num_waiting == 0


def test_a_server_without_embeddings_refuses_them(tiny_llm):
    s = HTTPServer(tiny_llm)
    try:
        code, j = post(s, {"input": "hi"})
    finally:
        s.close()
    assert code == 400 and "--enable-embeddings" in j["error"]["message"]
