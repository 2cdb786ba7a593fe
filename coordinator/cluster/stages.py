"""The coordinator's one way to reach stage work: the proto messages of proto/cluster.proto.

A `Pipeline` is the stages of one model in ring order. Each stage is either a `RemoteStage` (a gRPC
client of `metal-cluster worker`) or a `LocalStage` (a StageHost in this process: the single-machine
form, no gRPC, no ring). The executor only ever talks to a Pipeline.
"""

import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from metal_cluster.proto import PROTO_VERSION, pb
from metal_cluster.proto import cluster_pb2_grpc as pb_grpc
from metal_cluster.stage_worker.net import cluster_tls
from metal_cluster.stage_worker.net.auth import resolve_token
from metal_cluster.stage_worker.net.ring import JOINING_RING

MAX_MESSAGE = 256 * 1024 * 1024
FETCH_TIMEOUT_S = 6 * 3600
# A worker that resets itself is unreachable for a few seconds. grpc's default reconnect backoff
# (1 s, growing 1.6x to 120 s) then kept the re-plan waiting up to ~10 s after the worker listened
# again; retry its address every quarter second instead (a refused connect costs next to nothing, and
# a re-plan waits for the slowest worker to come back: each second here was a second of the outage).
RECONNECT = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 250)]
# How often a wait for a worker to come up (or back, idle) asks again: a warm standby takes a
# worker's ports over within milliseconds of its reset, so each poll here is outage time.
WAIT_POLL_S = 0.05


