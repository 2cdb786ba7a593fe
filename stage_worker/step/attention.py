"""Paged attention for mlx-lm's attention modules.

mlx-lm's decoder blocks are reused as they are (norms, MLP or experts, residuals); only their
`self_attn` is wrapped, so that K/V go to the paged pool and attention reads it. The wrapped
module's own projections, q/k norms and RoPE do the rest; its family (`families/`) says what its
head counts, scale, window and sinks are called.
"""

import mlx.core as mx
import mlx.nn as nn

from metal_cluster.kernels import paged_attention
from metal_cluster.kernels.norm_rope import NormRope, norm_rope
from metal_cluster.stage_worker.step.tracing.compiled import SplitMixer


class LayerContext:
    """What one layer needs from the step: positions, its KV cache group's slots and attention
    metadata, and its KV pool."""

    def __init__(self, batch, pool, layer_index: int):
        self.batch = batch
        self.pool = pool
        self.layer_index = layer_index
        tables = batch.groups[pool.layout.groups[layer_index]]
        self.slots, self.attn, self.state = tables.slot_mapping, tables.attn, tables.state


class PagedAttention(SplitMixer):
    def __init__(self, inner: nn.Module, n_heads: int, n_kv_heads: int, scale: float,
                 sliding_window: int | None = None, sinks: mx.array | None = None):
        super().__init__()
        self.inner = inner
        self.n_heads, self.n_kv_heads, self.scale = n_heads, n_kv_heads, scale
        self.sliding_window = sliding_window
        self.has_sinks = sinks is not None  # the sinks stay a parameter of `inner`
        # On a GPU q/k/v may be one module (`model/fuse.py`): self.qkv, split at these columns.
        self.qkv_split: list[int] | None = None
        # With q/k/v fused on a GPU, the q/k norms and RoPE as one kernel (`kernels/norm_rope.py`).
        self.norm_rope: NormRope | None = None

    # The split for the compiled decode step (`compiled.SplitMixer`): projections, norms and RoPE;
    # K/V into the pool and attention; o_proj.
    def before(self, x: mx.array, positions: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        a = self.inner
        if self.qkv_split is not None:
            if self.norm_rope is not None:
                return self.prepare_fused(self.qkv(x), positions)
            return self.prepare(*mx.split(self.qkv(x), self.qkv_split, axis=-1), positions)
        return self.prepare(a.q_proj(x), a.k_proj(x), a.v_proj(x), positions)

    def middle(self, parts, cache: LayerContext) -> tuple[mx.array]:
        return (self.attend_prepared(*parts, cache),)

    def after(self, parts) -> mx.array:
        attended, = parts
        return self.inner.o_proj(attended.reshape(1, attended.shape[0], -1))  # one packed row, as x came

    def prepare(self, q: mx.array, k: mx.array, v: mx.array, positions: mx.array):
        """Projections -> per-head queries, keys and values [T, heads, D], normed and roped."""
        a = self.inner
        tokens = positions.shape[0]
        # Each token is its own batch row of length 1 ([T, heads, 1, D]), so RoPE takes a per-token
        # offset array; shaped so from the projection on, which costs no extra op.
        q = q.reshape(tokens, self.n_heads, 1, -1)
        k = k.reshape(tokens, self.n_kv_heads, 1, -1)
        v = v.reshape(tokens, self.n_kv_heads, -1)
        if hasattr(a, "q_norm"):
            q = a.q_norm(q)
        if hasattr(a, "k_norm"):
            k = a.k_norm(k)
        q, k = a.rope(q, offset=positions), a.rope(k, offset=positions)
        return q.reshape(tokens, self.n_heads, -1), k.reshape(tokens, self.n_kv_heads, -1), v

    def prepare_fused(self, qkv: mx.array, positions: mx.array):
        """`prepare` from the fused product, q/k norms and RoPE in one kernel; v is a view."""
        a, spec = self.inner, self.norm_rope
        tokens = positions.shape[0]
        flat = qkv.reshape(tokens, -1)
        weights = (a.q_norm.weight, a.k_norm.weight) if spec.norm else ()
        q, k = norm_rope(flat, positions, spec, *weights)
        return q, k, flat[:, self.qkv_split[1]:].reshape(tokens, self.n_kv_heads, -1)

    def attend_prepared(self, q: mx.array, k: mx.array, v: mx.array, cache: LayerContext) -> mx.array:
        """K/V into the pool, paged attention over it."""
        a = self.inner
        cache.pool.write(cache.layer_index, cache.slots, k, v)
        k_pool, v_pool = cache.pool.flat(cache.layer_index)
        sinks = a.sinks if self.has_sinks else None
        return paged_attention(q, k_pool, v_pool, cache.attn, self.scale, self.sliding_window, sinks=sinks)


def _rope(rope, x, positions):
    # Each token is its own batch row of length 1, so RoPE takes a per-token offset array.
    return rope(x[:, :, None, :], offset=positions)[:, :, 0, :]
