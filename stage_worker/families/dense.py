"""Llama-style decoders: llama (and mistral, which mlx-lm runs as llama), qwen2, qwen3.

Their attention modules carry n_heads / n_kv_heads / scale / rope and q/k/v/o projections (Qwen3
adds q/k norms); the MLP is whatever the block holds. Llama alternates sliding and full layers by
`layer_types`; mlx-lm's qwen2/qwen3 have no sliding window, so neither do we.
"""

from metal_cluster.stage_worker.families.base import Family


class Llama(Family):
    model_types = ("llama", "mistral")
    architectures = ("LlamaForCausalLM", "MistralForCausalLM")
    fuses_projections = True


class Qwen(Family):
    model_types = ("qwen2", "qwen3")
    architectures = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
    reads_sliding_window = False
    fuses_projections = True
