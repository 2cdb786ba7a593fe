"""`metal-cluster worker`: the stage daemon. A gRPC face on a StageHost; errors become statuses
that name the problem, and the worker stays up."""

import logging
import threading
from concurrent import futures

import grpc

from metal_cluster.proto import cluster_pb2_grpc as pb_grpc
from metal_cluster.proto import pb
from metal_cluster.stage_worker.auth import TokenCheck
from metal_cluster.stage_worker.errors import ModelLoadError
from metal_cluster.stage_worker.host import StageHost, StageStateError, VersionError
from metal_cluster.stage_worker.request_table import StepError
from metal_cluster.stage_worker.ring import RingError

log = logging.getLogger("metal_cluster.worker")

STATUS = {
    VersionError: grpc.StatusCode.FAILED_PRECONDITION,
    StageStateError: grpc.StatusCode.FAILED_PRECONDITION,
    StepError: grpc.StatusCode.INVALID_ARGUMENT,
    ModelLoadError: grpc.StatusCode.INVALID_ARGUMENT,
    RingError: grpc.StatusCode.UNAVAILABLE,
}
MAX_MESSAGE = 256 * 1024 * 1024


def _rpc(method):
    def handler(self, request, context):
        try:
            return method(self, request)
        except tuple(STATUS) as e:
            log.warning("%s refused: %s", method.__name__, e)
            context.abort(STATUS[type(e)], str(e))
        except Exception as e:  # a bug or a broken stage: say so, keep serving the next call
            log.exception("%s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")

    handler.__name__ = method.__name__
    return handler


class StageService(pb_grpc.StageServicer):
    def __init__(self, host: StageHost, stop: threading.Event):
        self.host = host
        self.stop = stop

    @_rpc
    def Assign(self, req):
        log.info("assigned layers [%d, %d) of %s", req.layer_start, req.layer_end, req.model or "the default model")
        resp = self.host.assign(req)
        log.info("loaded: %.2f GiB weights, %.2f GiB activations, KV budget %.2f GiB",
                 resp.weights_bytes / 2**30, resp.activation_bytes / 2**30, resp.kv_budget_bytes / 2**30)
        return resp

    @_rpc
    def Start(self, req):
        resp = self.host.start(req)
        log.info("serving as stage %d of %d with %d KV blocks", req.rank, req.world_size, req.num_blocks)
        return resp

    @_rpc
    def Step(self, req):
        return self.host.step(req)

    @_rpc
    def Health(self, req):
        return self.host.health()

    @_rpc
    def Shutdown(self, req):
        log.info("shutting down on request")
        self.stop.set()
        return pb.ShutdownResponse()


def serve(host: str, port: int, ring_port: int, token: str, advertise_ip: str | None = None,
          node_id: str | None = None) -> None:
    stop = threading.Event()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="rpc"),
        interceptors=[TokenCheck(token)],
        options=[("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE)],
    )
    stage = StageHost(node_id=node_id, ring_port=ring_port)
    pb_grpc.add_StageServicer_to_server(StageService(stage, stop), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    server.start()
    log.info("worker %s listening on %s:%d (ring port %d)", stage.node_id, host, bound, ring_port)
    advertiser = None
    if advertise_ip:
        from metal_cluster.stage_worker.advertise import Advertiser
        from metal_cluster.stage_worker.host import device_name

        advertiser = Advertiser(advertise_ip, stage.node_id, bound, ring_port, device_name())
        log.info("announcing %s on %s (mDNS)", advertiser.info.name, advertise_ip)
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    if advertiser:
        advertiser.close()
    server.stop(grace=2).wait()
    log.info("worker stopped")
