"""The class vLLM's model registry resolves for our architectures. It is never called: the cluster
executor runs the model on MLX. Its methods exist only so vLLM classifies it as a text generator."""

import torch.nn as nn


class MLXExecutedModel(nn.Module):
    # Pipeline stages are ours (MLX workers); vLLM only needs to know PP is allowed to schedule for it.
    supports_pp = True
    # LoRA runs on the stages (stage_worker/step/lora.py); vLLM only checks that the model declares it.
    supports_lora = True
    packed_modules_mapping: dict[str, list[str]] = {}
    embedding_modules: dict[str, str] = {}

    def __init__(self, *, vllm_config=None, prefix: str = ""):
        super().__init__()

    def embed_input_ids(self, input_ids):
        raise NotImplementedError("metal-cluster runs the model on MLX stages, not in torch")

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        raise NotImplementedError("metal-cluster runs the model on MLX stages, not in torch")

    def compute_logits(self, hidden_states):
        raise NotImplementedError("metal-cluster runs the model on MLX stages, not in torch")

    def make_empty_intermediate_tensors(self, batch_size, dtype, device):
        raise NotImplementedError("metal-cluster stages pass hidden states over the MLX ring, not torch")


class MLXExecutedHybridModel(MLXExecutedModel):
    """A model with recurrent (Gated DeltaNet) layers beside attention: vLLM then runs its hybrid
    KV cache manager over MambaSpec groups and, with prefix caching, its "align" mamba mode."""

    is_hybrid = True
