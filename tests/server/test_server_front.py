"""A real `jaxserve serve` process with an API key, seen from the wire: a message bigger than
max_model_len tokens can need is refused by gRPC before Python reads it, malformed bytes get
INVALID_ARGUMENT with one log line and no traceback, reflection answers as v1 and v1alpha, and a
lower-case `bearer` scheme is accepted."""

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2 as refl

from jaxserve.client import GenerationClient
from jaxserve.proto import generation_pb2 as pb
from jaxserve.server.server import message_bytes_limit
from tests.server.server_process import ServerProcess
from tests.server.shapes import SERVER_ENGINE

KEY = "front-door-key"
PROMPT = "The tide comes in"
AUTH = (("authorization", f"Bearer {KEY}"),)


@pytest.fixture(scope="module")
def server(tiny_llm, tiny_llama_dir, xla_cache_dir, tmp_path_factory):
    srv = ServerProcess(tiny_llama_dir, xla_cache_dir, tmp_path_factory.mktemp("server-front") / "server.log",
                        env={"JAXSERVE_API_KEY": KEY})
    try:
        srv.wait_serving()
        yield srv
    finally:
        srv.kill()


@pytest.fixture
def client(server):
    with GenerationClient(server.target, api_key=KEY, timeout=120) as c:
        yield c


def test_a_message_bigger_than_max_model_len_can_need_is_refused_unread(client):
    limit = message_bytes_limit(SERVER_ENGINE["max_model_len"])   # no --max-message-bytes: derived from it
    with pytest.raises(grpc.RpcError) as e:
        client.generate("x" * (limit + 1), max_tokens=2)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED       # gRPC's own refusal
    assert str(limit) in e.value.details(), e.value.details()
    assert client.generate(PROMPT, max_tokens=2).completion_tokens == 2


def test_malformed_bytes_get_invalid_argument_and_one_log_line(server):
    with server.channel() as ch:
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/jaxserve.v1.Generation/GetModelInfo")(b"\x0a\xff\xff\xff", timeout=60, metadata=AUTH)
        info = ch.unary_unary("/jaxserve.v1.Generation/GetModelInfo", request_serializer=None,
                              response_deserializer=pb.ModelInfo.FromString)(b"", timeout=60, metadata=AUTH)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("malformed request: ") and "\n" not in e.value.details()
    assert info.max_model_len == SERVER_ENGINE["max_model_len"]         # still serving
    log = server.log()
    assert "Traceback" not in log and "DecodeError" not in log, log
    assert sum("malformed request to /jaxserve.v1.Generation/GetModelInfo" in line
               for line in log.splitlines()) == 1, log


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_answers_as_v1_and_v1alpha(server, version):
    with server.channel() as ch:
        call = ch.stream_stream(f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                                request_serializer=refl.ServerReflectionRequest.SerializeToString,
                                response_deserializer=refl.ServerReflectionResponse.FromString)
        answers = list(call(iter([refl.ServerReflectionRequest(list_services="")]), timeout=60, metadata=AUTH))
    names = {s.name for s in answers[0].list_services_response.service}
    assert {"jaxserve.v1.Generation", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= names, names


def test_a_lower_case_bearer_scheme_is_accepted(server):
    with server.channel() as ch:
        info = ch.unary_unary("/jaxserve.v1.Generation/GetModelInfo",
                              request_serializer=pb.GetModelInfoRequest.SerializeToString,
                              response_deserializer=pb.ModelInfo.FromString)(
            pb.GetModelInfoRequest(), timeout=60, metadata=(("authorization", f"bearer {KEY}"),))
    assert info.max_model_len == SERVER_ENGINE["max_model_len"]
