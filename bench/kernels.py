#!/usr/bin/env python3
"""Paged attention kernels on the GPU: the kernel vs MLX's SDPA, and a Qwen3-1.7B-shaped decode.

1. Attention alone: `metal_cluster.kernels.gpu` (paged, shuffled blocks) against
   `mx.fast.scaled_dot_product_attention` over contiguous K/V of the same shapes (Qwen3-1.7B's
   attention: 16 heads, 8 kv heads, head dim 128, bf16), decode and causal prefill.
   MLA's absorbed decode (`--sections mla`): DeepSeek-V2-Lite / V3 shapes, kernel vs reference vs SDPA.
2. Decode tokens/s of a random-weight Qwen3-1.7B-shaped model (bf16) through the stage runner
   (kernel; and the MLX-ops reference for scale) against mlx-lm's own generation (`generate_step`
   at batch 1, `BatchGenerator` at batch 32).

Run on a GPU machine:  python bench/kernels.py [--json out.json] [--quick]
"""

import argparse
import importlib
import json
import random
import sys
import time
from pathlib import Path

import mlx.core as mx

from metal_cluster.kernels import AttentionMetadata, gpu_backend, paged_attention, paged_attention_reference
from metal_cluster.stage_worker.families import REGISTRY

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 16
DTYPE = mx.bfloat16
QWEN3_1_7B = dict(
    model_type="qwen3", hidden_size=2048, num_hidden_layers=28, intermediate_size=6144,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
    vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=True,
)


def time_per_call(fn, iters: int, warmup: int = 3) -> float:
    """Seconds per call: `iters` independent calls queued lazily and evaluated together, so the
    host-side sync is paid once (what a model's forward pass sees), after a compile warm-up."""
    for _ in range(warmup):
        mx.eval(fn())
    t0 = time.perf_counter()
    mx.eval([fn() for _ in range(iters)])
    return (time.perf_counter() - t0) / iters


# --- 1. attention alone ---------------------------------------------------------------------

def paged_inputs(q_lens, ctx_lens, seed=0, heads=HEADS):
    """Random q and a paged pool holding each request's context in shuffled blocks."""
    rng = random.Random(seed)
    need = [-(-c // BLOCK) for c in ctx_lens]
    num_blocks = 1 + sum(need)
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at : at + n] + [0] * (max(need) - n))
        at += n
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    q = mx.random.normal((cu[-1], heads, HEAD_DIM)).astype(DTYPE)
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_pool, v_pool = mx.random.normal(shape).astype(DTYPE), mx.random.normal(shape).astype(DTYPE)
    meta = AttentionMetadata(
        cu_seqlens_q=mx.array(cu, dtype=mx.int32), seq_lens=mx.array(ctx_lens, dtype=mx.int32),
        block_tables=mx.array(tables, dtype=mx.int32), block_size=BLOCK,
        query_lens_host=list(q_lens), seq_lens_host=list(ctx_lens),
    )
    mx.eval(q, k_pool, v_pool)
    return q, k_pool, v_pool, meta


def bench_decode(batch: int, ctx: int, iters: int) -> dict:
    scale = HEAD_DIM ** -0.5
    q, k_pool, v_pool, meta = paged_inputs([1] * batch, [ctx] * batch)
    paged = time_per_call(lambda: paged_attention(q, k_pool, v_pool, meta, scale), iters)
    qs = mx.random.normal((batch, HEADS, 1, HEAD_DIM)).astype(DTYPE)
    k = mx.random.normal((batch, KV_HEADS, ctx, HEAD_DIM)).astype(DTYPE)
    v = mx.random.normal((batch, KV_HEADS, ctx, HEAD_DIM)).astype(DTYPE)
    mx.eval(qs, k, v)
    sdpa = time_per_call(lambda: mx.fast.scaled_dot_product_attention(qs, k, v, scale=scale), iters)
    return dict(batch=batch, ctx=ctx, paged_us=paged * 1e6, sdpa_us=sdpa * 1e6, ratio=paged / sdpa)


