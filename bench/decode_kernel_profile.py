"""The decode attention kernel's own device time at batch 1, against MLX's SDPA and an empty kernel.

At batch 1 a decode step of Qwen3-8B runs the paged decode kernel 36 times, at 14-15 us each
where MLX's SDPA over contiguous K/V takes 8 us (bench/README.md, kernel_profile). This script
times the kernel alone, as CUPTI sees it (torch's profiler), to tell its fixed cost from its cost
per key: over context lengths, over the keys each lane-slot keeps in flight per loop step
(`keys_per_warp_step`, 4 by default at this GQA ratio) and over the warps per threadgroup
(`decode_warps`). Beside it, per length: SDPA on the same
shapes, and a custom kernel that does nothing on the same grid (the floor of a launch).

Each call runs after a 256 MB elementwise pass, so the K/V rows come from memory as they do in a
step, where a layer's weights pass through the L2 cache between two attention calls.

On the GPU machine (a CUDA torch beside MLX's CUDA build):
    python3 bench/decode_kernel_profile.py [--contexts 16,128,512,2048] [--keys 1,2,4,8] [--warps 4,8,16]
        [--calls 40] [--json out.json]
"""

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import mlx.core as mx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernel_profile  # noqa: E402
import kernels as attention_bench  # noqa: E402  (bench/kernels.py: its paged inputs)

from metal_cluster.kernels import gpu, gpu_backend  # noqa: E402

HEADS = 32  # Qwen3-8B's attention; kv heads, head dim, block size and dtype as bench/kernels.py's
KV_HEADS, HEAD_DIM, DTYPE = attention_bench.KV_HEADS, attention_bench.HEAD_DIM, attention_bench.DTYPE


def empty_kernel():
    kernel = mx.fast.cuda_kernel(name="empty_launch", input_names=["inp"], output_names=["out"],
                                 source="  if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = inp[0];\n")
    return lambda x: kernel(inputs=[x], grid=(KV_HEADS * gpu.THREADS, 1, 1), threadgroup=(gpu.THREADS, 1, 1),
                            output_shapes=[(1,)], output_dtypes=[x.dtype])[0]


def device_times(fn, calls: int) -> dict[str, float]:
    """Each kernel's median device time (us) over `calls` calls of fn, each after a pass that
    flushes L2 (its own kernel left out)."""
    flush = mx.zeros((128 << 20,), dtype=DTYPE)
    mx.eval(flush)

    def step():
        mx.eval(flush + 1)
        mx.eval(fn())

    _, events = kernel_profile.record(step, calls, warm=3)
    times: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") == "kernel" and "binary" not in e["name"].lower():
            times.setdefault(kernel_profile.short_name(e, by_grid=False), []).append(e["dur"])
    return {n: statistics.median(d) for n, d in times.items() if len(d) >= calls}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="16,128,512,2048")
    ap.add_argument("--keys", default="1,2,4,8", help="keys per lane-slot in flight per loop step")
    ap.add_argument("--warps", default="", help="warps per threadgroup to sweep (default: what decode_warps picks)")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    backend = gpu_backend()
    if backend != "cuda" or not torch.cuda.is_available():
        sys.exit("decode_kernel_profile: needs MLX's CUDA backend and a CUDA torch (CUPTI) on the same GPU")
    scale = HEAD_DIM ** -0.5
    rows = []
    default_keys, default_warps = gpu.keys_per_warp_step, gpu.decode_warps
    warps = [int(w) for w in args.warps.split(",")] if args.warps else [None]
    empty = empty_kernel()
    one = mx.zeros((1,), dtype=DTYPE)
    for ctx in [int(c) for c in args.contexts.split(",")]:
        q, k_pool, v_pool, step_meta = attention_bench.paged_inputs([1], [ctx], heads=HEADS)
        row = dict(ctx=ctx, splits=gpu.plan_decode_splits(1, KV_HEADS, ctx, gpu.TARGET_THREADGROUPS[backend]))
        for w in warps:
            for u in [int(u) for u in args.keys.split(",")]:
                gpu.keys_per_warp_step = lambda gqa, u=u: u
                if w is not None:
                    gpu.decode_warps = lambda *_, w=w: w
                key = f"kernel_u{u}" + (f"_w{w}" if w else "")
                try:
                    meta = dataclasses.replace(step_meta)  # a fresh object: the launch plan is cached on it
                    row[key] = device_times(
                        lambda: gpu.paged_attention_kernel(q, k_pool, v_pool, meta, scale, backend=backend), args.calls)
                except RuntimeError as e:  # a layout whose registers do not fit `w` warps on one SM
                    row[key] = dict(error=str(e)[:200])
                finally:
                    gpu.keys_per_warp_step, gpu.decode_warps = default_keys, default_warps
        qs = q.reshape(1, HEADS, 1, HEAD_DIM)
        k = mx.random.normal((1, KV_HEADS, ctx, HEAD_DIM)).astype(DTYPE)
        v = mx.random.normal((1, KV_HEADS, ctx, HEAD_DIM)).astype(DTYPE)
        mx.eval(k, v)
        row["sdpa"] = device_times(lambda: mx.fast.scaled_dot_product_attention(qs, k, v, scale=scale), args.calls)
        row["empty"] = device_times(lambda: empty(one), args.calls)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(dict(rows=rows, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                             mlx=mx.__version__), indent=2))


if __name__ == "__main__":
    main()
