"""The draft model of speculative decoding (vLLM's `draft_model` method), run whole on the last
stage beside the target's layers.

Its KV pool has the target's block ids and block size, so vLLM's block tables serve it too: a
request's token sits at the same position in both models, and vLLM reserves
num_speculative_tokens lookahead slots past every step's tokens for a draft model, which is where
the KV of the drafted tokens goes. No second allocator; the coordinator counts the draft's pool in
what a block costs the last stage.

Each step, once the target's tokens are chosen, the draft
1. catches up in one packed pass: every scheduled request's tokens whose KV it lacks (a prompt
   chunk; after a verification, the accepted tokens it did not write and the new last token);
2. proposes k tokens per sampling request, greedily (vLLM's default draft_sample_method: the
   verifier's rule for drafts of probability 1 then keeps the target's distribution), one token
   per request and pass.
The KV it wrote for its own drafts stays valid for as many of them as the target accepts, so in
steady state step 1 runs one or two tokens per request.
"""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from metal_cluster.kernels import AttentionMetadata
from metal_cluster.proto import pb
from metal_cluster.stage_worker.step.batch import GroupTables
from metal_cluster.stage_worker.step.tracing.decode_chain import DecodeChain
from metal_cluster.stage_worker.errors import ModelLoadError
from metal_cluster.stage_worker.model.model_source import resolve_model
from metal_cluster.stage_worker.kv.paged_kv import KVPool, bytes_per_block
from metal_cluster.stage_worker.model.shard import ModelShard, load_shard


@dataclass
class DraftBatch:
    """What the draft's layers read of a pass (attention.LayerContext): positions, one group's tables."""

    positions: mx.array
    groups: list[GroupTables]


@dataclass
class Row:
    """One request in a draft pass: its tokens at positions [start, start + len(tokens))."""

    req_id: str
    table: list[int]  # block ids (the target's full-attention group)
    start: int
    tokens: list[int] | None = None  # None in a proposing pass: the previous pass's draft, on the device