def bench_prefill(length: int, iters: int) -> dict:
    """`paged` is what paged_attention dispatches to (the kernel up to PREFILL_KERNEL_MAX_WORK, then
    the reference); `kernel` the prefill kernel itself."""
    scale = HEAD_DIM ** -0.5
    q, k_pool, v_pool, meta = paged_inputs([length], [length])
    paged = time_per_call(lambda: paged_attention(q, k_pool, v_pool, meta, scale), iters)
    fast = importlib.import_module("metal_cluster.kernels.gpu")
    kernel = time_per_call(lambda: fast.paged_attention_kernel(q, k_pool, v_pool, meta, scale, backend=gpu_backend()), iters)
    qs = mx.random.normal((1, HEADS, length, HEAD_DIM)).astype(DTYPE)
    k = mx.random.normal((1, KV_HEADS, length, HEAD_DIM)).astype(DTYPE)
    v = mx.random.normal((1, KV_HEADS, length, HEAD_DIM)).astype(DTYPE)
    mx.eval(qs, k, v)
    sdpa = time_per_call(lambda: mx.fast.scaled_dot_product_attention(qs, k, v, scale=scale, mask="causal"), iters)
    ref = time_per_call(lambda: paged_attention_reference(q, k_pool, v_pool, meta, scale), iters)
    return dict(length=length, paged_us=paged * 1e6, kernel_us=kernel * 1e6, reference_us=ref * 1e6,
                sdpa_us=sdpa * 1e6, kernel_ratio=kernel / sdpa, paged_ratio=paged / sdpa)


def bench_mixed(decodes: int, ctx: int, chunk: int, iters: int) -> dict:
    """A continuous-batching step: `decodes` requests decoding at `ctx`, plus one prompt chunk of
    `chunk` new tokens at the end of a `ctx`-token context. The kernel alone, paged_attention's
    dispatch (which sends large chunks to the reference) and the MLX-ops reference alone."""
    scale = HEAD_DIM ** -0.5
    q, k_pool, v_pool, meta = paged_inputs([1] * decodes + [chunk], [ctx] * (decodes + 1))
    fast = importlib.import_module("metal_cluster.kernels.gpu")
    kernel = time_per_call(lambda: fast.paged_attention_kernel(q, k_pool, v_pool, meta, scale, backend=gpu_backend()), iters)
    paged = time_per_call(lambda: paged_attention(q, k_pool, v_pool, meta, scale), iters)
    ref = time_per_call(lambda: paged_attention_reference(q, k_pool, v_pool, meta, scale), iters)
    return dict(decodes=decodes, ctx=ctx, chunk=chunk, kernel_us=kernel * 1e6, paged_us=paged * 1e6,
                reference_us=ref * 1e6)


