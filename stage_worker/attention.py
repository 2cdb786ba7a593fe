"""Paged attention for mlx-lm's attention modules.

mlx-lm's decoder blocks are reused as they are (norms, MLP, residuals); only their `self_attn` is
wrapped, so that K/V go to the paged pool and attention reads it. The wrapped module's own
projections, q/k norms (Qwen3) and RoPE do the rest.
"""

import mlx.core as mx
import mlx.nn as nn

from metal_cluster.kernels import paged_attention


class LayerContext:
    """What one layer needs from the step: positions, slots, attention metadata and its KV pool."""

    def __init__(self, batch, pool, layer_index: int):
        self.batch = batch
        self.pool = pool
        self.layer_index = layer_index


class PagedAttention(nn.Module):
    def __init__(self, inner: nn.Module, sliding_window: int | None):
        super().__init__()
        self.inner = inner
        self.sliding_window = sliding_window

    def __call__(self, x: mx.array, mask=None, cache: LayerContext = None) -> mx.array:
        a = self.inner
        batch = cache.batch
        tokens = x.shape[1]  # x is [1, total_q, hidden]: the whole packed batch as one row
        q = a.q_proj(x).reshape(tokens, a.n_heads, -1)
        k = a.k_proj(x).reshape(tokens, a.n_kv_heads, -1)
        v = a.v_proj(x).reshape(tokens, a.n_kv_heads, -1)
        if hasattr(a, "q_norm"):
            q, k = a.q_norm(q), a.k_norm(k)
        q, k = _rope(a.rope, q, batch.positions), _rope(a.rope, k, batch.positions)
        cache.pool.write(cache.layer_index, batch.slot_mapping, k, v)
        k_pool, v_pool = cache.pool.layer(cache.layer_index)
        out = paged_attention(q, k_pool, v_pool, batch.attn, a.scale, self.sliding_window)
        return a.o_proj(out.reshape(1, tokens, -1))


def _rope(rope, x, positions):
    # Each token is its own batch row of length 1, so RoPE takes a per-token offset array.
    return rope(x[:, :, None, :], offset=positions)[:, :, 0, :]


def wrap_attention(layers, sliding_window: int | None) -> None:
    """Swap each layer's attention for the paged one, in place."""
    for layer in layers:
        window = sliding_window if getattr(layer, "use_sliding", False) else None
        layer.self_attn = PagedAttention(layer.self_attn, window)
