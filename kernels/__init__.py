"""Paged varlen attention: one API, dispatched by backend.

- Apple GPU (Metal): the kernels in `gpu.py` through `mx.fast.metal_kernel`;
- NVIDIA GPU (MLX's CUDA backend): the same kernels through `mx.fast.cuda_kernel`;
- anywhere else (MLX's CPU backend) and for shapes the kernels do not cover (`gpu.supports`): the
  reference in plain MLX ops, which is also the kernels' test oracle.
"""

import mlx.core as mx

from metal_cluster.kernels import gpu as _fast
from metal_cluster.kernels.metadata import AttentionMetadata
from metal_cluster.kernels.reference import paged_attention_reference


def gpu_backend() -> str | None:
    """'metal' or 'cuda' when MLX runs on that GPU by default, else None (the CPU backend)."""
    if mx.default_device().type != mx.DeviceType.gpu:
        return None
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return None


def paged_attention(q, k_pool, v_pool, meta: AttentionMetadata, scale: float, sliding_window=None):
    """Attention of packed queries `q` [total_q, H, D] over each request's paged context.

    `k_pool`/`v_pool` are one layer's pools, [num_blocks, block_size, kv_heads, D], already holding
    the K/V of this step's tokens. Returns [total_q, H, D].
    """
    backend = gpu_backend()
    if backend is not None and _fast.supports(q, k_pool, meta, v_pool):
        return _fast.paged_attention_kernel(q, k_pool, v_pool, meta, scale, sliding_window, backend=backend)
    return paged_attention_reference(q, k_pool, v_pool, meta, scale, sliding_window)


__all__ = ["AttentionMetadata", "gpu_backend", "paged_attention", "paged_attention_reference"]
