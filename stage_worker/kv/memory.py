"""The memory guard: what is left for the KV pool once weights and activations have their share."""

from dataclasses import dataclass

import psutil

GIB = 2**30


class MemoryBudgetError(RuntimeError):
    """The budget cannot hold one max-length request; the message names the numbers and the flags."""


def host_memory_bytes() -> int:
    return psutil.virtual_memory().total


def stage_memory_bytes() -> int:
    """What a stage's weights, activations and KV come out of: the GPU's own memory where MLX
    reports one (a discrete GPU; a Mac's GPU reports its unified memory, the same as the host's),
    else the host's RAM (MLX's CPU backend)."""
    import mlx.core as mx  # imported here: the coordinator uses KVBudget without MLX

    info = mx.device_info() if mx.default_device().type == mx.DeviceType.gpu else {}
    return int(info.get("total_memory") or info.get("memory_size") or host_memory_bytes())


@dataclass
class KVBudget:
    utilization: float
    host_bytes: int
    weights_bytes: int
    activation_bytes: int

    @property
    def kv_bytes(self) -> int:
        return max(0, int(self.utilization * self.host_bytes) - self.weights_bytes - self.activation_bytes)

    def check_fits(self, max_model_len: int, needed: int) -> None:
        """`needed`: the KV bytes one max_model_len-token request holds (`paged_kv.request_bytes`)."""
        if self.kv_bytes >= needed:
            return
        raise MemoryBudgetError(
            f"not enough memory for one {max_model_len}-token request: the KV cache needs {needed / GIB:.2f} GiB, "
            f"but {self.utilization:.0%} of {self.host_bytes / GIB:.1f} GiB of memory minus "
            f"{self.weights_bytes / GIB:.2f} GiB weights and {self.activation_bytes / GIB:.2f} GiB activations "
            f"leaves {self.kv_bytes / GIB:.2f} GiB; raise --gpu-memory-utilization or lower --max-model-len"
        )


def kv_budget(utilization: float, weights_bytes: int, activation_bytes: int) -> KVBudget:
    return KVBudget(utilization, stage_memory_bytes(), weights_bytes, activation_bytes)
