"""The cluster executor: a vLLM Executor whose workers are our stages.

vLLM's EngineCore (scheduler, KV block manager) calls this with SchedulerOutputs; we turn each into a
StepRequest for the pipeline and its answer into a ModelRunnerOutput. No torch model ever runs.
With N stages vLLM runs N steps at once (its pipeline-parallel batch queue), each over other
requests, so stage k works on step n while stage k+1 works on step n-1.

When a step fails or a stage stops answering heartbeats, the steps in flight are answered at once
with a `StageLossOutput`: the scheduler takes their requests back and holds them (cluster_scheduler.py)
while a re-plan runs in the background (replan.py); on the new plan they resume where they stopped.
"""

import json
import logging
import os
import threading
import time
from concurrent.futures import Future
from functools import cached_property
from pathlib import Path

from vllm.outputs import RequestError
from vllm.v1.executor.abstract import Executor
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

from metal_cluster.coordinator.engine import kv_specs, pooling
from metal_cluster.coordinator.commands import load_progress, start_times
from metal_cluster.coordinator.cluster import replan
from metal_cluster.coordinator.engine.cluster_control import CONTROL_KEY, ClusterControl
from metal_cluster.coordinator.engine.cluster_scheduler import loss_output, with_request_errors
from metal_cluster.coordinator.engine.lora_registry import LoRARegistry
from metal_cluster.coordinator.cluster.cluster_state import RUN_DIR_ENV
from metal_cluster.coordinator.engine.executor_env import (
    DEFAULT_RESUME_TIMEOUT_S, DEFAULT_STAGE_TIMEOUT_S, DEFAULT_STEP_TIMEOUT_S, LAYERS_ENV, LOCAL_STAGES_ENV,
    MANIFEST_ENV, MODEL_STORE_ENV, NO_OVERLAP_ENV, RESUME_TIMEOUT_ENV, STAGE_TIMEOUT_ENV, STAGES_ENV,
    STEP_TIMEOUT_ENV,
)
from metal_cluster.coordinator.cluster.monitor import Monitor
from metal_cluster.coordinator.cluster.stages import (
    DraftAssignment, LazyFuture, LocalStage, Pipeline, RemoteStage, StageCallError, even_split, wire_dtype,
)
from metal_cluster.coordinator.engine.step_translation import StepTranslator, to_runner_output
from metal_cluster.stage_worker.model.dtypes import from_name
from metal_cluster.stage_worker.families import family_of
from metal_cluster.stage_worker.kv.memory import KVBudget, MemoryBudgetError
from metal_cluster.stage_worker.model.model_source import text_config
from metal_cluster.stage_worker.kv.paged_kv import request_bytes

# A child of vLLM's logger, so our lines come out with the engine's own (same format, same process tag).
log = logging.getLogger("vllm.metal_cluster.executor")

RING_TIMEOUT_S = 60
FENCE_WATCH_S = 600  # how long a lost stage is watched for, to fence it if it answers again
LOCAL = "local"  # the address of the in-process stage of a single-machine server


def _done(value=None, error=None) -> Future:
    future = Future()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
    return future


def _run(fn, non_block, *args):
    try:
        value = fn(*args)
    except Exception as e:
        if not non_block:
            raise
        return _done(error=e)
    if isinstance(value, Future):
        return value if non_block else value.result()
    return _done(value) if non_block else value


