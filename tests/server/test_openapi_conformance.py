"""/openapi.json against the server it describes (server/http/openapi.py).

The default set checks the document's promises on a live server: every status the server sends is
declared with OpenAI's error body (and FastAPI's 422, never sent, is not), text endpoints are text,
the server's own limits are in the request schemas, routes it does not serve are not listed, and a
refusal no schema can express carries its code. The slow set runs schemathesis with every check
(response conformance, status codes, content types, negative and positive data, auth, the stateful
links) over the whole document: `pytest -m slow tests/server/test_openapi_conformance.py`.
"""

import os
import subprocess
import sys
from pathlib import Path

import httpx2 as httpx
import pytest

from jaxserve.server.chat_roles import chat_roles
from jaxserve.server.http.openapi import REFUSAL_CODES
from jaxserve.server.request_caps import RequestCaps
from tests.server.http_harness import API_KEY, HTTPServer

AUTH = {"Authorization": f"Bearer {API_KEY}"}
# small enough for a fuzz run to send the largest bodies the document allows
LIMITS = RequestCaps(max_n=4, max_prompts=8, max_embedding_inputs=16)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(embedding_llm):
    s = HTTPServer(embedding_llm)
    s.front.limits = LIMITS
    yield s
    s.close()


def root(s) -> str:
    return s.base_url.removesuffix("/v1")


def document(s) -> dict:
    r = httpx.get(root(s) + "/openapi.json", timeout=60)
    assert r.status_code == 200
    return r.json()


def declared(doc, method, path) -> dict:
    return doc["paths"][path][method]["responses"]


def test_every_status_sent_is_declared_with_the_error_body(server):
    doc = document(server)
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            assert "422" not in op["responses"], (method, path)     # validation errors are 400s here
            body = "AnthropicErrorResponse" if path.startswith("/v1/messages") else "ErrorResponse"
            for status, response in op["responses"].items():
                if status != "200" and path != "/metrics":
                    schema = response["content"]["application/json"]["schema"]
                    assert schema == {"$ref": f"#/components/schemas/{body}"}, (method, path, status)
    completions = declared(doc, "post", "/v1/completions")
    assert {"400", "401", "404", "408", "413", "429", "503"} <= set(completions)
    # what the server really answers is among them
    base = root(server) + "/v1/completions"
    answers = {
        httpx.post(base, json={"prompt": "a", "max_tokens": 0}, headers=AUTH).status_code,
        httpx.post(base, json={"prompt": "a", "model": "no-such-model"}, headers=AUTH).status_code,
        httpx.post(base, json={"prompt": "a"}).status_code,
    }
    assert answers == {400, 404, 401} and {str(a) for a in answers} <= set(completions)
    missing = httpx.get(root(server) + "/v1/responses/resp_none", headers=AUTH)
    assert missing.status_code == 404 and "404" in declared(doc, "get", "/v1/responses/{response_id}")
    # Anthropic's: 529 where the others say 429, and what the Messages routes answer is declared
    messages = declared(doc, "post", "/v1/messages")
    assert {"400", "401", "404", "408", "413", "529", "503"} <= set(messages) and "429" not in messages
    base = root(server) + "/v1/messages"
    hi = [{"role": "user", "content": "a"}]
    answers = {httpx.post(base, json={"model": server.model, "messages": hi}, headers=AUTH).status_code,
               httpx.post(base, json={"model": "no-such-model", "messages": hi, "max_tokens": 1},
                          headers=AUTH).status_code,
               httpx.post(base, json={"model": server.model, "messages": hi, "max_tokens": 1}).status_code}
    assert answers == {400, 404, 401} and {str(a) for a in answers} <= set(messages)


def test_text_endpoints_are_declared_as_what_they_send(server):
    doc = document(server)
    health = declared(doc, "get", "/health")
    assert "content" not in health["200"] and "503" in health
    r = httpx.get(root(server) + "/health")
    assert r.status_code == 200 and r.content == b""
    assert set(declared(doc, "get", "/metrics")["200"]["content"]) == {"text/plain"}
    stream = declared(doc, "post", "/v1/chat/completions")["200"]["content"]
    assert set(stream) == {"application/json", "text/event-stream"}
    event = stream["text/event-stream"]["schema"]["properties"]["data"]["anyOf"][1]
    assert event["contentSchema"] == {"$ref": "#/components/schemas/ChatCompletionChunk"}


