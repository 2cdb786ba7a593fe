"""Paged varlen attention: one API, dispatched by backend.

Only the reference (plain MLX ops) exists so far; it is the oracle for faster kernels and the CPU path.
"""

from metal_cluster.kernels.metadata import AttentionMetadata
from metal_cluster.kernels.reference import paged_attention_reference


def paged_attention(q, k_pool, v_pool, meta: AttentionMetadata, scale: float, sliding_window=None):
    """Attention of packed queries `q` [total_q, H, D] over each request's paged context.

    `k_pool`/`v_pool` are one layer's pools, [num_blocks, block_size, kv_heads, D], already holding
    the K/V of this step's tokens. Returns [total_q, H, D].
    """
    return paged_attention_reference(q, k_pool, v_pool, meta, scale, sliding_window)


__all__ = ["AttentionMetadata", "paged_attention"]
