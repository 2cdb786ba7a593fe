"""One line at start saying where the time went: stage load, warm-up, KV allocation, and the rest
(imports, vLLM's engine set-up) since the command began."""

import os
import time

# Set once by the CLI when a command begins (kept through its OpenBLAS re-exec and by vLLM's processes).
STARTED_ENV = "METAL_CLUSTER_STARTED"


def mark_started() -> None:
    os.environ.setdefault(STARTED_ENV, repr(time.time()))


def since_start() -> float | None:
    try:
        return time.time() - float(os.environ[STARTED_ENV])
    except (KeyError, ValueError):
        return None


def line(assigned, started, kv_bytes: int) -> str:
    """Stages work side by side, so each phase counts as its slowest stage."""
    load = max(a.load_seconds for a in assigned)
    warm_up = max(a.warm_up_seconds for a in assigned)
    kv = max(s.kv_allocate_seconds for s in started)
    text = f"start: load {load:.1f} s, warm-up {warm_up:.1f} s, KV {kv:.1f} s ({kv_bytes / 2**30:.2f} GiB)"
    total = since_start()
    if total is not None:
        text += f"; imports and vLLM set-up {max(0.0, total - load - warm_up - kv):.1f} s; {total:.1f} s since the command"
    # serve.py's choice, which EngineCore inherits: a forked one did not import torch and vLLM again
    method = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
    return f"{text}; EngineCore {'forked' if method == 'fork' else 'spawned'}"
