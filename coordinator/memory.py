"""The memory guard: what is left for the KV pool once weights and activations have their share."""

import psutil


def host_memory_bytes() -> int:
    return psutil.virtual_memory().total


def kv_budget(utilization: float, weights_bytes: int, activation_peak_bytes: int) -> int:
    """Bytes for KV: `utilization` of the host's memory minus weights and the measured activation peak.

    May be zero or negative; vLLM then refuses to start and names the numbers and the flag to change.
    """
    return max(0, int(utilization * host_memory_bytes()) - weights_bytes - activation_peak_bytes)
