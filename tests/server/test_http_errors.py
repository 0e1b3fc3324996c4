"""The HTTP API's errors in OpenAI's shape and status codes (400 naming the parameter, 401, 404,
429, 503), and a client that leaves (mid-stream, or while waiting for a whole answer) aborting its
request so that its KV blocks are freed. Requests are held in flight by a StepGate, never by
racing the clock."""

import json
import socket

import httpx2 as httpx
import openai
import pytest

from tests.server.http_harness import blocks_all_free, serving, wait_until

PROMPT = "The tide comes in"


server, client = serving(max_waiting_requests=1)


def error_of(e: openai.APIStatusError) -> dict:
    body = e.response.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]


@pytest.mark.parametrize("field, value", [("temperature", -1), ("top_p", 1.5), ("n", 9), ("max_tokens", 0),
                                          ("logprobs", 50), ("top_k", "many"), ("not_a_field", 1),
                                          ("presence_penalty", 2.5), ("repetition_penalty", 0),
                                          ("logit_bias", {"x": 1}), ("logit_bias", {"1": 101}),
                                          ("logit_bias", {"99999": 1}), ("stop_token_ids", [1000000])])
def test_a_bad_field_is_a_400_naming_it(server, client, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt=PROMPT, max_tokens=2, extra_body={field: value})
    err = error_of(e.value)
    assert e.value.status_code == 400 and err["type"] == "invalid_request_error"
    assert err["param"] == field, err


def test_chat_fields_are_named_as_the_chat_api_spells_them(server, client):
    messages = [{"role": "user", "content": PROMPT}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model, messages=messages, logprobs=True, top_logprobs=99)
    assert error_of(e.value)["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model, messages=[{"role": "wizard", "content": "hi"}])
    err = error_of(e.value)
    assert err["param"] == "messages[0].role" and "allowed" in err["message"]


def test_a_prompt_too_long_is_a_400_with_the_numbers(server, client):
    m = server.engine.max_model_len
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt=[1] * (m + 5), max_tokens=2)
    err = error_of(e.value)
    assert err["param"] == "prompt" and f"max_model_len is {m}" in err["message"]


