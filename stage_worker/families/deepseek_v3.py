"""DeepSeek V3 (and Kimi K2, which mlx-lm runs as DeepSeek V3): multi-head latent attention over a
paged latent cache, and mlx-lm's MoE as it is (group-limited sigmoid routing with
e_score_correction_bias, routed_scaling_factor, shared experts; the first layers dense).

Each layer keeps one entry per token, kv_lora_rank + qk_rope_head_dim wide (576 for V3): the latent
after kv_a_layernorm and the roped key part. That is vLLM's MLAAttentionSpec with one KV head, a
fraction of what GQA arithmetic on 128 heads would say. Attention over it: `kernels.mla`.

Its checkpoints carry `num_nextn_predict_layers` multi-token-prediction layers after the decoder
layers (`model.layers.{N}.*`: enorm, hnorm, eh_proj, a decoder layer, shared_head), which mlx-lm's
sanitize drops; `load_mtp` reads them for speculative decoding's `mtp` method (vLLM's DeepSeekMTP).
"""

import dataclasses
import re
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import deepseek_v3

from metal_cluster.kernels.mla import paged_mla_attention
from metal_cluster.stage_worker.step.attention import _rope
from metal_cluster.stage_worker.errors import ModelLoadError
from metal_cluster.stage_worker.families.base import Family, LayerCache, MTPLayer

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# An MTP layer's own parts; the rest of its tensors are its decoder layer's.
_MTP_PARTS = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")


class DeepseekV3(Family):
    model_types = ("deepseek_v3", "kimi_k2")
    architectures = ("DeepseekV3ForCausalLM",)  # Kimi K2's config.json names it too
    reads_sliding_window = False

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

    # --- multi-token prediction ------------------------------------------------------------------
    def mtp_layers(self, config):
        return config.get("num_nextn_predict_layers") or 0

    def is_mtp_tensor(self, name, config):
        m = _LAYER.match(name)
        return m is not None and int(m.group(1)) >= config["num_hidden_layers"]

    def load_mtp(self, source, config):
        from metal_cluster.stage_worker.model.tensors import load_tensors

        first, n = config["num_hidden_layers"], self.mtp_layers(config)
        if not n:
            return super().load_mtp(source, config)
        args = deepseek_v3.ModelArgs.from_dict(config)
        top = ("model.embed_tokens.weight", "lm_head.weight")  # for layers without their own copies
        stored = load_tensors(source.folder, lambda name: self.is_mtp_tensor(name, config) or name in top)
        cache = self.layer_caches(config)[-1]
        return [_load_mtp_layer(source, args, first + i, stored, cache) for i in range(n)]


class PagedLatentAttention(nn.Module):
    """mlx-lm's DeepseekV3Attention with its latent cache in the paged pool."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        a, batch = self.inner, cache.batch
        tokens = x.shape[1]  # x is [1, total_q, hidden]: the whole packed batch as one row
        q = a.q_proj(x) if a.q_lora_rank is None else a.q_b_proj(a.q_a_layernorm(a.q_a_proj(x)))
        q = q.reshape(tokens, a.num_heads, a.q_head_dim)
        q_nope, q_pe = q[..., : a.qk_nope_head_dim], q[..., a.qk_nope_head_dim :]
        compressed = a.kv_a_proj_with_mqa(x)[0]
        latent = a.kv_a_layernorm(compressed[:, : a.kv_lora_rank])
        k_pe = compressed[:, None, a.kv_lora_rank :]  # [T, 1, rope]
        q_pe, k_pe = _rope(a.rope, q_pe, batch.positions), _rope(a.rope, k_pe, batch.positions)
        cache.pool.write(cache.layer_index, cache.slots, mx.concatenate([latent[:, None], k_pe], axis=-1))
        pool, _ = cache.pool.layer(cache.layer_index)
        out = paged_mla_attention(q_nope, q_pe, pool, cache.attn, a.scale, a.embed_q, a.unembed_out)
        return a.o_proj(out.reshape(1, tokens, -1))



class DeepseekMTPLayer(MTPLayer):
    """vLLM's DeepSeekMultiTokenPredictorLayer: the next token's embedding (zero at position 0) and
    the target's hidden state, each RMS-normed, concatenated, projected (eh_proj), through one
    decoder layer; shared_head's norm and head give the logits."""

    def __init__(self, args: deepseek_v3.ModelArgs, index: int, cache: LayerCache):
        super().__init__()
        h = args.hidden_size
        self.embed_tokens = nn.Embedding(args.vocab_size, h)
        self.enorm = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.hnorm = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = deepseek_v3.DeepseekV3DecoderLayer(args, index)
        self.shared_head = nn.Module()
        self.shared_head.norm = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.shared_head.head = nn.Linear(h, args.vocab_size, bias=False)
        self.cache = cache

    @property
    def cast_predicate(self):
        return lambda k: "e_score_correction_bias" not in k  # as mlx-lm's DeepSeek V3 keeps it

    def __call__(self, tokens, positions, hidden, context):
        e = mx.where((positions == 0)[:, None], 0, self.embed_tokens(tokens))
        x = self.eh_proj(mx.concatenate([self.enorm(e), self.hnorm(hidden).astype(e.dtype)], axis=-1))
        return self.block(x[None], None, context)[0]

    def logits(self, out):
        return self.shared_head.head(self.shared_head.norm(out))

    def recycle(self, out):
        return self.shared_head.norm(out)


def _load_mtp_layer(source, args, index: int, stored: dict, cache: LayerCache) -> DeepseekMTPLayer:
    prefix = f"model.layers.{index}."
    own = {k[len(prefix):]: v for k, v in stored.items() if k.startswith(prefix)}
    if not own:
        raise ModelLoadError(f"{source.folder}: config.json has num_nextn_predict_layers, but the checkpoint has "
                             f"no tensors {prefix}* (mlx-lm's conversions drop them): "
                             "use the original checkpoint, or speculate with \"ngram\" or \"draft_model\"")
    for name, fallback in (("embed_tokens.weight", "model.embed_tokens.weight"), ("shared_head.head.weight", "lm_head.weight")):
        if name not in own and fallback in stored:
            own[name] = stored[fallback]
    if any(k.endswith(".scales") for k in own):
        raise ModelLoadError(f"{source.folder}: quantized MTP layers ({prefix}*) are not supported; "
                             "use a checkpoint whose MTP layers are in float, bfloat16 or fp8")
    # mlx-lm's sanitize does to the layer's tensors what it does to every layer's (stacked experts,
    # MLA's kv_b_proj split, fp8 dequantized), here as layer 0 of a one-layer model.
    one = SimpleNamespace(args=dataclasses.replace(args, num_hidden_layers=1))
    sanitized = deepseek_v3.Model.sanitize(one, {f"model.layers.0.{k}": v for k, v in own.items()})
    weights = {}
    for name, v in sanitized.items():
        name = name.removeprefix("model.layers.0.")
        weights[name if name.startswith(_MTP_PARTS) else "block." + name] = v
    layer = DeepseekMTPLayer(args, index, cache)
    try:
        layer.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ModelLoadError(f"{source.folder}: MTP layer {prefix}*: {str(e).splitlines()[0]}") from None
    return layer
