"""Pack one step's scheduled tokens into flat arrays: no padding, prefill chunks and decodes mixed."""

from dataclasses import dataclass

import mlx.core as mx

from metal_cluster.kernels import AttentionMetadata
from metal_cluster.stage_worker.step.request_table import PENDING, RequestTable, StepError


@dataclass
class StateRows:
    """Where a group's recurrent layers read each request's state and write it back, one row (a
    block id) per request in batch order: the state after token t lives in the block of the
    request's table that holds t. vLLM gives a recurrent (MambaSpec) group either one block per
    request ("none" mode: every index lands on it, the state is updated in place) or one per
    block_size tokens ("align" mode, for prefix caching): a step reads the state its first token
    follows and writes the one its last token leaves into the block holding that token, so the
    states at block boundaries stay behind as vLLM's cached prefix states. Without vLLM (a stage
    run by `generate` or the tests, one K/V group for all layers) the same rule walks the state
    along the request's K/V blocks."""

    read: mx.array  # [B] block id holding the state before this step's tokens
    write: mx.array  # [B] block id the state after them goes to
    fresh: mx.array  # [B] bool: the request starts at position 0, from zero states


@dataclass
class GroupTables:
    """Where one KV cache group's layers write this step's tokens and read their context."""

    slot_mapping: mx.array  # [total_q] flat KV slot of each token (empty for a recurrent group)
    attn: AttentionMetadata
    state: StateRows | None = None  # a recurrent group's


@dataclass
class PromptRows:
    """A request asking for prompt logprobs: its rows of this chunk that score a next prompt token."""

    req_id: str
    start: int  # prompt position of the first row; row i scores prompt token start + i + 1
    first_row: int  # that row's index in the packed batch
    targets: list[int]
    num_logprobs: int  # the top k besides the prompt token (-1: all)
    complete: bool  # this chunk reaches the end of the prompt


@dataclass
class StepBatch:
    req_ids: list[str]  # in batch order, one per scheduled request
    num_tokens: list[int]
    token_ids: mx.array  # [total_q]
    positions: mx.array  # [total_q]
    groups: list[GroupTables]  # one per KV cache group
    # Rows whose request reaches the end of its known tokens this step: only these get logits; a
    # request with drafts gets 1 + len(drafts) of them (its last known token's row, then each draft's).
    logits_rows: mx.array
    sample_req_ids: list[str]
    drafts: list[list[int]]  # per sample_req_ids: the drafts its rows verify ([] for most)
    # (row in token_ids, request, history index) of tokens this stage sampled that are still on
    # the device: token_ids holds PENDING there until the runner fills them in.
    pending: list[tuple[int, str, int]]
    prompt_rows: list[PromptRows]
    lora_slots: "np.ndarray | None" = None  # [total_q] each token's LoRA slot (None: no adapter this step)

    @property
    def is_decode(self) -> bool:
        """One token per request: a step whose shapes recur from step to step."""
        return len(self.num_tokens) == self.token_ids.shape[0]

    @property
    def is_verification(self) -> bool:
        """Every request scores its last token and as many drafts (a draft model's k): shapes that
        recur as decode's do. A prompt chunk never counts, whatever its length."""
        return (len(self.sample_req_ids) == len(self.req_ids) and len({len(d) for d in self.drafts}) == 1
                and all(n == 1 + len(d) for n, d in zip(self.num_tokens, self.drafts)))


