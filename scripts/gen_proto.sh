#!/usr/bin/env bash
# Regenerate the gRPC modules from jaxserve/server/proto/generation.proto with the venv's
# grpcio-tools. Run from anywhere; the proto is compiled relative to the repo root so the
# generated _pb2_grpc imports `jaxserve.server.proto.generation_pb2`.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-$root/.venv/bin/python}"
cd "$root"
"$py" -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. \
  jaxserve/server/proto/generation.proto
echo "generated jaxserve/server/proto/generation_pb2{,_grpc}.py and .pyi"
