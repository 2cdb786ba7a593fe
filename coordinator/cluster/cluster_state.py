"""What `metal-cluster status` shows, as plain data, and where a running coordinator keeps it.

The executor (in vLLM's engine process) writes a snapshot of nodes and stages; the CLI writes who
the coordinator is (URL, pid). Both live in a run directory under the cache, one per API port.
"""

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from metal_cluster.stage_worker.model.model_source import cache_dir

RUN_DIR_ENV = "METAL_CLUSTER_RUN_DIR"
SNAPSHOT = "cluster.json"
COORDINATOR = "coordinator.json"


@dataclass
class NodeStatus:
    name: str
    address: str
    state: str  # serving | loaded | idle | down
    device: str = ""
    memory_used_bytes: int = 0
    memory_total_bytes: int = 0
    last_heartbeat: float = 0.0  # unix time
    rtt_ms: float = 0.0


@dataclass
class StageStatus:
    node: str
    layers: list[int]  # [start, end)
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    step_ms: float = 0.0
    ring_bytes_sent: int = 0
    kv_dtype: str = ""
    # Weights fetched from the coordinator's model store by this stage's worker, and the load now.
    weights_fetched_bytes: int = 0
    fetch_bytes_done: int = 0
    fetch_bytes_total: int = 0


@dataclass
class ClusterSnapshot:
    model: str
    nodes: list[NodeStatus] = field(default_factory=list)
    stages: list[StageStatus] = field(default_factory=list)
    state: str = "serving"  # serving | healing (a stage was lost, re-planning) | unavailable
    reason: str = ""  # why it is not serving
    replans: int = 0
    stage_losses: int = 0
    requests_held: int = 0  # running when a stage was lost, waiting for the new plan now
    requests_resumed: int = 0  # held, then resumed on a new plan where they stopped
    requests_lost: int = 0  # held, then ended with a retryable error (no room, or waited too long)
    events: list[dict] = field(default_factory=list)  # {"time", "message"}, oldest first
    last_replan: dict = field(default_factory=dict)  # the last re-plan's phases, in seconds
    updated: float = field(default_factory=time.time)

    def to_dict(self) -> dict:
        return asdict(self)


def run_root() -> Path:
    return cache_dir() / "run"


def run_dir_for(port: int) -> Path:
    return run_root() / str(port)


def write_json(path: Path, data: dict) -> None:
    """Atomically: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def pid_alive(pid: int) -> bool:
    """Running, that is: an exited child its parent has not reaped yet (a zombie) counts as gone."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def local_coordinators() -> list[dict]:
    """Coordinators started on this machine that are still running, newest first."""
    found = []
    for path in run_root().glob(f"*/{COORDINATOR}"):
        info = read_json(path)
        if info and pid_alive(info.get("pid", -1)):
            found.append(info)
    return sorted(found, key=lambda i: i.get("started", 0), reverse=True)
