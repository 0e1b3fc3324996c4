"""Two processes on loopback, each with 2 CPU devices, joined by jax.distributed into one 4-way
engine on a tiny Llama (8 query heads, 2 KV heads: each device one replicated KV head).

Rank 0 schedules and generates; rank 1 runs its steps. The greedy outputs must equal HF
transformers' continuations (as a one-process engine's do: tests/engine/test_llm_tiny.py). Then
rank 1 is killed and rank 0, idle as a server between requests, must exit with an error naming
rank 1 within a bounded time (host_timeout_s is 10 s, generous against a watchdog thread starved
on a busy machine; the bound on the exit is more generous still)."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from jaxserve.testing.tiny_models import hf_greedy, make_tiny_model
from tests.parallel.cpu_devices import REPO, cpu_device_env

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multihost_driver.py")
START_BOUND_S = 600        # both hosts build and compile (a busy 2-core machine)
EXIT_BOUND_S = 90          # host_timeout_s = 10 plus the watchdog's period, on a busy machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tp-hosts"), "llama", seed=2, num_heads=8, num_kv_heads=2)


def test_two_hosts_generate_like_one_and_a_dead_host_ends_the_other(model_dir, tmp_path):
    port, report = str(free_port()), str(tmp_path / "report.json")
    env = cpu_device_env(2)
    # output to files, not pipes: nobody reads a pipe while the hosts run, and a full one would stall them
    logs = [open(tmp_path / f"rank{rank}.log", "w+") for rank in (0, 1)]
    ranks = [subprocess.Popen([sys.executable, DRIVER, str(rank), port, model_dir, report], env=env, cwd=REPO,
                              stdout=log, stderr=subprocess.STDOUT, text=True) for rank, log in zip((0, 1), logs)]

    def output(rank: int) -> str:
        logs[rank].flush()
        return (tmp_path / f"rank{rank}.log").read_text()[-4000:]

    try:
        deadline = time.monotonic() + START_BOUND_S
        while not os.path.exists(report):
            assert all(p.poll() is None for p in ranks), [output(0), output(1)]
            assert time.monotonic() < deadline, "the two hosts did not generate in time"
            time.sleep(0.5)
        import json

        with open(report) as f:
            got = json.load(f)
        assert got["mesh"] == {"devices": 4, "hosts": 2, "axis_sizes": {"data": 1, "model": 4}}
        want = [hf_greedy(model_dir, ids, 12) for ids in got["prompts"]]
        assert got["tokens"] == want

        ranks[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        ranks[0].wait(timeout=EXIT_BOUND_S)
        assert ranks[0].returncode == 1, output(0)
        assert "host rank 1 stopped answering" in output(0)
        assert time.monotonic() - killed < EXIT_BOUND_S
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
