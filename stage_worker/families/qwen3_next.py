"""Qwen3-Next: Gated DeltaNet layers (a linear-attention recurrence with a fixed-size state per
request) with a gated full-attention layer every `full_attention_interval`; MoE MLPs with a shared
expert (mlx-lm's blocks as they are).

A recurrent layer's state lives in the pool by block id, one row per id (`paged_kv.KVPool.state`),
in the blocks vLLM's hybrid manager gives the layer's KV cache group (a MambaSpec group; which
block holds which state: `batch.StateRows`). The recurrence itself is mlx-lm's module, called per
prefill request, and once for all decodes of a step with their states gathered into one batch.
"""

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import compute_g, normalize_qk

from metal_cluster.kernels import gated_delta

from metal_cluster.stage_worker.kv.paged_kv import state_rows
from metal_cluster.stage_worker.step.attention import PagedAttention
from metal_cluster.stage_worker.step.tracing.compiled import SplitMixer
from metal_cluster.stage_worker.families.base import Family, LayerCache


class Qwen3Next(Family):
    model_types = ("qwen3_next",)
    architectures = ("Qwen3NextForCausalLM",)
    reads_sliding_window = False
    hybrid = True

    def layer_caches(self, config: dict) -> list[LayerCache]:
        kv_heads, head_dim = self.kv_geometry(config)
        key_dim = config["linear_num_key_heads"] * config["linear_key_head_dim"]
        value_heads, value_dim = config["linear_num_value_heads"], config["linear_value_head_dim"]
        conv = (config["linear_conv_kernel_dim"] - 1, 2 * key_dim + value_heads * value_dim)
        recurrent = (value_heads, value_dim, config["linear_key_head_dim"])
        return [LayerCache(0, 0, state_shapes=(conv, recurrent)) if is_recurrent(config, i)
                else LayerCache(kv_heads, head_dim) for i in range(config["num_hidden_layers"])]

    def wrap_layer(self, layer: nn.Module, cache: LayerCache) -> None:
        if cache.state_shapes:
            layer.linear_attn = self.paged_recurrence(layer.linear_attn)
        else:
            a = layer.self_attn
            layer.self_attn = GatedPagedAttention(a, a.num_attention_heads, a.num_key_value_heads, a.scale)

    @staticmethod
    def paged_recurrence(linear_attn: nn.Module) -> nn.Module:
        return PagedGatedDeltaNet(linear_attn)


def is_recurrent(config: dict, layer: int) -> bool:
    return (layer + 1) % config.get("full_attention_interval", 4) != 0


class GatedPagedAttention(PagedAttention):
    """Qwen3-Next's attention: q_proj yields the queries and a gate; the output is gated by it."""

    def before(self, x, positions):
        a = self.inner
        tokens = x.shape[1]
        queries, gate = mx.split(a.q_proj(x).reshape(tokens, self.n_heads, -1), 2, axis=-1)
        return *self.prepare(queries, a.k_proj(x), a.v_proj(x), positions), gate

    def middle(self, parts, cache):
        *qkv, gate = parts
        return self.attend_prepared(*qkv, cache), gate

    def after(self, parts):
        out, gate = parts
        tokens = out.shape[0]
        return self.inner.o_proj(out.reshape(1, tokens, -1) * mx.sigmoid(gate.reshape(1, tokens, -1)))


class PagedGatedDeltaNet(SplitMixer):
    """mlx-lm's Qwen3NextGatedDeltaNet with its conv and recurrent states in the pool, read and
    written at the rows `batch.StateRows` gives each request.

    A decode-only step is one call over all requests (`SplitMixer`'s parts: reading the states,
    projections and the convolution; the recurrence and the state writes; the output norm and
    projection); a step with prompt chunks runs each request on its own."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        if self.phase is not None or all(n == 1 for n in cache.attn.query_lens_host):
            return super().__call__(x, mask, cache)
        conv, recurrent = cache.pool.read_state(cache.layer_index, cache.state)
        outs, convs, recurrents, begin = [], [], [], 0
        for r, n in enumerate(cache.attn.query_lens_host):
            o, c, s = self._run(x[:, begin : begin + n], conv[r : r + 1], recurrent[r : r + 1])
            outs.append(o), convs.append(c), recurrents.append(s)
            begin += n
        cache.pool.write_state(cache.layer_index, cache.state.write, mx.concatenate(convs), mx.concatenate(recurrents))
        return mx.concatenate(outs, axis=1)

    # --- the decode split: x is [1, B, hidden], one token per request --------------------------------
    def reads(self, cache):
        conv, recurrent = cache.pool.state(cache.layer_index)
        return conv, recurrent, cache.state.read, cache.state.fresh

    def before(self, x, positions, conv_pool, recurrent_pool, read, fresh):
        conv, recurrent = state_rows(conv_pool, recurrent_pool, read, fresh)
        return *self._prepare(x[0][:, None], conv), recurrent

    def middle(self, parts, cache):
        q, k, v, g, beta, z, new_conv, recurrent = parts
        out, state = gated_delta(q, k, v, g, beta, recurrent)
        cache.pool.write_state(cache.layer_index, cache.state.write, new_conv, state)
        return out, z

    def after(self, parts):
        return self._finish(*parts)[:, 0][None]

    # --- mlx-lm's module, step by step -----------------------------------------------------------
    def _run(self, x, conv, recurrent):
        """x: [B, S, hidden] for B requests with these states; returns the output and the new
        states. The recurrence runs on `kernels.gated_delta` (mlx-lm loops over tokens in Python
        on every backend but Metal)."""
        q, k, v, g, beta, z, new_conv = self._prepare(x, conv)
        out, state = gated_delta(q, k, v, g, beta, recurrent)
        return self._finish(out, z), new_conv, state

    def _prepare(self, x, conv):
        """Projections and the causal convolution over the window `conv` -> the recurrence's
        q, k, v, decay g and beta, the output gate z, and the new window."""
        a = self.inner
        B, S, _ = x.shape
        mixed, z, b, gate = self.project(x)
        conv_input = mx.concatenate([conv.astype(x.dtype), mixed], axis=1)
        new_conv = conv_input[:, -(a.conv_kernel_size - 1):]
        conv_out = nn.silu(a.conv1d(conv_input))
        q, k, v = (t.reshape(B, S, h, d) for t, h, d in zip(
            mx.split(conv_out, [a.key_dim, 2 * a.key_dim], -1), (a.num_k_heads, a.num_k_heads, a.num_v_heads),
            (a.head_k_dim, a.head_k_dim, a.head_v_dim)))
        q, k = normalize_qk(q, k, inv_scale=a.head_k_dim**-0.5, eps=1e-6)
        return q, k, v, compute_g(a.A_log, gate, a.dt_bias), mx.sigmoid(b), z, new_conv

    def _finish(self, out, z):
        a = self.inner
        B, S = out.shape[:2]
        return a.out_proj(a.norm(out, z).reshape(B, S, -1))

    def project(self, x):
        """x [B, S, hidden] -> the convolution's input (q, k, v side by side) [B, S, conv_dim], the
        output gate z [B, S, Hv, Dv], and b and a [B, S, Hv] (beta's and the decay's inputs)."""
        a = self.inner
        B, S, _ = x.shape
        q, k, v, z, b, gate = a.fix_query_key_value_ordering(a.in_proj_qkvz(x), a.in_proj_ba(x))
        return mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1), z, b, gate
