"""Pack one step's scheduled tokens into flat arrays: no padding, prefill chunks and decodes mixed."""

from dataclasses import dataclass

import mlx.core as mx

from metal_cluster.kernels import AttentionMetadata
from metal_cluster.stage_worker.request_table import PENDING, RequestTable, StepError


@dataclass
class GroupTables:
    """Where one KV cache group's layers write this step's tokens and read their context."""

    slot_mapping: mx.array  # [total_q] flat KV slot of each token
    attn: AttentionMetadata


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
    # Rows whose request reaches the end of its known tokens this step: only these get logits.
    logits_rows: mx.array
    sample_req_ids: list[str]
    # (row in token_ids, request, history index) of tokens this stage sampled that are still on
    # the device: token_ids holds PENDING there until the runner fills them in.
    pending: list[tuple[int, str, int]]
    prompt_rows: list[PromptRows]
    lora_slots: "np.ndarray | None" = None  # [total_q] each token's LoRA slot (None: no adapter this step)


def build_batch(table: RequestTable, scheduled, block_size: int) -> StepBatch:
    req_ids, num_tokens, tokens, positions = [], [], [], []
    slots, tables = [[] for _ in range(table.num_groups)], [[] for _ in range(table.num_groups)]
    seq_lens, logits_rows, sample_ids, pending, prompt_rows = [], [], [], [], []
    for sched in scheduled:
        if sched.num_tokens == 0:
            continue
        state = table[sched.req_id]
        start, n = state.num_computed_tokens, sched.num_tokens
        end = start + n
        if end > len(state.token_ids):
            raise StepError(
                f"request {sched.req_id!r}: {n} tokens scheduled from position {start}, "
                f"but only {len(state.token_ids)} tokens are known"
            )
        # A sliding group's table is as long as a full one: blocks behind its window are block 0.
        for group in state.block_tables:
            if end > len(group) * block_size:
                raise StepError(
                    f"request {sched.req_id!r}: {end} tokens need {-(-end // block_size)} blocks, "
                    f"it has {len(group)}"
                )
        if state.sampling.HasField("prompt_logprobs") and not state.prompt_logprobs_done:
            prompt_rows.append(_prompt_rows(state, start, end, len(tokens)))
        req_ids.append(sched.req_id)
        num_tokens.append(n)
        scheduled = state.token_ids[start:end]
        if PENDING in scheduled:
            pending.extend((len(tokens) + k, sched.req_id, start + k) for k, t in enumerate(scheduled) if t == PENDING)
        tokens.extend(scheduled)
        positions.extend(range(start, end))
        for group, group_slots, group_tables in zip(state.block_tables, slots, tables):
            group_slots.extend(group[pos // block_size] * block_size + pos % block_size for pos in range(start, end))
            group_tables.append(group)
        seq_lens.append(end)
        if end == len(state.token_ids):
            logits_rows.append(len(tokens) - 1)
            sample_ids.append(sched.req_id)

    cu = [0]
    for n in num_tokens:
        cu.append(cu[-1] + n)
    cu_seqlens_q, seq_lens_arr = mx.array(cu, dtype=mx.int32), mx.array(seq_lens, dtype=mx.int32)

    def group(group_slots, group_tables) -> GroupTables:
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
        return GroupTables(mx.array(group_slots, dtype=mx.int32), attn)

    return StepBatch(
        req_ids=req_ids,
        num_tokens=num_tokens,
        token_ids=mx.array(tokens, dtype=mx.int32),
        positions=mx.array(positions, dtype=mx.int32),
        groups=[group(s, t) for s, t in zip(slots, tables)],
        logits_rows=mx.array(logits_rows, dtype=mx.int32),
        sample_req_ids=sample_ids,
        pending=pending,
        prompt_rows=prompt_rows,
    )


def _prompt_rows(state, start: int, end: int, first_row: int) -> PromptRows:
    # The last prompt position predicts the first output token: that one is sampled, not scored.
    last = min(end, state.num_prompt_tokens - 1)
    return PromptRows(state.req_id, start, first_row, state.token_ids[start + 1 : last + 1],
                      state.sampling.prompt_logprobs, end >= state.num_prompt_tokens)
