"""Qwen3.5 (qwen3_5; qwen3_5_moe with Qwen3-Next's MoE blocks): Qwen3-Next's layer pattern, gated
attention and state pools, with two differences mlx-lm's qwen3_5 module has.

- The language model sits inside a vision-language checkpoint: its config under `text_config`
  (`model_source.text_config` lays it over the top level), its modules under
  `model.language_model` (mlx-lm's Model wraps a TextModel as `language_model`; its sanitize drops
  the vision tower and the multi-token-prediction head, as `model_source.text_tensor_name` does). A
  stage keeps the TextModel alone.
- The Gated DeltaNet's projections are kept apart: in_proj_qkv (the convolution's input, already in
  q, k, v order), in_proj_z, in_proj_b, in_proj_a.

RoPE comes from `rope_parameters` (partial rotary, an mrope_section): text-only positions are the
same on all three M-RoPE axes, which makes it plain RoPE over the rotary part, as mlx-lm runs it.
"""

import mlx.core as mx
import mlx.nn as nn

from metal_cluster.stage_worker.families.qwen3_next import PagedGatedDeltaNet, Qwen3Next


class Qwen3_5(Qwen3Next):
    model_types = ("qwen3_5", "qwen3_5_moe")
    architectures = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")

    @staticmethod
    def language_model(model: nn.Module) -> nn.Module:
        return model.language_model

    @staticmethod
    def paged_recurrence(linear_attn: nn.Module) -> nn.Module:
        return PagedQwen3_5GatedDeltaNet(linear_attn)


class PagedQwen3_5GatedDeltaNet(PagedGatedDeltaNet):
    def project(self, x):
        a = self.inner
        B, S, _ = x.shape
        z = a.in_proj_z(x).reshape(B, S, a.num_v_heads, a.head_v_dim)
        return a.in_proj_qkv(x), z, a.in_proj_b(x), a.in_proj_a(x)
