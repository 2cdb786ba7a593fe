"""Heartbeats: the executor asks every stage for its health ten times a second (all stages at once),
measures the round trip, notes state changes in the log, keeps the status snapshot up to date, and
reports a stage that has not answered for the stage timeout as lost.

A frozen stage is seen within the stage timeout plus one interval (under a second by default): each
probe waits up to the stage timeout, so one probe that fails after waiting that long is the loss. A
stage that is only slow (a loaded host, a freeze shorter than the timeout) answers the probe late,
and a late answer is an answer."""

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from metal_cluster.coordinator.cluster.cluster_state import SNAPSHOT, ClusterSnapshot, NodeStatus, StageStatus, write_json
from metal_cluster.coordinator.cluster.stages import StageCallError

log = logging.getLogger("vllm.metal_cluster.monitor")
INTERVAL_S = 0.1
SNAPSHOT_EVERY_S = 1.0  # `status` reads the snapshot file once a second; a state change writes it at once


class Monitor:
    def __init__(self, pipeline, ranges, model: str, run_dir: Path | None, control, stage_timeout_s: float,
                 on_lost=lambda reason, generation: None):
        self.model = model
        self.path = run_dir / SNAPSHOT if run_dir else None
        self.control = control
        self.stage_timeout_s = stage_timeout_s
        self.on_lost = on_lost
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)
        self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="heartbeat-probe")
        self.written = 0.0
        self.follow(pipeline, ranges, control.generation)

    def follow(self, pipeline, ranges, generation: int) -> None:
        """Watch the stages of a new plan from now on."""
        now = time.monotonic()
        with self.lock:
            self.pipeline, self.generation = pipeline, generation
            self.nodes = [NodeStatus(name=s.name, address=s.name, state="unknown") for s in pipeline.stages]
            self.stages = [StageStatus(node=s.name, layers=[a, b]) for s, (a, b) in zip(pipeline.stages, ranges)]
            self.last_answer = [now] * len(pipeline.stages)
            self.reported = False
            self.silent: set[str] = set()  # stages of this plan reported lost for their silence

    def start(self):
        self.poll()
        self.thread.start()

    def close(self):
        self.stop.set()
        self.pool.shutdown(wait=False)

    def lost_silent(self) -> set[str]:
        """Addresses of the stages this plan lost to silence: a re-plan need not probe them again."""
        with self.lock:
            return set(self.silent)

    def _loop(self):
        while not self.stop.wait(INTERVAL_S):
            try:
                self.poll()
            except Exception:  # heartbeats must outlive any one bad poll
                log.exception("heartbeat poll failed")

    def poll(self):
        with self.lock:
            pipeline, generation, nodes, stages = self.pipeline, self.generation, self.nodes, self.stages
            last_answer = self.last_answer
        # A probe waits the whole stage timeout: one that fails after that wait is the loss, one
        # that answers late (a slow host, a short freeze) is not.
        answers = list(self.pool.map(lambda s: _probe(s, self.stage_timeout_s), pipeline.stages))
        changed = False
        for k, (node, stage_status, (health, rtt, error)) in enumerate(zip(nodes, stages, answers)):
            if error is not None:
                changed |= self._set_state(node, "down", error)
                self._check_lost(time.monotonic() - last_answer[k], node, error, generation)
                continue
            last_answer[k] = time.monotonic()
            node.rtt_ms = rtt
            node.last_heartbeat = time.time()
            node.name = health.node_id or node.address
            node.device = health.device
            node.memory_total_bytes = health.host_memory_bytes
            node.memory_used_bytes = health.host_memory_bytes - health.host_memory_available_bytes
            stage_status.node = node.name
            stage_status.kv_blocks_used = health.kv_blocks_used
            stage_status.kv_blocks_total = health.num_blocks
            stage_status.step_ms = 1000 * health.step_seconds
            stage_status.ring_bytes_sent = health.ring_bytes_sent
            stage_status.kv_dtype = health.kv_dtype
            stage_status.weights_fetched_bytes = health.fetch_bytes_received
            stage_status.fetch_bytes_done, stage_status.fetch_bytes_total = health.fetch_bytes_done, health.fetch_bytes_total
            changed |= self._set_state(node, health.state, "")
        if self.path and (changed or time.monotonic() - self.written >= SNAPSHOT_EVERY_S):
            self.written = time.monotonic()
            write_json(self.path, self.snapshot().to_dict())

    def _check_lost(self, silent: float, node, error: str, generation: int) -> None:
        if self.reported or silent < self.stage_timeout_s or self.control.state != "serving":
            return
        self.reported = True
        with self.lock:
            if generation == self.generation:
                self.silent.add(node.address)
        self.on_lost(f"stage {node.address} has not answered heartbeats for {silent:.1f}s ({error})", generation)

    def snapshot(self) -> ClusterSnapshot:
        with self.lock:
            return ClusterSnapshot(model=self.model, nodes=list(self.nodes), stages=list(self.stages),
                                   **self.control.summary())

    def _set_state(self, node, state, reason) -> bool:
        if node.state == state:
            return False
        if state == "down":
            log.warning("stage %s is down: %s", node.address, reason)
        else:
            log.info("stage %s is %s", node.address, state)
        node.state = state
        return True


def _probe(stage, timeout: float):
    """(health, round trip ms, None) or (None, 0, why not)."""
    started = time.perf_counter()
    try:
        health = stage.health(timeout=timeout, heartbeat=True)
    except StageCallError as e:
        return None, 0.0, str(e)
    except ValueError as e:  # a channel a re-plan has just closed
        return None, 0.0, f"stage {stage.name}: {e}"
    return health, 1000 * (time.perf_counter() - started), None