@dataclass
class DraftModel:
    shard: ModelShard
    k: int  # drafts per request and step
    group: int = 0  # the target's KV cache group (a full-attention one) whose block tables the draft uses
    pool: KVPool | None = None
    block_size: int = 0
    weights_bytes: int = 0
    chain: DecodeChain | None = None  # the compiled path of one-token-per-row passes

    @classmethod
    def load(cls, path: str, k: int) -> "DraftModel":
        try:
            shard = load_shard(resolve_model(path))
        except ModelLoadError as e:
            raise ModelLoadError(f"draft model: {e}") from None
        if any(c.state_shapes for c in shard.caches):
            raise ModelLoadError(f"draft model {path}: recurrent layers cannot take back rejected drafts")
        from mlx.utils import tree_flatten

        weights = sum(v.nbytes for _, v in tree_flatten(shard.model.parameters()))
        return cls(shard, k, weights_bytes=weights, chain=DecodeChain(shard.layers, shard.compile_switch))

    def bytes_per_block(self, block_size: int) -> int:
        return bytes_per_block(self.shard.caches, block_size, self.shard.dtype)

    def allocate(self, num_blocks: int, block_size: int, group: int = 0) -> "DraftModel":
        """This draft with a pool of its own (the warm-up's is thrown away)."""
        pool = KVPool.allocate(self.shard.caches, num_blocks, block_size, self.shard.dtype)
        return DraftModel(self.shard, self.k, group, pool, block_size, self.weights_bytes, self.chain)

    # --- one step ---------------------------------------------------------------------------------
    def follow(self, table, step: pb.StepRequest, gained: dict[str, list[int]], batch=None,
               hidden: mx.array | None = None, compiles: bool = False) -> list[pb.SpecDraftTokens]:
        """Catch up with this step's tokens and propose the next drafts. `gained`: the tokens each
        sampling request got this step (its accepted drafts, then its new token). A draft model
        reads its own hidden states, not the target's (`batch`, `hidden`: see mtp.py). `compiles`:
        passes of one token per row (the proposing ones) take the compiled path, as the target's
        decode steps do (`decode_chain.py`): on a GPU each pass is host-bound."""
        rows, last, histories = [], {}, {}
        for sched in step.scheduled:
            if sched.num_tokens == 0:
                continue
            state = table[sched.req_id]
            known = state.num_computed_tokens - len(sched.draft_token_ids)  # the run advanced it already
            history = state.token_ids[:known] + gained.get(sched.req_id, [])
            valid = self._still_valid(state, history)
            if sched.req_id in gained:
                valid = min(valid, len(history) - 1)  # the last token's row gives the first draft
            if valid >= len(history):
                continue
            block_table = state.block_tables[self.group]
            if len(history) > len(block_table) * self.block_size:
                state.draft_kv, state.draft_written = min(valid, len(block_table) * self.block_size), []
                continue
            rows.append(Row(sched.req_id, block_table, valid, history[valid:]))
            state.draft_kv, state.draft_written = len(history), []
            if sched.req_id in gained:
                last[sched.req_id], histories[sched.req_id] = len(rows) - 1, history
        if not rows:
            return []
        hidden = self._forward(rows, compiles=compiles)
        proposing = [rows[i] for i in last.values()]
        if not proposing or self.k <= 0:
            mx.eval(self.pool.arrays)
            return []
        ends = np.cumsum([len(r.tokens) for r in rows]) - 1
        states = [table[r.req_id] for r in proposing]
        drafts = [choose(self.shard.logits(hidden[mx.array(ends[list(last.values())])]), states)]
        for r in proposing:
            r.start, r.tokens = r.start + len(r.tokens), None  # each pass: the draft before at the next position
        for _ in range(self.k - 1):
            room = [r for r in proposing if r.start < len(r.table) * self.block_size]
            if len(room) < len(proposing):
                break  # past a request's blocks (vLLM's lookahead always covers k; a guard, not a path)
            drafts.append(choose(self.shard.logits(self._forward(proposing, drafts[-1], compiles)), states))
            for r in proposing:
                r.start += 1
        tokens = mx.stack(drafts, axis=1)
        mx.eval(tokens, self.pool.arrays)
        out = []
        for r, ids in zip(proposing, tokens.tolist()):
            table[r.req_id].draft_written = ids[:-1]  # their KV is in the pool: valid while accepted
            out.append(pb.SpecDraftTokens(req_id=r.req_id, token_ids=ids, after=len(histories[r.req_id])))
        return out

    @staticmethod
    def _still_valid(state, history: list[int]) -> int:
        """Positions whose draft KV holds this history: those caught up, then the drafts it wrote
        for as long as the history went their way."""
        valid = min(state.draft_kv, len(history))
        for token in state.draft_written:
            if valid >= len(history) or history[valid] != token:
                break
            valid += 1
        return valid

    def _forward(self, rows: list[Row], tokens: mx.array | None = None, compiles: bool = False) -> mx.array:
        """One pass over the rows' tokens (or one device token per row): their hidden states."""
        batch = paged_batch(rows, self.block_size)
        if tokens is None:
            tokens = mx.array([t for r in rows for t in r.tokens], dtype=mx.int32)
        h = self.shard.embed(tokens)[None]
        h = self.chain.run(h, batch, self.pool, compiles and max(batch.groups[0].attn.query_lens_host) == 1)
        return h[0]



def paged_batch(rows: list[Row], block_size: int) -> DraftBatch:
    """A pass over the rows (each its tokens, or one token when they are on the device) as the
    paged layers read it: positions, slots in the rows' blocks, attention metadata."""
    lengths = [1 if r.tokens is None else len(r.tokens) for r in rows]
    positions, slots = [], []
    for r, n in zip(rows, lengths):
        for pos in range(r.start, r.start + n):
            positions.append(pos)
            slots.append(r.table[pos // block_size] * block_size + pos % block_size)
    seq_lens = [r.start + n for r, n in zip(rows, lengths)]
    widest = max(len(r.table) for r in rows)
    attn = AttentionMetadata(
        cu_seqlens_q=mx.array(np.concatenate([[0], np.cumsum(lengths)]), dtype=mx.int32),
        seq_lens=mx.array(seq_lens, dtype=mx.int32),
        block_tables=mx.array([r.table + [0] * (widest - len(r.table)) for r in rows], dtype=mx.int32),
        block_size=block_size, query_lens_host=lengths, seq_lens_host=seq_lens)
    return DraftBatch(mx.array(positions, dtype=mx.int32), [GroupTables(mx.array(slots, dtype=mx.int32), attn)])


def choose(logits: mx.array, states) -> mx.array:
    """Greedy, within a request's allowed_token_ids (a draft outside them can never be accepted)."""
    logits = logits.astype(mx.float32)
    limited = [(i, t) for i, s in enumerate(states) for t in s.sampling.allowed_token_ids]
    if limited:
        allowed = np.zeros(logits.shape, dtype=bool)
        rows, ids = zip(*limited)
        allowed[list(rows), list(ids)] = True
        for i, s in enumerate(states):
            if not s.sampling.allowed_token_ids:
                allowed[i] = True
        logits = mx.where(mx.array(allowed), logits, -mx.inf)
    return mx.argmax(logits, axis=-1).astype(mx.int32)