class StageCallError(RuntimeError):
    """A stage refused or failed an RPC; the message names the stage and its reason."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = code


class LazyFuture(Future):
    """A Future whose last piece of work runs in the first thread that waits for it.

    The in-process stage answers a step this way: its work is queued on the device at submit, and
    reading the tokens back waits until vLLM asks for them, after it has submitted the next step."""

    def __init__(self, run=None):
        super().__init__()
        self.run = run
        self._run_lock = threading.Lock()

    def _run(self) -> None:
        with self._run_lock:
            run, self.run = self.run, None
        if run is not None:
            run()

    def result(self, timeout=None):
        self._run()
        return super().result(timeout)

    def exception(self, timeout=None):
        self._run()
        return super().exception(timeout)


def _local_step(host, req) -> Future:
    out = LazyFuture()
    try:
        answer = host.launch(req)
    except Exception as e:
        out.set_exception(StageCallError(f"local stage: {e}"))
        return out

    def run():
        try:
            out.set_result(answer())
        except Exception as e:
            out.set_exception(StageCallError(f"local stage: {e}"))

    out.run = run
    return out


class LocalStage:
    def __init__(self):
        from metal_cluster.stage_worker.host import StageHost  # MLX only where a stage runs here

        self.host = StageHost()
        self.name = "local"

    def assign(self, req):
        return self.host.assign(req)

    def start(self, req):
        return self.host.start(req)

    def health(self, timeout=None, heartbeat=False):
        return self.host.health()

    def reset(self, reason: str):
        """In-process there is no ring to rejoin: a fresh StageHost is a fresh stage."""
        from metal_cluster.stage_worker.host import StageHost

        self.host = StageHost()

    def wait_ready(self, deadline: float, still_starting=lambda: True):
        return self.host.health()

    def submit(self, req) -> Future:
        return _local_step(self.host, req)

    def lora_add(self, req):
        try:
            return self.host.lora_add(req)
        except Exception as e:
            raise StageCallError(f"local stage: {e}") from None

    def lora_remove(self, req):
        return self.host.lora_remove(req)

    def close(self):
        pass


class RemoteStage:
    def __init__(self, address: str, token: str | None = None, timeout_s: float = 600, step_timeout_s: float = 600):
        self.name = address
        # Set where the worker has no copy of the model: the store it fetches its layers from.
        self.model_store = ""
        self.manifest_sha256 = ""
        self.timeout_s = timeout_s
        self.step_timeout_s = step_timeout_s
        try:
            self.channel = cluster_tls.channel(
                address, token or resolve_token(),
                options=[("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE),
                         *RECONNECT],
            )
        except cluster_tls.NoTokenError as e:
            raise StageCallError(f"stage {address}: {e}", grpc.StatusCode.UNAUTHENTICATED) from None
        self.stub = pb_grpc.StageStub(self.channel)

    def _error(self, e: grpc.RpcError) -> StageCallError:
        """A failed TLS handshake is a refusal (UNAUTHENTICATED), not a worker still starting."""
        refused = cluster_tls.refusal(e.details())
        if refused:
            return StageCallError(f"stage {self.name}: {refused}", grpc.StatusCode.UNAUTHENTICATED)
        return StageCallError(f"stage {self.name}: {e.details() or e.code().name}", e.code())

    def _call(self, method, req, timeout=None):
        try:
            return method(req, timeout=timeout or self.timeout_s)
        except grpc.RpcError as e:
            raise self._error(e) from None

    def assign(self, req):
        # A stage fetching its weights may take long; its progress shows in Health meanwhile.
        return self._call(self.stub.Assign, req, FETCH_TIMEOUT_S if req.model_store else None)

    def start(self, req):
        return self._call(self.stub.Start, req)

    def weights_room(self, req):
        return self._call(self.stub.WeightsRoom, req, 60)  # it fetches the small files only

    def health(self, timeout=5, heartbeat=False):
        return self._call(self.stub.Health, pb.HealthRequest(version=PROTO_VERSION, heartbeat=heartbeat), timeout)

    def reset(self, reason: str):
        """The worker drops its plan by re-executing itself; wait_ready then sees it back, idle."""
        return self._call(self.stub.Reset, pb.ResetRequest(version=PROTO_VERSION, reason=reason), 5)

    def wait_ready(self, deadline: float, still_starting=lambda: True):
        """Health, polling while the worker is not reachable yet (still starting) until `deadline`
        (a time.monotonic() value). Any other answer, a refusal included, is returned or raised at once."""
        while True:
            try:
                return self.health(timeout=2)
            except StageCallError as e:
                booting = e.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                if not (booting and still_starting() and time.monotonic() < deadline):
                    raise
                time.sleep(WAIT_POLL_S)

    def lora_add(self, req):
        return self._call(self.stub.LoRAAdd, req)

    def lora_remove(self, req):
        return self._call(self.stub.LoRARemove, req)

    def shutdown(self):
        return self._call(self.stub.Shutdown, pb.ShutdownRequest(version=PROTO_VERSION), 5)

    def submit(self, req) -> Future:
        out = Future()
        call = self.stub.Step.future(req, timeout=self.step_timeout_s)

        def done(c):
            try:
                out.set_result(c.result())
            except grpc.RpcError as e:
                out.set_exception(self._error(e))

        call.add_done_callback(done)
        return out

    def close(self):
        self.channel.close()


@dataclass(frozen=True)
class DraftAssignment:
    """Speculative decoding's draft model (or the checkpoint's MTP layers), for the last stage to
    load beside its layers."""

    model: str  # a path on the last stage's host ("" for MTP layers: they are the target's)
    num_tokens: int  # drafts per request and step
    mtp: bool = False


class Pipeline:
    """Stages in ring order: stage k runs layers before stage k+1's and sends it hidden states."""

    def __init__(self, stages: list):
        self.stages = stages
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(stages)), thread_name_prefix="stage-ctl")

    def __len__(self):
        return len(self.stages)

    def assign(self, model: str, ranges: list[tuple[int, int]], block_size: int, max_tokens: int,
               utilization: list[float], activation_known: list[int] | None = None,
               draft: DraftAssignment | None = None) -> list[pb.AssignResponse]:
        """activation_known: per stage, an activation peak already measured (0: the stage warms up)."""
        reqs = [
            pb.AssignRequest(version=PROTO_VERSION, model=model, layer_start=a, layer_end=b, block_size=block_size,
                             max_num_batched_tokens=max_tokens, memory_utilization=share,
                             model_store=getattr(stage, "model_store", ""),
                             manifest_sha256=getattr(stage, "manifest_sha256", ""), activation_bytes_known=known)
            for (a, b), share, stage, known in zip(ranges, utilization, self.stages,
                                                   activation_known or [0] * len(self.stages))
        ]
        if draft is not None:  # the last stage verifies, so it drafts
            reqs[-1].spec_draft_model, reqs[-1].spec_num_draft_tokens = draft.model, draft.num_tokens
            reqs[-1].spec_mtp = draft.mtp
        return list(self.pool.map(lambda sr: sr[0].assign(sr[1]), zip(self.stages, reqs)))

    def start(self, num_blocks: int, ring_hosts: list[str], ring_timeout_s: float = 60, wire: str = "",
              kv_groups: list[list[int]] = ()) -> list[pb.StartResponse]:
        """kv_groups: vLLM's KV cache groups as global layer indices (empty: one group)."""
        hostfile = json.dumps([[h] for h in ring_hosts])
        groups = [pb.BlockIds(ids=g) for g in kv_groups]
        reqs = [
            pb.StartRequest(version=PROTO_VERSION, num_blocks=num_blocks, rank=k, world_size=len(self.stages),
                            ring_hostfile=hostfile, ring_timeout_s=ring_timeout_s, wire_dtype=wire, kv_groups=groups)
            for k in range(len(self.stages))
        ]
        # Every rank must be joining at once: the ring connects only when all are there. MLX's ring has
        # ranks 0..S-2 listen first and rank S-1 connect first (to rank 0), and a connect that finds
        # no listener sleeps 1 s (then 2, 4, ...) before it tries again: that second was most of a
        # re-plan's ring join. So the last rank starts once the others are listening.
        first = [self.pool.submit(s.start, r) for s, r in zip(self.stages[:-1], reqs[:-1])]
        _until_joining(self.stages[:-1], first, time.monotonic() + JOIN_HEAD_START_S)
        last = self.pool.submit(self.stages[-1].start, reqs[-1])
        return [f.result() for f in [*first, last]]

    def lora_add(self, adapter, lora_id: int, max_loras: int, max_rank: int,
                 ranges: list[tuple[int, int]]) -> None:
        """Give every stage its own layers' part of a LoRA adapter (`lora_adapters.LoRAAdapter`)."""
        reqs = [adapter.add_request(lora_id, max_loras, max_rank, range(a, b)) for a, b in ranges]
        list(self.pool.map(lambda sr: sr[0].lora_add(sr[1]), zip(self.stages, reqs)))

    def lora_remove(self, lora_id: int) -> None:
        req = pb.LoRARemoveRequest(version=PROTO_VERSION, lora_id=lora_id)
        list(self.pool.map(lambda s: s.lora_remove(req), self.stages))

    def submit(self, step: pb.StepRequest) -> Future:
        """Every stage gets every step; the answer is the last stage's. The first error answers at
        once: the other stages may be blocked on the ring behind the one that failed."""
        futures = [s.submit(step) for s in self.stages]
        if len(futures) == 1:
            return futures[0]
        out = Future()
        remaining = [len(futures)]
        lock = threading.Lock()

        def done(f):
            with lock:
                remaining[0] -= 1
                if out.done():
                    return
                if f.exception() is not None:
                    out.set_exception(f.exception())
                elif not remaining[0]:
                    out.set_result(futures[-1].result())

        for f in futures:
            f.add_done_callback(done)
        return out

    def close(self):
        for s in self.stages:
            s.close()
        self.pool.shutdown(wait=False)


