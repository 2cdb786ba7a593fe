"""One stage's life: assigned a layer range, started with a KV pool and a ring, then steps.

Proto in, proto out: the gRPC service and the coordinator's in-process adapter both wrap this, so
a stage behaves the same on another Mac or inside the coordinator.
"""

import os
import platform
import threading
import time
import uuid
from collections.abc import Callable

import mlx.core as mx
import psutil

from metal_cluster.proto import PROTO_VERSION, pb
from metal_cluster.stage_worker.kv import memory
from metal_cluster.stage_worker.step.speculative.draft import DraftModel
from metal_cluster.stage_worker.step.speculative.mtp import MTPDrafter
from metal_cluster.stage_worker.model.dtypes import dtype_name, from_name
from metal_cluster.stage_worker.errors import ModelLoadError
from metal_cluster.stage_worker.net.auth import resolve_token
from metal_cluster.stage_worker.transfer.fetch import FetchProgress, fetch_stage, weights_room
from metal_cluster.stage_worker.kv.kv_layout import KVLayout
from metal_cluster.stage_worker.model.model_source import resolve_model
from metal_cluster.stage_worker.kv.paged_kv import KVPool, bytes_per_block
from metal_cluster.stage_worker.step.phases import StepPhases, Stopwatch
from metal_cluster.stage_worker.step.request_table import StepError
from metal_cluster.stage_worker.net.ring import JOINING_RING, Ring
from metal_cluster.stage_worker.step.runner import StageOutput, StageRunner, to_response
from metal_cluster.stage_worker.model.shard import load_shard


# Float32 (tokens x tokens) arrays per attention head that one layer's attention may hold at once
# (scores, their softmax, a mask, a cast): the most the activation fit lets grow with n^2.
SCORE_ARRAYS = 8
# The largest warm-up prefill a stage runs at start; larger --max-num-batched-tokens are extrapolated.
# On the CPU a 2048-token warm-up alone takes seconds; on a GPU a prefill of vLLM's default batch
# (8192 tokens) takes well under one, so there the peak is measured at the batch itself, as vLLM's
# own profile run does (a fit from small prefills read 77 GiB for 8192 tokens of Qwen3-8B on CUDA).
WARM_UP_TOKENS = 256
GPU_WARM_UP_TOKENS = 16384
# A pipeline stage builds its step's graph on the previous stage's hidden states before they
# arrive (`_launch`); 0 waits for them first, as before (the benches' A/B switch).
BUILD_AHEAD_OF_RECV = os.environ.get("METAL_CLUSTER_BUILD_AHEAD_OF_RECV", "1") != "0"


class StageStateError(RuntimeError):
    """An RPC that does not fit the stage's state (e.g. a step before start)."""