def test_the_request_schemas_carry_this_server_s_limits(server):
    doc = document(server)
    schemas = doc["components"]["schemas"]
    engine = server.engine
    completion = schemas["CompletionRequest"]["properties"]
    assert completion["n"]["maximum"] == LIMITS.max_n
    strings, _, ids, lists = completion["prompt"]["anyOf"]
    assert strings["minLength"] == 1 and lists["maxItems"] == LIMITS.max_prompts
    assert ids["items"]["maximum"] == engine.vocab_size - 1 and ids["maxItems"] == engine.max_model_len - 1
    embedding = schemas["EmbeddingRequest"]["properties"]["input"]["anyOf"]
    assert embedding[1]["maxItems"] == LIMITS.max_embedding_inputs
    roles = schemas["ChatMessage"]["properties"]["role"]["enum"]
    assert set(roles) == chat_roles(engine.tokenizer.chat_template)
    assert schemas["CompletionRequest"]["properties"]["prompt_logprobs"] == {"type": "null"}   # not enabled here
    # and the server holds to them: one past each is refused, naming the field
    base = root(server) + "/v1/completions"
    r = httpx.post(base, json={"prompt": [[engine.vocab_size]], "max_tokens": 1}, headers=AUTH)
    assert r.status_code == 400
    r = httpx.post(base, json={"prompt": "a", "max_tokens": 1, "n": LIMITS.max_n + 1}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_routes_the_server_does_not_serve_are_not_listed(tiny_llm, server):
    assert "/v1/embeddings" in document(server)["paths"]
    s = HTTPServer(tiny_llm)        # without embeddings and LoRA
    try:
        paths = document(s)["paths"]
        assert "/v1/completions" in paths
        assert not {"/v1/embeddings", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"} & set(paths)
    finally:
        s.close()


@pytest.mark.parametrize("body, code", [
    ({"prompt": [[5] * 100], "max_tokens": 100}, "context_length_exceeded"),   # each valid, not together
    ({"prompt": "a", "best_of": 2, "n": 1}, "conflicting_fields"),
    ({"prompt": "a", "max_tokens": 2, "structured_outputs": {"regex": "("}}, "invalid_grammar"),
    ({"prompt": "a", "echo": True, "logprobs": 1, "max_tokens": 1}, "feature_disabled"),
])
def test_a_refusal_no_schema_expresses_carries_its_code(server, body, code):
    r = httpx.post(root(server) + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == code and code in REFUSAL_CODES


@pytest.mark.slow
def test_schemathesis_with_every_check_finds_nothing(server):
    """schemathesis' every check over the whole document: examples, boundary coverage, fuzzing and
    the stateful phase (a created response's links). tests/server/openapi_checks.py holds the one
    replaced check (refusals that carry a REFUSAL_CODES code are not "valid data rejected").
    Responses are not timed (--max-response-time far above any request: tests never depend on
    the machine's speed); the control routes that pause or swap the engine are left out."""
    cli = Path(sys.executable).parent / "schemathesis"
    env = dict(os.environ, SCHEMATHESIS_HOOKS="tests.server.openapi_checks",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run(
        [str(cli), "--no-color", "run", root(server) + "/openapi.json", "--checks", "all",
         "--exclude-checks", "positive_data_acceptance", "--max-response-time", "600",
         "-H", f"Authorization: Bearer {API_KEY}", "--max-examples", "50", "--seed", "1",
         "--exclude-path-regex", "^/(pause|resume|update_weights_from_disk)$", "--request-timeout", "300",
         "--generation-database", "none"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=3000)
    summary = run.stdout[run.stdout.find("SUMMARY"):] if "SUMMARY" in run.stdout else run.stdout[-4000:]
    assert run.returncode == 0, summary + run.stderr[-2000:]
    assert " passed" in summary and "failures" not in summary.lower()
