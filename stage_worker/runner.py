"""Run one step of one stage: apply the step to the request table, pack the batch, run this stage's
layers over it with paged attention, and either hand the hidden states on or sample tokens.
"""

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from metal_cluster.proto import pb
from metal_cluster.stage_worker.attention import LayerContext
from metal_cluster.stage_worker.batch import StepBatch, build_batch
from metal_cluster.stage_worker.paged_kv import KVPool
from metal_cluster.stage_worker.request_table import RequestTable, StepError
from metal_cluster.stage_worker.sampler import Sampled, SampleRow, plain_greedy, sample_rows
from metal_cluster.stage_worker.shard import ModelShard


@dataclass
class StageOutput:
    step_id: int
    hidden: mx.array | None = None  # [total_q, hidden] for the next stage (non-last stages), unevaluated
    sampled: dict[str, Sampled] = field(default_factory=dict)  # last stage only


class StageRunner:
    def __init__(self, shard: ModelShard, pool: KVPool):
        self.shard = shard
        self.pool = pool
        self.table = RequestTable(pool.num_blocks)

    def step(self, step: pb.StepRequest, hidden_in: mx.array | None = None) -> StageOutput:
        return self.run(step, self.prepare(step), hidden_in)

    def prepare(self, step: pb.StepRequest) -> StepBatch:
        """Bookkeeping and checks: everything a stage does before it needs hidden states."""
        self.table.apply(step)
        self.pool.copy_blocks([(c.src, c.dst) for c in step.block_copies])
        return build_batch(self.table, step.scheduled, self.pool.block_size)

    def run(self, step: pb.StepRequest, batch: StepBatch, hidden_in: mx.array | None = None) -> StageOutput:
        out = StageOutput(step_id=step.step_id)
        if not batch.req_ids:
            return out
        hidden = self._forward(batch, hidden_in)
        for req_id, n in zip(batch.req_ids, batch.num_tokens):
            self.table.advance(req_id, n)
        # One sync per step, where its result leaves the device: every layer's KV write feeds its
        # attention, so evaluating what the step hands on evaluates the pools too.
        if not self.shard.is_last:
            out.hidden = hidden  # lazy: the ring send evaluates it
            return out
        if not batch.sample_req_ids:
            mx.eval(hidden)  # a prompt chunk that samples nothing still writes its KV
        else:
            logits = self.shard.logits(hidden[batch.logits_rows])
            rows = self._sample_rows(batch.sample_req_ids, _grammar_rows(step))
            if all(plain_greedy(r) for r in rows):
                # Copying [rows, vocab] logits to the host and scanning them in NumPy cost more than
                # the attention of a whole decode step on a GPU.
                tokens = mx.argmax(logits.astype(mx.float32), axis=-1).tolist()
                out.sampled = {r: Sampled(token_id=t) for r, t in zip(batch.sample_req_ids, tokens)}
            else:
                logits = np.array(logits.astype(mx.float32))
                out.sampled = dict(zip(batch.sample_req_ids, sample_rows(logits, rows)))
        return out

    def _sample_rows(self, req_ids: list[str], grammar: dict[str, np.ndarray]) -> list[SampleRow]:
        rows = []
        for req_id in req_ids:
            state = self.table[req_id]
            rows.append(SampleRow(
                params=state.sampling,
                prompt_ids=state.token_ids[: state.num_prompt_tokens],
                output_ids=state.output_ids,
                rng=state.rng,
                allowed_mask=grammar.get(req_id),
            ))
        return rows

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


def _grammar_rows(step: pb.StepRequest) -> dict[str, np.ndarray]:
    if not step.grammar_req_ids:
        return {}
    mask = np.frombuffer(step.grammar_bitmask, dtype=np.int32).reshape(len(step.grammar_req_ids), -1)
    return dict(zip(step.grammar_req_ids, mask))


def to_response(out: StageOutput) -> pb.StepResponse:
    response = pb.StepResponse(step_id=out.step_id)
    for req_id, s in out.sampled.items():
        token = pb.SampledToken(req_id=req_id, token_id=s.token_id, logprob=s.logprob, rank=s.rank)
        if s.top_ids is not None:
            token.top.SetInParent()  # logprobs were asked for, even with no top-k alternatives
            token.top.token_ids.extend(s.top_ids)
            token.top.logprobs.extend(s.top_logprobs)
        response.sampled.append(token)
    return response
