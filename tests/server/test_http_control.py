"""The HTTP control routes a trainer drives (server/http/control.py): refused without the API key,
pause and resume (requests sent while paused are held, then answered), and a weight update from
a checkpoint directory on disk after which the completions are HF transformers' greedy tokens of
the new weights; a bad path or a checkpoint of another shape answers 400 and changes nothing.
The shared tiny runner gets its own weights back at the end."""

import threading

import httpx2 as httpx
import pytest

from jaxserve.testing.tiny_models import hf_greedy, make_tiny_model
from tests.server.http_harness import API_KEY, HANG_GUARD_S, serving, wait_until

PROMPT = "The tide comes in"
N = 6

server, client = serving()


@pytest.fixture(scope="module")
def second_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama-seed2"), "llama", seed=2)


def post(server, path, body=None, key=API_KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.base_url.removesuffix("/v1") + path, json=body, headers=headers, timeout=HANG_GUARD_S)


def greedy_text(client, server):
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=N, temperature=0,
                                  extra_body={"ignore_eos": True})
    return r.choices[0].text


def served_by_the_runner(server, model_dir, ids):
    """The runner's greedy answer through the Python API (checked token for token against HF
    transformers on `model_dir`'s weights): the text the HTTP answer must be."""
    from jaxserve import SamplingParams

    out = server.reference(lambda llm: llm.generate({"prompt_token_ids": ids}, SamplingParams(
        max_tokens=N, temperature=0.0, ignore_eos=True), use_tqdm=False)[0].outputs[0])
    assert out.token_ids == hf_greedy(model_dir, ids, N)
    return out.text


def test_control_routes_are_refused_without_the_api_key(server):
    for path in ("/pause", "/resume", "/update_weights_from_disk"):
        r = post(server, path, {}, key=None)
        assert r.status_code == 401, path
    r = httpx.get(server.base_url.removesuffix("/v1") + "/is_paused", timeout=HANG_GUARD_S)
    assert r.status_code == 401


def test_a_request_sent_while_paused_is_held_until_resume(server, client):
    r = post(server, "/pause", {"mode": "keep"})
    assert r.status_code == 200 and r.json() == {"paused": True, "aborted": []}
    assert post(server, "/pause", {"mode": "sideways"}).status_code == 400
    got = {}
    sender = threading.Thread(target=lambda: got.update(r=client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=3, temperature=0)))
    sender.start()
    wait_until(lambda: server.stats().requests.num_held == 1, "the request to be held", HANG_GUARD_S)
    assert not got and server.stats().lifecycle.paused
    assert httpx.get(server.base_url.removesuffix("/v1") + "/is_paused", headers={"Authorization": f"Bearer {API_KEY}"},
                     timeout=HANG_GUARD_S).json() == {"is_paused": True}
    assert post(server, "/resume").json() == {"paused": False}
    sender.join(HANG_GUARD_S)
    assert got["r"].choices[0].finish_reason == "length" and not server.stats().lifecycle.paused


def test_update_from_disk_serves_the_new_weights_and_bad_ones_change_nothing(server, client, tiny_llama_dir,
                                                                             second_dir, tmp_path):
    runner = server.engine.runner
    own = runner.params
    ids = server.engine.tokenizer.encode(PROMPT)
    try:
        r = post(server, "/update_weights_from_disk", {"model_path": str(second_dir), "version": 3})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["version"] == 3 and body["num_requests_recomputed"] == 0 and body["seconds"] >= 0
        s = server.stats()
        assert s.weights.version == "3" and s.steps.num_compilations_after_warmup == 0
        assert greedy_text(client, server) == served_by_the_runner(server, second_dir, ids)

        before = runner.params
        missing = post(server, "/update_weights_from_disk", {"model_path": str(tmp_path / "nowhere")})
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "model_path"
        wider = make_tiny_model(tmp_path / "wider", "llama", seed=0, hidden_size=96)
        refused = post(server, "/update_weights_from_disk", {"model_path": str(wider)})
        assert refused.status_code == 400 and "shape" in refused.json()["error"]["message"]
        assert runner.params is before and server.stats().weights.version == "3"
    finally:
        server.run(server.state.aengine.update_weights(own))
    assert greedy_text(client, server) == served_by_the_runner(server, tiny_llama_dir, ids)
