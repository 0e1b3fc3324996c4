"""`jaxserve bench serve --target NAME=http://...` against a real jaxserve HTTP server (in process, on
the tiny random Llama), beside a fake gRPC target in the same command: both get the same requests,
every HTTP request finishes with exactly the asked tokens (the server's usage), TTFT <= E2E, and
the model id from /v1/models is recorded. No speed is asserted: the SLO is loose enough for any
machine."""

import json

import pytest

from jaxserve.bench import cli
from tests.server.http_harness import HTTPServer
from tests.server.shapes import SERVER_ENGINE

LOOSE = "ttft=100000,tpot=100000000"
OUTPUT_LEN = 5
NUM_PROMPTS = 6


@pytest.fixture(scope="module")
def http_server(tiny_llama_dir):
    from jaxserve import LLM

    server = HTTPServer(LLM(tiny_llama_dir, **SERVER_ENGINE), api_key="bench-key")
    yield server
    server.close()


def _fake_grpc(monkeypatch, seen: list):
    import asyncio
    import time

    import jaxserve.client

    async def stream(prompt_token_ids, params):
        seen.append((tuple(prompt_token_ids), params["max_tokens"]))
        for i in range(params["max_tokens"]):
            await asyncio.sleep(0.0005)
            yield [i], time.perf_counter()

    monkeypatch.setattr(jaxserve.client, "bench_stream", lambda target, api_key: (stream, "sha256:grpc"))


@pytest.mark.parametrize("prompt_mode", ["ids", "text"])
def test_http_target_beside_a_grpc_one_gets_the_same_requests_and_counts_the_servers_tokens(
        http_server, tiny_llama_dir, tmp_path, monkeypatch, prompt_mode):
    seen: list = []
    _fake_grpc(monkeypatch, seen)
    url = http_server.base_url   # .../v1: the target takes it with or without
    res = cli.main(["bench", "serve", "--model", tiny_llama_dir, "--output-dir", str(tmp_path), "--no-progress",
                    "--num-warmup", "0", "--num-prompts", str(NUM_PROMPTS), "--input-len", "8:24",
                    "--output-len", f"{OUTPUT_LEN}:{OUTPUT_LEN}", "--request-rate", "inf", "--slo", LOOSE,
                    "--target", "grpc=127.0.0.1:1", "--target", f"http={url}", "--api-key", "bench-key",
                    "--http-prompt", prompt_mode, "--name", "http-e2e"])
    with open(res["files"][0]) as f:
        data = json.load(f)
    runs = {r["backend"]: r for r in data["runs"]}
    assert set(runs) == {"grpc", "http"}
    http = runs["http"]
    assert http["config"]["model"] == http_server.model and http["config"]["http_prompt"] == prompt_mode
    assert http["checkpoint_identity"].startswith("unverified")
    assert http["config"]["failed_requests"] == {}
    m = http["metrics"]
    assert m["completed"] == NUM_PROMPTS and m["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    grpc_prompts = sorted(len(p) for p, _ in seen)
    assert sorted(r["prompt_len"] for r in http["requests"]) == grpc_prompts   # the same requests
    assert m["total_prompt_tokens"] == runs["grpc"]["metrics"]["total_prompt_tokens"]
    for r in http["requests"]:
        assert r["output_len"] == OUTPUT_LEN and r["chunked"]
        assert 1 <= len(r["token_times"]) <= OUTPUT_LEN
        assert r["arrival_time"] <= r["first_token_time"] <= r["finished_time"]
    assert m["ttft"]["max"] <= m["e2e"]["max"]
    point = data["extra"]["goodput"]["targets"]["http"]["points"][0]
    assert point["sent"] == NUM_PROMPTS and point["met"] == NUM_PROMPTS and point["failed"] == 0
    assert point["aborted"] == 0
    stats = http_server.stats()   # the server ends clean: nothing holds a KV block
    assert stats.scheduler.num_kv_blocks_free + stats.scheduler.num_kv_blocks_cached == stats.scheduler.num_kv_blocks_total


def test_an_unreachable_http_target_stops_the_command_before_any_load(tiny_llama_dir, tmp_path):
    with pytest.raises(SystemExit, match="/v1/models"):
        cli.main(["bench", "serve", "--model", tiny_llama_dir, "--output-dir", str(tmp_path), "--no-progress",
                  "--num-prompts", "2", "--target", "x=http://127.0.0.1:9"])
