#!/usr/bin/env bash
# Regenerate the gRPC modules with the venv's grpcio-tools: the public service
# (jaxserve/proto/generation.proto, jaxserve.v1.Generation) and the engines' internal KV-transfer
# service (jaxserve/disagg/proto/kv_transfer.proto, jaxserve.kv.v1.KVTransfer). Run from anywhere;
# each proto is compiled relative to the repo root so its generated _pb2_grpc imports its _pb2 by
# the package path (`jaxserve.proto.generation_pb2`, `jaxserve.disagg.proto.kv_transfer_pb2`).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-$root/.venv/bin/python}"
cd "$root"
for proto in jaxserve/proto/generation.proto jaxserve/disagg/proto/kv_transfer.proto; do
  "$py" -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. "$proto"
  echo "generated ${proto%.proto}_pb2{,_grpc}.py and .pyi"
done
