"""Run one step of one stage: apply the step to the request table, pack the batch, run this stage's
layers over it with paged attention, and either hand the hidden states on or sample tokens.
"""

from dataclasses import dataclass, field

import mlx.core as mx

from metal_cluster.proto import pb
from metal_cluster.stage_worker.attention import LayerContext
from metal_cluster.stage_worker.batch import StepBatch, build_batch
from metal_cluster.stage_worker.paged_kv import KVPool
from metal_cluster.stage_worker.request_table import RequestTable, StepError
from metal_cluster.stage_worker.sampler import sample
from metal_cluster.stage_worker.shard import ModelShard


@dataclass
class StageOutput:
    step_id: int
    hidden: mx.array | None = None  # [total_q, hidden] for the next stage (non-last stages)
    sampled: dict[str, int] = field(default_factory=dict)  # last stage: req_id -> token


class StageRunner:
    def __init__(self, shard: ModelShard, pool: KVPool):
        self.shard = shard
        self.pool = pool
        self.table = RequestTable(pool.num_blocks)

    def step(self, step: pb.StepRequest, hidden_in: mx.array | None = None) -> StageOutput:
        self.table.apply(step)
        self.pool.copy_blocks([(c.src, c.dst) for c in step.block_copies])
        batch = build_batch(self.table, step.scheduled, self.pool.block_size)
        out = StageOutput(step_id=step.step_id)
        if not batch.req_ids:
            return out
        hidden = self._forward(batch, hidden_in)
        for req_id, n in zip(batch.req_ids, batch.num_tokens):
            self.table.advance(req_id, n)
        mx.eval(hidden, self.pool.keys, self.pool.values)
        if not self.shard.is_last:
            out.hidden = hidden
            return out
        if batch.sample_req_ids:
            logits = self.shard.logits(hidden[batch.logits_rows])
            params = [self.table[r].sampling for r in batch.sample_req_ids]
            out.sampled = dict(zip(batch.sample_req_ids, sample(logits, params)))
        return out

    def _forward(self, batch: StepBatch, hidden_in: mx.array | None) -> mx.array:
        if self.shard.is_first:
            h = self.shard.embed(batch.token_ids)
        else:
            if hidden_in is None or hidden_in.shape[0] != batch.token_ids.shape[0]:
                got = None if hidden_in is None else hidden_in.shape[0]
                raise StepError(f"step {batch.req_ids[:1]}: expected hidden states for {batch.token_ids.shape[0]} tokens, got {got}")
            h = hidden_in
        h = h[None]
        for i, layer in enumerate(self.shard.layers):
            h = layer(h, None, LayerContext(batch, self.pool, i))
        return h[0]


def to_response(out: StageOutput) -> pb.StepResponse:
    response = pb.StepResponse(step_id=out.step_id)
    for req_id, token in out.sampled.items():
        response.sampled.append(pb.SampledToken(req_id=req_id, token_id=token))
    return response
