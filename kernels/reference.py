"""Reference paged varlen attention in plain MLX ops: the oracle for kernels and the CPU path.

One request at a time: gather its blocks into a contiguous K/V, then run MLX's fused SDPA with the
mask its queries need (causal over the new tokens, full over the cached context, optional window).
"""

import mlx.core as mx

from metal_cluster.kernels.metadata import AttentionMetadata


def paged_attention_reference(q, k_pool, v_pool, meta: AttentionMetadata, scale, sliding_window=None):
    num_blocks, block_size, kv_heads, head_dim = k_pool.shape
    outputs = []
    q_start = 0
    for r, (q_len, ctx_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        if q_len == 0:
            continue
        n_blocks = -(-ctx_len // block_size)
        blocks = meta.block_tables[r, :n_blocks]
        k = _gather(k_pool, blocks, ctx_len)
        v = _gather(v_pool, blocks, ctx_len)
        q_r = q[q_start : q_start + q_len].transpose(1, 0, 2)[None]  # [1, H, q_len, D]
        mask = _mask(q_len, ctx_len, sliding_window)
        out = mx.fast.scaled_dot_product_attention(q_r, k, v, scale=scale, mask=mask)
        outputs.append(out[0].transpose(1, 0, 2))
        q_start += q_len
    return mx.concatenate(outputs, axis=0) if len(outputs) > 1 else outputs[0]


def _gather(pool, blocks, ctx_len):
    """[ctx_len] tokens of one request as [1, kv_heads, ctx_len, D]."""
    _, block_size, kv_heads, head_dim = pool.shape
    kv = pool[blocks].reshape(-1, kv_heads, head_dim)[:ctx_len]
    return kv.transpose(1, 0, 2)[None]


def _mask(q_len, ctx_len, window):
    """Boolean [q_len, ctx_len] mask, or None when every query sees the whole context."""
    if q_len == 1 and (window is None or ctx_len <= window):
        return None
    q_pos = mx.arange(ctx_len - q_len, ctx_len)[:, None]
    k_pos = mx.arange(ctx_len)[None]
    mask = k_pos <= q_pos
    if window is not None:
        mask = mask & (q_pos - k_pos < window)
    return mask
