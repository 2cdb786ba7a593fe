"""The cluster executor: a vLLM Executor whose workers are our stages.

vLLM's EngineCore (scheduler, KV block manager) calls this with SchedulerOutputs; we turn each into a
StepRequest for the pipeline and its answer into a ModelRunnerOutput. No torch model ever runs.
With N stages vLLM runs N steps at once (its pipeline-parallel batch queue), each over other
requests, so stage k works on step n while stage k+1 works on step n-1.
"""

import logging
import os
import threading
from concurrent.futures import Future
from pathlib import Path
from functools import cached_property

from vllm.v1.executor.abstract import Executor
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

from metal_cluster.coordinator.cluster_state import RUN_DIR_ENV
from metal_cluster.coordinator.executor_env import LAYERS_ENV, NO_OVERLAP_ENV, STAGES_ENV
from metal_cluster.coordinator.monitor import Monitor
from metal_cluster.coordinator.stages import LocalStage, Pipeline, RemoteStage, even_split
from metal_cluster.coordinator.step_translation import StepTranslator, to_runner_output
from metal_cluster.stage_worker.memory import KVBudget, MemoryBudgetError
from metal_cluster.stage_worker.model_source import kv_geometry

# A child of vLLM's logger, so our lines come out with the engine's own (same format, same process tag).
log = logging.getLogger("vllm.metal_cluster.executor")

RING_TIMEOUT_S = 60


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
        addresses = [a for a in os.environ.get(STAGES_ENV, "").split(",") if a]
        self.pipeline = Pipeline([RemoteStage(a) for a in addresses] if addresses else [LocalStage()])
        num_layers = self.model_config.hf_config.num_hidden_layers
        planned = os.environ.get(LAYERS_ENV)
        self.ranges = ([tuple(int(x) for x in r.split("-")) for r in planned.split(",")] if planned
                       else even_split(num_layers, len(self.pipeline)))
        log.info("loading %s: %d layers over %d stage(s) %s, then a %d-token warm-up per stage",
                 os.path.basename(self.model_config.model), num_layers, len(self.pipeline), self.ranges,
                 self.scheduler_config.max_num_batched_tokens)
        self.shares = self._utilization_per_stage()
        self.assigned = self.pipeline.assign(
            self.model_config.model, self.ranges, self.cache_config.block_size,
            self.scheduler_config.max_num_batched_tokens, self.shares,
        )
        for (a, b), r, stage in zip(self.ranges, self.assigned, self.pipeline.stages):
            log.info("stage %s: layers [%d, %d), %.2f GiB weights, %.2f GiB activations, KV budget %.2f GiB",
                     stage.name, a, b, r.weights_bytes / 2**30, r.activation_bytes / 2**30, r.kv_budget_bytes / 2**30)
        self.translator = StepTranslator()
        self.translator_lock = threading.Lock()
        self.pending = None
        self.overlap = os.environ.get(NO_OVERLAP_ENV) != "1"

    def _utilization_per_stage(self) -> list[float]:
        """--gpu-memory-utilization is per host: stages sharing a machine split its share."""
        hosts = [s.health().host_id for s in self.pipeline.stages]
        return [self.cache_config.gpu_memory_utilization / hosts.count(h) for h in hosts]

    # --- KV cache sizing: one entry per stage; vLLM takes the minimum block count over them ----------
    def get_kv_cache_specs(self):
        import torch
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        kv_heads, head_dim = kv_geometry(self.model_config.hf_config.to_dict())
        spec = FullAttentionSpec(
            block_size=self.cache_config.block_size, num_kv_heads=kv_heads, head_size=head_dim, dtype=torch.float32
        )
        return [{f"model.layers.{i}.self_attn.attn": spec for i in range(a, b)} for a, b in self.ranges]

    def get_supported_kv_cache_layouts(self):
        return [["LBNHC"]] * len(self.pipeline)

    def set_kv_cache_layout(self, layout_name, cp_kv_cache_interleave_size) -> None:
        pass

    def determine_available_memory(self) -> list[int]:
        for (a, b), r, stage, share in zip(self.ranges, self.assigned, self.pipeline.stages, self.shares):
            budget = KVBudget(share, r.host_memory_bytes, r.weights_bytes, r.activation_bytes)
            try:
                budget.check_fits(self.model_config.max_model_len, self.cache_config.block_size, r.bytes_per_block)
            except MemoryBudgetError as e:
                # One clear line instead of vLLM's tracebacks from two processes; the API server sees
                # the engine gone and `metal-cluster serve` exits non-zero.
                where = f"stage {stage.name} (layers [{a}, {b}))" if len(self.pipeline) > 1 else "this host"
                log.error("%s: %s", where, e)
                logging.shutdown()
                os._exit(3)
        return [r.kv_budget_bytes for r in self.assigned]

    def initialize_from_config(self, kv_cache_configs) -> None:
        num_blocks = min(c.num_blocks for c in kv_cache_configs)
        block_size = self.cache_config.block_size
        hosts = [f"{s.name.rsplit(':', 1)[0]}:{s.health().ring_port}" for s in self.pipeline.stages] \
            if len(self.pipeline) > 1 else []
        self.pipeline.start(num_blocks, hosts, RING_TIMEOUT_S)
        log.info("KV cache: %d blocks x %d tokens = %d tokens on every stage", num_blocks, block_size,
                 num_blocks * block_size)
        run_dir = os.environ.get(RUN_DIR_ENV)
        self.monitor = Monitor(self.pipeline, self.ranges, os.path.basename(self.model_config.model),
                               Path(run_dir) if run_dir else None)
        self.monitor.start()

    def compile_or_warm_up_model(self) -> None:
        pass

    @cached_property
    def supported_tasks(self):
        return ("generate",)

    # --- steps -----------------------------------------------------------------------------------
    def execute_model(self, scheduler_output, non_block: bool = False):
        return _run(self._execute, non_block, scheduler_output)

    def sample_tokens(self, grammar_output, non_block: bool = False):
        return _run(self._sample, non_block, grammar_output)

    def _execute(self, so):
        if so.total_num_scheduled_tokens == 0:
            # Nothing to run, but the stages must still forget finished requests.
            with self.translator_lock:
                step = self.translator.to_step(so)
            self.pipeline.submit(step).result()
            return EMPTY_MODEL_RUNNER_OUTPUT
        # The grammar bitmask for this step only arrives in sample_tokens, so the step goes out there.
        self.pending = so
        return None

    def _sample(self, grammar_output) -> Future:
        so, self.pending = self.pending, None
        with self.translator_lock:
            step = self.translator.to_step(so, grammar_output)
        answer = self.pipeline.submit(step)
        out = Future()

        def done(f):
            # Record the sampled tokens before anyone sees the output: the scheduler may put these
            # requests into the very next step.
            try:
                response = f.result()
                with self.translator_lock:
                    self.translator.record(response)
                out.set_result(to_runner_output(so, response))
            except Exception as e:
                out.set_exception(e)

        answer.add_done_callback(done)
        if not self.overlap:
            out.exception()  # wait: the next step goes out only after this one is back
        return out

    def take_draft_token_ids(self):
        return None

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
        if getattr(self, "monitor", None):
            self.monitor.close()
        self.pipeline.close()

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return False
