"""Paged varlen attention: one API, dispatched by backend.

- Apple GPU (Metal): the kernels in `gpu.py` through `mx.fast.metal_kernel`;
- NVIDIA GPU (MLX's CUDA backend): the same kernels through `mx.fast.cuda_kernel`;
- anywhere else (MLX's CPU backend) and for shapes the kernels do not cover (`gpu.supports`): the
  reference in plain MLX ops, which is also the kernels' test oracle.

On a GPU, a batch's large prefill chunks (`PREFILL_KERNEL_MAX_WORK`) go to the reference, whose
per-request SDPA uses the matrix units, while its decodes and small chunks stay on the kernel.
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


# A multi-token request whose query x context work passes this takes MLX's SDPA (a gather, then
# tensor cores) through the reference, not the kernel's scalar tiles. Measured on an H200 at
# Qwen3-1.7B's attention shape: break-even near a 512-token prompt; at 2K the kernel is 2x slower.
PREFILL_KERNEL_MAX_WORK = 512 * 512


def paged_attention(q, k_pool, v_pool, meta: AttentionMetadata, scale: float, sliding_window=None):
    """Attention of packed queries `q` [total_q, H, D] over each request's paged context.

    `k_pool`/`v_pool` are one layer's pools, [num_blocks, block_size, kv_heads, D], already holding
    the K/V of this step's tokens. Returns [total_q, H, D].
    """
    backend = gpu_backend()
    if backend is None or not _fast.supports(q, k_pool, meta, v_pool):
        return paged_attention_reference(q, k_pool, v_pool, meta, scale, sliding_window)
    split = _split_large_prefills(meta)
    if split is None:
        return _fast.paged_attention_kernel(q, k_pool, v_pool, meta, scale, sliding_window, backend=backend)
    (small_rows, small), (large_rows, large), order = split
    if small is None:
        return paged_attention_reference(q, k_pool, v_pool, meta, scale, sliding_window)
    fast = _fast.paged_attention_kernel(q[small_rows], k_pool, v_pool, small, scale, sliding_window, backend=backend)
    slow = paged_attention_reference(q[large_rows], k_pool, v_pool, large, scale, sliding_window)
    return mx.concatenate([fast, slow], axis=0)[order]


def _split_large_prefills(meta: AttentionMetadata):
    """None when the kernel takes the whole batch; else ((rows, meta) for the kernel's requests
    (meta None if there are none), (rows, meta) for the large prefills, and the gather that puts
    the two outputs back in row order). Cached on the step's metadata, shared by every layer."""
    cache = meta.__dict__.setdefault("_paged_attention_split", {})
    if PREFILL_KERNEL_MAX_WORK not in cache:
        q_lens, ctx_lens = meta.query_lens_host, meta.seq_lens_host
        large = [r for r, (n, c) in enumerate(zip(q_lens, ctx_lens)) if n > 1 and n * c > PREFILL_KERNEL_MAX_WORK]
        if not large:
            cache[PREFILL_KERNEL_MAX_WORK] = None
        else:
            small = [r for r in range(len(q_lens)) if r not in set(large)]
            starts = [0]
            for n in q_lens:
                starts.append(starts[-1] + n)
            parts = [_sub_batch(meta, reqs, starts) if reqs else ([], None) for reqs in (small, large)]
            perm = parts[0][0] + parts[1][0]
            order = [0] * len(perm)
            for i, row in enumerate(perm):
                order[row] = i
            cache[PREFILL_KERNEL_MAX_WORK] = (
                (mx.array(parts[0][0], dtype=mx.int32), parts[0][1]),
                (mx.array(parts[1][0], dtype=mx.int32), parts[1][1]),
                mx.array(order, dtype=mx.int32),
            )
    return cache[PREFILL_KERNEL_MAX_WORK]


def _sub_batch(meta: AttentionMetadata, reqs: list[int], starts: list[int]):
    rows = [i for r in reqs for i in range(starts[r], starts[r + 1])]
    q_lens = [meta.query_lens_host[r] for r in reqs]
    ctx = [meta.seq_lens_host[r] for r in reqs]
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    sub = AttentionMetadata(
        cu_seqlens_q=mx.array(cu, dtype=mx.int32), seq_lens=mx.array(ctx, dtype=mx.int32),
        block_tables=meta.block_tables[mx.array(reqs, dtype=mx.int32)], block_size=meta.block_size,
        query_lens_host=q_lens, seq_lens_host=ctx,
    )
    return rows, sub


__all__ = ["AttentionMetadata", "PREFILL_KERNEL_MAX_WORK", "gpu_backend", "paged_attention", "paged_attention_reference"]
