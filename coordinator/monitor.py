"""Heartbeats: the executor asks every stage for its health once a second, measures the round trip,
notes state changes in the log, and keeps the status snapshot up to date."""

import logging
import threading
import time
from pathlib import Path

from metal_cluster.coordinator.cluster_state import SNAPSHOT, ClusterSnapshot, NodeStatus, StageStatus, write_json
from metal_cluster.coordinator.stages import StageCallError

log = logging.getLogger("vllm.metal_cluster.monitor")
INTERVAL_S = 1.0


class Monitor:
    def __init__(self, pipeline, ranges, model: str, run_dir: Path | None):
        self.pipeline = pipeline
        self.ranges = ranges
        self.model = model
        self.path = run_dir / SNAPSHOT if run_dir else None
        self.nodes = [NodeStatus(name=s.name, address=s.name, state="unknown") for s in pipeline.stages]
        self.stages = [StageStatus(node=s.name, layers=[a, b]) for s, (a, b) in zip(pipeline.stages, ranges)]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)

    def start(self):
        self.poll()
        self.thread.start()

    def close(self):
        self.stop.set()

    def _loop(self):
        while not self.stop.wait(INTERVAL_S):
            self.poll()

    def poll(self):
        for stage, node, stage_status in zip(self.pipeline.stages, self.nodes, self.stages):
            started = time.perf_counter()
            try:
                h = stage.health()
            except StageCallError as e:
                self._set_state(node, "down", str(e))
                continue
            node.rtt_ms = 1000 * (time.perf_counter() - started)
            node.last_heartbeat = time.time()
            node.name = h.node_id or stage.name
            node.device = h.device
            node.memory_total_bytes = h.host_memory_bytes
            node.memory_used_bytes = h.host_memory_bytes - h.host_memory_available_bytes
            stage_status.node = node.name
            stage_status.kv_blocks_used = h.kv_blocks_used
            stage_status.kv_blocks_total = h.num_blocks
            stage_status.step_ms = 1000 * h.step_seconds
            stage_status.ring_bytes_sent = h.ring_bytes_sent
            self._set_state(node, h.state, "")
        if self.path:
            write_json(self.path, self.snapshot().to_dict())

    def snapshot(self) -> ClusterSnapshot:
        return ClusterSnapshot(model=self.model, nodes=list(self.nodes), stages=list(self.stages))

    def _set_state(self, node, state, reason):
        if node.state == state:
            return
        if state == "down":
            log.warning("stage %s is down: %s", node.address, reason)
        else:
            log.info("stage %s is %s", node.address, state)
        node.state = state