def build_batch(table: RequestTable, scheduled, block_size: int, with_state: bool = False) -> StepBatch:
    """with_state: the stage has recurrent layers (each group then gets its StateRows)."""
    req_ids, num_tokens, tokens, positions = [], [], [], []
    slots, tables = [[] for _ in range(table.num_groups)], [[] for _ in range(table.num_groups)]
    rows = [([], []) if with_state else None for _ in range(table.num_groups)]
    seq_lens, logits_rows, sample_ids, pending, prompt_rows, drafts = [], [], [], [], [], []
    for sched in scheduled:
        if sched.num_tokens == 0:
            continue
        state = table[sched.req_id]
        start, n = state.num_computed_tokens, sched.num_tokens
        end = start + n
        draft = list(sched.draft_token_ids)
        known_end = end - len(draft)
        if known_end > len(state.token_ids) or (draft and known_end != len(state.token_ids)) or known_end <= start:
            raise StepError(
                f"request {sched.req_id!r}: {n} tokens ({len(draft)} of them drafts) scheduled from position "
                f"{start}, but {len(state.token_ids)} tokens are known"
            )
        # A sliding group's table is as long as a full one: blocks behind its window are block 0.
        for group, recurrent in zip(state.block_tables, table.recurrent):
            if recurrent and not group:
                raise StepError(f"request {sched.req_id!r}: no block for its recurrent layers' state")
            if not recurrent and end > len(group) * block_size:
                raise StepError(
                    f"request {sched.req_id!r}: {end} tokens need {-(-end // block_size)} blocks, "
                    f"it has {len(group)}"
                )
        if state.sampling.HasField("prompt_logprobs") and not state.prompt_logprobs_done:
            prompt_rows.append(_prompt_rows(state, start, end, len(tokens)))
        req_ids.append(sched.req_id)
        num_tokens.append(n)
        scheduled = state.token_ids[start:known_end]
        if PENDING in scheduled:
            pending.extend((len(tokens) + k, sched.req_id, start + k) for k, t in enumerate(scheduled) if t == PENDING)
        tokens.extend(scheduled)
        tokens.extend(draft)
        positions.extend(range(start, end))
        for g, (group, group_slots, group_tables, group_rows) in enumerate(zip(state.block_tables, slots, tables,
                                                                              rows)):
            group_tables.append(group)
            if group_rows is not None:
                group_rows[0].append(group[min(max(start - 1, 0) // block_size, len(group) - 1)])
                group_rows[1].append(group[min((end - 1) // block_size, len(group) - 1)])
            if table.recurrent[g]:
                continue
            group_slots.extend(group[pos // block_size] * block_size + pos % block_size for pos in range(start, end))
        seq_lens.append(end)
        if known_end == len(state.token_ids):
            logits_rows.extend(range(len(tokens) - 1 - len(draft), len(tokens)))
            sample_ids.append(sched.req_id)
            drafts.append(draft)

    cu = [0]
    for n in num_tokens:
        cu.append(cu[-1] + n)
    cu_seqlens_q, seq_lens_arr = mx.array(cu, dtype=mx.int32), mx.array(seq_lens, dtype=mx.int32)

    fresh = mx.array([end == n for n, end in zip(num_tokens, seq_lens)])  # starts at position 0

    def group(group_slots, group_tables, group_rows) -> GroupTables:
        max_blocks = max((len(t) for t in group_tables), default=0)
        padded = [t + [0] * (max_blocks - len(t)) for t in group_tables]
        attn = AttentionMetadata(
            cu_seqlens_q=cu_seqlens_q,
            seq_lens=seq_lens_arr,
            block_tables=mx.array(padded, dtype=mx.int32),
            block_size=block_size,
            query_lens_host=num_tokens,
            seq_lens_host=seq_lens,
        )
        state = None if group_rows is None else StateRows(
            mx.array(group_rows[0], dtype=mx.int32), mx.array(group_rows[1], dtype=mx.int32), fresh)
        return GroupTables(mx.array(group_slots, dtype=mx.int32), attn, state)

    return StepBatch(
        req_ids=req_ids,
        num_tokens=num_tokens,
        token_ids=mx.array(tokens, dtype=mx.int32),
        positions=mx.array(positions, dtype=mx.int32),
        groups=[group(s, t, r) for s, t, r in zip(slots, tables, rows)],
        logits_rows=mx.array(logits_rows, dtype=mx.int32),
        sample_req_ids=sample_ids,
        drafts=drafts,
        pending=pending,
        prompt_rows=prompt_rows,
    )


def _prompt_rows(state, start: int, end: int, first_row: int) -> PromptRows:
    # The last prompt position predicts the first output token: that one is sampled, not scored.
    last = min(end, state.num_prompt_tokens - 1)
    return PromptRows(state.req_id, start, first_row, state.token_ids[start + 1 : last + 1],
                      state.sampling.prompt_logprobs, end >= state.num_prompt_tokens)
