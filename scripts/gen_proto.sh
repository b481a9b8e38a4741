#!/usr/bin/env bash
# Regenerate the gRPC Python code from router/proto/duet_api.proto (committed; run after edits).
# The virtual include path makes the generated code import itself as duet.router.proto.*.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp -d)
python -m grpc_tools.protoc -I duet/router/proto=router/proto \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" router/proto/duet_api.proto
cp "$out"/duet/router/proto/duet_api_pb2*.py* router/proto/
rm -rf "$out"
