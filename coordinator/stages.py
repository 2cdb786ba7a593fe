"""The coordinator's one way to reach stage work: send a StepRequest, get a StepResponse.

`InProcessStage` is the single-machine form: the whole model in this process, no gRPC, no ring.
"""

from dataclasses import dataclass

from metal_cluster.proto import pb
from metal_cluster.stage_worker.model_source import ModelSource
from metal_cluster.stage_worker.paged_kv import KVPool
from metal_cluster.stage_worker.runner import StageRunner, to_response
from metal_cluster.stage_worker.shard import load_shard


@dataclass
class KVLayout:
    num_blocks: int
    block_size: int


class InProcessStage:
    def __init__(self, source: ModelSource, layout: KVLayout):
        shard = load_shard(source)
        cfg = source.config
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        pool = KVPool.allocate(len(shard.layers), layout.num_blocks, layout.block_size, kv_heads, head_dim)
        self.runner = StageRunner(shard, pool)

    def step(self, request: pb.StepRequest) -> pb.StepResponse:
        return to_response(self.runner.step(request))
