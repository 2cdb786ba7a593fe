"""The committed generated module must describe exactly what cluster.proto says."""

from pathlib import Path

from google.protobuf import descriptor_pb2
from grpc_tools import protoc

from metal_cluster.proto import cluster_pb2

PROTO_DIR = Path(__file__).resolve().parent.parent / "proto"


def test_generated_module_matches_proto(tmp_path):
    out = tmp_path / "cluster.desc"
    rc = protoc.main(["protoc", f"-I{PROTO_DIR}", f"--descriptor_set_out={out}", str(PROTO_DIR / "cluster.proto")])
    assert rc == 0
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    for message in fresh.message_type:  # protoc adds json names the generated module omits
        for field in message.field:
            field.ClearField("json_name")
    committed = descriptor_pb2.FileDescriptorProto.FromString(cluster_pb2.DESCRIPTOR.serialized_pb)
    assert fresh == committed, "proto/cluster_pb2.py is stale: run `python -m grpc_tools.protoc -Iproto --python_out=proto --pyi_out=proto proto/cluster.proto`"
