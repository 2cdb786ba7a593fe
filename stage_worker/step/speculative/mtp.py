"""Multi-token-prediction layers as speculative decoding's drafter (vLLM's `mtp` method), run on the
last stage: they need the target's final hidden states, which only the last stage has, and the
tokens it just chose.

An MTP layer at position p reads the target's hidden state there (after the final norm, as vLLM
passes it) and the token at p + 1, and guesses the token at p + 2 (families/base.py MTPLayer). Like
the draft model (draft.py) it keeps its own paged KV on the target's block ids and block size, so
vLLM's block tables and its lookahead slots serve it too.

Each step, once the target's tokens are chosen:
1. one pass of the first MTP layer over every scheduled request's positions whose next token is
   known and whose target hidden state is real: a prompt chunk's positions, a verification's last
   known token and the drafts it accepted; its KV at those positions is rewritten from the target's;
2. for each request that sampled, the guess of its last row is the first draft; each further draft
   is one more position, reading the draft before and the previous output's recycled hidden state,
   through the same layer again. vLLM's proposer runs the checkpoint's first MTP layer for every
   draft (spec_step_idx stays 0), so only that one is loaded: a later layer's KV would hold only
   the positions of its own drafts.
Drafts are greedy, as vLLM's. A position's KV written from a draft's hidden state (step 2) is
rewritten in the next step's pass (step 1), since the target then scores that position.
"""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from metal_cluster.proto import pb
from metal_cluster.stage_worker.errors import ModelLoadError
from metal_cluster.stage_worker.kv.paged_kv import KVPool, bytes_per_block
from metal_cluster.stage_worker.model import dtypes
from metal_cluster.stage_worker.model.shard import ModelShard
from metal_cluster.stage_worker.step.attention import LayerContext
from metal_cluster.stage_worker.step.speculative.draft import Row, choose, paged_batch


@dataclass
class MTPDrafter:
    layer: object  # families.base.MTPLayer: the checkpoint's first
    final_norm: object  # the target's final norm: what MTP layers read of its hidden states
    k: int  # drafts per request and step
    dtype: mx.Dtype
    group: int = 0  # the target's KV cache group (a full-attention one) whose block tables it uses
    pool: KVPool | None = None
    block_size: int = 0
    weights_bytes: int = 0

    @classmethod
    def load(cls, source, shard: ModelShard, k: int, fetched: set[str] | None = None) -> "MTPDrafter":
        """The checkpoint's MTP layers beside a last stage's layers, in its compute dtype. `fetched`:
        the tensors a folder fetched from a model store holds (the others are holes)."""
        if not shard.is_last:
            raise ModelLoadError("MTP layers run on the last stage")
        family = shard.family
        if not family.mtp_layers(shard.config):
            raise ModelLoadError(f"{source.folder}: the checkpoint has no multi-token-prediction layers "
                                 f"({shard.config.get('model_type')}: num_nextn_predict_layers is 0 or missing)")
        if fetched is not None:
            from metal_cluster.stage_worker.model.checkpoint_sizes import read_headers

            missing = [n for n in read_headers(source.folder) if family.is_mtp_tensor(n, shard.config) and n not in fetched]
            if missing:
                raise ModelLoadError(f"{source.folder}: the MTP layers need {missing[0]} (and {len(missing) - 1} more), "
                                     "which were not fetched from the model store")
        layer = family.load_mtp(source, shard.config)[0]  # the others stay lazy: never read
        dtypes.settle(layer, shard.dtype)
        mx.eval(layer.parameters())
        family.wrap_layer(layer.block, layer.cache)
        weights = sum(v.nbytes for _, v in tree_flatten(layer.parameters()))
        return cls(layer, family.inner(shard.model).norm, k, shard.dtype, weights_bytes=weights)

    @property
    def caches(self) -> list:
        return [self.layer.cache]

    def bytes_per_block(self, block_size: int) -> int:
        return bytes_per_block(self.caches, block_size, self.dtype)

    def allocate(self, num_blocks: int, block_size: int, group: int = 0) -> "MTPDrafter":
        """This layer with a pool of its own (the warm-up's is thrown away)."""
        pool = KVPool.allocate(self.caches, num_blocks, block_size, self.dtype)
        return MTPDrafter(self.layer, self.final_norm, self.k, self.dtype, group, pool, block_size,
                          self.weights_bytes)

    # --- one step ---------------------------------------------------------------------------------
    def follow(self, table, step: pb.StepRequest, gained: dict[str, list[int]], batch,
               hidden: mx.array, compiles: bool = False) -> list[pb.SpecDraftTokens]:
        """`gained`: the tokens each sampling request got this step (accepted drafts, then its new
        token); `batch`, `hidden`: the step's packed rows and the last stage's output for them.
        `compiles` is the draft model's (one MTP layer runs as it is)."""
        num_drafts = {s.req_id: len(s.draft_token_ids) for s in step.scheduled}
        rows, pieces, proposing, histories = [], [], [], []
        offset = 0
        for req_id, n in zip(batch.req_ids, batch.num_tokens):
            state = table[req_id]
            start = state.num_computed_tokens - n  # the run advanced it already
            if req_id in gained:
                history = state.token_ids[: start + n - num_drafts.get(req_id, 0)] + gained[req_id]
            else:
                history = state.token_ids  # a prompt chunk: the prompt goes on after it
            # Positions whose next token is known; past the accepted drafts the target's hidden
            # states are of rejected guesses.
            end = min(start + n, len(history) - 1)
            if end > start:
                rows.append(Row(req_id, state.block_tables[self.group], start, history[start + 1:end + 1]))
                pieces.append(hidden[offset:offset + end - start])
                if req_id in gained and end == len(history) - 1:
                    proposing.append(len(rows) - 1)
                    histories.append(history)
            offset += n
        if not rows:
            return []
        layer = self.layer
        out = self._forward(rows, self.final_norm(mx.concatenate(pieces)))
        if not proposing or self.k <= 0:
            mx.eval(self.pool.arrays)
            return []
        ends = np.cumsum([len(r.tokens) for r in rows]) - 1
        out = out[mx.array(ends[proposing])]
        proposers = [rows[i] for i in proposing]
        states = [table[r.req_id] for r in proposers]
        drafts = [choose(layer.logits(out), states)]
        for r in proposers:
            r.start, r.tokens = r.start + len(r.tokens), None  # the next position: its token is the draft
        for _ in range(1, self.k):
            if any(r.start >= len(r.table) * self.block_size for r in proposers):
                break  # past a request's blocks (vLLM's lookahead always covers k; a guard, not a path)
            out = self._forward(proposers, layer.recycle(out), drafts[-1])
            drafts.append(choose(layer.logits(out), states))
            for r in proposers:
                r.start += 1
        tokens = mx.stack(drafts, axis=1)
        mx.eval(tokens, self.pool.arrays)
        return [pb.SpecDraftTokens(req_id=r.req_id, token_ids=ids, after=len(history))
                for r, ids, history in zip(proposers, tokens.tolist(), histories)]

    def _forward(self, rows: list[Row], hidden: mx.array, tokens: mx.array | None = None) -> mx.array:
        """The MTP layer over the rows: their tokens (or one device token per row) and hidden states."""
        batch = paged_batch(rows, self.block_size)
        if tokens is None:
            tokens = mx.array([t for r in rows for t in r.tokens], dtype=mx.int32)
        return self.layer(tokens, batch.positions, hidden.astype(self.dtype), LayerContext(batch, self.pool, 0))
