"""What every family says about itself, with the defaults most decoder-only models share.

A family is a small object: which mlx-lm model types it covers, what each of its layers keeps in the
paged pool (`LayerCache`, by global layer index), how its attention module meets the pool
(`paged_attention`), what a first stage embeds and what a last stage applies before logits. The
defaults are those of mlx-lm's llama-style models; a family module overrides only what differs.
"""

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from metal_cluster.stage_worker.step.attention import PagedAttention


@dataclass(frozen=True)
class LayerCache:
    """What one attention layer keeps per token in its paged pool."""

    kv_heads: int
    head_dim: int
    sliding_window: int | None = None  # the layer attends to this many most recent tokens
    # One array, no separate V: an MLA layer keeps its compressed latent (plus the roped key part)
    # per token, and attention reads V out of the same entries.
    shared_kv: bool = False
    # A recurrent layer (Gated DeltaNet) keeps no K/V but a fixed-size state per request, in one
    # block of its own: the shapes of its convolution window and of its recurrent state.
    state_shapes: tuple[tuple[int, ...], ...] = ()

    @property
    def values_per_token(self) -> int:
        """Values one token costs this layer's pool (K and V, or the one shared entry)."""
        if self.state_shapes:
            return 0
        return (1 if self.shared_kv else 2) * self.kv_heads * self.head_dim

    def block_bytes(self, block_size: int, itemsize: int) -> int:
        """What one block id costs this layer: block_size tokens of K/V, or one request's state
        (the recurrent state in float32, as mlx-lm keeps it)."""
        if self.state_shapes:
            conv, recurrent = self.state_shapes
            return math.prod(conv) * itemsize + math.prod(recurrent) * 4
        return block_size * self.values_per_token * itemsize


class MTPLayer(nn.Module):
    """One multi-token-prediction layer of a checkpoint (a family file builds it; `step/speculative/mtp.py`
    runs it): at position p it reads the target's final hidden state there and the token at p + 1,
    and its output's logits guess the token at p + 2. Its attention meets the paged pool as the
    family's decoder layers do (`block`, wrapped with `cache`)."""

    cache: LayerCache  # what its attention keeps per token

    def __call__(self, tokens: mx.array, positions: mx.array, hidden: mx.array, context) -> mx.array:
        """[T] tokens at positions + 1, [T] positions, [T, hidden] hidden states -> its output [T, hidden]."""
        raise NotImplementedError

    def logits(self, out: mx.array) -> mx.array:
        raise NotImplementedError

    def recycle(self, out: mx.array) -> mx.array:
        """What the next guess reads as its hidden state (the output's final norm, as vLLM recycles it)."""
        raise NotImplementedError


class Family:
    model_types: tuple[str, ...] = ()
    architectures: tuple[str, ...] = ()  # the names config.json gives them (vLLM resolves these)
    # Whether `layer_types` / `sliding_window` in config.json apply (mlx-lm's qwen2/qwen3 ignore them).
    reads_sliding_window = True
    # What keeps `serve` and `up` from serving the family yet, when its stages already run it.
    serving_gap: str | None = None
    # Some layers are recurrent (LayerCache.state_shapes): vLLM must treat the model as hybrid.
    hybrid = False
    # Its layers are mlx-lm's plain pre-norm blocks (q/k/v projections, a SwiGLU MLP or experts,
    # residual adds around both): on a GPU they load with the projections fused into fewer matmuls
    # and the first residual add fused with the norm after it (`model/fuse.py`).
    fuses_projections = False

    # --- the paged pool ----------------------------------------------------------------------------
    def layer_caches(self, config: dict) -> list[LayerCache]:
        """One entry per layer of the whole model, in global layer order."""
        kv_heads, head_dim = self.kv_geometry(config)
        return [LayerCache(kv_heads, head_dim, self.sliding_window(config, i))
                for i in range(config["num_hidden_layers"])]

    @staticmethod
    def kv_geometry(config: dict) -> tuple[int, int]:
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        return config.get("num_key_value_heads") or config["num_attention_heads"], head_dim

    def sliding_window(self, config: dict, layer: int) -> int | None:
        window, types = config.get("sliding_window"), config.get("layer_types")
        if not self.reads_sliding_window or not window or not types:
            return None
        return window if types[layer] == "sliding_attention" else None

    def paged_attention(self, attn: nn.Module, cache: LayerCache) -> PagedAttention:
        return PagedAttention(attn, attn.n_heads, attn.n_kv_heads, attn.scale, cache.sliding_window)

    def wrap_layer(self, layer: nn.Module, cache: LayerCache) -> None:
        """Point one decoder layer's attention at the paged pool."""
        layer.self_attn = self.paged_attention(layer.self_attn, cache)

    # --- the model's ends ----------------------------------------------------------------------------
    @staticmethod
    def language_model(model: nn.Module) -> nn.Module:
        """The module of mlx-lm's model that a stage keeps: the model itself, or the text model a
        vision-language model wraps (its `model` and `lm_head`)."""
        return model

    @staticmethod
    def inner(model: nn.Module) -> nn.Module:
        """The module holding embed_tokens, layers and norm."""
        return model.model

    def embed(self, model: nn.Module, token_ids: mx.array) -> mx.array:
        return self.inner(model).embed_tokens(token_ids)

    def logits(self, model: nn.Module, hidden: mx.array) -> mx.array:
        hidden = self.inner(model).norm(hidden)
        if "lm_head" in model:
            return model.lm_head(hidden)
        return self.inner(model).embed_tokens.as_linear(hidden)

    def check_weights(self, config: dict, where) -> None:
        """Refuse a checkpoint whose config this family cannot serve (one line, naming the file)."""

    # --- multi-token prediction (speculative decoding's `mtp` method) ----------------------------
    def mtp_layers(self, config: dict) -> int:
        """How many multi-token-prediction layers the checkpoint carries beside its decoder layers."""
        return 0

    def is_mtp_tensor(self, name: str, config: dict) -> bool:
        """A checkpoint tensor of those layers: the target's own load leaves it out."""
        return False

    def load_mtp(self, source, config: dict) -> list[MTPLayer]:
        """The checkpoint's MTP layers in order, their weights loaded lazily."""
        from metal_cluster.stage_worker.errors import ModelLoadError

        raise ModelLoadError(f"{source.folder}: {config.get('model_type')} checkpoints carry no "
                             "multi-token-prediction layers metal-cluster can run")
