"""Multi-head latent attention (DeepSeek V3's MLA) over a paged latent cache.

Each token keeps one entry per layer: its normalised latent (kv_lora_rank wide) followed by its
roped key part (qk_rope_head_dim wide), one "KV head". Per head h, the key is
[W_UK[h] · latent ‖ k_pe] and the value W_UV[h] · latent. Two exact ways to attend over it:

- absorbed (single queries): fold W_UK into the query, q' = [q_nope · W_UK ‖ q_pe], and the query
  heads attend to the entries themselves as MQA (K = the entry, V = its latent part); W_UV is applied
  to the [H, kv_lora_rank] result. This is ordinary paged attention with one KV head and K/V head
  dims 576/512, so it goes through `kernels.paged_attention` with V as the leading 512 values of
  each entry (`v_dim`): on a GPU the decode kernel reads each entry once for both, tiling the query
  heads over threadgroups;
- expanded (prompt chunks): gather the request's latents, expand them to per-head K and V, and run
  causal attention, adding the rope part's scores as mlx-lm does.

mlx-lm picks the form by query length (one query: absorbed), and so does this; a packed batch mixes
both. `embed_q` / `unembed_out` are the layer's own per-head maps (mlx-lm's MultiLinear, quantized
or not): embed_q(x) maps nope -> latent, embed_q(x, transpose=False) latent -> nope key; unembed_out
maps latent -> value.
"""

import mlx.core as mx

from metal_cluster.kernels import _sub_batch, paged_attention
from metal_cluster.kernels.metadata import AttentionMetadata
from metal_cluster.kernels.reference import stitch


def paged_mla_attention(q_nope, q_pe, pool, meta: AttentionMetadata, scale: float, embed_q, unembed_out):
    """q_nope [T, H, nope], q_pe [T, H, rope] (roped), `pool` one layer's entries
    [num_blocks, block_size, 1, kv_lora_rank + rope], already holding this step's tokens.
    Returns [T, H, v_head_dim]."""
    q_lens = meta.query_lens_host
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    singles = [r for r, n in enumerate(q_lens) if n == 1]
    single_out = None
    if singles:
        rows, sub = _sub_batch(meta, singles, starts)
        index = mx.array(rows, dtype=mx.int32)
        latent_dim = pool.shape[-1] - q_pe.shape[-1]
        q_latent = _per_head(embed_q, q_nope[index])  # [R, H, kv_lora_rank]
        q_abs = mx.concatenate([q_latent, q_pe[index].astype(q_latent.dtype)], axis=-1)
        # V is each entry's latent part, read in place (a slice would be copied whole per layer).
        out = paged_attention(q_abs, pool, None, sub, scale, v_dim=latent_dim)  # [R, H, kv_lora_rank]
        single_out = _per_head(unembed_out, out)
    return stitch(q_lens, singles, single_out, lambda r: _expanded_one(
        q_nope[starts[r] : starts[r + 1]], q_pe[starts[r] : starts[r + 1]], pool, meta, r, scale, embed_q, unembed_out))


def _per_head(linear, x):
    """A per-head map over [T, H, D] (MultiLinear multiplies [..., H, T, D] by its [H, out, in])."""
    return linear(x.transpose(1, 0, 2)).transpose(1, 0, 2)


def _expanded_one(q_nope, q_pe, pool, meta, r, scale, embed_q, unembed_out):
    """One request's prompt chunk: [q_len, H, v_head_dim], over its whole cached context."""
    q_len, ctx_len = q_nope.shape[0], meta.seq_lens_host[r]
    block_size, rope_dim = pool.shape[1], q_pe.shape[-1]
    blocks = meta.block_tables[r, : -(-ctx_len // block_size)]
    entries = pool[blocks].reshape(-1, pool.shape[-1])[:ctx_len]  # [ctx, kv_lora_rank + rope]
    latent, k_pe = entries[:, :-rope_dim], entries[:, -rope_dim:]
    latent = latent[None, None]  # [1, 1, ctx, kv_lora_rank]: one "head" broadcast over H
    k = embed_q(latent, transpose=False)  # [1, H, ctx, nope]
    v = unembed_out(latent)  # [1, H, ctx, v_head_dim]
    q = q_nope.transpose(1, 0, 2)[None]  # [1, H, q_len, nope]
    # The rope part's scores join as an additive mask, as in mlx-lm (masked: the dtype's minimum).
    pe_scores = (q_pe.transpose(1, 0, 2)[None] * scale) @ k_pe.astype(q_pe.dtype).T  # [1, H, q_len, ctx]
    q_pos = mx.arange(ctx_len - q_len, ctx_len)[:, None]
    causal = mx.arange(ctx_len)[None] <= q_pos
    pe_scores = mx.where(causal, pe_scores, mx.array(mx.finfo(pe_scores.dtype).min, pe_scores.dtype))
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=pe_scores)
    return out[0].transpose(1, 0, 2)
