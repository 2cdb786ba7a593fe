"""vLLM platform plugin: lets vLLM's engine start on a host whose model runs on MLX, not torch.

Active only in processes started by `metal-cluster` (it sets ACTIVATE_ENV), so a plain `vllm`
on the same machine is left alone. Kept import-light: vLLM resolves it in every process it starts.
"""

import os

from vllm.platforms.interface import Platform, PlatformEnum

from metal_cluster.coordinator.engine.executor_env import NO_OVERLAP_ENV

ACTIVATE_ENV = "METAL_CLUSTER_VLLM"
EXECUTOR = "metal_cluster.coordinator.engine.executor.ClusterExecutor"
SCHEDULER = "metal_cluster.coordinator.engine.cluster_scheduler.ClusterScheduler"
ASYNC_SCHEDULER = "metal_cluster.coordinator.engine.cluster_scheduler.AsyncClusterScheduler"

# Request fields the MLX sampler does not implement: refused with a 400 naming them, never ignored.
# vLLM itself refuses both unless the server was started with the feature (--reasoning-parser,
# --enable-trace-replay), which vLLM then implements only in its own GPU model runner.
UNSUPPORTED_SAMPLING = {
    "thinking_token_budget": lambda p: getattr(p, "thinking_token_budget", None) is not None,
    "trace_decode_token_ids": lambda p: bool(getattr(p, "trace_decode_token_ids", None)),
}


def register() -> str | None:
    if os.environ.get(ACTIVATE_ENV) != "1":
        return None
    return "metal_cluster.coordinator.engine.vllm_platform.MetalClusterPlatform"


def register_models() -> None:
    """vLLM insists on resolving the architecture to a class; ours never runs (MLX does the work)."""
    if os.environ.get(ACTIVATE_ENV) != "1":
        return
    from vllm import ModelRegistry

    from metal_cluster.coordinator.engine.vllm_stub_model import MLXExecutedHybridModel, MLXExecutedModel
    from metal_cluster.stage_worker.families import FAMILIES

    for family in FAMILIES:
        for arch in family.architectures:
            ModelRegistry.register_model(arch, MLXExecutedHybridModel if family.hybrid else MLXExecutedModel)


def _noop(cls, *args, **kwargs):
    return None


class MetalClusterPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name = "mlx"
    device_type = "cpu"  # torch only ever sees CPU tensors: the model never runs in torch
    dispatch_key = "CPU"
    dist_backend = "gloo"
    ray_device_key = ""
    simple_compile_backend = "eager"
    device_control_env_var = "METAL_CLUSTER_DEVICES"

    import_kernels = classmethod(_noop)
    import_ir_kernels = classmethod(_noop)
    set_device = classmethod(_noop)
    manual_seed_all = classmethod(_noop)
    check_if_supports_dtype = classmethod(_noop)

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "mlx"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        import psutil

        return psutil.virtual_memory().total

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        # Sliding-window and recurrent layers get KV cache groups of their own (kv_specs.py): vLLM
        # frees a sliding group's blocks behind its window and keeps recurrent states per block; the
        # stages read a block table per group.
        return True

    @classmethod
    def get_current_memory_usage(cls, device=None) -> float:
        return 0.0

    @classmethod
    def inference_mode(cls):
        import torch

        return torch.no_grad()

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        return "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        from vllm.config import CompilationMode, CUDAGraphMode

        compilation = vllm_config.compilation_config
        compilation.mode = CompilationMode.NONE
        compilation.cudagraph_mode = CUDAGraphMode.NONE
        compilation.cudagraph_capture_sizes = []
        compilation.max_cudagraph_capture_size = 0
        parallel = vllm_config.parallel_config
        if parallel.distributed_executor_backend in (None, "uni", "mp"):
            parallel.distributed_executor_backend = EXECUTOR
        scheduler = vllm_config.scheduler_config
        # vLLM's async scheduling (the next step scheduled while this one runs; the in-process stage
        # keeps its tokens on the device) exists in vLLM 0.33 only without pipeline parallelism, where
        # vLLM's own batch queue already keeps one step in flight per stage.
        # Speculative drafts are made in the scheduler from the tokens a step returns (cluster_scheduler.py),
        # so a step can only be scheduled once the one before it is back.
        if (parallel.pipeline_parallel_size > 1 or os.environ.get(NO_OVERLAP_ENV) == "1"
                or vllm_config.speculative_config is not None):
            scheduler.async_scheduling = False
        if scheduler.scheduler_cls is None:
            # Both hold requests while stages re-plan; the async one also schedules ahead.
            scheduler.scheduler_cls = ASYNC_SCHEDULER if scheduler.async_scheduling else SCHEDULER

    @classmethod
    def validate_request(cls, processed_inputs, params) -> None:
        from vllm.exceptions import VLLMValidationError  # a client error: vLLM answers 400

        for name, used in UNSUPPORTED_SAMPLING.items():
            if hasattr(params, "temperature") and used(params):  # SamplingParams, not PoolingParams
                raise VLLMValidationError(
                    f"'{name}' is not supported by metal-cluster's sampler; remove it from the request", parameter=name
                )
