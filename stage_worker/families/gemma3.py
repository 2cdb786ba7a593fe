"""Gemma 3 (text): five sliding layers to one global, each type with its own RoPE base (mlx-lm
picks it per layer when it builds the model, so the module already holds the right one), the
embedding scaled by sqrt(hidden) on the first stage, (1 + w) RMSNorms, and a tied head.
"""

import mlx.core as mx

from metal_cluster.stage_worker.families.base import Family


class Gemma3(Family):
    model_types = ("gemma3_text",)
    architectures = ("Gemma3ForCausalLM",)

    def sliding_window(self, config, layer):
        types = config.get("layer_types")
        if types:
            sliding = types[layer] == "sliding_attention"
        else:
            sliding = (layer + 1) % config.get("sliding_window_pattern", 6) != 0
        return config.get("sliding_window", 512) if sliding else None

    def embed(self, model, token_ids):
        h = self.inner(model).embed_tokens(token_ids)
        # As mlx-lm does: the scale rounded to bf16 first, whatever the activation dtype.
        return h * mx.array(model.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)
