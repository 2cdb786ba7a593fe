"""The coordinator's model store: the manifest of the model it serves, and byte ranges of its files,
for workers that hold no copy (cluster token checked like every other RPC). The bytes go over the
plaintext bulk port (transfer/bulk.py: Grant gives the ticket) or, with `weights_over_tls`, streamed
over TLS by Read.

The files are checked against the manifest (size, mtime) on every read: a model changed under a
running cluster is refused, with the file named, instead of handing a worker bytes that match
no hash.
"""

import logging
import os
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

from metal_cluster.proto import PROTO_VERSION, pb
from metal_cluster.proto import cluster_pb2_grpc as pb_grpc
from metal_cluster.stage_worker.transfer import bulk, chunk_wire
from metal_cluster.stage_worker.net import cluster_tls
from metal_cluster.stage_worker.transfer import manifest as manifests
from metal_cluster.stage_worker.model.model_source import ModelSource

log = logging.getLogger("metal_cluster.model_store")

CHUNK_BYTES = 4 * 2**20  # one gRPC message; HTTP/2 windows bound what is in flight


class ModelStoreService(pb_grpc.ModelStoreServicer):
    def __init__(self, manifest: pb.ManifestResponse, files: dict[str, Path], sender: bulk.BulkSender | None = None):
        self.manifest = manifest
        self.files = files
        self.stamps = {name: _stamp(path) for name, path in files.items()}
        self.entries = {f.path: f for f in manifest.files}
        self.sender = sender

    def Manifest(self, request, context):
        self._check_version(request.version, context)
        return self.manifest

    def Read(self, request, context) -> Iterator[bytes]:
        """ReadChunk messages, already in their wire bytes (chunk_wire.py says why)."""
        path = self._checked(request, context)
        with open(path, "rb", buffering=0) as f:
            for p in request.pieces:
                at, end = p.offset, p.offset + p.length
                while at < end:
                    data = os.pread(f.fileno(), min(CHUNK_BYTES, end - at), at)
                    if not data:
                        context.abort(grpc.StatusCode.DATA_LOSS, f"{path} is shorter than its manifest says")
                    yield chunk_wire.encode(at, data)
                    at += len(data)

    def Grant(self, request, context) -> pb.BulkTicket:
        if self.sender is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this coordinator sends weights over TLS only "
                          "(`up --weights-over-tls`): use Read")
        path = self._checked(request, context)

        def unchanged() -> None:  # checked again when the worker connects
            if _stamp(path) != self.stamps[request.path]:
                raise OSError(f"{path} changed since its manifest was made")

        ranges = [(p.offset, p.length) for p in request.pieces]
        return pb.BulkTicket(ticket=self.sender.grant(path, ranges, unchanged))

    def _checked(self, request, context) -> Path:
        """The file a Read or Grant asks for, once the request is found to be for this manifest,
        a file of it unchanged since, and ranges inside it; else the RPC is aborted."""
        self._check_version(request.version, context)
        if request.manifest_sha256 != self.manifest.sha256:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"this coordinator serves manifest {self.manifest.sha256[:12]}, not "
                          f"{request.manifest_sha256[:12]}: the model changed; re-plan")
        entry = self.entries.get(request.path)
        if entry is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"the model has no file {request.path!r}")
        path = self.files[request.path]
        if _stamp(path) != self.stamps[request.path]:
            log.warning("refused a read of %s: the file changed since its manifest was made", path)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{path} changed on the coordinator since `up` read it; restart `up` to serve the new copy")
        for p in request.pieces:
            if p.offset < 0 or p.length < 0 or p.offset + p.length > entry.size:
                context.abort(grpc.StatusCode.OUT_OF_RANGE, f"{request.path}: bytes [{p.offset}, "
                              f"{p.offset + p.length}) are outside its {entry.size} bytes")
        return path

    def _check_version(self, version: int, context) -> None:
        if version != PROTO_VERSION:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"proto version {version} is not this coordinator's {PROTO_VERSION}; "
                          "run the same metal-cluster on every host")


def _handlers(service: ModelStoreService) -> grpc.GenericRpcHandler:
    """The generated servicer's handlers, but Read's messages go out as the bytes it made."""
    service_name = pb.DESCRIPTOR.services_by_name["ModelStore"].full_name
    return grpc.method_handlers_generic_handler(service_name, {
        "Manifest": grpc.unary_unary_rpc_method_handler(
            service.Manifest, request_deserializer=pb.ManifestRequest.FromString,
            response_serializer=pb.ManifestResponse.SerializeToString),
        "Read": grpc.unary_stream_rpc_method_handler(
            service.Read, request_deserializer=pb.ReadRequest.FromString, response_serializer=bytes),
        "Grant": grpc.unary_unary_rpc_method_handler(
            service.Grant, request_deserializer=pb.ReadRequest.FromString,
            response_serializer=pb.BulkTicket.SerializeToString),
    })


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


@dataclass
class RunningStore:
    address: str
    manifest: pb.ManifestResponse
    server: grpc.Server
    sender: bulk.BulkSender | None = None

    def stop(self) -> None:
        if self.sender:
            self.sender.stop()
        self.server.stop(grace=1).wait(5)


def start(source: ModelSource, name: str, host: str, token: str, port: int = 0,
          progress=lambda done, total: None, weights_over_tls: bool = False) -> RunningStore:
    """Build (or reuse) the manifest and serve it on host:port (0: a free port); the weights'
    bulk port is another free port on `host`, unless `weights_over_tls`."""
    manifest = manifests.build(source, name, progress)
    sender = None if weights_over_tls else bulk.BulkSender(host)
    if sender:
        manifest.bulk_port = sender.port
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="store"))
    server.add_generic_rpc_handlers([_handlers(ModelStoreService(manifest, manifests.model_files(source), sender))])
    bound = cluster_tls.add_port(server, f"{host}:{port}", token, "model-store")
    if not bound:
        if sender:
            sender.stop()
        raise OSError(f"the model store cannot listen on {host}:{port}")
    server.start()
    return RunningStore(f"{host}:{bound}", manifest, server, sender)
