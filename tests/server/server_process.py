"""A real `jaxserve serve` process on a free loopback port, for the server tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.server.shapes import tiny_engine_flags

START_GUARD_S = 240   # a server that never becomes ready fails the test instead of stalling it
SERVE = "import sys; from jaxserve.cli import main; sys.exit(main())"
# the same, with its warm-up held and a StepGate on its engine (tests/server/step_gate.py)
SERVE_GATED = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('step_gate', {path!r}); "
               "gate = importlib.util.module_from_spec(spec); spec.loader.exec_module(gate); "
               "sys.exit(gate.serve_gated())").format(path=os.path.join(os.path.dirname(__file__), "step_gate.py"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model_dir: str, cache_dir: str, log_path, *extra: str, env: dict | None = None,
                 tls_root_cert: bytes | None = None, gated: bool = False):
        """gated: the warm-up waits for `release_warm_up()`, and `steps_held()` can hold the engine."""
        self.tls_root_cert = tls_root_cert
        self.port = free_port()
        self.metrics_port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-c", SERVE_GATED if gated else SERVE,
               "serve", "--model", model_dir, "--port", str(self.port), "--metrics-port", str(self.metrics_port),
               *tiny_engine_flags(cache_dir), *extra]
        # cwd outside the repo: the folder sched/ must not shadow the standard library's sched
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=os.path.dirname(str(log_path)), stdout=self._log,
                                     stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                     stdin=subprocess.PIPE if gated else subprocess.DEVNULL)
        self._gate_commands = 0

    def health(self, timeout: float = 2.0) -> str | None:
        """SERVING / NOT_SERVING, or None while nothing answers."""
        with self.channel() as ch:
            try:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            except grpc.RpcError:
                return None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    def channel(self) -> grpc.Channel:
        if self.tls_root_cert is None:
            return grpc.insecure_channel(self.target)
        return grpc.secure_channel(self.target, grpc.ssl_channel_credentials(self.tls_root_cert))

    def wait_serving(self) -> None:
        deadline = time.monotonic() + START_GUARD_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            if self.health() == "SERVING":
                return
            time.sleep(0.1)
        raise RuntimeError(f"the server was not SERVING after {START_GUARD_S} s:\n{self.log()}")

    def log(self, tail: int = 4000) -> str:
        self._log.flush()
        text = open(self.log_path, "rb").read().decode(errors="replace")
        return text[-tail:] if tail else text

    # ---- a gated server (gated=True) ----
    def release_warm_up(self) -> None:
        self._gate("warm-up")

    @contextlib.contextmanager
    def steps_held(self):
        """While inside, the engine runs only the steps that bring a new request to its first
        output; nothing else moves until the block ends, however fast or slow the machine."""
        self._gate("hold")
        try:
            yield
        finally:
            self._gate("release")

    def _gate(self, command: str) -> None:
        self._gate_commands += 1
        line = f"{command} {self._gate_commands}"
        self.proc.stdin.write(f"{line}\n".encode())
        self.proc.stdin.flush()
        wait_until(lambda: f"step gate: {line}\n" in self.log(tail=0) or self.proc.poll() is not None,
                   f"the server to take '{line}'")

    def terminate(self, timeout: float = 120) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self._log.close()


def wait_until(predicate, what: str, guard_s: float = 60.0, every_s: float = 0.05):
    """Poll until predicate() returns a truthy value; the guard only turns a hang into a failure."""
    deadline = time.monotonic() + guard_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(every_s)


def self_signed_cert(directory) -> tuple[str, str]:
    """(cert.pem, key.pem) for 127.0.0.1, made with the openssl command line."""
    cert, key = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "2", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    return cert, key
