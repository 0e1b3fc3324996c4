"""A real `jaxserve router` process on a free loopback port, and a call helper that returns the
router's trailing metadata (which replica served, the prefix it expected there)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve.client import _fold, Completion, build_request
from jaxserve.proto import generation_pb2 as pb
from jaxserve.proto import generation_pb2_grpc as pb_grpc
from tests.server.server_process import SERVE, free_port

START_GUARD_S = 120


class RouterProcess:
    def __init__(self, replicas: list[str], log_path, *extra: str, tls_root_cert: bytes | None = None):
        self.tls_root_cert = tls_root_cert
        self.port = free_port()
        self.metrics_port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-c", SERVE, "router", "--port", str(self.port),
               "--metrics-port", str(self.metrics_port), *[a for r in replicas for a in ("--replica", r)], *extra]
        self._log = open(log_path, "wb")
        # cwd outside the repo: the folder sched/ must not shadow the standard library's
        self.proc = subprocess.Popen(cmd, cwd=os.path.dirname(str(log_path)), stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def health(self) -> str | None:
        with self.channel() as ch:
            try:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
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
                raise RuntimeError(f"the router exited with {self.proc.returncode}:\n{self.log()}")
            if self.health() == "SERVING":
                return
            time.sleep(0.1)
        raise RuntimeError(f"the router was not SERVING after {START_GUARD_S} s:\n{self.log()}")

    def log(self, tail: int = 4000) -> str:
        self._log.flush()
        text = open(self.log_path, "rb").read().decode(errors="replace")
        return text[-tail:] if tail else text

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            self._log.close()


def generate(target: str, prompt, *, timeout: float = 120, **kwargs) -> tuple[Completion, dict]:
    """One Generate call: (the completion, the trailing metadata as a dict)."""
    sampling = {k: v for k, v in kwargs.items() if k not in ("request_id", "cache_salt")}
    req = build_request(prompt, request_id=kwargs.get("request_id", ""), cache_salt=kwargs.get("cache_salt"),
                        **sampling)
    with grpc.insecure_channel(target) as ch:
        call = pb_grpc.GenerationStub(ch).Generate(req, timeout=timeout)
        result = Completion()
        for msg in call:
            _fold(result, msg)
        return result, dict(call.trailing_metadata() or ())


def server_info(target: str) -> pb.ServerInfo:
    with grpc.insecure_channel(target) as ch:
        return pb_grpc.GenerationStub(ch).GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
