"""Where the KV-transfer RPCs live: the engines' internal jaxserve.kv.v1.KVTransfer service
(disagg/proto/kv_transfer.proto), not the public jaxserve.v1.Generation; the client and the
disaggregation package load nothing of the server; and `jaxserve serve` exposes KVTransfer only
for a prefill or decode role."""

import asyncio
import subprocess
import sys
import textwrap

import grpc
import pytest
from grpc import aio

from jaxserve.disagg.proto import kv_transfer_pb2 as kv_pb
from jaxserve.disagg.proto import kv_transfer_pb2_grpc as kv_pb_grpc
from jaxserve.proto import generation_pb2 as pb
from jaxserve.server.grpc_front import start_grpc
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.server import ServerConfig
from jaxserve.server.state import ServerState

KV_RPCS = {"GetKVLayout", "PullKV", "KVLeaseControl"}


def test_the_public_service_has_no_kv_rpcs_and_the_internal_one_has_them_all():
    public = pb.DESCRIPTOR.services_by_name["Generation"]
    assert not KV_RPCS & set(public.methods_by_name)
    assert {"Generate", "Abort", "GetModelInfo", "GetServerInfo"} <= set(public.methods_by_name)
    internal = kv_pb.DESCRIPTOR.services_by_name["KVTransfer"]
    assert internal.full_name == "jaxserve.kv.v1.KVTransfer" and set(internal.methods_by_name) == KV_RPCS
    # the internal proto stands alone; what the router carries between engines stays public
    assert not kv_pb.DESCRIPTOR.dependencies
    for name in ("KVTransfer", "RemoteKV", "KVLease"):
        assert name in pb.DESCRIPTOR.message_types_by_name
    for name in ("KVLayout", "PullKVRequest", "KVBlocks", "KVLeaseRequest", "KVLeaseReply"):
        assert name not in pb.DESCRIPTOR.message_types_by_name and name in kv_pb.DESCRIPTOR.message_types_by_name


CHILD = textwrap.dedent("""
    import importlib, pkgutil, sys
    import jaxserve.client, jaxserve.disagg
    for m in pkgutil.walk_packages(jaxserve.disagg.__path__, "jaxserve.disagg."):
        importlib.import_module(m.name)
    loaded = sorted(m for m in sys.modules if m == "jaxserve.server" or m.startswith("jaxserve.server."))
    assert "jaxserve.disagg.service" in sys.modules and "jaxserve.disagg.proto.kv_transfer_pb2_grpc" in sys.modules
    print("server modules:", loaded)
""")


def test_the_client_and_the_disagg_package_import_nothing_of_the_server():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "server modules: []" in done.stdout, done.stdout


async def _layout_status(kv_transfer: bool) -> grpc.StatusCode:
    """GetKVLayout on a gRPC front still warming up (no engine): UNAVAILABLE where KVTransfer is
    served (the same gate as Generate), UNIMPLEMENTED where it is not."""
    state = ServerState()
    front = await start_grpc(ServerConfig(port=0), 1 << 20, state, ServerMetrics(lambda: None),
                             kv_transfer=kv_transfer)
    try:
        async with aio.insecure_channel(f"127.0.0.1:{front.port}") as ch:
            with pytest.raises(aio.AioRpcError) as e:
                await kv_pb_grpc.KVTransferStub(ch).GetKVLayout(kv_pb.GetKVLayoutRequest(), timeout=30)
            return e.value.code()
    finally:
        await front.server.stop(0)


@pytest.mark.parametrize("kv_transfer, code", [(True, grpc.StatusCode.UNAVAILABLE),
                                               (False, grpc.StatusCode.UNIMPLEMENTED)])
def test_kv_transfer_is_served_beside_generation_only_when_asked(kv_transfer, code):
    assert asyncio.run(_layout_status(kv_transfer)) == code