class ClusterExecutor(Executor):
    uses_ray = False
    supports_pp = True

    def _init_executor(self) -> None:
        self.stage_timeout_s = float(os.environ.get(STAGE_TIMEOUT_ENV, DEFAULT_STAGE_TIMEOUT_S))
        self.step_timeout_s = float(os.environ.get(STEP_TIMEOUT_ENV, DEFAULT_STEP_TIMEOUT_S))
        self.local_stage = None
        self.addresses = [a for a in os.environ.get(STAGES_ENV, "").split(",") if a] or [LOCAL]
        self.pipeline = Pipeline([self._stage(a) for a in self.addresses])
        self._refuse_unservable()
        self._align_block_size()
        num_layers = self._model_json["num_hidden_layers"]
        planned = os.environ.get(LAYERS_ENV)
        self.ranges = ([tuple(int(x) for x in r.split("-")) for r in planned.split(",")] if planned
                       else even_split(num_layers, len(self.pipeline)))
        log.info("loading %s: %d layers over %d stage(s) %s, then a %d-token warm-up per stage",
                 self.model_name, num_layers, len(self.pipeline), self.ranges,
                 self.scheduler_config.max_num_batched_tokens)
        self.healths = [s.health() for s in self.pipeline.stages]
        self.shares = replan.shares_per_host([h.host_id for h in self.healths],
                                             self.cache_config.gpu_memory_utilization)
        with load_progress.reported(self.pipeline.stages, lambda line: log.info("%s", line)):
            self.assigned = self.pipeline.assign(
                self.model_config.model, self.ranges, self.cache_config.block_size,
                self.scheduler_config.max_num_batched_tokens, self.shares, draft=self.draft,
            )
        self.activation_peak = max(r.activation_bytes for r in self.assigned)  # measured: see replan.activation_known
        self.placement_costs = {}  # see replan.Settings.costs
        for (a, b), r, stage in zip(self.ranges, self.assigned, self.pipeline.stages):
            log.info("stage %s: layers [%d, %d), %.2f GiB weights, %.2f GiB activations, KV budget %.2f GiB",
                     stage.name, a, b, r.weights_bytes / 2**30, r.activation_bytes / 2**30, r.kv_budget_bytes / 2**30)
        if self.draft is not None:
            r = self.assigned[-1]
            log.info("%s on stage %s: %.2f GiB weights, %.1f KiB KV per token, %d drafts per step",
                     "MTP layers" if self.draft.mtp else f"draft model {os.path.basename(self.draft.model)}",
                     self.pipeline.stages[-1].name,
                     r.spec_draft_weights_bytes / 2**30,
                     r.spec_draft_bytes_per_block / self.cache_config.block_size / 1024, self.draft.num_tokens)
        self.translator = StepTranslator(stage_keeps_tokens=len(self.pipeline) == 1,
                                         pooling=pooling.pooling_type(self.model_config),
                                         classifier=pooling.classifier_head(self.model_config))
        self.lock = threading.Lock()  # the translator, the pipeline and the steps in flight change together
        self.inflight: dict[Future, object] = {}  # answer -> its SchedulerOutput
        self.pending = None
        self.overlap = os.environ.get(NO_OVERLAP_ENV) != "1"
        # The scheduler finds this in the config both are built from (see cluster_control.py).
        self.control = ClusterControl(
            resume_timeout_s=float(os.environ.get(RESUME_TIMEOUT_ENV, DEFAULT_RESUME_TIMEOUT_S)))
        if isinstance(self.vllm_config.additional_config, dict):
            self.vllm_config.additional_config[CONTROL_KEY] = self.control
        self.monitor = None
        self.closed = threading.Event()
        lora = self.vllm_config.lora_config
        self.loras = (LoRARegistry(self.model_config.model, lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras)
                      if lora is not None else None)

    @cached_property
    def draft(self) -> DraftAssignment | None:
        """The draft model of `--speculative-config '{"method": "draft_model", ...}'`: a path on
        the last stage's host (weights travel does not carry it yet: a remote last stage needs it at
        the same path)."""
        spec = self.vllm_config.speculative_config
        if spec is not None and spec.method == "mtp":  # the checkpoint's own MTP layers
            return DraftAssignment("", spec.num_speculative_tokens, mtp=True)
        if spec is None or spec.method != "draft_model":
            return None
        return DraftAssignment(spec.model, spec.num_speculative_tokens)

    def _draft_block_bytes(self, assigned) -> list[int]:
        """What a block id costs each stage's draft pool (the last stage's only)."""
        return [r.spec_draft_bytes_per_block for r in assigned]

    @cached_property
    def _model_json(self) -> dict:
        """The model folder's config.json, as the stages' families read it (its text model's)."""
        return text_config(json.loads((Path(self.model_config.model) / "config.json").read_text()))

    def _refuse_unservable(self) -> None:
        gap = family_of(self._model_json, self.model_config.model).serving_gap
        if gap:
            log.error("cannot serve %s (%s) yet: %s", self.model_name, self._model_json.get("model_type"), gap)
            logging.shutdown()
            os._exit(3)
        refusal = pooling.classifier_refusal(self.model_config)
        if refusal:
            log.error("cannot serve %s as a classifier: %s", self.model_name, refusal)
            logging.shutdown()
            os._exit(3)

    def _align_block_size(self) -> None:
        """With recurrent layers, a block big enough that a K/V page holds a state page (vLLM's
        hybrid manager needs one page size); in "align" mode a state block is a block too."""
        cache = self.cache_config
        size = kv_specs.hybrid_block_size(self._layer_caches(), cache.block_size)
        if size != cache.block_size:
            log.info("block size %d tokens (was %d): a K/V page holds a Gated DeltaNet state", size, cache.block_size)
            cache.block_size = size
        if cache.mamba_cache_mode == "align":
            cache.mamba_block_size = cache.block_size

    @property
    def model_name(self) -> str:
        return os.path.basename(self.model_config.model)

    def _stage(self, address: str):
        if address == LOCAL:
            self.local_stage = self.local_stage or LocalStage()
            return self.local_stage
        stage = RemoteStage(address, step_timeout_s=self.step_timeout_s)
        if address not in os.environ.get(LOCAL_STAGES_ENV, "").split(","):
            # A worker on another host has no copy of the model: it fetches its layers from our store.
            stage.model_store = os.environ.get(MODEL_STORE_ENV, "")
            stage.manifest_sha256 = os.environ.get(MANIFEST_ENV, "")
        return stage

    # --- KV cache sizing: one entry per stage; vLLM takes the minimum block count over them ----------
    def _layer_caches(self):
        return family_of(self._model_json, self.model_config.model).layer_caches(self._model_json)

    def get_kv_cache_specs(self):
        import torch

        # Each stage's own KV dtype, so that vLLM's page size, and with it its block count, is the real one.
        dtypes = [getattr(torch, r.dtype or "float32") for r in self.assigned]
        cache = self.cache_config
        return kv_specs.kv_cache_specs(self._layer_caches(), self.ranges, dtypes, cache.block_size, cache.cache_dtype,
                                       cache.mamba_block_size or 0, cache.mamba_cache_mode)

    def get_supported_kv_cache_layouts(self):
        return [kv_specs.KV_LAYOUTS] * len(self.pipeline)

    def set_kv_cache_layout(self, layout_name, cp_kv_cache_interleave_size) -> None:
        pass

    def usable_blocks(self) -> int:
        """The most blocks the scheduler can ever hold at once: --max-num-seqs requests of
        --max-model-len tokens each, plus vLLM's null block. A pool past that would only hold
        prefix cache, and it costs start time: every page is committed up front."""
        per_request = -(-self.model_config.max_model_len // self.cache_config.block_size)
        return self.scheduler_config.max_num_seqs * per_request + 1

    def determine_available_memory(self) -> list[int]:
        caches = self._layer_caches()
        max_len = self.model_config.max_model_len
        for (a, b), r, stage, share in zip(self.ranges, self.assigned, self.pipeline.stages, self.shares):
            budget = KVBudget(share, r.host_memory_bytes, r.weights_bytes, r.activation_bytes)
            draft_bytes = r.spec_draft_bytes_per_block * (-(-max_len // self.cache_config.block_size) + 1)
            try:
                budget.check_fits(max_len, request_bytes(caches[a:b], max_len, self.cache_config.block_size,
                                                         from_name(r.dtype or "float32")) + draft_bytes)
            except MemoryBudgetError as e:
                # One clear line instead of vLLM's tracebacks from two processes; the API server sees
                # the engine gone and `metal-cluster serve` exits non-zero.
                where = f"stage {stage.name} (layers [{a}, {b}))" if len(self.pipeline) > 1 else "this host"
                log.error("%s: %s", where, e)
                logging.shutdown()
                os._exit(3)
        usable = self.usable_blocks()
        specs = self.get_kv_cache_specs()
        groups, by_index = kv_specs.vllm_groups(self.vllm_config, specs)
        ours = kv_specs.pool_bytes_per_block(caches, self.ranges, [r.dtype or "float32" for r in self.assigned],
                                             self.cache_config.block_size, by_index)
        # The draft's pool takes a block id's worth too, beside the last stage's own.
        ours = [cost + draft for cost, draft in zip(ours, self._draft_block_bytes(self.assigned))]
        budgets = [min(r.kv_budget_bytes, usable * cost) for r, cost in zip(self.assigned, ours)]
        if budgets != [r.kv_budget_bytes for r in self.assigned]:
            log.info("KV pool capped at %d blocks: all that %d requests of %d tokens can use (--max-num-seqs x "
                     "--max-model-len); the memory share would hold %d", usable, self.scheduler_config.max_num_seqs,
                     self.model_config.max_model_len,
                     min(r.kv_budget_bytes // cost for r, cost in zip(self.assigned, ours)))
        return [budget * kv_specs.vllm_bytes_per_block(groups, spec) // cost
                for budget, spec, cost in zip(budgets, specs, ours)]

    def initialize_from_config(self, kv_cache_configs) -> None:
        self.num_blocks = min(c.num_blocks for c in kv_cache_configs)
        self.kv_groups = kv_specs.global_kv_groups(kv_cache_configs)
        block_size = self.cache_config.block_size
        wire = wire_dtype([r.dtype for r in self.assigned])
        with load_progress.reported(self.pipeline.stages, lambda line: log.info("%s", line)):
            started = self.pipeline.start(self.num_blocks, replan.ring_hosts(self.pipeline.stages, self.healths),
                                          RING_TIMEOUT_S, wire, self.kv_groups)
        # What a block id costs the pools as laid out for vLLM's groups (a sliding group's window,
        # recurrent states beside K/V), not one array per layer.
        costs = kv_specs.pool_bytes_per_block(self._layer_caches(), self.ranges,
                                              [r.dtype or "float32" for r in self.assigned], block_size, self.kv_groups)
        costs = [cost + draft for cost, draft in zip(costs, self._draft_block_bytes(self.assigned))]
        kv = ", ".join(sorted({f"{r.dtype}: {cost / block_size / 1024:.1f} KiB per token"
                               for r, cost in zip(self.assigned, costs)}))
        groups = f"; {len(self.kv_groups)} KV cache groups" if len(self.kv_groups) > 1 else ""
        log.info("KV cache: %d blocks x %d tokens = %d tokens on every stage (%s)%s%s", self.num_blocks, block_size,
                 self.num_blocks * block_size, kv, groups,
                 f"; hidden states travel as {wire}" if len(self.pipeline) > 1 else "")
        log.info("%s", start_times.line(self.assigned, started, self.num_blocks * sum(costs)))
        run_dir = os.environ.get(RUN_DIR_ENV)
        self.monitor = Monitor(self.pipeline, self.ranges, self.model_name, Path(run_dir) if run_dir else None,
                               self.control, self.stage_timeout_s, on_lost=self._lose)
        self.monitor.start()
        if len(self.pipeline) > 1:  # placement's cost of the model, ahead of a re-plan (it reads the headers)
            replan.model_cost(self._settings(), on_gpu=all(h.device.endswith("gpu") for h in self.healths))

    def compile_or_warm_up_model(self) -> None:
        pass

    @cached_property
    def supported_tasks(self):
        return (pooling.pooling_task(self.model_config) or "generate",)

    # --- steps -----------------------------------------------------------------------------------
    def execute_model(self, scheduler_output, non_block: bool = False):
        return _run(self._execute, non_block, scheduler_output)

    def sample_tokens(self, grammar_output, non_block: bool = False):
        return _run(self._sample, non_block, grammar_output)

    def _execute(self, so):
        if so.total_num_scheduled_tokens == 0:
            # Nothing to run, but the stages must still forget finished requests.
            with self.lock:
                if self.loras is not None:
                    self.loras.finish(so.finished_req_ids)
                if self.control.state != "serving":
                    self.translator.forget(so.finished_req_ids)
                    return EMPTY_MODEL_RUNNER_OUTPUT  # the next plan's stages never knew them
                step = self.translator.to_step(so)
                pipeline, generation = self.pipeline, self.control.generation
            # Not waited for: the stages run steps in order anyway, and a frozen stage must not
            # hold up the engine (and with it the error answers of the requests in flight).
            pipeline.submit(step).add_done_callback(
                lambda f: f.exception() is not None and self._lose(f"a step failed: {f.exception()}", generation))
            return EMPTY_MODEL_RUNNER_OUTPUT
        # The grammar bitmask for this step only arrives in sample_tokens, so the step goes out there.
        self.pending = so
        if self.translator.pooling:
            return self._sample(None)  # vLLM never calls sample_tokens for a pooling model
        return None

    def _sample(self, grammar_output) -> Future:
        so, self.pending = self.pending, None
        out = LazyFuture()
        with self.lock:
            if self.control.state != "serving":
                self.translator.forget(so.finished_req_ids)
                out.set_result(loss_output(so, self._failure(), self.control.outage_id))
                return out
            unreadable = self.loras.admit(so, self.pipeline, self.ranges) if self.loras is not None else {}
            step = self.translator.to_step(so, grammar_output, keep_back=unreadable)
            pipeline, generation = self.pipeline, self.control.generation
            self.inflight[out] = so

        def done(f):
            try:
                response = f.result()
            except Exception as e:
                self._lose(f"a step failed: {e}", generation)
                return
            with self.lock:
                if self.inflight.pop(out, None) is None:
                    return  # an outage has answered it already
                # Record the sampled tokens before anyone sees the output: the scheduler may put
                # these requests into the very next step.
                self.translator.record(response)
                prompt_logprobs = self.translator.prompt_logprobs.add(response.prompt_logprobs)
                pooled = self.translator.pooled(so, response)
            result = to_runner_output(so, response, prompt_logprobs, pooled)
            if unreadable:  # a 400 naming the adapter, for those requests only
                result = with_request_errors(result, {r: RequestError(code="validation_error", message=m)
                                                      for r, m in unreadable.items()})
            out.set_result(result)

        answer = pipeline.submit(step)
        out.run = answer.exception  # vLLM's wait for this step drives an in-process stage's answer
        answer.add_done_callback(done)
        if not self.overlap:
            out.exception()  # wait: the next step goes out only after this one is back
        return out

    def take_draft_token_ids(self):
        return None

    # --- faults and re-plans --------------------------------------------------------------------
    def _failure(self) -> RequestError:
        if self.control.state == "unavailable":
            return RequestError(code="cluster_unavailable", message=self.control.reason, retryable=True)
        return RequestError(
            code="stage_lost", retryable=True,
            message=f"this request was running when the cluster lost a stage ({self.control.reason}); "
                    "the cluster is re-planning on the hosts that remain: retry the request",
        )

    def _lose(self, reason: str, generation: int | None = None) -> None:
        """A stage of plan `generation` failed: answer every step in flight, then re-plan."""
        self._begin_outage(reason, generation, ())

    def rebalance(self, addresses: list[str], drain_s: float = 30.0) -> str:
        """`metal-cluster rebalance`: re-plan over the stages we have plus `addresses` (returning or
        new workers), in the background. Running requests may finish first, for up to `drain_s`
        seconds; new ones wait for the new plan."""
        if self.control.state == "unavailable":
            drain_s = 0  # nothing runs
        elif not self.control.begin_drain():
            return "a re-plan is already running"
        threading.Thread(target=self._drain_then_replan, args=(tuple(addresses), drain_s), name="drain",
                         daemon=True).start()
        return "draining, then re-planning" if drain_s else "re-planning"

    def _drain_then_replan(self, addresses: tuple[str, ...], drain_s: float) -> None:
        deadline = time.monotonic() + drain_s
        idle_since = time.monotonic()
        while not self.control.drained.wait(0.2) and time.monotonic() < deadline:
            with self.lock:
                busy = bool(self.inflight)
            if busy:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > 1.0:
                break  # no step for a second: nothing runs (an idle engine never asks its scheduler)
        self._begin_outage("re-planning on the operator's request (metal-cluster rebalance)", None, addresses)

    def _begin_outage(self, reason, generation, extra) -> bool:
        with self.lock:
            if generation is not None and generation != self.control.generation:
                return False  # a stage of an older plan; that one is over
            outage_id = self.control.begin_outage(reason)
            if outage_id is None:
                return False
            answered, self.inflight = self.inflight, {}
        log.warning("cluster: %s; holding the running requests (%d step(s) in flight) and re-planning", reason,
                    len(answered))
        failure = self._failure()
        for out, so in answered.items():
            out.set_result(loss_output(so, failure, outage_id))
        threading.Thread(target=self._heal, args=(reason, extra), name="replan", daemon=True).start()
        return True

    def _heal(self, reason: str, extra: tuple[str, ...]) -> None:
        clock = [time.monotonic()]
        # The stages heartbeats found silent are lost already: probing them again would only wait.
        silent_known = self.monitor.lost_silent() if self.monitor is not None else set()
        candidates = [self._stage(a) for a in dict.fromkeys([*self.addresses, *extra]) if a not in silent_known]
        # Short: a live worker answers health at once, even mid-step (it does not wait for MLX).
        alive, lost = replan.answering(candidates, timeout_s=min(2.0, self.stage_timeout_s))
        lost += [f"stage {a}: silent for the stage timeout ({self.stage_timeout_s:g}s)" for a in sorted(silent_known)]
        candidates += [self._stage(a) for a in sorted(silent_known)]
        for why in lost:
            log.warning("cluster: left out of the new plan: %s", why)
        silent = [s for s in candidates if s not in alive]
        self.control.note_lost(lost)
        self.pipeline.close()  # ends steps still waiting on the old stages
        clock.append(time.monotonic())
        stages, healths = replan.reset_all(alive, reason, clock[0] + replan.RESET_TIMEOUT_S)
        clock.append(time.monotonic())
        try:
            settings = self._settings()
            plan = replan.build(stages, healths, settings, say=lambda line: log.info("cluster: %s", line))
        except replan.ReplanError as e:
            clock.append(time.monotonic())
            self._give_up(stages, e, {"probe": clock[1] - clock[0], "restart": clock[2] - clock[1],
                                      "place, load and start": clock[3] - clock[2], "total": clock[3] - clock[0]})
            return
        self.activation_peak = max(self.activation_peak,
                                   replan.measured_peak(plan.pipeline.stages, plan.assigned, settings.activation_known))
        clock.append(time.monotonic())
        self._adopt(plan, clock)
        if silent:
            threading.Thread(target=self._fence, args=(silent, self.control.generation), name="fence",
                             daemon=True).start()

    def _fence(self, stages: list, generation: int) -> None:
        """A stage left out of a plan because it stopped answering may only be frozen (SIGSTOP, a host
        cut off for a while). Once it answers again it is told to reset: it frees its memory and the
        old ring's sockets, and never runs a step of a plan that is gone."""
        deadline = time.monotonic() + FENCE_WATCH_S
        while stages and time.monotonic() < deadline and not self.closed.wait(1.0):
            for stage in list(stages):
                try:
                    state = stage.health(timeout=1).state
                    if state != "idle":  # it may have reset itself already (its coordinator went quiet)
                        stage.reset(f"fenced: the cluster replaced this stage's plan (now plan {generation}) "
                                    "while it did not answer")
                except StageCallError:
                    continue
                what = "told to reset" if state != "idle" else "idle"
                message = (f"stage {stage.name} answers again after it was lost: {what}, fenced out of plan "
                           f"{generation} (`metal-cluster rebalance` takes it back)")
                self.control.note(message)
                log.info("cluster: %s", message)
                stages.remove(stage)
                stage.close()

    def _give_up(self, stages: list, error: replan.ReplanError, seconds: dict[str, float]) -> None:
        """Serve 503s that say why, with the idle stages kept for a `rebalance`."""
        self.addresses = [s.name for s in stages]
        message = (f"cannot serve {self.model_name} on the hosts that remain: {error}; start or fix a worker, "
                   "then run `metal-cluster rebalance`")
        log.error("cluster: %s", message)
        self.monitor.follow(Pipeline(stages), [(0, 0)] * len(stages), self.control.generation)
        self.control.settle("unavailable", message, seconds=seconds)

    def _adopt(self, plan: replan.Plan, clock: list[float]) -> None:
        with self.lock:
            self.pipeline, self.ranges, self.assigned = plan.pipeline, plan.ranges, plan.assigned
            self.addresses = [s.name for s in plan.pipeline.stages]
            # The new stages know no request yet; the ones held through the outage go to them as new.
            self.translator = self.translator.next_plan(len(plan.pipeline) == 1)
            if self.loras is not None:
                self.loras.resend(plan.pipeline, plan.ranges)
        probe, restart, load = (b - a for a, b in zip(clock, clock[1:]))
        stages = ", ".join(f"{s.name} [{a}, {b})" for s, (a, b) in zip(plan.pipeline.stages, plan.ranges))
        parts = ", ".join(f"{k} {v:.1f}s" for k, v in plan.seconds.items())
        message = (f"re-planned in {clock[-1] - clock[0]:.1f}s: {len(plan.ranges)} stage(s) {stages}; "
                   f"{plan.num_blocks} KV blocks (probe {probe:.1f}s, worker restart {restart:.1f}s, "
                   f"load and start {load:.1f}s: {parts})")
        log.info("cluster: %s", message)
        seconds = {"probe": probe, "restart": restart, **plan.seconds, "total": clock[-1] - clock[0]}
        self.control.settle("serving", message, plan.num_blocks, seconds)
        self.monitor.follow(plan.pipeline, plan.ranges, self.control.generation)
        self.monitor.poll()  # `status` shows the new plan now, not at the next heartbeat

    def _settings(self) -> replan.Settings:
        return replan.Settings(
            model=self.model_config.model, config=text_config(self.model_config.hf_config.to_dict()),
            block_size=self.cache_config.block_size,
            max_num_batched_tokens=self.scheduler_config.max_num_batched_tokens,
            utilization=self.cache_config.gpu_memory_utilization, max_model_len=self.model_config.max_model_len,
            num_blocks=self.num_blocks, ring_timeout_s=RING_TIMEOUT_S, kv_groups=self.kv_groups,
            caches=self._layer_caches(), activation_known=replan.activation_known(self.addresses, self.activation_peak),
            costs=self.placement_costs, draft=self.draft,
        )

    # --- LoRA: vLLM's own versions call collective_rpc, which resolves names on this class ----------
    def add_lora(self, lora_request) -> bool:
        if self.loras is None:
            raise ValueError("LoRA is not enabled: start the server with --enable-lora")
        with self.lock:
            return self.loras.add(lora_request, self.pipeline, self.ranges)

    def remove_lora(self, lora_id: int) -> bool:
        with self.lock:
            return self.loras is not None and self.loras.remove(lora_id, self.pipeline)

    def pin_lora(self, lora_id: int) -> bool:
        return self.loras is not None and self.loras.pin(lora_id)

    def list_loras(self) -> set[int]:
        return self.loras.ids() if self.loras is not None else set()

    # --- the rest of vLLM's executor surface ------------------------------------------------------
    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False):
        fn = (lambda *a, **k: method(self, *a, **k)) if callable(method) else getattr(self, method, lambda *a, **k: None)
        return _run(lambda: [fn(*args, **(kwargs or {}))], non_block)

    def reset_mm_cache(self) -> None:
        pass

    def reset_encoder_cache(self) -> None:
        pass

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        self.closed.set()
        if getattr(self, "monitor", None):
            self.monitor.close()
        self.pipeline.close()

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True  # with one stage; the platform turns it off for pipelines (vllm_platform.py)
