"""gRPC server reflection under both of its names: `grpc.reflection.v1` (grpcurl, Postman and
current gRPC tooling try it first) and `grpc.reflection.v1alpha` (older clients).

grpcio-reflection serves only v1alpha. v1 is the same protocol renamed: the same messages with the
same field numbers, so one servicer answers both, its v1alpha messages being byte-for-byte what a
v1 client expects. The v1 file descriptor is derived from v1alpha's (package and file name
changed) and added to the default pool, so a client can also describe the v1 service itself.
"""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection as v1alpha
from grpc_reflection.v1alpha import reflection_pb2 as pb
from grpc_reflection.v1alpha import reflection_pb2_grpc as pb_grpc

V1_PACKAGE = "grpc.reflection.v1"
V1_FILE = "grpc/reflection/v1/reflection.proto"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
V1ALPHA_SERVICE_NAME = v1alpha.SERVICE_NAME
SERVICE_NAMES = (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)


def _add_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    try:
        pool.FindFileByName(V1_FILE)
        return
    except KeyError:
        pass
    old = f".{pb.DESCRIPTOR.package}."
    fdp = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(fdp)
    fdp.name, fdp.package = V1_FILE, V1_PACKAGE
    fdp.ClearField("options")    # v1alpha's language options (java_package, ...) and deprecation
    for message in fdp.message_type:
        for f in message.field:
            if f.type_name.startswith(old):
                f.type_name = f".{V1_PACKAGE}.{f.type_name[len(old):]}"
    for service in fdp.service:
        for m in service.method:
            m.input_type = f".{V1_PACKAGE}.{m.input_type[len(old):]}"
            m.output_type = f".{V1_PACKAGE}.{m.output_type[len(old):]}"
    pool.AddSerializedFile(fdp.SerializeToString())


def enable_server_reflection(service_names, server: grpc.aio.Server) -> None:
    """Serve reflection (v1 and v1alpha) for `service_names` and for reflection itself."""
    _add_v1_descriptor(descriptor_pool.Default())
    servicer = v1alpha.aio.ReflectionServicer((*service_names, *SERVICE_NAMES))
    pb_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(servicer.ServerReflectionInfo,
                                               request_deserializer=pb.ServerReflectionRequest.FromString,
                                               response_serializer=pb.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1_SERVICE_NAME,
                                                                          {"ServerReflectionInfo": v1}),))
