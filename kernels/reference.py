"""Reference paged varlen attention in plain MLX ops: the oracle for kernels and the CPU path.

Decodes (one query each) go through one batched SDPA over their gathered, padded contexts; each
prefill chunk gathers its own blocks and runs SDPA with the mask its queries need (causal over the
new tokens, full over the cached context, optional sliding window). On the CPU the cost is mostly
per-op overhead, so fewer, larger ops win.
"""

import mlx.core as mx

from metal_cluster.kernels.metadata import AttentionMetadata


# Padding every decode to the longest context pays off only while contexts are short: beyond this,
# one SDPA per request (no padding, no mask) is faster on MLX's CPU backend (measured, SmolLM2 shapes).
BATCHED_DECODE_MAX_CONTEXT = 512


def paged_attention_reference(q, k_pool, v_pool, meta: AttentionMetadata, scale, sliding_window=None, sinks=None):
    q_lens, ctx_lens = meta.query_lens_host, meta.seq_lens_host
    decodes = [r for r, n in enumerate(q_lens) if n == 1]
    if decodes and max(ctx_lens[r] for r in decodes) > BATCHED_DECODE_MAX_CONTEXT:
        decodes = []
    decoded = _decode_batch(q, k_pool, v_pool, meta, decodes, scale, sliding_window, sinks) if decodes else None
    starts = _starts(q_lens)
    return stitch(q_lens, decodes, decoded, lambda r: _prefill_one(
        q[starts[r] : starts[r] + q_lens[r]], k_pool, v_pool, meta, r, scale, sliding_window, sinks))


def stitch(q_lens, batched: list[int], batched_out, one):
    """The output rows in request order: requests `batched` from `batched_out` (one row each, in that
    order), every other request with queries from `one(r)`."""
    if len(batched) == len(q_lens):
        return batched_out
    outputs, slot = [], {r: i for i, r in enumerate(batched)}
    for r, n in enumerate(q_lens):
        if n == 0:
            continue
        outputs.append(batched_out[slot[r] : slot[r] + 1] if r in slot else one(r))
    return mx.concatenate(outputs, axis=0) if len(outputs) > 1 else outputs[0]


def _starts(q_lens):
    starts, total = [], 0
    for n in q_lens:
        starts.append(total)
        total += n
    return starts


def _decode_batch(q, k_pool, v_pool, meta, rows, scale, window, sinks):
    """All single-query requests at once: [R, H, D] out of contexts padded to the longest."""
    block_size = k_pool.shape[1]
    ctx = [meta.seq_lens_host[r] for r in rows]
    n_blocks = -(-max(ctx) // block_size)
    index = mx.array(rows)
    tables = meta.block_tables[index, :n_blocks]
    starts = _starts(meta.query_lens_host)
    q_rows = q[mx.array([starts[r] for r in rows])][:, :, None, :]  # [R, H, 1, D]
    k, v = _gather_padded(k_pool, tables), _gather_padded(v_pool, tables)
    positions = mx.arange(n_blocks * block_size)[None, :]
    lens = mx.array(ctx)[:, None]
    mask = positions < lens
    if window is not None:
        mask = mask & (positions >= lens - window)
    out = _sdpa(q_rows, k, v, scale, mask[:, None, None, :], sinks)
    return out[:, :, 0, :]


def _gather_padded(pool, tables):
    """[R, n_blocks] block ids -> [R, kv_heads, n_blocks * block_size, D]."""
    r, n = tables.shape
    _, block_size, kv_heads, head_dim = pool.shape
    kv = pool[tables.reshape(-1)].reshape(r, n * block_size, kv_heads, head_dim)
    # MLX's CPU SDPA is several times slower on a strided (transposed) K/V than on a packed one.
    return mx.contiguous(kv.transpose(0, 2, 1, 3))


def _prefill_one(q_r, k_pool, v_pool, meta, r, scale, window, sinks):
    q_len, ctx_len = q_r.shape[0], meta.seq_lens_host[r]
    block_size = k_pool.shape[1]
    blocks = meta.block_tables[r, : -(-ctx_len // block_size)]
    k = _gather_padded(k_pool, blocks[None])[:, :, :ctx_len]
    v = _gather_padded(v_pool, blocks[None])[:, :, :ctx_len]
    out = _sdpa(q_r.transpose(1, 0, 2)[None], k, v, scale, _causal_mask(q_len, ctx_len, window), sinks)
    return out[0].transpose(1, 0, 2)


def _sdpa(q, k, v, scale, mask, sinks):
    if sinks is None:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks.astype(q.dtype))


def _causal_mask(q_len, ctx_len, window):
    """Query i sits at position ctx_len - q_len + i. None: no masking; "causal": SDPA's own mask,
    which aligns the queries to the context's end as here (and is what mlx-lm passes), so MLX may
    take its fused path instead of materialising the scores (on a GPU an 8192-token prompt's
    [heads, 8192, 8192] scores were most of the activation peak); else a boolean [q_len, ctx_len]."""
    if q_len == 1 and (window is None or ctx_len <= window):
        return None
    if window is None or ctx_len <= window:
        return "causal"
    q_pos = mx.arange(ctx_len - q_len, ctx_len)[:, None]
    k_pos = mx.arange(ctx_len)[None]
    mask = k_pos <= q_pos
    if window is not None:
        mask = mask & (q_pos - k_pos < window)
    return mask
