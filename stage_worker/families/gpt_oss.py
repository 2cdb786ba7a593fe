"""GPT-OSS: learned attention sinks, full and 128-token sliding layers alternating by `layer_types`,
and a biased router over SwiGLU experts (mlx-lm's MLPBlock, run as it is).

A sink is one learned logit per head that takes part in the softmax but has no value: the kernels
seed each head's softmax with it.
"""

from metal_cluster.stage_worker.step.attention import PagedAttention
from metal_cluster.stage_worker.families.base import Family


class GptOss(Family):
    model_types = ("gpt_oss",)
    architectures = ("GptOssForCausalLM",)

    def sliding_window(self, config, layer):
        types = config.get("layer_types") or [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(config["num_hidden_layers"])
        ]  # mlx-lm's default when the config has none
        return config.get("sliding_window", 128) if types[layer] == "sliding_attention" else None

    def paged_attention(self, attn, cache):
        return PagedAttention(attn, attn.num_attention_heads, attn.num_key_value_heads, attn.sm_scale,
                              cache.sliding_window, sinks=attn.sinks)
