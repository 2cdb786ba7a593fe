"""Mixture-of-experts decoders whose MoE blocks mlx-lm runs as they are: qwen3_moe, mixtral, glm4_moe.

Routing is a pure function of each token (no capacity, no per-request state), so the packed batch
goes through mlx-lm's SwitchGLU unchanged; only attention meets the paged pool. Qwen3-MoE's attention
is Qwen3's; GLM-4.5's rotates part of each head (its nn.RoPE has fewer dims than the head) and
normalises q/k only with `use_qk_norm`; Mixtral names its head counts differently. GLM-4.5's
checkpoints carry MTP layers as DeepSeek V3's do (nextn.py).
"""

from metal_cluster.stage_worker.step.attention import PagedAttention
from metal_cluster.stage_worker.errors import ModelLoadError
from metal_cluster.stage_worker.families import nextn
from metal_cluster.stage_worker.families.base import Family


class Qwen3Moe(Family):
    model_types = ("qwen3_moe",)
    architectures = ("Qwen3MoeForCausalLM",)
    reads_sliding_window = False
    fuses_projections = True  # q/k/v; the dense MLPs of its mlp_only_layers too

    def check_weights(self, config, where):
        _need(config, where, "num_experts", "num_experts_per_tok", "moe_intermediate_size")


class Mixtral(Family):
    model_types = ("mixtral",)
    architectures = ("MixtralForCausalLM",)
    reads_sliding_window = False  # mlx-lm's mixtral attends to the whole context
    fuses_projections = True  # q/k/v (its experts are one SwitchGLU already)

    def kv_geometry(self, config):
        return config.get("num_key_value_heads") or config["num_attention_heads"], \
            config["hidden_size"] // config["num_attention_heads"]  # mlx-lm ignores head_dim here

    def paged_attention(self, attn, cache):
        return PagedAttention(attn, attn.num_heads, attn.num_key_value_heads, attn.scale, cache.sliding_window)

    def check_weights(self, config, where):
        _need(config, where, "num_local_experts", "num_experts_per_tok")


class Glm4Moe(nextn.NextNHooks, Family):
    model_types = ("glm4_moe",)
    architectures = ("Glm4MoeForCausalLM",)
    reads_sliding_window = False
    # vLLM's GLM MTP feeds each further guess its output as it is (no norm, unlike DeepSeek's).
    mtp_module, mtp_block, mtp_recycles_norm = "glm4_moe", "DecoderLayer", False

    def check_weights(self, config, where):
        _need(config, where, "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")


def _need(config: dict, where, *keys: str) -> None:
    missing = [k for k in keys if config.get(k) is None]
    if missing:
        raise ModelLoadError(f"{where}: a {config.get('model_type')} config needs {', '.join(missing)}")
