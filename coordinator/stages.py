"""The coordinator's one way to reach stage work: send a StepRequest, get a StepResponse.

`InProcessStage` is the single-machine form: the whole model in this process, no gRPC, no ring.
"""

import time
from dataclasses import dataclass

import mlx.core as mx

from metal_cluster.proto import PROTO_VERSION, pb
from metal_cluster.stage_worker.model_source import ModelSource
from metal_cluster.stage_worker.paged_kv import KVPool, bytes_per_block
from metal_cluster.stage_worker.runner import StageRunner, to_response
from metal_cluster.stage_worker.shard import load_shard


@dataclass
class KVLayout:
    num_blocks: int
    block_size: int


@dataclass
class KVShape:
    num_layers: int
    kv_heads: int
    head_dim: int


def kv_shape(config: dict, num_layers: int) -> KVShape:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return KVShape(num_layers, kv_heads, head_dim)


class InProcessStage:
    def __init__(self, source: ModelSource, layout: KVLayout | None = None):
        self.source = source
        self.shard = load_shard(source)
        self.shape = kv_shape(source.config, len(self.shard.layers))
        self.runner = None
        if layout is not None:
            self.allocate(layout)

    @property
    def weights_bytes(self) -> int:
        return sum(v.nbytes for _, v in _flat_params(self.shard.model))

    def bytes_per_block(self, block_size: int) -> int:
        s = self.shape
        return bytes_per_block(s.num_layers, block_size, s.kv_heads, s.head_dim)

    def allocate(self, layout: KVLayout) -> None:
        s = self.shape
        pool = KVPool.allocate(s.num_layers, layout.num_blocks, layout.block_size, s.kv_heads, s.head_dim)
        self.runner = StageRunner(self.shard, pool)

    def measure_activation_peak(self, num_tokens: int, block_size: int) -> tuple[int, float]:
        """Run one prefill of num_tokens on a throw-away pool; return (peak bytes above weights, seconds)."""
        blocks = -(-num_tokens // block_size) + 1
        saved, self.runner = self.runner, None
        self.allocate(KVLayout(blocks, block_size))
        pool_bytes = self.runner.pool.nbytes
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        start = time.perf_counter()
        step = pb.StepRequest(version=PROTO_VERSION)
        step.new_requests.append(pb.NewRequest(req_id="warm-up", prompt_token_ids=[0] * num_tokens, block_ids=range(1, blocks)))
        step.scheduled.append(pb.ScheduledTokens(req_id="warm-up", num_tokens=num_tokens))
        self.runner.step(step)
        elapsed = time.perf_counter() - start
        peak = max(0, mx.get_peak_memory() - base) + pool_bytes // blocks
        self.runner = saved
        mx.clear_cache()
        return peak, elapsed

    def step(self, request: pb.StepRequest) -> pb.StepResponse:
        return to_response(self.runner.step(request))


def _flat_params(model):
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())
