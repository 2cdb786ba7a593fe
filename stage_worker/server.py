"""`metal-cluster worker`: the stage daemon. A gRPC face on a StageHost; errors become statuses
that name the problem, and the worker stays up.

A plan ends with a reset, because MLX's ring can be joined only once per process: the worker's warm
standby (standby.py) takes the ports over at once, idle, and the process that served re-executes
itself (same pid) to become the next standby; without a standby ready, the process re-executes itself
and comes back idle on the same ports. A coordinator asks for a reset (Reset) when it re-plans; the
worker does it by itself when its coordinator has been silent too long.
"""

import logging
import os
import sys
import threading
from concurrent import futures

import grpc

from metal_cluster.proto import cluster_pb2_grpc as pb_grpc
from metal_cluster.proto import pb
from metal_cluster.stage_worker import standby
from metal_cluster.stage_worker.net import cluster_tls
from metal_cluster.stage_worker.errors import ModelLoadError
from metal_cluster.stage_worker.step.lora import LoRAError
from metal_cluster.stage_worker.host import StageHost, StageStateError, VersionError, check_version
from metal_cluster.stage_worker.step.request_table import StepError
from metal_cluster.stage_worker.net.ring import RingError
from metal_cluster.stage_worker.worker_env import NODE_ID_ENV, PARENT_PID_ENV

log = logging.getLogger("metal_cluster.worker")

STATUS = {
    VersionError: grpc.StatusCode.FAILED_PRECONDITION,
    StageStateError: grpc.StatusCode.FAILED_PRECONDITION,
    StepError: grpc.StatusCode.INVALID_ARGUMENT,
    LoRAError: grpc.StatusCode.INVALID_ARGUMENT,
    ModelLoadError: grpc.StatusCode.INVALID_ARGUMENT,
    RingError: grpc.StatusCode.UNAVAILABLE,
}
MAX_MESSAGE = 256 * 1024 * 1024
LOADED_LIMIT_S = 600  # assigned but never started: the coordinator died while other stages loaded


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
    def __init__(self, host: StageHost, stop: threading.Event, reset: "PendingReset",
                 on_serving=lambda: None):
        self.host = host
        self.stop = stop
        self.reset = reset
        self.on_serving = on_serving  # after a start: the worker makes sure it has a warm standby

    @_rpc
    def Assign(self, req):
        source = f" (fetching from the model store at {req.model_store})" if req.model_store else ""
        log.info("assigned layers [%d, %d) of %s%s", req.layer_start, req.layer_end,
                 req.model or "the default model", source)
        resp = self.host.assign(req)
        log.info("loaded: %.2f GiB weights, %.2f GiB activations, KV budget %.2f GiB",
                 resp.weights_bytes / 2**30, resp.activation_bytes / 2**30, resp.kv_budget_bytes / 2**30)
        return resp

    @_rpc
    def WeightsRoom(self, req):
        resp = self.host.weights_room(req)
        if resp.refusal:
            log.warning("no room for layers [%d, %d): %s", req.layer_start, req.layer_end, resp.refusal)
        else:
            log.info("room for layers [%d, %d): %d bytes of weights to fetch", req.layer_start, req.layer_end,
                     resp.need_bytes)
        return resp

    @_rpc
    def Start(self, req):
        resp = self.host.start(req)
        log.info("serving as stage %d of %d with %d KV blocks", req.rank, req.world_size, req.num_blocks)
        self.on_serving()
        return resp

    @_rpc
    def Step(self, req):
        return self.host.step(req)

    @_rpc
    def Health(self, req):
        if req.heartbeat:
            self.host.touch()
        health = self.host.health()
        if self.reset.reason is not None:
            # Between a Reset and this process going away it is not idle, whatever its host says: a
            # coordinator that took "idle" from here would assign layers to a process about to exit.
            health.state = "resetting"
        return health

    @_rpc
    def LoRAAdd(self, req):
        resp = self.host.lora_add(req)
        log.info("LoRA adapter %r (id %d) added: %d tensors on this stage's layers", req.name, req.lora_id,
                 len(req.tensors))
        return resp

    @_rpc
    def LoRARemove(self, req):
        resp = self.host.lora_remove(req)
        if resp.removed:
            log.info("LoRA adapter %d removed", req.lora_id)
        return resp

    @_rpc
    def Shutdown(self, req):
        log.info("shutting down on request")
        self.stop.set()
        return pb.ShutdownResponse()

    @_rpc
    def Reset(self, req):
        check_version(req.version)
        self.reset.set_reason(req.reason or "the coordinator asked for it")
        self.stop.set()
        return pb.ResetResponse()


class PendingReset:
    """Why the worker is going to re-execute itself once its gRPC server has stopped (None: it isn't)."""

    def __init__(self):
        self.reason: str | None = None

    def set_reason(self, reason: str) -> None:
        self.reason = self.reason or reason


def _parent_alive() -> bool:
    """False once the server that started this worker is gone (even killed with -9)."""
    parent = int(os.environ.get(PARENT_PID_ENV, 0))
    return not parent or os.getppid() == parent


