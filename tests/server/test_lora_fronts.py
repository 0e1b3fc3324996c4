"""LoRA adapters through the server's fronts, on the tiny Llama with random PEFT adapters
(tests/lora/conftest.py): gRPC LoadLoRAAdapter / ListLoRAAdapters / UnloadLoRAAdapter and a
Generate naming `lora_name`; HTTP /v1/load_lora_adapter and /v1/unload_lora_adapter behind the
API key, the adapter listed by /v1/models (parent: the base model) and served as `model`, one
batch mixing the base model and two adapters; each answer is HF + peft's greedy continuation
(checked through the Python API on the same engine before the servers start). Errors: a name in
use, a path that is no adapter, an unknown name, a server without --enable-lora."""

import asyncio

import grpc
import httpx2 as httpx
import pytest
from grpc import aio

from jaxserve import LLM, LoRARequest, SamplingParams
from jaxserve.client import AsyncGenerationClient
from jaxserve.testing.lora_adapters import hf_peft_greedy
from tests.lora.conftest import LORA_ENGINE, adapter_dirs  # noqa: F401  (the fixture)
from tests.sched.sched_testkit import check_invariants
from tests.server.http_harness import API_KEY, HANG_GUARD_S, HTTPServer
from tests.server.test_front_in_process import serve

PROMPT = [5, 17, 33, 71, 9, 100, 42, 8, 11]
N = 8
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


@pytest.fixture(scope="module")
def lora_llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, **LORA_ENGINE)


@pytest.fixture(scope="module")
def expected(lora_llm, tiny_llama_dir, adapter_dirs):  # noqa: F811
    """name (None: the base model) -> (token ids, text): the engine's greedy answer through the
    Python API, checked token for token against HF + peft, taken before any server runs."""
    names = [None, "qv4", "all8"]
    loras = [None if n is None else LoRARequest(n, i + 1, adapter_dirs[n]) for i, n in enumerate(names)]
    outs = lora_llm.generate([{"prompt_token_ids": PROMPT}] * 3, GREEDY, lora_request=loras, use_tqdm=False)
    got = {}
    for name, out in zip(names, outs):
        c = out.outputs[0]
        assert list(c.token_ids) == hf_peft_greedy(tiny_llama_dir, adapter_dirs.get(name), PROMPT, N), name
        got[name] = (list(c.token_ids), c.text)
    assert len({tuple(t) for t, _ in got.values()}) == 3    # each adapter changes the answer: the test can fail
    for name in ("qv4", "all8"):
        assert lora_llm.engine.remove_lora(name)     # the fronts load them again, by their own names
    return got


def test_grpc_loads_lists_serves_and_unloads_adapters(lora_llm, expected, adapter_dirs, tmp_path):  # noqa: F811
    engine = lora_llm.engine

    async def body(target, state):
        async with AsyncGenerationClient(target, timeout=HANG_GUARD_S) as anonymous:
            with pytest.raises(aio.AioRpcError) as refused:
                await anonymous.load_lora_adapter("qv4", adapter_dirs["qv4"])
        async with AsyncGenerationClient(target, api_key=API_KEY, timeout=HANG_GUARD_S) as c:
            await c.load_lora_adapter("qv4", adapter_dirs["qv4"])
            listed = await c.list_lora_adapters()
            errors = {}
            for what, call in {"twice": c.load_lora_adapter("qv4", adapter_dirs["all8"]),
                               "no adapter": c.load_lora_adapter("x", str(tmp_path)),
                               "unknown unload": c.unload_lora_adapter("nope"),
                               "unknown generate": c.generate(PROMPT, lora_name="nope", max_tokens=2)}.items():
                with pytest.raises(aio.AioRpcError) as e:
                    await call
                errors[what] = e.value
            adapted, base = await asyncio.gather(
                c.generate(PROMPT, lora_name="qv4", max_tokens=N, temperature=0.0, ignore_eos=True),
                c.generate(PROMPT, max_tokens=N, temperature=0.0, ignore_eos=True))
            await c.unload_lora_adapter("qv4")
            after = await c.list_lora_adapters()
        return refused.value, listed, errors, adapted, base, after

    refused, listed, errors, adapted, base, after = asyncio.run(serve(engine, body, api_key=API_KEY))
    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED
    assert [(a.lora_name, a.lora_path) for a in listed] == [("qv4", adapter_dirs["qv4"])] and listed[0].lora_int_id >= 1
    assert errors["twice"].code() == grpc.StatusCode.INVALID_ARGUMENT and "already loaded" in errors["twice"].details()
    assert errors["no adapter"].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert errors["unknown unload"].code() == grpc.StatusCode.NOT_FOUND
    assert errors["unknown generate"].code() == grpc.StatusCode.NOT_FOUND
    assert adapted.token_ids == expected["qv4"][0]
    assert base.token_ids == expected[None][0]
    assert after == []
    assert engine.stats().steps.num_compilations_after_warmup == 0
    check_invariants(engine.scheduler)


@pytest.fixture(scope="module")
def server(lora_llm, expected):
    s = HTTPServer(lora_llm, share_runner=False)
    yield s
    s.close()


def post(server, path, body, key=API_KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.base_url.removesuffix("/v1") + path, json=body, headers=headers, timeout=HANG_GUARD_S)


def test_http_load_list_serve_and_unload(server, expected, adapter_dirs, tmp_path):  # noqa: F811
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "qv4", "lora_path": adapter_dirs["qv4"]},
                key=None).status_code == 401
    for name in ("qv4", "all8"):
        r = post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": adapter_dirs[name]})
        assert r.status_code == 200 and name in r.text, r.text
    again = post(server, "/v1/load_lora_adapter", {"lora_name": "qv4", "lora_path": adapter_dirs["qv4"]})
    assert again.status_code == 409 and "already loaded" in again.json()["error"]["message"]   # its state
    not_adapter = post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})
    assert not_adapter.status_code == 404 and not_adapter.json()["error"]["param"] == "lora_path"
    unknown_field = post(server, "/v1/load_lora_adapter", {"lora_name": "y", "lora_path": "p", "rank": 4})
    assert unknown_field.status_code == 400

    with server.client() as client:
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {server.model, "qv4", "all8"}
        assert cards["qv4"].parent == server.model and cards["qv4"].root == adapter_dirs["qv4"]
        assert client.models.retrieve("all8").id == "all8"

        def complete(model):
            return client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0,
                                             extra_body={"ignore_eos": True})

        # three concurrent requests: one batch mixing the base model and both adapters
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(3) as pool:
            answers = dict(zip([None, "qv4", "all8"], pool.map(complete, [server.model, "qv4", "all8"])))
        for name, answer in answers.items():
            assert answer.choices[0].text == expected[name][1], name
            assert answer.model == (server.model if name is None else name)

        import openai

        with pytest.raises(openai.NotFoundError):
            complete("nope")

    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "qv4"})
    assert r.status_code == 200, r.text
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "qv4"}).status_code == 404
    with server.client() as client:
        assert {m.id for m in client.models.list().data} == {server.model, "all8"}
    server.wait_idle()
    assert server.stats().steps.num_compilations_after_warmup == 0
    check_invariants(server.engine.scheduler)


def test_a_server_without_lora_refuses_adapters(tiny_llm):
    s = HTTPServer(tiny_llm)
    try:
        r = post(s, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/nowhere"})
        assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]
        with s.client() as client:
            import openai

            with pytest.raises(openai.NotFoundError):
                client.completions.create(model="a", prompt=PROMPT, max_tokens=1)
    finally:
        s.close()
