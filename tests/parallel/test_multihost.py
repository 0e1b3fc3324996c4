"""Two processes on loopback, each with 2 CPU devices, joined by jax.distributed into one 4-way
engine on a tiny Llama (8 query heads, 2 KV heads: each device one replicated KV head).

Rank 0 schedules and generates; rank 1 runs its steps. The greedy outputs must equal HF
transformers' continuations (as a one-process engine's do: tests/engine/test_llm_tiny.py). Then
rank 1 is killed and rank 0, idle as a server between requests, must exit with an error naming
rank 1 within a bounded time (host_timeout_s is 10 s, generous against a watchdog thread starved
on a busy machine; the bound on the exit is more generous still)."""

import json
import os
import re
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

        with open(report) as f:
            got = json.load(f)
        assert got["mesh"] == {"devices": 4, "hosts": 2, "axis_sizes": {"data": 1, "model": 4}}
        want = [hf_greedy(model_dir, ids, 12) for ids in got["prompts"]]
        assert got["tokens"] == want

        ranks[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        ranks[0].wait(timeout=EXIT_BOUND_S)
        out = output(0)
        # whichever notices first ends rank 0 naming rank 1: our watchdog (exit 1), or on a loaded
        # machine JAX's coordination service, whose heartbeat check aborts the process itself
        by_watchdog = ranks[0].returncode == 1 and "host rank 1 stopped answering" in out
        by_jax = (ranks[0].returncode != 0
                  and re.search(r"tasks are unhealthy \(stopped sending heartbeats\):\s*1\b", out) is not None)
        assert by_watchdog or by_jax, (ranks[0].returncode, out)
        assert time.monotonic() - killed < EXIT_BOUND_S
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()


@pytest.mark.slow
def test_a_second_start_of_both_hosts_loads_what_the_first_kept(model_dir, tmp_path):
    """Each host keeps its executables in its own folder (as two machines would); two rounds of
    fresh processes: the second compiles no step or sampler on either host and generates the
    first round's tokens (runner/executables.py loads each onto the mesh's devices, which span
    both hosts here)."""
    env = cpu_device_env(2)
    rounds = []
    for round_ in range(2):
        port, report = str(free_port()), str(tmp_path / f"report{round_}.json")
        logs, ranks = [], []
        for rank in (0, 1):
            log = open(tmp_path / f"round{round_}-rank{rank}.log", "w+")
            rank_env = {**env, "IDLE_S": "0", "CACHE_DIR": str(tmp_path / f"cache-rank{rank}"),
                        "COMPILE_LOG": str(tmp_path / f"round{round_}-rank{rank}.compiled")}
            logs.append(log)
            ranks.append(subprocess.Popen([sys.executable, DRIVER, str(rank), port, model_dir, report], env=rank_env,
                                          cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True))
        try:
            for p in ranks:
                p.wait(timeout=START_BOUND_S)
            texts = [(tmp_path / f"round{round_}-rank{rank}.log").read_text()[-4000:] for rank in (0, 1)]
            assert [p.returncode for p in ranks] == [0, 0], texts
        finally:
            for p in ranks:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for log in logs:
                log.close()
        with open(report) as f:
            got = json.load(f)
        compiled = [len((tmp_path / f"round{round_}-rank{rank}.compiled").read_text().splitlines())
                    if (tmp_path / f"round{round_}-rank{rank}.compiled").exists() else 0 for rank in (0, 1)]
        rounds.append((got["tokens"], compiled))
    (cold_tokens, cold_compiled), (warm_tokens, warm_compiled) = rounds
    assert min(cold_compiled) > 0
    assert warm_compiled == [0, 0]
    assert warm_tokens == cold_tokens
