"""A TLS server with an API key (from the environment) and a limit of two concurrent streams: missing
or wrong tokens give UNAUTHENTICATED, a plaintext client gets nothing, a third stream gets
RESOURCE_EXHAUSTED, and SIGTERM lets the stream in flight finish before the process exits 0."""

import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve.client import GenerationClient
from tests.server.server_process import ServerProcess, self_signed_cert, wait_until

KEY = "s3cret-test-key"
PROMPT = "The tide comes in"


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    cert, key = self_signed_cert(tmp_path_factory.mktemp("tls"))
    return cert, key, open(cert, "rb").read()


@pytest.fixture(scope="module")
def server(tiny_llm, tiny_llama_dir, xla_cache_dir, tmp_path_factory, tls):
    cert, key, root = tls
    srv = ServerProcess(tiny_llama_dir, xla_cache_dir, tmp_path_factory.mktemp("server-limits") / "server.log",
                        "--max-concurrent-streams", "2", "--grace-period", "120", "--tls-cert", cert,
                        "--tls-key", key, env={"JAXSERVE_API_KEY": KEY}, tls_root_cert=root, gated=True)
    try:
        srv.release_warm_up()
        srv.wait_serving()
        yield srv
    finally:
        srv.kill()


@pytest.fixture
def client(server):
    with GenerationClient(server.target, api_key=KEY, tls_root_cert=server.tls_root_cert, timeout=120) as c:
        yield c


@pytest.mark.parametrize("key, why", [(None, "missing"), ("not-the-key", "wrong")])
def test_a_missing_or_wrong_token_gives_unauthenticated(server, key, why):
    with GenerationClient(server.target, api_key=key, tls_root_cert=server.tls_root_cert, timeout=60) as c:
        for call in (lambda: c.generate(PROMPT, max_tokens=2), c.model_info, c.server_info):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert why in e.value.details()


def test_the_right_token_is_served_and_health_needs_none(server, client):
    assert client.generate(PROMPT, max_tokens=3, temperature=0.0).completion_tokens == 3
    with server.channel() as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
    assert r.status == health_pb2.HealthCheckResponse.SERVING


def test_a_plaintext_client_is_not_served_by_a_tls_server(server):
    with GenerationClient(server.target, api_key=KEY, timeout=10) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.model_info()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_streams_beyond_the_limit_get_resource_exhausted(server, client):
    with server.steps_held():                            # the two cannot finish on their own
        held = [client.stream(PROMPT, max_tokens=120, temperature=0.0, ignore_eos=True) for _ in range(2)]
        for s in held:
            next(s)                                      # both are in flight on the server
        with pytest.raises(grpc.RpcError) as e:
            client.generate(PROMPT, max_tokens=2)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_concurrent_streams=2" in e.value.details()
        for s in held:
            s.close()
        wait_until(lambda: client.server_info().active_streams == 0, "streams to end")
    assert client.generate(PROMPT, max_tokens=2).completion_tokens == 2   # room again


def test_sigterm_lets_the_stream_in_flight_finish_and_exits_0(server, client):
    with server.steps_held():                            # still in flight when the signal lands
        stream = client.stream(PROMPT, max_tokens=100, temperature=0.0, ignore_eos=True)
        tokens = list(next(stream).token_ids)
        server.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: server.health() != "SERVING", "health to leave SERVING", every_s=0.01)
    tokens += [t for c in stream for t in c.token_ids]
    assert len(tokens) == 100                            # drained, not aborted
    assert server.proc.wait(120) == 0, server.log()
    assert "draining: 1 streams in flight" in server.log()   # the drain really had a stream to wait for


def test_sigterm_during_warmup_exits_0_without_waiting_for_the_compile(tiny_llama_dir, tmp_path):
    # the warm-up is held, never released: the signal lands during it however fast it would be
    srv = ServerProcess(tiny_llama_dir, str(tmp_path / "cold-cache"), tmp_path / "server.log", gated=True)
    try:
        wait_until(lambda: srv.health() == "NOT_SERVING", "the server to listen", guard_s=120)
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0, srv.log()
        assert "stopping during warmup" in srv.log()
    finally:
        srv.kill()