def _watch_coordinator(host: StageHost, timeout_s: float, reset: PendingReset, stop: threading.Event):
    """A serving stage whose coordinator went quiet (it crashed or restarted) frees itself, so that a
    new coordinator finds it idle without anyone restarting this worker."""
    while not stop.wait(1.0):
        if not _parent_alive():  # its server is gone: so is this worker
            log.info("the server that started this worker is gone; stopping")
            stop.set()
            return
        limit = timeout_s if host.state == "serving" else max(timeout_s, LOADED_LIMIT_S)
        if host.state != "idle" and host.coordinator_silent_s() > limit:
            reset.set_reason(f"no word from the coordinator for {limit:.0f}s")
            stop.set()


def _reexec(reason: str, link: "standby.Link | None", handed_over: bool) -> None:
    if handed_over:
        twin = link.peer_pid or (os.getppid() if not standby.is_first_process() else "its twin")
        log.info("resetting (%s): restarting this worker process idle, as its standby; the warm standby "
                 "(pid %s) serves from now on", reason, twin)
        os.environ[standby.STANDBY_ENV] = "1"
        os.environ[standby.DELAY_ENV] = str(standby.SETTLE_S)
    else:
        log.info("resetting (%s): restarting this worker process idle", reason)
        os.environ.pop(standby.STANDBY_ENV, None)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # MLX's ring sockets are not close-on-exec; a leaked listener would hold the ring port. Marked
    # close-on-exec rather than closed here: gRPC's poller threads still run until execv, and one
    # that finds its epoll descriptor closed under it aborts the process ("epoll_wait error: Bad file
    # descriptor"), which is how a resetting worker used to die instead of coming back idle.
    _close_on_exec()
    if link is not None:  # the link to the twin lives on in the next image
        os.set_inheritable(link.sock.fileno(), True)
    os.execv(sys.executable, sys.orig_argv)


def _close_on_exec() -> None:
    fd_dir = next((d for d in ("/proc/self/fd", "/dev/fd") if os.path.isdir(d)), None)
    fds = [int(f) for f in os.listdir(fd_dir)] if fd_dir else range(3, 65536)
    for fd in fds:
        if fd > 2:
            try:
                os.set_inheritable(fd, False)
            except OSError:  # closed meanwhile, or the listing's own descriptor
                pass


def serve(host: str, port: int, ring_port: int, token: str, advertise_ip: str | None = None,
          coordinator_timeout_s: float = 30.0, cache_limit: int = 0) -> None:
    stop = threading.Event()
    reset = PendingReset()
    node_id = os.environ.get(NODE_ID_ENV)
    link = standby.Link.from_env()
    credentials = None
    if link is not None and link.standing_by:
        # Everything a start costs is done before the wait: the imports, and the TLS key and
        # certificate (a fresh key per process, as always).
        credentials = cluster_tls.server_credentials(token, node_id)
        link.wait_turn(still_wanted=_parent_alive)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="rpc"),
        options=[("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE)],
    )
    stage = StageHost(node_id=node_id, ring_port=ring_port, token=token, cache_limit=cache_limit)
    os.environ[NODE_ID_ENV] = stage.node_id
    twin = [link]

    def ensure_standby():
        if twin[0] is None and standby.enabled():
            twin[0] = standby.Link.spawn()

    pb_grpc.add_StageServicer_to_server(StageService(stage, stop, reset, ensure_standby), server)
    try:
        # Mutual TLS keyed by the token: a caller from another cluster, or a plaintext one, fails the
        # handshake (grpc logs one "Handshake failed" line here) and never reaches a handler.
        bound = cluster_tls.add_port(server, f"{host}:{port}", token, stage.node_id, credentials)
    except RuntimeError:  # grpc's way of saying the address is not this host's, or the port is taken
        bound = 0
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}: use an address of this host (--host or --interface) "
                      "and a free --port")
    server.start()
    log.info("worker %s listening on %s:%d, TLS for cluster %s (ring port %d)", stage.node_id, host, bound,
             cluster_tls.fingerprint(token), ring_port)
    advertiser = None
    if advertise_ip:
        from metal_cluster.stage_worker.net.advertise import Advertiser
        from metal_cluster.stage_worker.host import device_name

        advertiser = Advertiser(advertise_ip, stage.node_id, bound, ring_port, device_name())
        log.info("announcing %s on %s (mDNS)", advertiser.info.name, advertise_ip)
    threading.Thread(target=_watch_coordinator, args=(stage, coordinator_timeout_s, reset, stop),
                     name="coordinator-watch", daemon=True).start()
    try:
        while not stop.wait(0.5):  # a plain wait() would not see Ctrl-C
            pass
    except KeyboardInterrupt:
        pass
    if advertiser:
        advertiser.close()
    # A reset must not wait for a step stuck in a ring transfer: the new process image ends it.
    stopped = server.stop(grace=0.5 if reset.reason else 2)
    if reset.reason:
        # The listener is closed now: the standby may bind the ports while this server's last
        # calls end.
        handed_over = twin[0] is not None and twin[0].hand_over()
        stopped.wait(1)
        _reexec(reset.reason, twin[0], handed_over)
    stopped.wait(5)
    log.info("worker stopped")
