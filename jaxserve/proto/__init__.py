"""The public gRPC service's generated modules (generation.proto, jaxserve.v1.Generation): shared
by jaxserve.client, the server and the router, so they live apart from all three. Regenerate with
scripts/gen_proto.sh."""
