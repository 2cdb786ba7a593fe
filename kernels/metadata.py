"""Per-step attention metadata shared by every layer of a stage."""

from dataclasses import dataclass

import mlx.core as mx


@dataclass
class AttentionMetadata:
    """Where each request's queries and context live, for one step.

    Request r owns query rows cu_seqlens_q[r]:cu_seqlens_q[r+1]; its context is seq_lens[r] tokens
    (cached plus this step's), stored in the blocks block_tables[r]. The query rows are the last
    query_len tokens of that context.
    """

    cu_seqlens_q: mx.array  # [num_reqs + 1] int32
    seq_lens: mx.array  # [num_reqs] int32
    block_tables: mx.array  # [num_reqs, max_blocks] int32, padded with 0 (the null block)
    block_size: int
    # Host copies, so CPU-side loops need no device sync.
    query_lens_host: list[int]
    seq_lens_host: list[int]
