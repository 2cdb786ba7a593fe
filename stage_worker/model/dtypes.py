"""One compute dtype per stage: the model's own on a GPU, float32 on MLX's CPU backend.

On a GPU (Metal, CUDA) the model runs in the dtype it was trained and shipped in: bf16/fp16
activations, KV pool and hidden states, quantized weights kept quantized (their scales' dtype is
the compute dtype). On MLX's CPU backend bf16/fp16 are 5-40x slower than float32 and its
quantized matmul is slower than float32 with OpenBLAS, so there everything is float32.
"""

from collections import Counter

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_unflatten
from mlx_lm.utils import dequantize_model

NAMES = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}
BY_NAME = {name: dtype for dtype, name in NAMES.items()}


def on_gpu() -> bool:
    return mx.default_device().type == mx.DeviceType.gpu


def dtype_name(dtype: mx.Dtype) -> str:
    return NAMES[dtype]


def from_name(name: str) -> mx.Dtype:
    if name not in BY_NAME:
        raise ValueError(f"unknown dtype {name!r} (one of {', '.join(BY_NAME)})")
    return BY_NAME[name]


def weights_dtype(weights: dict[str, mx.array]) -> mx.Dtype:
    """The dtype a checkpoint computes in: its scales' if it is quantized, else the floating dtype
    most of its values are stored in (norms kept in float32 beside bf16 matrices do not count)."""
    scales = [v.dtype for k, v in weights.items() if k.endswith(".scales")]
    if scales:
        return Counter(scales).most_common(1)[0][0]
    sizes = Counter()
    for v in weights.values():
        if v.dtype in NAMES:
            sizes[v.dtype] += v.size
    return sizes.most_common(1)[0][0] if sizes else mx.float32


def compute_dtype(weights: dict[str, mx.array], gpu: bool | None = None) -> mx.Dtype:
    gpu = on_gpu() if gpu is None else gpu
    return weights_dtype(weights) if gpu else mx.float32


def model_weights(model: nn.Module) -> dict[str, mx.array]:
    return dict(tree_flatten(model.parameters()))


def settle(model: nn.Module, dtype: mx.Dtype) -> None:
    """Cast the model to its stage's compute dtype, in place (lazily: nothing is read yet), every
    parameter in its own row-major buffer.

    Parameters the model's `cast_predicate` excludes keep their stored dtype, as mlx-lm keeps them
    (DeepSeek V3's and GLM's float32 routing biases: rounded, they would pick other experts).
    float32 (the CPU path) also dequantizes: scales go to float32 first, so the values are exact.

    Own buffers: mlx-lm's sanitize splits fused checkpoint tensors into strided views (Qwen3.5-MoE's
    experts.gate_up_proj into gate and up halves), and a cast to the dtype they have keeps them views,
    as on a GPU. MLX's CUDA gather_mm reads such a strided expert stack wrongly once the routed rows
    are sorted by expert (64 or more: packed batches, long prompts); measured on the H200, the first
    MoE layer's output was noise (bench/README.md). mx.contiguous is a no-op for the others."""
    cast = getattr(model, "cast_predicate", None)
    if cast is None:
        model.set_dtype(dtype)
    else:
        model.update(tree_unflatten([(k, v.astype(dtype)) for k, v in tree_flatten(model.parameters())
                                     if cast(k) and mx.issubdtype(v.dtype, mx.floating)]), strict=False)
    if dtype == mx.float32:
        dequantize_model(model)
    model.update(tree_map(mx.contiguous, model.parameters()))
