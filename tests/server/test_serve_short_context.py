"""`jaxserve serve` (its defaults: the slo chunk policy, calibrated at start-up) with a context
shorter than the calibration's usual prompt tile and depth starts and answers. Three real server
starts with the default shapes: slow (tests/engine/test_chunk_policy.py checks every calibration
step of the same configurations against the engine's limits without compiling)."""

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.server.server_process import SERVE, free_port

START_GUARD_S = 900


def get(url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read() or b"{}")


@pytest.mark.slow
@pytest.mark.parametrize("max_model_len", [64, 256, 1024])
def test_serve_starts_and_answers_with_a_short_context(tiny_llama_dir, tmp_path, max_model_len):
    port = free_port()
    log_path = tmp_path / "serve.log"
    cmd = [sys.executable, "-c", SERVE, "serve", "--model", tiny_llama_dir, "--dtype", "float32",
           "--max-model-len", str(max_model_len), "--http-port", str(port), "--no-grpc",
           "--cache-dir", str(tmp_path / "cache"), "--compilation-cache-dir", ""]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=str(tmp_path), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=dict(os.environ))
        try:
            deadline = time.monotonic() + START_GUARD_S
            while True:
                assert proc.poll() is None, log_path.read_text()[-4000:]
                assert time.monotonic() < deadline, "not ready in time:\n" + log_path.read_text()[-4000:]
                try:
                    get(f"http://127.0.0.1:{port}/health")
                    break
                except OSError:
                    time.sleep(0.5)
            model = get(f"http://127.0.0.1:{port}/v1/models")["data"][0]["id"]
            out = get(f"http://127.0.0.1:{port}/v1/completions",
                      {"model": model, "prompt": "The tide comes in", "max_tokens": 8, "min_tokens": 8})
            assert out["usage"]["completion_tokens"] == 8
        finally:
            proc.terminate()
            proc.wait(120)
