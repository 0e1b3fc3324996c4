"""`jaxserve router --replicas N`: N local `jaxserve serve` processes, started and stopped with the
router, for a one-command set-up.

Each child gets its own free loopback port and, where `--replica-cpus` gives one, its own CPU set
(os.sched_setaffinity in the child before it execs, so jax's thread pools see only those cores),
and where `--replica-devices` gives them, its own accelerators (CUDA_VISIBLE_DEVICES).
Children run with the working directory outside any checkout: a folder named `sched` on sys.path
would shadow the standard library's. The router stops them with SIGTERM (their own graceful drain)
when it stops, and kills what is left after their grace period.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass

log = logging.getLogger("jaxserve.router")

SERVE = "import sys; from jaxserve.cli import main; sys.exit(main())"


def parse_cpus(text: str) -> frozenset[int]:
    """'0', '0,2', '0-3', '0-1,4' -> the CPU ids; ValueError naming the flag otherwise."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            lo, sep, hi = part.strip().partition("-")
            cpus.update(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    except ValueError:
        raise ValueError(f"--replica-cpus {text!r} must be CPU ids like 0 or 0-1 or 0,2") from None
    if not cpus or min(cpus) < 0:
        raise ValueError(f"--replica-cpus {text!r} names no CPU")
    return frozenset(cpus)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Child:
    port: int
    cpus: frozenset[int] | None
    proc: subprocess.Popen
    log_path: str


def per_replica(values: list, n: int, flag: str) -> list:
    """A flag given once (for every replica) or once per replica -> one value per replica
    (None each when not given)."""
    if not values:
        return [None] * n
    if len(values) not in (1, n):
        raise ValueError(f"{flag} was given {len(values)} times for {n} replicas: give it once or {n} times")
    return list(values) * n if len(values) == 1 else list(values)


def start_children(n: int, serve_args: list[str], *, host: str = "127.0.0.1",
                   cpus: list[frozenset[int]] | None = None, devices: list[str] | None = None,
                   log_dir: str | None = None, per_child_args: list[list[str]] | None = None) -> list[Child]:
    """N `jaxserve serve` processes with `serve_args` (engine flags, --model), each on its port.
    `cpus`: one CPU set per child, or one for all, or None; `devices`: likewise, the accelerators
    each child sees (CUDA_VISIBLE_DEVICES); per_child_args: flags for child i alone (its KV
    events' endpoints). Their output goes to log files."""
    if n < 1:
        raise ValueError(f"--replicas {n} must be >= 1")
    cpu_sets = per_replica(cpus or [], n, "--replica-cpus")
    device_sets = per_replica(devices or [], n, "--replica-devices")
    log_dir = log_dir or tempfile.mkdtemp(prefix="jaxserve-router-")
    children = []
    for i in range(n):
        port = free_port(host)
        mine = cpu_sets[i]
        env = dict(os.environ)
        if device_sets[i] is not None:
            env["CUDA_VISIBLE_DEVICES"] = device_sets[i]
        own = per_child_args[i] if per_child_args else []
        cmd = [sys.executable, "-c", SERVE, "serve", "--host", host, "--port", str(port), *serve_args, *own]
        path = os.path.join(log_dir, f"replica-{i}.log")
        out = open(path, "wb")
        proc = subprocess.Popen(cmd, cwd=tempfile.gettempdir(), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=_pin(mine), env=env)
        out.close()
        log.info("replica %d: pid %d on %s:%d%s%s, log %s", i, proc.pid, host, port,
                 f", cpus {sorted(mine)}" if mine else "",
                 f", devices {device_sets[i]}" if device_sets[i] is not None else "", path)
        children.append(Child(port, mine, proc, path))
    return children


def _pin(cpus: frozenset[int] | None):
    if cpus is None:
        return None

    def pin() -> None:   # runs in the child between fork and exec
        os.sched_setaffinity(0, cpus)

    return pin


def stop_children(children: list[Child], grace_s: float = 30.0) -> None:
    for c in children:
        if c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)
    for c in children:
        try:
            c.proc.wait(grace_s + 5.0)
        except subprocess.TimeoutExpired:
            log.warning("replica pid %d did not stop in time; killing it", c.proc.pid)
            c.proc.kill()
            c.proc.wait()
