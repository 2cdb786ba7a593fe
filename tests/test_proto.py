"""The committed generated modules must be exactly what proto/generate.sh makes of cluster.proto."""

import os
import subprocess
import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent.parent / "proto"
GENERATED = ("cluster_pb2.py", "cluster_pb2.pyi", "cluster_pb2_grpc.py")


def test_generated_modules_match_proto(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run(["bash", str(PROTO_DIR / "generate.sh"), str(tmp_path)], check=True, timeout=60, env=env)
    for name in GENERATED:
        fresh = (tmp_path / name).read_text()
        assert fresh == (PROTO_DIR / name).read_text(), f"proto/{name} is stale: run `bash proto/generate.sh`"