# Longest the last rank's start waits for the others to reach the ring (then it goes anyway).
JOIN_HEAD_START_S = 5.0
JOIN_POLL_S = 0.02
# MLX's ring init holds Python's lock while it waits for its peers, so a joining worker answers no
# health check: one unanswered for this long, once its start was sent, is a worker listening.
JOIN_SILENT_S = 0.25
JOIN_MARGIN_S = 0.05  # from "joining the ring" to MLX's listen: a thread start and a bind


def _until_joining(stages: list, starts: list[Future], deadline: float) -> None:
    """Until every stage is joining the ring, its start has ended, or the deadline."""
    if not stages:
        return
    waiting = list(zip(stages, starts))
    while waiting and time.monotonic() < deadline:
        waiting = [(stage, start) for stage, start in waiting if not (start.done() or _joining(stage))]
        if waiting:
            time.sleep(JOIN_POLL_S)
    time.sleep(JOIN_MARGIN_S)


def _joining(stage) -> bool:
    try:
        return stage.health(timeout=JOIN_SILENT_S).phase == JOINING_RING
    except StageCallError as e:
        return e.code == grpc.StatusCode.DEADLINE_EXCEEDED


def even_split(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for k in range(num_stages):
        end = start + base + (1 if k < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def wire_dtype(stage_dtypes: list[str]) -> str:
    """The one dtype hidden states travel in for a plan whose stages compute in `stage_dtypes`.

    Stages that agree send their own. A mixed plan (a CPU stage, float32, beside GPU stages) sends
    the GPU's half-width dtype: half the bytes per hop, and no precision the GPU stages keep anyway
    is lost; bfloat16 before float16, whose range is narrower."""
    names = set(d for d in stage_dtypes if d)
    if len(names) <= 1:
        return names.pop() if names else "float32"
    for name in ("bfloat16", "float16"):
        if name in names:
            return name
    return "float32"
