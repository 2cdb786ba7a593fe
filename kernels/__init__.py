"""Paged varlen attention: one API, dispatched by backend.

- Apple GPU (Metal): the kernels in `gpu.py` through `mx.fast.metal_kernel`;
- NVIDIA GPU (MLX's CUDA backend): the same kernels through `mx.fast.cuda_kernel`;
- anywhere else (MLX's CPU backend) and for shapes the kernels do not cover (`gpu.supports`): the
  reference in plain MLX ops, which is also the kernels' test oracle.

On a GPU a mixed batch is served in up to three parts (`_split_batch`): its decodes by the decode
kernel, its small prompt chunks by the prefill kernel, and its large ones (`PREFILL_KERNEL_MAX_WORK`)
by the reference, whose per-request SDPA uses the matrix units.
"""

import mlx.core as mx

from metal_cluster.kernels import gdn as _gdn
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
# Decodes ride along in the prefill kernel's launch (one tile each, in parallel with the chunks'
# tiles) unless their contexts add up to more than this: splitting costs a few extra ops, which lost
# at 8 decodes x 1K beside a 128-token chunk (H200: 415 vs 271 us), while 31 decodes x 2K is 2-4x
# faster on the decode kernel.
DECODE_SPLIT_MIN_CONTEXT = 16384


def gated_delta(q, k, v, g, beta, state):
    """The Gated DeltaNet recurrence over T steps for B requests (shapes: `gdn.py`): the
    kernel on a GPU, mlx-lm's ops elsewhere (its reference). Returns (y, new float32 state)."""
    backend = gpu_backend()
    if backend is None or g.ndim != 3 or not _gdn.supports(q, v):
        from mlx_lm.models.gated_delta import gated_delta_ops

        return gated_delta_ops(q, k, v, g, beta, state)
    y, new_state = _gdn.gated_delta_kernel(q, k, v, g, beta, state, backend)
    return y, new_state


def paged_attention(q, k_pool, v_pool, meta: AttentionMetadata, scale: float, sliding_window=None, sinks=None,
                    v_dim: int | None = None):
    """Attention of packed queries `q` [total_q, H, D] over each request's paged context.

    `k_pool`/`v_pool` are one layer's pools, [num_blocks, block_size, kv_heads, D] or flat
    [num_blocks * block_size, kv_heads, D] (as the stage's pool keeps them: the kernels index
    slots themselves, so only the reference needs the blocked view), already holding the K/V of
    this step's tokens. `sinks` [H]: one learned logit per head that joins each softmax with no
    value (GPT-OSS). `v_dim` (with `v_pool` None): V is the leading v_dim values of each K row,
    read in place (MLA's latent entries; a slice of the pool would be copied per call, since the
    kernels take row-contiguous inputs). Returns [total_q, H, D], or [total_q, H, v_dim].
    """
    if v_dim is not None:
        if v_pool is not None:
            raise ValueError("paged_attention: pass v_pool=None with v_dim (V is then the K rows' leading values)")
    elif v_pool is None:
        raise ValueError("paged_attention: v_pool is None but no v_dim says where V is")
    backend = gpu_backend()
    route = _route(q, k_pool, v_pool, meta, backend, v_dim)
    if route == "reference":
        k_pool = _blocked(k_pool, meta)
        v = k_pool[..., :v_dim] if v_dim is not None else _blocked(v_pool, meta)
        return paged_attention_reference(q, k_pool, v, meta, scale, sliding_window, sinks)
    if route == "kernel":
        return _fast.paged_attention_kernel(q, k_pool, v_pool, meta, scale, sliding_window, backend=backend, sinks=sinks,
                                            v_dim=v_dim)
    parts, order = route
    outs = [
        paged_attention_reference(q[rows], _blocked(k_pool, meta), _blocked(v_pool, meta), sub, scale,
                                  sliding_window, sinks) if kind == "large"
        else _fast.paged_attention_kernel(q[rows], k_pool, v_pool, sub, scale, sliding_window, backend=backend,
                                          sinks=sinks)
        for kind, rows, sub in parts
    ]
    return mx.concatenate(outs, axis=0)[order]


def _route(q, k_pool, v_pool, meta: AttentionMetadata, backend: str | None, v_dim: int | None):
    """"reference", "kernel", or (parts, order) of a split batch (`_split_batch`). Decided by the
    first layer of a step with these shapes and kept on the step's metadata for the others."""
    routes = meta.__dict__.setdefault("_paged_attention_routes", {})
    key = (backend, q.shape, q.dtype, k_pool.shape, k_pool.dtype,
           None if v_pool is None else (v_pool.shape, v_pool.dtype), v_dim)
    route = routes.get(key)
    if route is None:
        if backend is None or not _fast.supports(q, k_pool, meta, v_pool, v_dim=v_dim):
            route = "reference"
        elif v_dim is not None:  # decodes only (supports says so): the decode kernel reads V in the K rows
            route = "kernel"
        else:
            split = _split_batch(meta)
            route = "kernel" if split is None else "reference" if split[1] is None else split
        routes[key] = route
    return route


def _blocked(pool, meta: AttentionMetadata):
    """A pool as [num_blocks, block_size, kv_heads, D] (a view of a flat one)."""
    return pool if pool.ndim == 4 else pool.reshape(-1, meta.block_size, *pool.shape[1:])


def _split_batch(meta: AttentionMetadata):
    """How a GPU batch is served. None: the kernel takes it whole. Else (parts, order): each part
    (kind, query rows, sub-batch metadata) is one of "decode" (single queries: the decode kernel,
    much faster per key than the tiled one), "chunk" (small multi-token queries, and decodes with
    little context beside them: the prefill kernel) or "large" (the reference); `order` gathers the parts' concatenated outputs back into
    row order, or is None when the reference takes the batch whole. Cached on the step's metadata,
    shared by every layer."""
    cache = meta.__dict__.setdefault("_paged_attention_split", {})
    if PREFILL_KERNEL_MAX_WORK in cache:
        return cache[PREFILL_KERNEL_MAX_WORK]
    groups = {"decode": [], "chunk": [], "large": []}
    for r, (n, c) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        if n == 1:
            groups["decode"].append(r)
        elif n > 1:
            groups["large" if n * c > PREFILL_KERNEL_MAX_WORK else "chunk"].append(r)
    if groups["chunk"] and not groups["large"] and \
            sum(meta.seq_lens_host[r] for r in groups["decode"]) <= DECODE_SPLIT_MIN_CONTEXT:
        groups["chunk"] = sorted(groups["chunk"] + groups["decode"])
        groups["decode"] = []
    used = [kind for kind, reqs in groups.items() if reqs]
    if len(used) <= 1:
        plan = None if used != ["large"] else ([], None)
    else:
        starts = [0]
        for n in meta.query_lens_host:
            starts.append(starts[-1] + n)
        parts, perm = [], []
        for kind in used:
            rows, sub = _sub_batch(meta, groups[kind], starts)
            parts.append((kind, mx.array(rows, dtype=mx.int32), sub))
            perm.extend(rows)
        order = [0] * len(perm)
        for i, row in enumerate(perm):
            order[row] = i
        plan = (parts, mx.array(order, dtype=mx.int32))
    cache[PREFILL_KERNEL_MAX_WORK] = plan
    return plan


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