class StageHost:
    def __init__(self, node_id: str | None = None, ring_port: int = 0, token: str | None = None,
                 cache_limit: int = 0):
        self.node_id = node_id or uuid.uuid4().hex[:12]
        self.token = token  # for the coordinator's model store (None: this host's token)
        self.fetch = FetchProgress()
        self.cache_limit = cache_limit  # bytes of fetched weights this host keeps (0: no limit)
        self.ring_port = ring_port
        self.state = "idle"
        self.phase = ""  # what assign/start is doing now, for progress (Health)
        self.shard = None
        self.source = None  # where the stage's weights are read from (a fetched folder or the model's)
        self.fetched: set[str] | None = None  # the tensors a fetched folder holds
        # Speculative decoding's draft model or MTP layers (last stage only).
        self.draft: DraftModel | MTPDrafter | None = None
        self.runner: StageRunner | None = None
        self.ring: Ring | None = None
        self.block_size = 0
        self.steps = 0
        self.last_step_s = 0.0
        self.phases = StepPhases()  # the parts of the last steps (Health)
        self.lock = threading.Lock()  # one MLX user at a time
        # Steps run strictly in step_id order: ring messages between stages match only that way.
        self.turn = threading.Condition()
        self.next_step = 0
        self.last_contact = time.monotonic()  # the owning coordinator's last step or heartbeat

    # --- control ---------------------------------------------------------------------------------
    def touch(self) -> None:
        """The coordinator that owns this stage is alive (a step, a heartbeat, an assign or start)."""
        self.last_contact = time.monotonic()

    def coordinator_silent_s(self) -> float:
        return 0.0 if self.state == "idle" else time.monotonic() - self.last_contact

    def assign(self, req: pb.AssignRequest) -> pb.AssignResponse:
        check_version(req.version)
        with self.lock:
            if self.state != "idle":
                raise StageStateError(
                    f"this stage already holds layers [{self.shard.start}, {self.shard.end}); "
                    "a new plan needs a new stage process"
                )
            began = time.perf_counter()
            self.phase = "fetching weights" if req.model_store else "loading weights"
            try:
                self.shard = self._load(req)
                self.block_size = req.block_size
                weights = sum(v.nbytes for v in _params(self.shard.model))
                if (req.spec_draft_model or req.spec_mtp) and self.shard.is_last:
                    self.phase = "loading the MTP layers" if req.spec_mtp else "loading the draft model"
                    self.draft = self._load_mtp(req) if req.spec_mtp else self._load_draft(req)
                    weights += self.draft.weights_bytes
                loaded = time.perf_counter()
                if req.activation_bytes_known > 0:  # a re-plan: this worker measured it for the last plan
                    activation = req.activation_bytes_known
                else:
                    self.phase = f"warming up ({min(req.max_num_batched_tokens, warm_up_limit())}-token prefill)"
                    activation = self._activation_peak(req.max_num_batched_tokens)
                warmed = time.perf_counter()
            finally:
                self.phase = ""
            budget = memory.kv_budget(req.memory_utilization or 0.5, weights, activation)
            self.state = "loaded"
            self.touch()
            return pb.AssignResponse(
                weights_bytes=weights,
                activation_bytes=activation,
                bytes_per_block=self.bytes_per_block,
                kv_budget_bytes=budget.kv_bytes,
                num_layers=self.shard.num_layers,
                host_memory_bytes=budget.host_bytes,
                dtype=dtype_name(self.dtype),
                load_seconds=loaded - began,
                warm_up_seconds=warmed - loaded,
                spec_draft_bytes_per_block=self.draft.bytes_per_block(self.block_size) if self.draft else 0,
                spec_draft_weights_bytes=self.draft.weights_bytes if self.draft else 0,
            )

    def _load(self, req: pb.AssignRequest):
        if not req.model_store:
            self.source = resolve_model(req.model or None)
            return load_shard(self.source, req.layer_start, req.layer_end)
        fetched = fetch_stage(req.model_store, req.manifest_sha256, req.layer_start, req.layer_end,
                              self.token or resolve_token(), self.fetch, cache_limit=self.cache_limit,
                              mtp=req.spec_mtp)
        self.source, self.fetched = resolve_model(fetched.folder), fetched.tensors
        return load_shard(self.source, req.layer_start, req.layer_end, fetched.tensors)

    def _load_draft(self, req: pb.AssignRequest) -> DraftModel:
        try:
            return DraftModel.load(req.spec_draft_model, req.spec_num_draft_tokens)
        except ModelLoadError as e:
            if not req.model_store:
                raise
            # Weights travel with the plan for the target only (model_store.py): not for a draft yet.
            raise ModelLoadError(f"{e}; this worker fetches its layers from the coordinator, but a draft model "
                                 f"does not travel: put it at {req.spec_draft_model} on this host too") from None

    def _load_mtp(self, req: pb.AssignRequest) -> MTPDrafter:
        """From where the stage's layers came: a fetched last stage fetched the MTP layers too."""
        return MTPDrafter.load(self.source, self.shard, req.spec_num_draft_tokens, self.fetched)

    def weights_room(self, req: pb.WeightsRoomRequest) -> pb.WeightsRoomResponse:
        check_version(req.version)
        return weights_room(req.model_store, req.manifest_sha256, req.layer_start, req.layer_end,
                            self.token or resolve_token(), cache_limit=self.cache_limit, mtp=req.spec_mtp)

    def start(self, req: pb.StartRequest) -> pb.StartResponse:
        check_version(req.version)
        with self.lock:
            if self.state != "loaded":
                raise StageStateError(f"start needs an assigned stage; this one is {self.state}")
            try:
                if req.world_size > 1:
                    self.phase = JOINING_RING
                    wire = from_name(req.wire_dtype) if req.wire_dtype else self.dtype
                    self.ring = Ring.join(req.rank, req.world_size, req.ring_hostfile, req.ring_timeout_s or 60, wire)
                layout = KVLayout.of_stage([list(g.ids) for g in req.kv_groups], self.shard.start, self.shard.end,
                                           self.shard.family.layer_caches(self.shard.config))
                pool_bytes = req.num_blocks * bytes_per_block(self.shard.caches, self.block_size, self.dtype, layout)
                if self.draft is not None:
                    pool_bytes += req.num_blocks * self.draft.bytes_per_block(self.block_size)
                self.phase = f"allocating the KV pool ({pool_bytes / 2**30:.2f} GiB)"
                began = time.perf_counter()
                self.runner = StageRunner(self.shard, self._allocate(req.num_blocks, layout),
                                          self._allocate_draft(req.num_blocks, layout))
                allocated = time.perf_counter() - began
            finally:
                self.phase = ""
            self.state = "serving"
            self.touch()
        return pb.StartResponse(kv_allocate_seconds=allocated)

    def health(self) -> pb.HealthResponse:
        shard = self.shard
        vm = psutil.virtual_memory()
        return pb.HealthResponse(
            version=PROTO_VERSION,
            state=self.state,
            node_id=self.node_id,
            layer_start=shard.start if shard else 0,
            layer_end=shard.end if shard else 0,
            num_blocks=self.runner.pool.num_blocks if self.runner else 0,
            num_requests=len(self.runner.table) if self.runner else 0,
            resident_bytes=psutil.Process(os.getpid()).memory_info().rss,
            steps=self.steps,
            ring_port=self.ring_port,
            host_id=machine_id(),
            kv_blocks_used=self.runner.table.blocks_in_use() if self.runner else 0,
            host_memory_bytes=vm.total,
            host_memory_available_bytes=vm.available,
            device=device_name(),
            step_seconds=self.last_step_s,
            ring_bytes_sent=self.ring.bytes_sent if self.ring else 0,
            coordinator_silent_s=self.coordinator_silent_s(),
            kv_dtype=dtype_name(self.runner.pool.dtype) if self.runner else "",
            fetch_bytes_total=self.fetch.total,
            fetch_bytes_done=self.fetch.done,
            fetch_bytes_received=self.fetch.received,
            phase=self.phase,
            step_phases=self.phases.medians(),
            step_marks=self.phases.last_marks,
        )

    # --- LoRA adapters ---------------------------------------------------------------------------
    def lora_add(self, req: pb.LoRAAddRequest) -> pb.LoRAAddResponse:
        check_version(req.version)
        with self.lock:  # never while a step is being prepared or built
            if self.runner is None:
                raise StageStateError(f"a LoRA adapter needs a started stage; this one is {self.state}")
            self.runner.lora.add(req)
        return pb.LoRAAddResponse()

    def lora_remove(self, req: pb.LoRARemoveRequest) -> pb.LoRARemoveResponse:
        check_version(req.version)
        with self.lock:
            removed = self.runner is not None and self.runner.lora.remove(req.lora_id)
        return pb.LoRARemoveResponse(removed=removed)

    # --- data ------------------------------------------------------------------------------------
    def step(self, req: pb.StepRequest, wait_s: float = 60.0) -> pb.StepResponse:
        """Run one step and answer it, before the next step may start (the gRPC path)."""
        started = time.perf_counter()
        clock = self.phases.stopwatch()
        return self._in_turn(req, wait_s, lambda: self._answer(self._launch(req, clock), started, clock), clock)

    def launch(self, req: pb.StepRequest, wait_s: float = 60.0) -> Callable[[], pb.StepResponse]:
        """Queue one step's work on the device; the function returned waits for it and answers.

        Between the two the caller may launch the next step (the in-process stage under vLLM's
        async scheduling), so the device never waits for the host to build it."""
        started = time.perf_counter()
        clock = self.phases.stopwatch()
        out = self._in_turn(req, wait_s, lambda: self._launch(req, clock), clock)

        def answer():
            clock.restart()  # the time between is the caller's (the next step's launch)
            return self._answer(out, started, clock)

        return answer

    def _in_turn(self, req: pb.StepRequest, wait_s: float, run, clock: Stopwatch):
        """`run()` once every earlier step has had its turn: ring messages between stages match
        only in step order."""
        check_version(req.version)
        if self.state != "serving":
            raise StageStateError(f"a step needs a started stage; this one is {self.state}")
        self.touch()
        with self.turn:
            if not self.turn.wait_for(lambda: req.step_id <= self.next_step, wait_s):
                raise StepError(f"step {req.step_id} waited {wait_s:.0f}s for step {self.next_step}, which never came")
            if req.step_id < self.next_step:
                raise StepError(f"step {req.step_id} already ran (the next step is {self.next_step})")
            clock.mark("queue")
            try:
                return run()
            finally:
                self.next_step += 1
                self.turn.notify_all()

    def _launch(self, req: pb.StepRequest, clock: Stopwatch) -> StageOutput:
        with self.lock:
            batch = self.runner.prepare(req)
            clock.mark("prepare")
            hidden_in = received = ready = None
            if batch.req_ids and not self.shard.is_first:
                # The step's graph is built on the receive before it is done, while the previous
                # stage still computes; the receive is waited for on the host before any of the
                # step goes to the device, so no device work ever waits on the ring (on one GPU
                # shared by two stages, a waiting kernel would take time slices from the other).
                received = self.ring.recv_prev(int(batch.token_ids.shape[0]), self.hidden_size,
                                               wait=not BUILD_AHEAD_OF_RECV)
                hidden_in = received.astype(self.dtype)

                def ready():
                    clock.mark("build")
                    mx.eval(received)
                    clock.mark("recv")
            try:
                out = self.runner.run(req, batch, hidden_in, ready)
            finally:
                if received is not None:
                    # Done before anything else happens (the graph may have failed to build): a
                    # receive still pending in MLX's threads can take the process down with it
                    # when it re-executes itself for a new plan, and the ring's order depends on it.
                    mx.eval(received)
            if self.runner.handed_at is not None and "build" not in clock.marks:
                clock.mark("build", self.runner.handed_at)  # the step's graph, up to its hand-over to MLX
            self.runner.handed_at = None
            clock.mark("device")  # the wait for it (0 where the step is only queued)
            if out.hidden is not None:
                self.ring.send_next(out.hidden)
                clock.mark("send")
            return out

    def _answer(self, out: StageOutput, started: float, clock: Stopwatch) -> pb.StepResponse:
        with self.lock:
            out.resolve()
            clock.mark("resolve")  # the sampled tokens read back
            response = to_response(out)
            clock.mark("answer")
            self.steps += 1
            self.last_step_s = time.perf_counter() - started
            self.phases.add("step", self.last_step_s)
            return response

    # --- helpers ---------------------------------------------------------------------------------
    @property
    def dtype(self) -> mx.Dtype:
        return self.shard.dtype

    @property
    def hidden_size(self) -> int:
        return self.shard.config["hidden_size"]

    @property
    def bytes_per_block(self) -> int:
        return bytes_per_block(self.shard.caches, self.block_size, self.dtype)

    def _allocate(self, num_blocks: int, layout: KVLayout | None = None) -> KVPool:
        return KVPool.allocate(self.shard.caches, num_blocks, self.block_size, self.dtype, layout)

    def _allocate_draft(self, num_blocks: int, layout: KVLayout | None = None) -> DraftModel | None:
        """The draft's own pool; its KV follows the block tables of the target's first
        full-attention group (a sliding group's tables drop the blocks behind the window)."""
        if self.draft is None:
            return None
        windows = layout.windows if layout else (None,)
        full = [g for g, (w, r) in enumerate(zip(windows, layout.recurrent if layout else (False,))) if not w and not r]
        if not full:
            raise StageStateError("a draft model needs a full-attention KV cache group in the target")
        return self.draft.allocate(num_blocks, self.block_size, full[0])

    def _activation_peak(self, num_tokens: int) -> int:
        """Activation bytes of a num_tokens prefill. Past `warm_up_limit()`, two smaller prefills fit
        a*n + c*n^2 (linear layers, and attention scores where attention materialises them) and the
        fit is read at num_tokens: on the CPU a 2048-token warm-up cost ~16x a 256-token one and
        the fit lands within 1% of it (SmolLM2-135M). The larger of fit and measurement counts.

        The quadratic term is capped at what attention can materialise, one layer at a time: a few
        float32 score arrays per head (SCORE_ARRAYS). On CUDA the two small prefills differ by more
        than their work (MLX's memory pool grows in steps), and an uncapped fit read 351 GiB of
        activations for an 8192-token batch of Qwen3-8B: there it is measured up to 16384 tokens."""
        limit = warm_up_limit()
        if num_tokens <= limit:
            return self._measure_activation_peak(num_tokens)
        n1, n2 = limit // 2, limit
        p1, p2 = self._measure_activation_peak(n1), self._measure_activation_peak(n2)
        heads = self.shard.config.get("num_attention_heads", 1)
        c = min(max(0.0, (p2 - 2 * p1) / (n2 * n2 - 2 * n1 * n1)), SCORE_ARRAYS * 4 * heads)
        a = max(0.0, (p2 - c * n2 * n2) / n2)
        return max(p2, int(a * num_tokens + c * num_tokens * num_tokens))

    def _measure_activation_peak(self, num_tokens: int) -> int:
        """One local prefill of num_tokens on a throw-away pool (no ring): activation bytes."""
        if num_tokens <= 0:
            return 0
        # With a draft model the prompt's token and the drafts after it need room too.
        ahead = 1 + self.draft.k if self.draft is not None else 0
        blocks = -(-(num_tokens + ahead) // self.block_size) + 1
        runner = StageRunner(self.shard, self._allocate(blocks), self._allocate_draft(blocks))
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        step = pb.StepRequest(version=PROTO_VERSION)
        step.new_requests.append(pb.NewRequest(req_id="warm-up", prompt_token_ids=[0] * num_tokens, block_ids=range(1, blocks)))
        step.scheduled.append(pb.ScheduledTokens(req_id="warm-up", num_tokens=num_tokens))
        hidden = None if self.shard.is_first else mx.zeros((num_tokens, self.hidden_size), dtype=self.dtype)
        runner.step(step, hidden)
        peak = max(0, mx.get_peak_memory() - base)
        del runner
        mx.clear_cache()
        return peak


def warm_up_limit() -> int:
    """The largest prefill this device measures rather than extrapolates."""
    return GPU_WARM_UP_TOKENS if mx.default_device().type == mx.DeviceType.gpu else WARM_UP_TOKENS


def machine_id() -> str:
    """Stable per machine (not per process): /etc/machine-id where there is one, else the host name."""
    try:
        with open("/etc/machine-id") as f:
            return f.read().strip() or platform.node()
    except OSError:
        return platform.node()


def device_name() -> str:
    device = mx.default_device()
    return f"{platform.machine()} {device.type.name}"


def check_version(version: int) -> None:
    if version != PROTO_VERSION:
        raise VersionError(f"proto version {version} is not this worker's version {PROTO_VERSION}; run the same metal-cluster on every host")


class VersionError(ValueError):
    pass


def _params(model):
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten(model.parameters())]


__all__ = ["StageHost", "StageStateError", "StepError", "VersionError", "check_version"]
