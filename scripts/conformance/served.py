"""What the conformance scripts share: a `jaxserve serve` of this checkout on a free loopback port
(HTTP only, the embedded SmolLM2-135M-Instruct unless the extra flags name a model), or a server
already running at --url; the served model's name; where results go; the run's provenance
(commit, machine) for the JSON each script writes under docs/results/.

The server runs this checkout's code through jaxserve.bench.run_from_checkout (from the repo root,
with the checkout at the end of sys.path, so its folder sched/ does not shadow the standard
library's `sched`), its log in a temporary file that a failed start prints.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx2 as httpx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "docs", "results")
START_GUARD_S = 900.0    # a first start compiles (about a minute on 2 cores); a start that never ends fails


def split_serve_args(argv: list[str] | None, default: list[str] = ()) -> tuple[list[str], list[str]]:
    """(the script's own arguments, those after `--` for `jaxserve serve`; `default` without a `--`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--" not in argv:
        return argv, list(default)
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served_model(url: str) -> str:
    """The first model /v1/models lists (url ends in /v1)."""
    r = httpx.get(url + "/models", timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


@contextlib.contextmanager
def jaxserve(extra: list[str] | None = None, *, url: str | None = None, log_dir: str | None = None):
    """Yields the /v1 base URL of `jaxserve serve --http-port P --no-grpc EXTRA` (started here,
    stopped with SIGTERM after), or `url` itself when given (nothing is started)."""
    if url:
        yield url.rstrip("/")
        return
    port = free_port()
    log_dir = log_dir or tempfile.mkdtemp(prefix="jaxserve-conformance-")
    log_path = os.path.join(log_dir, "serve.log")
    cmd = [sys.executable, "-m", "jaxserve.bench.run_from_checkout", "jaxserve.cli", "serve",
           "--host", "127.0.0.1", "--http-port", str(port), "--no-grpc", *(extra or [])]
    print(f"starting: {' '.join(cmd[3:])} (log {log_path})", file=sys.stderr, flush=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + START_GUARD_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"jaxserve serve exited with {proc.returncode}:\n{_tail(log_path)}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"jaxserve serve not ready after {START_GUARD_S:.0f} s:\n{_tail(log_path)}")
            time.sleep(0.25)
        print(f"ready: {base}", file=sys.stderr, flush=True)
        yield base
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


def _tail(path: str, n: int = 4000) -> str:
    with open(path, "rb") as f:
        return f.read().decode(errors="replace")[-n:]


def provenance(command: list[str]) -> dict:
    """The commit (and whether the tree had changes), the machine and the command of a run."""
    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"commit": git("rev-parse", "--short=12", "HEAD"), "tree_changed": bool(git("status", "--porcelain",
                                                                                         "--untracked-files=no")),
            "machine": f"{len(os.sched_getaffinity(0))}-core {cpu} CPU ({platform.machine()}), no accelerator",
            "command": " ".join(command), "date": time.strftime("%Y-%m-%d %H:%M:%S %z")}


def write_result(name: str, result: dict, out: str | None = None) -> str:
    path = out or os.path.join(RESULTS, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(f"wrote {path}", file=sys.stderr, flush=True)
    return path
