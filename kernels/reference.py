"""Reference paged varlen attention in plain MLX ops: the oracle for kernels and the CPU path.

Decodes (one query each) go through one batched SDPA over their gathered, padded contexts (a lone
decode's context sliced to its length instead: no padding, no mask); each prefill chunk gathers its
own blocks and runs SDPA with the mask its queries need (causal over the new tokens, full over the
cached context, optional sliding window). On the CPU the cost is mostly per-op overhead, so fewer,
larger ops win: what the decodes' gathers need from the step's metadata is planned once per step
(`DecodeGather`) and shared by every layer.
"""

from dataclasses import dataclass

import mlx.core as mx

from metal_cluster.kernels.metadata import AttentionMetadata


# Padding every decode to the longest context pays off only while contexts are short: beyond this,
# one SDPA per request (no padding, no mask) is faster on MLX's CPU backend (measured, SmolLM2 shapes).
BATCHED_DECODE_MAX_CONTEXT = 512


def paged_attention_reference(q, k_pool, v_pool, meta: AttentionMetadata, scale, sliding_window=None, sinks=None):
    q_lens, ctx_lens = meta.query_lens_host, meta.seq_lens_host
    decodes = [r for r, n in enumerate(q_lens) if n == 1]
    if len(decodes) > 1 and max(ctx_lens[r] for r in decodes) > BATCHED_DECODE_MAX_CONTEXT:
        decodes = []  # a lone decode is never padded
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


@dataclass(frozen=True)
class DecodeGather:
    """How a step's single-query requests read their contexts, the same in every layer."""

    q_rows: mx.array | None  # which rows of q are theirs; None: all of q, in order
    blocks: mx.array  # [requests * width] block ids, each request's `width` blocks in turn
    width: int
    span: tuple[int, int] | None  # one request: the tokens of its gathered blocks it attends to
    mask: mx.array | None  # several: [requests, 1, 1, width * block_size], past each length masked


def decode_gather(meta: AttentionMetadata, rows: list[int], block_size: int, window) -> DecodeGather:
    """The gather plan of decode requests `rows`, made on the step's first layer and kept on its
    metadata (as the kernels' routes are) for the others."""
    plans = meta.__dict__.setdefault("_reference_decode_gathers", {})
    key = (tuple(rows), block_size, window)
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = _plan_decode_gather(meta, rows, block_size, window)
    return plan


def _plan_decode_gather(meta, rows, block_size, window) -> DecodeGather:
    starts = _starts(meta.query_lens_host)
    every_row = rows == list(range(len(meta.query_lens_host))) and starts == rows
    q_rows = None if every_row else mx.array([starts[r] for r in rows])
    ctx = [meta.seq_lens_host[r] for r in rows]
    if len(rows) == 1:
        end = ctx[0]
        start = 0 if window is None else max(0, end - window)
        first, last = start // block_size, -(-end // block_size)
        blocks = meta.block_tables[rows[0], first:last]
        skip = first * block_size
        return DecodeGather(q_rows, blocks, last - first, (start - skip, end - skip), None)
    width = -(-max(ctx) // block_size)
    blocks = meta.block_tables[:, :width] if every_row else meta.block_tables[mx.array(rows), :width]
    positions = mx.arange(width * block_size)[None, :]
    lens = mx.array(ctx)[:, None]
    mask = positions < lens
    if window is not None:
        mask = mask & (positions >= lens - window)
    return DecodeGather(q_rows, blocks.reshape(-1), width, None, mask[:, None, None, :])


def _decode_batch(q, k_pool, v_pool, meta, rows, scale, window, sinks):
    """All single-query requests at once: [R, H, D]."""
    plan = decode_gather(meta, rows, k_pool.shape[1], window)
    q_rows = q if plan.q_rows is None else q[plan.q_rows]
    requests, heads, head_dim = q_rows.shape
    k, v = _gather(k_pool, plan.blocks, requests, plan.span), _gather(v_pool, plan.blocks, requests, plan.span)
    out = _sdpa(q_rows.reshape(requests, heads, 1, head_dim), k, v, scale, plan.mask, sinks)
    return out.reshape(requests, heads, out.shape[-1])


def _gather(pool, blocks, requests: int, span: tuple[int, int] | None = None):
    """[requests * n] block ids -> [requests, kv_heads, n * block_size, D], packed; `span` keeps
    those tokens of each request's gathered blocks (sliced before the copy)."""
    kv_heads, head_dim = pool.shape[2:]
    kv = pool[blocks].reshape(requests, -1, kv_heads, head_dim)
    if span is not None:
        kv = kv[:, span[0]: span[1]]
    # MLX's CPU SDPA is several times slower on a strided (transposed) K/V than on a packed one.
    return mx.contiguous(kv.transpose(0, 2, 1, 3))


def _prefill_one(q_r, k_pool, v_pool, meta, r, scale, window, sinks):
    q_len, ctx_len = q_r.shape[0], meta.seq_lens_host[r]
    block_size = k_pool.shape[1]
    blocks = meta.block_tables[r, : -(-ctx_len // block_size)]
    k = _gather(k_pool, blocks, 1)[:, :, :ctx_len]
    v = _gather(v_pool, blocks, 1)[:, :, :ctx_len]
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
