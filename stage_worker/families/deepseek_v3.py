"""DeepSeek V3 (and Kimi K2, which mlx-lm runs as DeepSeek V3): multi-head latent attention over a
paged latent cache, and mlx-lm's MoE as it is (group-limited sigmoid routing with
e_score_correction_bias, routed_scaling_factor, shared experts; the first layers dense).

Each layer keeps one entry per token, kv_lora_rank + qk_rope_head_dim wide (576 for V3): the latent
after kv_a_layernorm and the roped key part. That is vLLM's MLAAttentionSpec with one KV head, a
fraction of what GQA arithmetic on 128 heads would say. Attention over it: `kernels.mla`.

Its checkpoints carry `num_nextn_predict_layers` multi-token-prediction layers after the decoder
layers, which mlx-lm's sanitize drops; `load_mtp` reads them (nextn.py) for speculative decoding's
`mtp` method, as vLLM's DeepSeekMTP runs them.
"""

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import deepseek_v3

from metal_cluster.kernels.mla import paged_mla_attention
from metal_cluster.stage_worker.step.attention import _rope
from metal_cluster.stage_worker.step.tracing.compiled import SplitMixer
from metal_cluster.stage_worker.errors import ModelLoadError
from metal_cluster.stage_worker.families import nextn
from metal_cluster.stage_worker.families.base import Family, LayerCache


class DeepseekV3(nextn.NextNHooks, Family):
    model_types = ("deepseek_v3", "kimi_k2")
    architectures = ("DeepseekV3ForCausalLM",)  # Kimi K2's config.json names it too
    reads_sliding_window = False
    mtp_module, mtp_block, mtp_recycles_norm = "deepseek_v3", "DeepseekV3DecoderLayer", True

    def layer_caches(self, config):
        args = deepseek_v3.ModelArgs.from_dict(config)  # mlx-lm's defaults where config.json is silent
        width = args.kv_lora_rank + args.qk_rope_head_dim
        return [LayerCache(1, width, shared_kv=True) for _ in range(args.num_hidden_layers)]

    def paged_attention(self, attn, cache):
        return PagedLatentAttention(attn)

    def check_weights(self, config, where):
        missing = [k for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
                   if config.get(k) is None]
        if config.get("n_routed_experts") is not None:
            missing += [k for k in ("num_experts_per_tok", "moe_intermediate_size") if config.get(k) is None]
        if missing:
            raise ModelLoadError(f"{where}: a {config.get('model_type')} config needs {', '.join(missing)}")


class PagedLatentAttention(SplitMixer):
    """mlx-lm's DeepseekV3Attention with its latent cache in the paged pool (split as
    `compiled.SplitMixer` says: projections and RoPE; the latent write and attention; o_proj)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def before(self, x, positions):
        a = self.inner
        tokens = x.shape[1]  # x is [1, total_q, hidden]: the whole packed batch as one row
        q = a.q_proj(x) if a.q_lora_rank is None else a.q_b_proj(a.q_a_layernorm(a.q_a_proj(x)))
        q = q.reshape(tokens, a.num_heads, a.q_head_dim)
        q_nope, q_pe = q[..., : a.qk_nope_head_dim], q[..., a.qk_nope_head_dim :]
        compressed = a.kv_a_proj_with_mqa(x)[0]
        latent = a.kv_a_layernorm(compressed[:, : a.kv_lora_rank])
        k_pe = compressed[:, None, a.kv_lora_rank :]  # [T, 1, rope]
        q_pe, k_pe = _rope(a.rope, q_pe, positions), _rope(a.rope, k_pe, positions)
        return q_nope, q_pe, mx.concatenate([latent[:, None], k_pe], axis=-1)

    def middle(self, parts, cache):
        a = self.inner
        q_nope, q_pe, entry = parts
        cache.pool.write(cache.layer_index, cache.slots, entry)
        pool, _ = cache.pool.layer(cache.layer_index)
        return (paged_mla_attention(q_nope, q_pe, pool, cache.attn, a.scale, a.embed_q, a.unembed_out),)

    def after(self, parts):
        out, = parts
        return self.inner.o_proj(out.reshape(1, out.shape[0], -1))
