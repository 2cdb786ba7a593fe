"""The decode attention kernel's own device time at batch 1, against MLX's SDPA and an empty kernel.

At batch 1 a decode step of Qwen3-8B runs the paged decode kernel 36 times, at 14-15 us each
where MLX's SDPA over contiguous K/V takes 8 us (bench/README.md, kernel_profile). This script
times the kernel alone, as CUPTI sees it (torch's profiler), to tell its fixed cost from its cost
per key: over context lengths, and over the keys each lane-slot keeps in flight per loop step
(`keys_per_warp_step`, 4 by default at this GQA ratio). Beside it, per length: SDPA on the same
shapes, and a custom kernel that does nothing on the same grid (the floor of a launch).

Each call runs after a 256 MB elementwise pass, so the K/V rows come from memory as they do in a
step, where a layer's weights pass through the L2 cache between two attention calls.

On the GPU machine (a CUDA torch beside MLX's CUDA build):
    python3 bench/decode_kernel_profile.py [--contexts 16,128,512,2048] [--keys 1,2,4,8] [--calls 40] [--json out.json]
"""

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import torch
from torch.profiler import ProfilerActivity, profile

from metal_cluster.kernels import AttentionMetadata, gpu, gpu_backend

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16  # Qwen3-8B's attention
DTYPE = mx.bfloat16


def paged_inputs(ctx: int, seed: int = 0):
    """One request's query and a pool holding its context in shuffled blocks, as the runner lays it out."""
    rng = random.Random(seed)
    need = -(-ctx // BLOCK)
    ids = list(range(1, need + 1))
    rng.shuffle(ids)
    q = mx.random.normal((1, HEADS, HEAD_DIM)).astype(DTYPE)
    shape = (need + 1, BLOCK, KV_HEADS, HEAD_DIM)
    k_pool, v_pool = mx.random.normal(shape).astype(DTYPE), mx.random.normal(shape).astype(DTYPE)
    tables = mx.array([ids], dtype=mx.int32)
    mx.eval(q, k_pool, v_pool, tables)
    return q, k_pool, v_pool, tables


def metadata(ctx: int, tables: mx.array) -> AttentionMetadata:
    # A new object per variant: the kernels' launch plan is cached on it.
    return AttentionMetadata(cu_seqlens_q=mx.array([0, 1], dtype=mx.int32), seq_lens=mx.array([ctx], dtype=mx.int32),
                             block_tables=tables, block_size=BLOCK, query_lens_host=[1], seq_lens_host=[ctx])


def empty_kernel(backend: str):
    source = ("  if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = inp[0];\n"
              if backend == "cuda" else
              "  uint i = thread_position_in_grid.x;\n  if (i == 0) out[0] = inp[0];\n")
    make = mx.fast.cuda_kernel if backend == "cuda" else mx.fast.metal_kernel
    kernel = make(name="empty_launch", input_names=["inp"], output_names=["out"], source=source)
    return lambda x: kernel(inputs=[x], grid=(KV_HEADS * gpu.THREADS, 1, 1), threadgroup=(gpu.THREADS, 1, 1),
                            output_shapes=[(1,)], output_dtypes=[x.dtype])[0]


def device_times(fn, calls: int) -> dict[str, list[float]]:
    """Each kernel's device durations (us) over `calls` calls of fn, each after a pass that flushes L2."""
    flush = mx.zeros((128 << 20,), dtype=DTYPE)
    mx.eval(flush)
    for _ in range(3):
        mx.eval(fn())
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            mx.eval(flush + 1)
            mx.eval(fn())
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text()).get("traceEvents", [])
    times: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") == "kernel" and "dur" in e and "binary" not in e["name"].lower():
            times.setdefault(e["name"].split("(")[0][:80], []).append(e["dur"])
    return {n: d for n, d in times.items() if len(d) >= calls}


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {n: statistics.median(d) for n, d in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="16,128,512,2048")
    ap.add_argument("--keys", default="1,2,4,8", help="keys per lane-slot in flight per loop step")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    backend = gpu_backend()
    if backend != "cuda" or not torch.cuda.is_available():
        sys.exit("decode_kernel_profile: needs MLX's CUDA backend and a CUDA torch (CUPTI) on the same GPU")
    scale = HEAD_DIM ** -0.5
    rows = []
    default_keys = gpu.keys_per_warp_step
    empty = empty_kernel(backend)
    one = mx.zeros((1,), dtype=DTYPE)
    for ctx in [int(c) for c in args.contexts.split(",")]:
        q, k_pool, v_pool, tables = paged_inputs(ctx)
        row = dict(ctx=ctx, splits=gpu.plan_decode_splits(1, KV_HEADS, ctx, gpu.TARGET_THREADGROUPS[backend]))
        for u in [int(u) for u in args.keys.split(",")]:
            gpu.keys_per_warp_step = lambda gqa, u=u: u
            try:
                meta = metadata(ctx, tables)
                row[f"kernel_u{u}"] = medians(device_times(
                    lambda: gpu.paged_attention_kernel(q, k_pool, v_pool, meta, scale, backend=backend), args.calls))
            finally:
                gpu.keys_per_warp_step = default_keys
        qs = q.reshape(1, HEADS, 1, HEAD_DIM)
        k = mx.random.normal((1, KV_HEADS, ctx, HEAD_DIM)).astype(DTYPE)
        v = mx.random.normal((1, KV_HEADS, ctx, HEAD_DIM)).astype(DTYPE)
        mx.eval(k, v)
        row["sdpa"] = medians(device_times(lambda: mx.fast.scaled_dot_product_attention(qs, k, v, scale=scale), args.calls))
        row["empty"] = medians(device_times(lambda: empty(one), args.calls))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(dict(rows=rows, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                             mlx=mx.__version__), indent=2))


if __name__ == "__main__":
    main()