def test_a_body_that_is_not_json_is_a_400(server):
    r = httpx.post(server.base_url + "/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {server.api_key}", "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_beyond_the_limit_is_a_413_and_the_server_serves_on(server, client, chunked):
    body = json.dumps({"model": server.model, "prompt": "t" * server.max_body_bytes}).encode()
    content = iter([body[i:i + 65536] for i in range(0, len(body), 65536)]) if chunked else body
    r = httpx.post(server.base_url + "/completions", content=content, timeout=60,
                   headers={"Authorization": f"Bearer {server.api_key}", "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    assert client.completions.create(model=server.model, prompt=PROMPT, max_tokens=2).usage.completion_tokens >= 1


def test_an_unknown_model_is_a_404(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-17", prompt=PROMPT, max_tokens=2)
    assert error_of(e.value)["code"] == "model_not_found" and error_of(e.value)["param"] == "model"


@pytest.mark.parametrize("key", [None, "wrong"])
def test_without_the_api_key_every_v1_route_is_a_401_but_health_is_open(server, key):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for method, path, body in (("GET", "/models", None), ("POST", "/completions", {"prompt": "x"}),
                               ("POST", "/chat/completions", {"messages": []})):
        r = httpx.request(method, server.base_url + path, json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
        assert r.headers["www-authenticate"].startswith("Bearer"), path   # the scheme to authenticate with
    assert httpx.get(server.base_url.removesuffix("/v1") + "/health").status_code == 200
    # the scheme is case-insensitive, the key is not
    r = httpx.get(server.base_url + "/models", headers={"Authorization": f"bearer {server.api_key}"})
    assert r.status_code == 200


def test_warming_up_or_draining_is_a_503(server, client):
    from jaxserve.server.state import Phase

    for phase in (Phase.WARMING_UP, Phase.DRAINING):
        server.state.phase = phase
        try:
            with pytest.raises(openai.APIStatusError) as e:
                client.completions.create(model=server.model, prompt=PROMPT, max_tokens=2)
            assert e.value.status_code == 503, phase
            assert httpx.get(server.base_url.removesuffix("/v1") + "/health").status_code == 503
        finally:
            server.state.phase = Phase.SERVING
    assert client.completions.create(model=server.model, prompt=PROMPT, max_tokens=2).usage.completion_tokens >= 1


def raw_post(server, path: str, body: dict) -> socket.socket:
    """Send a request on a socket of our own and return it unread: closing it is a disconnect."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", server.listener.port))
    s.sendall(f"POST /v1{path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {server.api_key}\r\n"
              f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def test_a_full_waiting_queue_is_a_429_and_the_others_are_undisturbed(server, client):
    seats = server.engine.scheduler.config.max_num_seqs
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True}
    server.gate.close()
    socks = []
    try:
        for _ in range(seats + 1):   # every seat taken, one more waiting: the queue's limit
            socks.append(raw_post(server, "/completions", body))
        wait_until(lambda: (lambda s: s.scheduler.num_running == seats and s.scheduler.num_waiting == 1)(server.stats()),
                   "every seat taken and one request waiting")
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=server.model, prompt=PROMPT, max_tokens=8)
        assert e.value.status_code == 429 and "max_waiting_requests=1" in error_of(e.value)["message"]
        assert int(e.value.response.headers["retry-after"]) >= 1
        server.gate.open()
        for s in socks:              # the held requests finish whole
            s.settimeout(120)
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                reply += s.recv(65536)
            assert reply.startswith(b"HTTP/1.1 200") and b'"completion_tokens":8' in reply
    finally:
        server.gate.open()
        for s in socks:
            s.close()


def test_a_client_leaving_mid_stream_aborts_its_request_and_frees_its_blocks(server):
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 64, "ignore_eos": True, "stream": True}
    server.gate.close()
    try:
        with httpx.stream("POST", server.base_url + "/completions", json=body,
                          headers={"Authorization": f"Bearer {server.api_key}"}, timeout=120) as r:
            lines = r.iter_lines()   # kept: a line iterator dropped early closes the connection
            first = next(lines)
            assert first.startswith("data: {") and server.stats().scheduler.num_running == 1
        # the stream is closed, the request held mid-generation: only the disconnect can end it
        wait_until(lambda: server.stats().scheduler.num_running == 0, "the request to be aborted")
        assert blocks_all_free(server.stats())
        assert server.engine.finished_by_reason.get("abort", 0) >= 1
    finally:
        server.gate.open()


def test_a_client_leaving_before_a_whole_answer_aborts_its_request(server):
    aborted = server.engine.finished_by_reason.get("abort", 0)
    server.gate.close()
    try:
        s = raw_post(server, "/chat/completions", {"model": server.model, "max_tokens": 64, "ignore_eos": True,
                                                   "messages": [{"role": "user", "content": PROMPT}]})
        wait_until(lambda: server.stats().scheduler.num_running == 1, "the request to run")
        s.close()
        wait_until(lambda: server.stats().scheduler.num_running == 0, "the request to be aborted")
        assert blocks_all_free(server.stats())
        assert server.engine.finished_by_reason.get("abort", 0) == aborted + 1
    finally:
        server.gate.open()


@pytest.mark.parametrize("path, stream", [("/completions", True), ("/completions", False),
                                          ("/chat/completions", True), ("/responses", True)])
def test_a_client_leaving_while_its_request_waits_aborts_it_before_any_output(server, path, stream):
    """Every seat held (the gate closed), the request waits in the queue and has sent nothing: a
    streamed answer's connection is watched all the same, so its leaving aborts the request."""
    seats = server.engine.scheduler.config.max_num_seqs
    hold = {"model": server.model, "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True}
    if path == "/completions":
        body = {"model": server.model, "prompt": PROMPT, "max_tokens": 8, "stream": stream}
    elif path == "/chat/completions":
        body = {"model": server.model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
                "stream": stream}
    else:
        body = {"model": server.model, "input": PROMPT, "max_output_tokens": 8, "stream": stream}
    aborted = server.engine.finished_by_reason.get("abort", 0)
    server.gate.close()
    holders = []
    try:
        for _ in range(seats):
            holders.append(raw_post(server, "/completions", hold))
        wait_until(lambda: server.stats().scheduler.num_running == seats, "every seat taken")
        leaver = raw_post(server, path, body)
        wait_until(lambda: server.stats().scheduler.num_waiting == 1, "the request to wait for a seat")
        leaver.close()
        wait_until(lambda: server.stats().scheduler.num_waiting == 0, "the waiting request to be aborted")
        assert server.engine.finished_by_reason.get("abort", 0) == aborted + 1
        assert server.stats().scheduler.num_running == seats     # the others are untouched
    finally:
        server.gate.open()
        for s in holders:
            s.close()
    wait_until(lambda: server.stats().scheduler.num_running == 0, "the held requests to end")
    assert blocks_all_free(server.stats())


@pytest.mark.parametrize("method, path, allowed", [
    ("OPTIONS", "/health", {"GET", "HEAD"}),
    ("POST", "/health", {"GET", "HEAD"}),
    ("PUT", "/v1/responses/resp_x", {"GET", "DELETE"}),
    ("GET", "/v1/completions", {"POST"}),
])
def test_a_405_allows_every_method_the_path_takes(server, method, path, allowed):
    r = httpx.request(method, server.base_url.removesuffix("/v1") + path,
                      headers={"Authorization": f"Bearer {server.api_key}"})
    assert r.status_code == 405, r.text
    assert {m.strip() for m in r.headers["allow"].split(",")} == allowed
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_a_live_request_id_again_and_a_missing_body_name_their_param(server):
    headers = {"Authorization": f"Bearer {server.api_key}"}
    server.gate.close()
    try:
        body = {"model": server.model, "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "request_id": "dup-1"}
        s = raw_post(server, "/completions", body)
        wait_until(lambda: server.stats().scheduler.num_running == 1, "the first request to run")
        r = httpx.post(server.base_url + "/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "request_id", r.text
        s.close()
    finally:
        server.gate.open()
    for content in (b"", b"null"):
        r = httpx.post(server.base_url + "/completions", content=content,
                       headers={**headers, "Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "body" and "body" in r.json()["error"]["message"], r.text
