#!/usr/bin/env bash
# Regenerate the Python modules from cluster.proto (into $1, default: this folder).
# The grpc plugin writes a top-level `import cluster_pb2`; point it into our package instead.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here}"
"${PYTHON:-python3}" -m grpc_tools.protoc -I"$here" --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" "$here/cluster.proto"
sed -i 's/^import cluster_pb2 as cluster__pb2$/from metal_cluster.proto import cluster_pb2 as cluster__pb2/' "$out/cluster_pb2_grpc.py"
