"""The cluster executor: a vLLM Executor whose "workers" are our stages.

vLLM's EngineCore (scheduler, KV block manager) calls this with SchedulerOutputs; we turn each into a
StepRequest for the stages and their answer into a ModelRunnerOutput. No torch model ever runs.
"""

import logging
import os
from concurrent.futures import Future
from functools import cached_property

from vllm.v1.executor.abstract import Executor
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

from metal_cluster.coordinator import memory
from metal_cluster.coordinator.step_translation import StepTranslator, to_runner_output

# A child of vLLM's logger, so our lines come out with the engine's own (same format, same process tag).
log = logging.getLogger("vllm.metal_cluster.executor")


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
    return _done(value) if non_block else value


class ClusterExecutor(Executor):
    uses_ray = False
    supports_pp = False

    def _init_executor(self) -> None:
        from metal_cluster.coordinator.stages import InProcessStage
        from metal_cluster.stage_worker.model_source import resolve_model

        source = resolve_model(self.model_config.model)
        log.info("loading %s on MLX", source.folder.name)
        self.stage = InProcessStage(source)
        log.info("loaded %d layers, %.2f GiB of weights", len(self.stage.shard.layers), self.stage.weights_bytes / 2**30)
        self.translator = StepTranslator()
        self.pending = None

    # --- KV cache sizing -------------------------------------------------------------------------
    def get_kv_cache_specs(self):
        import torch
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        s = self.stage.shape
        spec = FullAttentionSpec(
            block_size=self.cache_config.block_size, num_kv_heads=s.kv_heads, head_size=s.head_dim, dtype=torch.float32
        )
        return [{f"model.layers.{i}.self_attn.attn": spec for i in range(s.num_layers)}]

    def get_supported_kv_cache_layouts(self):
        return [["LBNHC"]]

    def set_kv_cache_layout(self, layout_name, cp_kv_cache_interleave_size) -> None:
        pass

    def determine_available_memory(self) -> list[int]:
        tokens = self.scheduler_config.max_num_batched_tokens
        log.info("warming up: one %d-token prefill to measure activation memory", tokens)
        block_size = self.cache_config.block_size
        peak, seconds = self.stage.measure_activation_peak(tokens, block_size)
        budget = memory.kv_budget(self.cache_config.gpu_memory_utilization, self.stage.weights_bytes, peak)
        log.info("warm-up took %.1f s; activation peak %.2f GiB; KV budget %.2f GiB", seconds, peak / 2**30, budget.kv_bytes / 2**30)
        try:
            budget.check_fits(self.model_config.max_model_len, block_size, self.stage.bytes_per_block(block_size))
        except memory.MemoryBudgetError as e:
            # One clear line instead of vLLM's tracebacks from two processes; the API server sees
            # the engine gone and `metal-cluster serve` exits non-zero.
            log.error("%s", e)
            logging.shutdown()
            os._exit(3)
        return [budget.kv_bytes]

    def initialize_from_config(self, kv_cache_configs) -> None:
        from metal_cluster.coordinator.stages import KVLayout

        num_blocks = kv_cache_configs[0].num_blocks
        block_size = self.cache_config.block_size
        self.stage.allocate(KVLayout(num_blocks, block_size))
        log.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB)",
            num_blocks, block_size, num_blocks * block_size, self.stage.runner.pool.nbytes / 2**30,
        )

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
            self.stage.step(self.translator.to_step(so))
            return EMPTY_MODEL_RUNNER_OUTPUT
        # The grammar bitmask for this step only arrives in sample_tokens, so the step runs there.
        self.pending = so
        return None

    def _sample(self, grammar_output):
        so, self.pending = self.pending, None
        response = self.stage.step(self.translator.to_step(so, grammar_output))
        self.translator.record(response)
        return to_runner_output(so, response)

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
        self.stage = None

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return False
