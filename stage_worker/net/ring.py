"""The data plane between stages: MLX's ring backend, used point to point (stage k -> k+1).

The ring's init waits forever for a missing peer, so it runs in a thread with a deadline; a
process can join only one ring in its life, so a new plan means a new stage process.
"""

import json
import os
import tempfile
import threading

import mlx.core as mx


JOINING_RING = "joining the ring"  # a stage's phase (Health) from its start until its ring is connected


class RingError(RuntimeError):
    pass


class Ring:
    def __init__(self, group, rank: int, world_size: int, wire_dtype=mx.float32):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.wire_dtype = wire_dtype  # one per plan: every stage sends and receives in it
        self.bytes_sent = 0

    @classmethod
    def join(cls, rank: int, world_size: int, hostfile_json: str, timeout_s: float, wire_dtype=mx.float32) -> "Ring":
        hosts = json.loads(hostfile_json)
        if len(hosts) != world_size:
            raise RingError(f"ring hostfile lists {len(hosts)} ranks, expected {world_size}")
        path = os.path.join(tempfile.mkdtemp(prefix="metal-cluster-ring-"), "hosts.json")
        with open(path, "w") as f:
            json.dump(hosts, f)
        os.environ["MLX_RANK"] = str(rank)
        os.environ["MLX_HOSTFILE"] = path
        result = {}

        def connect():
            try:
                result["group"] = mx.distributed.init(backend="ring", strict=True)
            except Exception as e:  # surfaced below, with the deadline's message if it is later
                result["error"] = e

        thread = threading.Thread(target=connect, name="ring-init", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            raise RingError(f"ring init timed out after {timeout_s:.0f}s: a peer in {hosts} did not join")
        if "error" in result:
            raise RingError(f"ring init failed: {result['error']}")
        group = result["group"]
        if group.size() != world_size or group.rank() != rank:
            raise RingError(f"ring has rank {group.rank()} of {group.size()}, expected {rank} of {world_size}")
        return cls(group, rank, world_size, wire_dtype)

    def send_next(self, hidden: mx.array) -> None:
        hidden = hidden.astype(self.wire_dtype)
        mx.eval(mx.distributed.send(hidden, self.rank + 1, group=self.group))
        self.bytes_sent += hidden.nbytes

    def recv_prev(self, num_tokens: int, hidden_size: int, wait: bool = True) -> mx.array:
        """The previous stage's hidden states. `wait=False` returns the receive not yet done: the
        caller must evaluate it before it does anything else that could outlive the step (a
        receive still pending in MLX's threads when the process re-executes itself for a new plan
        can take the process down with it)."""
        hidden = mx.distributed.recv((num_tokens, hidden_size), self.wire_dtype, self.rank - 1, group=self.group)
        if wait:
            mx.eval(hidden)
        return hidden