def bench_mla_decode(heads: int, batch: int, ctx: int, iters: int) -> dict:
    """MLA's absorbed decode (DeepSeek-V2-Lite: 16 heads, V3: 128; one 576-wide latent entry per
    token, V its first 512 values): the decode kernel through `paged_attention(..., v_dim=512)`,
    the MLX-ops reference it replaces, and MLX's SDPA over a contiguous cache (mlx-lm's own path)."""
    dim, latent, scale = 576, 512, 192 ** -0.5
    need = -(-ctx // BLOCK)
    ids = list(range(1, 1 + batch * need))
    random.Random(0).shuffle(ids)
    meta = AttentionMetadata(
        cu_seqlens_q=mx.arange(batch + 1, dtype=mx.int32), seq_lens=mx.array([ctx] * batch, dtype=mx.int32),
        block_tables=mx.array([ids[r * need : (r + 1) * need] for r in range(batch)], dtype=mx.int32),
        block_size=BLOCK, query_lens_host=[1] * batch, seq_lens_host=[ctx] * batch,
    )
    q = mx.random.normal((batch, heads, dim)).astype(DTYPE)
    pool = mx.random.normal((1 + batch * need, BLOCK, 1, dim)).astype(DTYPE)
    mx.eval(q, pool)
    kernel = time_per_call(lambda: paged_attention(q, pool, None, meta, scale, v_dim=latent), iters)
    ref = time_per_call(lambda: paged_attention_reference(q, pool, pool[..., :latent], meta, scale), iters)
    qs = q[:, :, None, :]
    k = mx.random.normal((batch, 1, ctx, dim)).astype(DTYPE)
    mx.eval(qs, k)
    sdpa = time_per_call(lambda: mx.fast.scaled_dot_product_attention(qs, k, k[..., :latent], scale=scale), iters)
    return dict(heads=heads, batch=batch, ctx=ctx, kernel_us=kernel * 1e6, reference_us=ref * 1e6,
                sdpa_us=sdpa * 1e6, kernel_vs_sdpa=kernel / sdpa)


def sweep_decode(iters: int) -> list[dict]:
    """Decode-kernel tuning knobs (keys in flight per slot, split-KV threadgroup target) per shape."""
    fast = importlib.import_module("metal_cluster.kernels.gpu")
    backend = gpu_backend()
    saved = fast.keys_per_warp_step, dict(fast.TARGET_THREADGROUPS)
    rows = []
    try:
        for batch, ctx in [(1, 4096), (8, 4096), (32, 2048), (32, 4096), (64, 4096)]:
            q, k_pool, v_pool, meta = paged_inputs([1] * batch, [ctx] * batch)
            for u in (2, 4, 8):
                for target in (1024, 2048, 4096):
                    fast.keys_per_warp_step = lambda gqa, u=u: u
                    fast.TARGET_THREADGROUPS[backend] = target
                    t = time_per_call(lambda: fast.paged_attention_kernel(q, k_pool, v_pool, meta, HEAD_DIM ** -0.5,
                                                                          backend=backend), iters)
                    rows.append(dict(batch=batch, ctx=ctx, keys_per_step=u, target=target, us=t * 1e6))
                    print(f"sweep {rows[-1]}", flush=True)
    finally:
        fast.keys_per_warp_step = saved[0]
        fast.TARGET_THREADGROUPS.update(saved[1])
    return rows


# --- 2. model decode ------------------------------------------------------------------------

def random_model():
    from mlx_lm.models import qwen3

    model = qwen3.Model(qwen3.ModelArgs(**QWEN3_1_7B))
    model.set_dtype(DTYPE)
    mx.eval(model.parameters())
    return model


def prompts(batch: int, length: int, seed: int = 0):
    rng = random.Random(seed)
    return [[rng.randrange(1000, 100_000) for _ in range(length)] for _ in range(batch)]


def mlx_lm_batch1(model, prompt, warm: int, steps: int) -> float:
    from mlx_lm.generate import generate_step

    t0 = None
    for i, _ in enumerate(generate_step(mx.array(prompt), model, max_tokens=warm + steps)):
        if i == warm - 1:
            t0 = time.perf_counter()
    return steps / (time.perf_counter() - t0)


def mlx_lm_batched(model, batch_prompts, warm: int, steps: int) -> float:
    from mlx_lm.generate import BatchGenerator

    n = len(batch_prompts)
    gen = BatchGenerator(model, max_tokens=warm + steps + 1, completion_batch_size=n, prefill_batch_size=n)
    gen.insert(batch_prompts)
    done = 0
    while done < warm:  # prefill, then a few decode steps
        if len(gen.next_generated()) == n:
            done += 1
    t0 = time.perf_counter()
    tokens = 0
    for _ in range(steps):
        tokens += len(gen.next_generated())
    dt = time.perf_counter() - t0
    gen.close()
    return tokens / dt


def runner_tokens_per_s(model, batch_prompts, warm: int, steps: int, attention=None) -> float:
    """Decode through StageRunner, driven by the tests' scheduler double (greedy sampling)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from scheduler_double import SchedulerDouble

    attn_mod = importlib.import_module("metal_cluster.stage_worker.step.attention")
    from metal_cluster.stage_worker.kv.paged_kv import KVPool
    from metal_cluster.stage_worker.step.runner import StageRunner
    from metal_cluster.stage_worker.model.shard import ModelShard

    saved = attn_mod.paged_attention
    if attention is not None:
        attn_mod.paged_attention = attention
    try:
        n = len(batch_prompts)
        max_len = len(batch_prompts[0]) + warm + steps + 2
        num_blocks = 1 + n * -(-max_len // BLOCK) + 8
        layers = QWEN3_1_7B["num_hidden_layers"]
        family = REGISTRY["qwen3"]
        caches = family.layer_caches(QWEN3_1_7B)
        shard = ModelShard(model=model, config=QWEN3_1_7B, start=0, end=layers, num_layers=layers,
                           family=family, caches=caches, dtype=DTYPE)
        pool = KVPool.allocate(caches, num_blocks, BLOCK, DTYPE)
        runner = StageRunner(shard, pool)
        sched = SchedulerDouble(lambda step: {r: s.token_id for r, s in runner.step(step).sampled.items()},
                                num_blocks, BLOCK)
        for i, p in enumerate(batch_prompts):
            sched.add(f"r{i}", p, warm + steps + 1)
        for _ in range(1 + warm):  # prefill step, then warm-up decodes
            sched.step()
        t0 = time.perf_counter()
        tokens = 0
        for _ in range(steps):
            _, sampled = sched.step()
            tokens += len(sampled)
        return tokens / (time.perf_counter() - t0)
    finally:
        attn_mod.paged_attention = saved


def bench_model(batches, prompt_len: int, warm: int, steps: int, with_reference: bool) -> list[dict]:
    model = random_model()
    rows = []
    baseline = {}
    for b in batches:  # mlx-lm first: wrapping replaces the model's attention modules in place
        ps = prompts(b, prompt_len)
        baseline[b] = mlx_lm_batch1(model, ps[0], warm, steps) if b == 1 else mlx_lm_batched(model, ps, warm, steps)
    family = REGISTRY["qwen3"]
    for layer, cache in zip(model.model.layers, family.layer_caches(QWEN3_1_7B)):
        layer.self_attn = family.paged_attention(layer.self_attn, cache)
    for b in batches:
        ps = prompts(b, prompt_len)
        row = dict(batch=b, mlx_lm_tok_s=baseline[b], runner_kernel_tok_s=runner_tokens_per_s(model, ps, warm, steps))
        if with_reference:
            row["runner_reference_tok_s"] = runner_tokens_per_s(model, ps, warm, steps, attention=paged_attention_reference)
        row["ratio"] = row["runner_kernel_tok_s"] / row["mlx_lm_tok_s"]
        rows.append(row)
        print(f"model decode batch {b}: {row}", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the results here too")
    ap.add_argument("--quick", action="store_true", help="fewer shapes and steps")
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also sweep the decode kernel's tuning knobs")
    ap.add_argument("--sections", default="decode,prefill,mixed,mla,model", help="comma-separated subset to run")
    args = ap.parse_args()
    backend = gpu_backend()
    if backend is None:
        sys.exit("bench/kernels.py needs a GPU (Metal or CUDA): on the CPU paged_attention is the reference")
    print(f"backend={backend} device={mx.default_device()} mlx={mx.__version__}", flush=True)
    results = dict(backend=backend, decode=[], prefill=[], mixed=[], mla=[], model=[])
    if args.sweep:
        results["sweep"] = sweep_decode(iters=50)
    batches = [1, 8, 32, 64] if not args.quick else [1, 32]
    ctxs = [512, 1024, 2048, 4096] if not args.quick else [512, 4096]
    sections = set(args.sections.split(","))
    for b in batches if "decode" in sections else []:
        for c in ctxs:
            try:
                row = bench_decode(b, c, iters=50)
            except Exception as e:  # keep the other shapes' numbers
                row = dict(batch=b, ctx=c, error=repr(e))
            results["decode"].append(row)
            print(f"decode {row}", flush=True)
    for length in ([128, 512, 2048, 4096] if not args.quick else [2048]) if "prefill" in sections else []:
        try:
            row = bench_prefill(length, iters=10)
        except Exception as e:
            row = dict(length=length, error=repr(e))
        results["prefill"].append(row)
        print(f"prefill {row}", flush=True)
    mixed = [(31, 2048, 512), (8, 1024, 128), (63, 4096, 256), (63, 1024, 64)] if not args.quick else [(31, 2048, 512)]
    for decodes, ctx, chunk in mixed if "mixed" in sections else []:
        try:
            row = bench_mixed(decodes, ctx, chunk, iters=20)
        except Exception as e:
            row = dict(decodes=decodes, ctx=ctx, chunk=chunk, error=repr(e))
        results["mixed"].append(row)
        print(f"mixed {row}", flush=True)
    mla = [(h, b, c) for h in (16, 128) for b in ((1, 32) if args.quick else (1, 8, 32)) for c in (1024, 4096)]
    for heads, b, c in mla if "mla" in sections else []:
        try:
            row = bench_mla_decode(heads, b, c, iters=20)
        except Exception as e:
            row = dict(heads=heads, batch=b, ctx=c, error=repr(e))
        results["mla"].append(row)
        print(f"mla {row}", flush=True)
    if not args.skip_model and "model" in sections:
        try:
            results["model"] = bench_model([1, 32], prompt_len=128, warm=4, steps=32 if not args.quick else 16,
                                           with_reference=True)
        except Exception as e:
            import traceback
            traceback.print_exc()
            results["model_error"] = repr(e)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
