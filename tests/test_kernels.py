"""Paged attention kernels (Metal / CUDA) against the MLX-ops reference.

The kernel comparisons need a GPU (Metal on a Mac, CUDA on NVIDIA) and skip elsewhere; the pure
Python parts (split planner, tile search, per-backend source generation, CPU dispatch) run anywhere.
"""

import importlib
import random
import re
import zlib

import mlx.core as mx
import numpy as np
import pytest

from metal_cluster.kernels import (
    PREFILL_KERNEL_MAX_WORK, AttentionMetadata, gpu_backend, paged_attention, paged_attention_reference,
)

pa = importlib.import_module("metal_cluster.kernels.gpu")

BACKEND = gpu_backend()
requires_gpu = pytest.mark.skipif(
    BACKEND is None,
    reason="no Metal or CUDA GPU: MLX runs on its CPU backend here, where paged_attention uses the reference",
)


# --- building random paged batches --------------------------------------------------------

def make_batch(seed, specs, heads, kv_heads, head_dim, block_size, dtype, spare_blocks=7):
    """specs: [(query_len, context_len)] per request. Block ids are shuffled and non-contiguous."""
    rng = random.Random(seed)
    need = [-(-ctx // block_size) for _, ctx in specs]
    num_blocks = 1 + sum(need) + spare_blocks
    ids = list(range(1, num_blocks))  # block 0 is the null block
    rng.shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at : at + n])
        at += n
    width = max(need)
    padded = [t + [0] * (width - len(t)) for t in tables]
    key = mx.random.key(seed)
    kq, kk, kv = mx.random.split(key, 3)
    total_q = sum(n for n, _ in specs)
    q = mx.random.normal((total_q, heads, head_dim), key=kq).astype(dtype)
    flat_shape = (num_blocks * block_size, kv_heads, head_dim)
    k_pool = mx.random.normal(flat_shape, key=kk).astype(dtype).reshape(num_blocks, block_size, kv_heads, head_dim)
    v_pool = mx.random.normal(flat_shape, key=kv).astype(dtype).reshape(num_blocks, block_size, kv_heads, head_dim)
    cu = [0]
    for n, _ in specs:
        cu.append(cu[-1] + n)
    meta = AttentionMetadata(
        cu_seqlens_q=mx.array(cu, dtype=mx.int32),
        seq_lens=mx.array([c for _, c in specs], dtype=mx.int32),
        block_tables=mx.array(padded, dtype=mx.int32),
        block_size=block_size,
        query_lens_host=[n for n, _ in specs],
        seq_lens_host=[c for _, c in specs],
    )
    mx.eval(q, k_pool, v_pool)
    return q, k_pool, v_pool, meta


def reference_f32(q, k_pool, v_pool, meta, scale, window, sinks=None):
    """The oracle in float32 on the CPU, from the same (possibly bf16-rounded) inputs."""
    with mx.stream(mx.cpu):
        f32 = [a.astype(mx.float32) for a in (q, k_pool, v_pool)]
        out = paged_attention_reference(*f32, meta, scale, window, None if sinks is None else sinks.astype(mx.float32))
        mx.eval(out)
    return np.array(out)


TOLERANCE = {mx.float32: dict(atol=3e-4, rtol=2e-3), mx.bfloat16: dict(atol=2e-2, rtol=2e-2)}

# (id, specs [(q_len, ctx)], heads, kv_heads, head_dim, block_size, dtype, window)
CASES = [
    ("decode-mha-d64-bs8", [(1, c) for c in (1, 7, 8, 9, 63, 300, 1000)], 4, 4, 64, 8, mx.float32, None),
    ("decode-gqa2-d128-bs16-batch64", [(1, 1 + (i * 97) % 2048) for i in range(64)], 16, 8, 128, 16, mx.bfloat16, None),
    ("decode-split-gqa4-d128-bs32-4k", [(1, 4096)], 16, 4, 128, 32, mx.float32, None),
    ("decode-split-gqa2-d128-bs16", [(1, 3000), (1, 17), (1, 4096)], 16, 8, 128, 16, mx.bfloat16, None),
    ("decode-split-gqa8-d64-bs16-window", [(1, 4000), (1, 600), (1, 1)], 16, 2, 64, 16, mx.bfloat16, 512),
    ("decode-window-mha-d64-bs32", [(1, c) for c in (5, 100, 2500)], 8, 8, 64, 32, mx.float32, 64),
    ("decode-split-gqa32-tiled-d128-bs16", [(1, 3000), (1, 70), (1, 1)], 32, 1, 128, 16, mx.bfloat16, None),
    ("prefill-gqa2-d128-bs16", [(1000, 1000)], 16, 8, 128, 16, mx.bfloat16, None),
    ("prefill-chunk-mha-d128-bs16", [(512, 4096), (300, 300)], 4, 4, 128, 16, mx.float32, None),
    ("mixed-gqa4-d64-bs8", [(37, 300), (1, 4096), (1, 1), (128, 128), (5, 2000), (1, 33)], 8, 2, 64, 8, mx.float32, None),
    ("mixed-gqa8-d128-bs32-window", [(200, 900), (1, 3000), (64, 64), (3, 1500)], 16, 2, 128, 32, mx.bfloat16, 256),
    ("mixed-gqa1-d64-bs16-bf16", [(17, 17), (1, 250), (90, 400)], 2, 2, 64, 16, mx.bfloat16, None),
    ("mixed-gqa2-d64-bs32-window", [(33, 700), (1, 1), (260, 260)], 4, 2, 64, 32, mx.float32, 100),
]


def fast(q, k_pool, v_pool, meta, scale, window, sinks=None):
    """The kernel itself (not the dispatch, which may fall back to the reference)."""
    assert pa.supports(q, k_pool, meta, v_pool, kernel_only=True)
    return pa.paged_attention_kernel(q, k_pool, v_pool, meta, scale, window, backend=BACKEND, sinks=sinks)


def random_sinks(heads, seed):
    # Around the scores' own range (q.k * scale ~ N(0, 1)), some far above: the sink then takes most
    # of the weight, which a sink counted twice or not at all would show.
    return mx.random.normal((heads,), key=mx.random.key(seed)) * 3.0


@requires_gpu
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_matches_reference(case):
    name, specs, heads, kv_heads, head_dim, block_size, dtype, window = case
    q, k_pool, v_pool, meta = make_batch(zlib.crc32(name.encode()), specs, heads, kv_heads, head_dim, block_size, dtype)
    scale = head_dim ** -0.5
    out = fast(q, k_pool, v_pool, meta, scale, window)
    mx.eval(out)
    assert out.shape == q.shape and out.dtype == q.dtype
    got = np.array(out.astype(mx.float32))
    want = reference_f32(q, k_pool, v_pool, meta, scale, window)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, **TOLERANCE[dtype])


SINK_CASES = [c for c in CASES if c[0].startswith(("decode-split-gqa2", "decode-window", "prefill-gqa2", "mixed-gqa8",
                                                  "mixed-gqa1", "decode-mha", "decode-split-gqa32"))]


@requires_gpu
@pytest.mark.parametrize("case", SINK_CASES, ids=[c[0] for c in SINK_CASES])
def test_kernel_with_sinks_matches_reference(case):
    """GPT-OSS's learned sinks: decode (whole and split), prefill and mixed batches, with windows."""
    name, specs, heads, kv_heads, head_dim, block_size, dtype, window = case
    q, k_pool, v_pool, meta = make_batch(zlib.crc32(name.encode()), specs, heads, kv_heads, head_dim, block_size, dtype)
    sinks = random_sinks(heads, 7)
    scale = head_dim ** -0.5
    got = np.array(fast(q, k_pool, v_pool, meta, scale, window, sinks).astype(mx.float32))
    want = reference_f32(q, k_pool, v_pool, meta, scale, window, sinks)
    np.testing.assert_allclose(got, want, **TOLERANCE[dtype])
    without = reference_f32(q, k_pool, v_pool, meta, scale, window)
    assert not np.allclose(want, without, **TOLERANCE[dtype])  # the sinks matter in this case


def attention_by_definition(q, k_pool, v_pool, meta, scale, window):
    """Each query's softmax over its causal (windowed) context, token by token, in numpy."""
    block_size, kv_heads, head_dim = k_pool.shape[1:]
    flat_k = np.array(k_pool).reshape(-1, kv_heads, head_dim)
    flat_v = np.array(v_pool).reshape(-1, kv_heads, head_dim)
    tables, qs, heads = np.array(meta.block_tables), np.array(q), q.shape[1]
    out, row = np.zeros(qs.shape, np.float64), 0
    for r, (n, ctx) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        slots = [tables[r][p // block_size] * block_size + p % block_size for p in range(ctx)]
        for t in range(n):
            pos = ctx - n + t
            first = 0 if window is None else max(0, pos + 1 - window)
            for h in range(heads):
                kvh = h // (heads // kv_heads)
                k, v = flat_k[slots[first: pos + 1], kvh], flat_v[slots[first: pos + 1], kvh]
                logits = k @ qs[row, h] * scale
                p = np.exp(logits - logits.max())
                out[row, h] = (p / p.sum()) @ v
            row += 1
    return out


@pytest.mark.parametrize("specs,window", [
    ([(1, 37)], None),  # a lone decode: its context sliced to its length, no mask
    ([(1, 37)], 11),  # ... from a window that starts inside a block
    ([(1, 5), (1, 37), (1, 16)], None),  # several: padded to the longest, masked
    ([(1, 5), (1, 37), (1, 16)], 11),
    ([(3, 20), (1, 37), (1, 9)], 11),  # decodes beside a prompt chunk: their rows of q taken out
], ids=["one", "one-window", "several", "several-window", "beside-a-chunk"])
def test_reference_decodes_equal_the_definition(specs, window):
    """The reference's decode paths (one planned gather a step, `reference.DecodeGather`) against
    attention written out per token."""
    q, k_pool, v_pool, meta = make_batch(5, specs, 6, 2, 32, 8, mx.float32)
    with mx.stream(mx.cpu):
        got = np.array(paged_attention_reference(q, k_pool, v_pool, meta, 0.2, window))
        again = np.array(paged_attention_reference(q, k_pool, v_pool, meta, 0.2, window))  # the plan, reused
    want = attention_by_definition(q, k_pool, v_pool, meta, 0.2, window)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)
    assert np.array_equal(got, again) and len(meta.__dict__["_reference_decode_gathers"]) == 1


def test_reference_sinks_are_an_extra_logit_with_no_value():
    """The reference's sinks, against the definition: softmax over [scores, sink], the sink's share dropped."""
    q, k_pool, v_pool, meta = make_batch(3, [(4, 12), (1, 9)], 4, 2, 64, 8, mx.float32)
    sinks = random_sinks(4, 1)
    scale = 0.125
    with mx.stream(mx.cpu):
        got = np.array(paged_attention_reference(q, k_pool, v_pool, meta, scale, None, sinks))
    flat_k = np.array(k_pool).reshape(-1, 2, 64)
    flat_v = np.array(v_pool).reshape(-1, 2, 64)
    tables, qs, row = np.array(meta.block_tables), np.array(q), 0
    for r, (n, ctx) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        slots = [tables[r][p // 8] * 8 + p % 8 for p in range(ctx)]
        for t in range(n):
            pos = ctx - n + t
            for h in range(4):
                k, v = flat_k[slots[: pos + 1], h // 2], flat_v[slots[: pos + 1], h // 2]
                logits = np.append(k @ qs[row, h] * scale, float(np.array(sinks)[h]))
                p = np.exp(logits - logits.max())
                p /= p.sum()
                np.testing.assert_allclose(got[row, h], p[:-1] @ v, atol=1e-5, rtol=1e-4)
            row += 1


@requires_gpu
def test_random_shapes_against_reference():
    """Random mixed batches over the whole grid of GQA ratios, head dims and block sizes."""
    rng = random.Random(1234)
    for trial in range(16):
        gqa = rng.choice([1, 2, 4, 8])
        kv_heads = rng.choice([1, 2, 4])
        head_dim = rng.choice([64, 128])
        block_size = rng.choice([8, 16, 32])
        dtype = rng.choice([mx.float32, mx.bfloat16])
        window = rng.choice([None, None, rng.randint(1, 600)])
        specs = []
        for _ in range(rng.randint(1, 6)):
            ctx = rng.randint(1, 4096)
            q_len = rng.choice([1, 1, rng.randint(1, min(ctx, 300))])
            specs.append((q_len, ctx))
        q, k_pool, v_pool, meta = make_batch(trial, specs, gqa * kv_heads, kv_heads, head_dim, block_size, dtype)
        scale = head_dim ** -0.5
        out = fast(q, k_pool, v_pool, meta, scale, window)
        want = reference_f32(q, k_pool, v_pool, meta, scale, window)
        np.testing.assert_allclose(np.array(out.astype(mx.float32)), want, err_msg=f"trial {trial}: {specs}",
                                   **TOLERANCE[dtype])


@requires_gpu
@pytest.mark.parametrize("gqa", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_grid_mixed_and_decode(gqa, head_dim, block_size):
    """Every GQA ratio x head dim x block size: a mixed batch (chunks, a whole prompt, decodes at
    1..4K, one with a sliding window) and a decode-only batch long enough to split the KV."""
    kv_heads = 2
    rng = random.Random(gqa * 1000 + head_dim * 10 + block_size)
    dtype = mx.bfloat16 if (gqa + block_size) % 2 else mx.float32
    mixed = [(1, 1), (rng.randint(2, 40), 40), (1, rng.randint(2000, 4096)), (rng.randint(1, 64), 700), (17, 17)]
    decodes = [(1, rng.randint(1, 4096)) for _ in range(3)] + [(1, 4096)]
    for specs, window in ((mixed, None), (mixed, rng.randint(1, 300)), (decodes, None), (decodes, 333)):
        q, k_pool, v_pool, meta = make_batch(rng.randrange(1 << 30), specs, gqa * kv_heads, kv_heads, head_dim,
                                             block_size, dtype)
        scale = head_dim ** -0.5
        got = np.array(fast(q, k_pool, v_pool, meta, scale, window).astype(mx.float32))
        want = reference_f32(q, k_pool, v_pool, meta, scale, window)
        np.testing.assert_allclose(got, want, err_msg=f"{specs} window={window}", **TOLERANCE[dtype])


@requires_gpu
def test_block_size_not_a_power_of_two():
    q, k_pool, v_pool, meta = make_batch(9, [(1, 500), (30, 90), (1, 2)], 8, 2, 64, 12, mx.float32)
    got = np.array(fast(q, k_pool, v_pool, meta, 0.125, None))
    np.testing.assert_allclose(got, reference_f32(q, k_pool, v_pool, meta, 0.125, None), **TOLERANCE[mx.float32])


@requires_gpu
@pytest.mark.parametrize("seed, specs", [(5, [(1, 40), (1, 700)]), (6, [(12, 40), (1, 700)])], ids=["decode", "mixed"])
def test_dispatch_uses_the_kernel(seed, specs):
    q, k_pool, v_pool, meta = make_batch(seed, specs, 8, 4, 64, 16, mx.float32)
    assert pa.supports(q, k_pool, meta, v_pool)
    got = paged_attention(q, k_pool, v_pool, meta, 0.125, None)
    np.testing.assert_allclose(np.array(got), reference_f32(q, k_pool, v_pool, meta, 0.125, None), atol=3e-4, rtol=2e-3)


@requires_gpu
def test_dispatch_splits_off_large_prefills():
    big = int(PREFILL_KERNEL_MAX_WORK ** 0.5) + 8
    specs = [(1, 900), (big, big), (7, 50), (1, 3000), (big, 2 * big)]
    q, k_pool, v_pool, meta = make_batch(8, specs, 8, 2, 128, 16, mx.bfloat16)
    got = np.array(paged_attention(q, k_pool, v_pool, meta, 0.1, 200).astype(mx.float32))
    np.testing.assert_allclose(got, reference_f32(q, k_pool, v_pool, meta, 0.1, 200), **TOLERANCE[mx.bfloat16])


# --- MLA's absorbed decode: one 576-wide "KV head" (latent 512 + rope 64), V its first 512 ----

MLA_DIM, MLA_LATENT = 576, 512
MLA_SCALE = 192 ** -0.5  # DeepSeek's softmax scale: (qk_nope 128 + rope 64) ** -0.5
# (id, specs, heads, dtype): DeepSeek-V2-Lite's 16 heads and V3's 128, block size 16.
MLA_CASES = [
    ("h16-bf16", [(1, c) for c in (1, 15, 16, 17, 100, 255, 300, 2049, 4096)], 16, mx.bfloat16),
    ("h128-bf16", [(1, c) for c in (1, 17, 250, 1000, 3001)], 128, mx.bfloat16),
    ("h16-f32", [(1, c) for c in (2, 33, 700, 1500)], 16, mx.float32),
]


def mla_kernel(q, pool, meta, scale=MLA_SCALE):
    assert pa.supports(q, pool, meta, None, kernel_only=True, v_dim=MLA_LATENT)
    return pa.paged_attention_kernel(q, pool, None, meta, scale, None, backend=BACKEND, v_dim=MLA_LATENT)


def mla_plan_splits(meta, heads, dtype):
    tiles = pa.decode_plan(MLA_DIM, heads, dtype.size, MLA_LATENT, shared_v=True).head_tiles
    return pa.plan_decode_splits(len(meta.seq_lens_host), tiles, max(meta.seq_lens_host),
                                 pa.TARGET_THREADGROUPS[BACKEND])[0]


@requires_gpu
@pytest.mark.parametrize("split", [True, False], ids=["split", "whole"])
@pytest.mark.parametrize("case", MLA_CASES, ids=[c[0] for c in MLA_CASES])
def test_mla_decode_kernel_matches_reference(case, split, monkeypatch):
    """Mixed context lengths (inside a block, at block edges, across partitions), the KV split
    across threadgroups or not (no split: every request's context in one threadgroup per head tile)."""
    name, specs, heads, dtype = case
    if not split:
        monkeypatch.setitem(pa.TARGET_THREADGROUPS, BACKEND, 1)
    q, pool, _, meta = make_batch(zlib.crc32(name.encode()), specs, heads, 1, MLA_DIM, 16, dtype)
    assert (mla_plan_splits(meta, heads, dtype) > 1) == split
    out = mla_kernel(q, pool, meta)
    assert out.shape == (len(specs), heads, MLA_LATENT) and out.dtype == dtype
    got = np.array(out.astype(mx.float32))
    want = reference_f32(q, pool, pool[..., :MLA_LATENT], meta, MLA_SCALE, None)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, **TOLERANCE[dtype])


@requires_gpu
def test_mla_decode_batch_of_many():
    """Enough requests that the V3 shape needs no split (request x head tile fills the GPU)."""
    rng = random.Random(11)
    specs = [(1, rng.randint(1, 600)) for _ in range(80)]
    q, pool, _, meta = make_batch(11, specs, 128, 1, MLA_DIM, 16, mx.bfloat16)
    assert mla_plan_splits(meta, 128, mx.bfloat16) == 1
    got = np.array(mla_kernel(q, pool, meta).astype(mx.float32))
    np.testing.assert_allclose(got, reference_f32(q, pool, pool[..., :MLA_LATENT], meta, MLA_SCALE, None),
                               **TOLERANCE[mx.bfloat16])


@requires_gpu
def test_mla_dispatch_reads_v_in_place():
    """Through `paged_attention`: decodes take the kernel; a batch with a prompt chunk the reference."""
    q, pool, _, meta = make_batch(12, [(1, 40), (1, 900)], 16, 1, MLA_DIM, 16, mx.bfloat16)
    got = paged_attention(q, pool, None, meta, MLA_SCALE, v_dim=MLA_LATENT)
    want = reference_f32(q, pool, pool[..., :MLA_LATENT], meta, MLA_SCALE, None)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, **TOLERANCE[mx.bfloat16])
    q, pool, _, mixed = make_batch(13, [(1, 40), (6, 90)], 16, 1, MLA_DIM, 16, mx.bfloat16)
    assert not pa.supports(q, pool, mixed, None, kernel_only=True, v_dim=MLA_LATENT)
    got = paged_attention(q, pool, None, mixed, MLA_SCALE, v_dim=MLA_LATENT)
    want = reference_f32(q, pool, pool[..., :MLA_LATENT], mixed, MLA_SCALE, None)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, **TOLERANCE[mx.bfloat16])


# --- pure Python: runs everywhere ---------------------------------------------------------

def test_batch_split_puts_rows_back_in_order():
    """The GPU dispatch's split, checked with the reference on every part (runs on the CPU too)."""
    kernels = importlib.import_module("metal_cluster.kernels")
    big = int(PREFILL_KERNEL_MAX_WORK ** 0.5) + 1
    specs = [(2, 9), (big, big), (1, 40), (0, 7), (big, big + 5), (3, 3), (1, 1)]
    q, k_pool, v_pool, meta = make_batch(3, specs, 4, 2, 64, 16, mx.float32)
    parts, order = kernels._split_batch(meta)
    assert [(kind, sub.query_lens_host) for kind, _, sub in parts] == [
        ("decode", [1, 1]), ("chunk", [2, 3]), ("large", [big, big])]
    got = mx.concatenate([paged_attention_reference(q[rows], k_pool, v_pool, sub, 0.125, None)
                          for _, rows, sub in parts], axis=0)[order]
    want = paged_attention_reference(q, k_pool, v_pool, meta, 0.125, None)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5, rtol=1e-5)
    few_decodes = [(1, 9), (5, 50), (1, 4000)]  # decodes with little context stay with the chunks
    many_decodes = [(1, 4000)] * 5 + [(5, 50)]
    assert [kind for kind, _, _ in kernels._split_batch(make_batch(5, many_decodes, 4, 2, 64, 16, mx.float32)[3])[0]] \
        == ["decode", "chunk"]
    for specs, plan in (([(5, 9), (5, 4000)], None), ([(1, 9), (1, 4000)], None), ([(big, big)], ([], None)),
                        (few_decodes, None)):
        meta = make_batch(4, specs, 4, 2, 64, 16, mx.float32)[3]
        assert kernels._split_batch(meta) == plan


def test_decode_layout():
    assert pa.decode_layout(128, 2) == (8, 16)  # 16-byte loads, 16 lanes a row, 2 rows a warp
    assert pa.decode_layout(64, 2) == (8, 8)
    assert pa.decode_layout(128, 4) == (4, 32)
    assert pa.decode_layout(256, 4) == (4, 32)
    assert pa.decode_layout(96, 2) == (1, 32)  # 12 chunks of 16 bytes do not tile a warp
    for head_dim in range(32, 257, 32):
        for itemsize in (2, 4):
            vec, lanes = pa.decode_layout(head_dim, itemsize)
            assert 32 % lanes == 0 and head_dim % (vec * lanes) == 0 and vec * itemsize <= 16


def test_collectives_are_never_macro_arguments():
    """A ternary macro evaluates an argument twice, once on only some lanes: a shuffle passed to one
    becomes a divergent collective (this hung the prefill kernel on CUDA)."""
    for kind in ("decode", "decode_split", "reduce", "prefill"):
        for backend in pa.BACKENDS:
            _, body = pa.kernel_source(kind, backend, 128, 2)
            for macro in ("MINI", "MAXI"):
                for args in re.findall(macro + r"\(([^;]*)", body):
                    assert "SHFL" not in args and "WARP_SUM" not in args, (kind, backend, args)


def test_split_planner_keeps_big_batches_whole():
    assert pa.plan_decode_splits(num_reqs=64, kv_heads=8, max_ctx=4096) == (1, 4096)
    assert pa.plan_decode_splits(num_reqs=256, kv_heads=8, max_ctx=4096, target=2048) == (1, 4096)
    assert pa.plan_decode_splits(num_reqs=1, kv_heads=8, max_ctx=100) == (1, 100)


@pytest.mark.parametrize("num_reqs,kv_heads,max_ctx", [(1, 8, 4096), (2, 2, 4000), (4, 8, 1000), (1, 1, 65536)])
def test_split_planner_fills_the_gpu(num_reqs, kv_heads, max_ctx):
    splits, partition = pa.plan_decode_splits(num_reqs, kv_heads, max_ctx)
    assert splits > 1
    assert partition % 64 == 0 and partition >= pa.MIN_PARTITION
    assert splits * partition >= max_ctx > (splits - 1) * partition  # no empty trailing split
    # Not wildly more threadgroups than needed.
    assert num_reqs * kv_heads * splits <= 2 * pa.TARGET_THREADGROUPS["metal"]


@pytest.mark.parametrize("gqa", [1, 2, 4, 8, 3])
def test_prefill_tiles_cover_each_query_once(gqa):
    rng = random.Random(gqa)
    bq = pa.prefill_tile_tokens(gqa)
    q_lens = [rng.choice([0, 1, 1, bq - 1, bq, bq + 1, rng.randint(1, 100)]) for _ in range(20)]
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    covered = []
    for tile in range(pa.prefill_num_tiles(cu[-1], len(q_lens), gqa)):
        r, first = pa.tile_request(cu, tile, bq)
        if first >= 0:
            assert cu[r] <= first < cu[r + 1]
            covered.extend(range(first, min(first + bq, cu[r + 1])))
    assert covered == list(range(cu[-1]))


@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("kind", ["decode", "decode_split", "reduce", "prefill"])
def test_one_body_two_backends(kind, sinks):
    metal_header, metal = pa.kernel_source(kind, "metal", 128, 2, sinks=sinks)
    cuda_header, cuda = pa.kernel_source(kind, "cuda", 128, 2, sinks=sinks)
    assert ("sinks[" in metal) == (sinks and kind != "reduce")
    assert "threadgroup_position_in_grid" in metal and "blockIdx" not in metal
    assert "blockIdx" in cuda and "threadgroup_position_in_grid" not in cuda
    assert "simd_sum" in metal_header and "__shfl_xor_sync" in cuda_header
    # Past the per-backend prologue, the kernel body is the very same text.
    assert metal.replace(pa._PROLOGUE["metal"], "") == cuda.replace(pa._PROLOGUE["cuda"], "")
    assert "{" in metal and "{{" not in metal  # format() consumed every placeholder


def test_cpu_dispatch_is_the_reference():
    if BACKEND is not None:
        pytest.skip("a GPU backend is active: the kernels are tested above")
    q, k_pool, v_pool, meta = make_batch(0, [(3, 20), (1, 9)], 4, 2, 64, 8, mx.float32)
    out = paged_attention(q, k_pool, v_pool, meta, 0.125, None)
    ref = paged_attention_reference(q, k_pool, v_pool, meta, 0.125, None)
    assert mx.array_equal(out, ref)


# --- MLA and head tiles without a GPU: the plan, the dispatch, the generated CUDA (nvcc, emulated)

def test_decode_plan_for_mla_and_existing_shapes():
    for heads, tiles in ((16, 4), (128, 32)):  # DeepSeek-V2-Lite, V3: 4 heads a threadgroup
        plan = pa.decode_plan(MLA_DIM, heads, 2, MLA_LATENT, shared_v=True)
        assert (plan.vec, plan.lanes_per_key, plan.tail_vec) == (8, 32, 2)  # 16-byte latent loads, 4-byte rope
        assert plan.heads_per_group * tiles == heads and plan.head_tiles == tiles
    assert pa.decode_plan(MLA_DIM, 16, 2, MLA_LATENT) is None  # a narrower V of its own: not the kernel's
    # Every shape the kernels took before keeps one threadgroup per kv head, its keys per step and its name.
    for head_dim in (64, 96, 128, 256):
        for gqa in range(1, 17):
            for itemsize in (2, 4):
                plan = pa.decode_plan(head_dim, gqa, itemsize)
                assert plan.heads_per_group == gqa and plan.keys_per_step == pa.keys_per_warp_step(gqa)
                assert (plan.vec, plan.lanes_per_key, plan.tail_vec) == (*pa.decode_layout(head_dim, itemsize), 1)
    assert pa.kernel_name("decode", 128, 2) == "paged_attn_decode_d128_g2_v8_u4"
    assert pa.kernel_name("decode_split", 64, 8, 4, sinks=True) == "paged_attn_decode_split_d64_g8_v4_u2_sinks"
    assert pa.decode_plan(128, 32, 2).heads_per_group == 8  # past GQA 16 the heads are tiled


def test_supports_mla_decodes_only():
    q, pool, _, meta = make_batch(1, [(1, 5), (1, 40)], 16, 1, MLA_DIM, 16, mx.bfloat16)
    assert pa.supports(q, pool, meta, None, v_dim=MLA_LATENT)
    assert not pa.supports(q, pool, meta, pool[..., :MLA_LATENT])  # as a V pool of its own: no
    assert not pa.supports(q, pool, meta, None, v_dim=500)
    q, pool, _, mixed = make_batch(2, [(1, 5), (3, 40)], 16, 1, MLA_DIM, 16, mx.bfloat16)
    assert not pa.supports(q, pool, mixed, None, kernel_only=True, v_dim=MLA_LATENT)  # prompt chunks: mla.py expands
    q, k_pool, v_pool, meta = make_batch(3, [(1, 5), (1, 40)], 32, 1, 128, 16, mx.bfloat16)
    assert pa.supports(q, k_pool, meta, v_pool)  # GQA 32: the decode kernel tiles it ...
    q, k_pool, v_pool, mixed = make_batch(3, [(1, 5), (3, 40)], 32, 1, 128, 16, mx.bfloat16)
    assert not pa.supports(q, k_pool, mixed, v_pool, kernel_only=True)  # ... the prefill kernel does not take it


def test_cpu_dispatch_reads_v_as_the_k_prefix():
    if BACKEND is not None:
        pytest.skip("a GPU backend is active: the kernels are tested above")
    q, pool, _, meta = make_batch(4, [(3, 20), (1, 9)], 4, 1, 40, 8, mx.float32)
    out = paged_attention(q, pool, None, meta, 0.125, v_dim=32)
    assert out.shape == (4, 4, 32)
    assert mx.array_equal(out, paged_attention_reference(q, pool, pool[..., :32], meta, 0.125, None))
    with pytest.raises(ValueError, match="v_dim"):
        paged_attention(q, pool, None, meta, 0.125)
    with pytest.raises(ValueError, match="v_pool=None"):
        paged_attention(q, pool, pool, meta, 0.125, v_dim=32)


@pytest.mark.parametrize("shape", [(128, 2, None, False), (MLA_DIM, 16, MLA_LATENT, True), (MLA_DIM, 128, MLA_LATENT, True)],
                         ids=["d128-g2", "mla-h16", "mla-h128"])
def test_mla_body_two_backends(shape):
    head_dim, gqa, v_dim, shared_v = shape
    for kind in ("decode", "decode_split", "reduce"):
        metal = pa.kernel_source(kind, "metal", head_dim, gqa, 2, v_dim=v_dim, shared_v=shared_v)[1]
        cuda = pa.kernel_source(kind, "cuda", head_dim, gqa, 2, v_dim=v_dim, shared_v=shared_v)[1]
        assert metal.replace(pa._PROLOGUE["metal"], "") == cuda.replace(pa._PROLOGUE["cuda"], "")
        assert "{" in metal and "{{" not in metal
        for macro in ("MINI", "MAXI"):
            for args in re.findall(macro + r"\(([^;]*)", cuda):
                assert "SHFL" not in args and "WARP_SUM" not in args, (kind, args)


standin = importlib.import_module("kernel_standin")
requires_nvcc = pytest.mark.skipif(standin.NVCC is None, reason="no nvcc on this machine")
requires_gxx = pytest.mark.skipif(standin.GXX is None, reason="the CUDA emulation needs g++ on Linux")


def _unit(kind, dtype, head_dim, gqa, v_dim=None, shared_v=False, sinks=False, **layout):
    """One kernel as MLX's cuda_kernel would hand it to NVRTC."""
    header, source = pa.kernel_source(kind, "cuda", head_dim, gqa, dtype.size, sinks=sinks, v_dim=v_dim, shared_v=shared_v,
                                      **layout)
    ints = [(n, mx.int32) for n in ("cu_seqlens_q", "seq_lens", "block_tables", "params")]
    inputs = ([("part_o", mx.float32), ("part_ml", mx.float32), ("params", mx.int32)] if kind == "reduce" else
              [("q", dtype), ("k_pool", dtype), ("v_pool", dtype), *ints]) + [("scale", mx.float32), ("k_pool_kvh", mx.int32)]
    inputs += [("sinks", mx.float32)] if sinks and kind != "reduce" else []
    outputs = [("part_o", mx.float32), ("part_ml", mx.float32)] if kind == "decode_split" else [("out", dtype)]
    return standin.cuda_translation_unit("k", header, source, inputs, outputs, [("T", dtype)], standin.NVCC_DEVICE_HEADER)


@requires_nvcc
@pytest.mark.parametrize("kind", ["decode", "decode_split", "reduce"])
def test_mla_cuda_source_compiles_without_spills(kind):
    """The MLA kernels as NVRTC would get them, compiled by nvcc for an H200 (sm_90): they build,
    and the head tile's registers (4 heads x (18 + 16) floats a lane) fit without spilling."""
    for dtype, heads in ((mx.bfloat16, 128), (mx.float32, 16)):
        used = standin.nvcc_resources(_unit(kind, dtype, MLA_DIM, heads, MLA_LATENT, shared_v=True))
        assert used["spill_stores"] == 0 and used["spill_loads"] == 0, used["log"]


@requires_nvcc
def test_existing_cuda_sources_compile():
    for kind in ("decode", "decode_split", "prefill"):
        standin.nvcc_resources(_unit(kind, mx.bfloat16, 128, 2, sinks=True))


def test_few_decode_threadgroups_get_more_warps_on_cuda_only():
    plan = pa.decode_plan(128, 4, 2)  # Qwen3-8B's attention in bf16
    assert pa.decode_warps(8, plan, "cuda") == pa.MANY_WARPS  # batch 1: one threadgroup a kv head
    assert pa.decode_warps(8 * 64, plan, "cuda") == pa.WARPS
    assert pa.decode_warps(8, plan, "metal") == pa.WARPS
    assert pa.decode_warps(8, pa.decode_plan(128, 8, 2), "cuda") == pa.WARPS  # per-head registers too many
    assert pa.decode_warps(8, pa.decode_plan(MLA_DIM, 16, 2, MLA_LATENT, shared_v=True), "cuda") == pa.WARPS
    assert pa.kernel_name("decode", 128, 4, warps=8, kv_heads=8) == "paged_attn_decode_d128_g4_v8_u4_w8_h8"


@requires_nvcc
def test_more_warps_fit_one_sm():
    """The layouts `decode_warps` widens keep a threadgroup within an SM's 64K registers (sm_90)."""
    for kind in ("decode", "decode_split"):
        for gqa in (1, 2, 4):
            used = standin.nvcc_resources(_unit(kind, mx.bfloat16, 128, gqa, warps=pa.MANY_WARPS, kv_heads=8))
            assert used["registers"] * pa.MANY_WARPS * pa.LANES <= 65536 and used["spill_stores"] == 0, (kind, gqa, used)


@pytest.fixture
def emulated_cuda(monkeypatch):
    """`mx.fast.cuda_kernel` replaced by the CPU emulation of tests/kernel_standin.py: the CUDA
    path of `paged_attention_kernel` (plan, launches, generated source) runs here without a GPU."""
    emulator = standin.EmulatedCudaKernels()
    monkeypatch.setattr(mx.fast, "cuda_kernel", emulator)
    pa.build_kernel.cache_clear()
    yield emulator
    pa.build_kernel.cache_clear()  # no emulated kernel stays behind for a real GPU run


# (id, specs, heads, kv_heads, head_dim, v_dim, dtype, window, sinks): small contexts (the emulation
# runs 128 threads a group on one core), split (> MIN_PARTITION) and whole.
EMULATED = [
    ("mla-h16-tiled-bf16-split", [(1, 1), (1, 17), (1, 300)], 16, 1, MLA_DIM, MLA_LATENT, mx.bfloat16, None, False),
    ("mla-h128-tiled-bf16", [(1, 37), (1, 16)], 128, 1, MLA_DIM, MLA_LATENT, mx.bfloat16, None, False),
    ("tiny-mla-f32", [(1, 30), (1, 3)], 4, 1, 40, 32, mx.float32, None, False),
    ("gqa2-d128-bf16-split-window-sinks", [(1, 300), (1, 17), (1, 1)], 4, 2, 128, None, mx.bfloat16, 100, True),
    ("gqa32-tiled-d128-bf16-split-sinks", [(1, 290), (1, 9)], 32, 1, 128, None, mx.bfloat16, None, True),
]


@requires_gxx
@pytest.mark.parametrize("case", EMULATED, ids=[c[0] for c in EMULATED])
def test_emulated_cuda_decode_matches_reference(case, emulated_cuda):
    name, specs, heads, kv_heads, head_dim, v_dim, dtype, window, with_sinks = case
    q, k_pool, v_pool, meta = make_batch(zlib.crc32(name.encode()), specs, heads, kv_heads, head_dim, 16, dtype)
    sinks = random_sinks(heads, 5) if with_sinks else None
    scale = head_dim ** -0.5
    if v_dim is None:
        got = pa.paged_attention_kernel(q, k_pool, v_pool, meta, scale, window, backend="cuda", sinks=sinks)
    else:
        v_pool = k_pool[..., :v_dim]
        got = pa.paged_attention_kernel(q, k_pool, None, meta, scale, window, backend="cuda", sinks=sinks, v_dim=v_dim)
    plan = pa.decode_plan(head_dim, heads // kv_heads, dtype.size, v_dim, v_dim is not None)
    assert (plan.head_tiles > 1) == ("tiled" in name or heads // kv_heads > 16)
    kinds = [re.match(r"paged_attn_([a-z_]+?)_d\d", launch[0]).group(1) for launch in emulated_cuda.launches]
    assert kinds == (["decode_split", "reduce"] if "split" in name else ["decode"])
    if name.startswith("gqa2"):  # a few threadgroups of few heads: the wider threadgroup
        assert f"_w{pa.MANY_WARPS}_" in emulated_cuda.launches[0][0]
    assert got.shape == (len(specs), heads, v_dim or head_dim)
    want = reference_f32(q, k_pool, v_pool, meta, scale, window, sinks)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, err_msg=name, **TOLERANCE[dtype])


@requires_gxx
@pytest.mark.parametrize("window, with_sinks", [(None, False), (24, True)], ids=["full", "window-sinks"])
def test_emulated_cuda_decode_planned_for_a_longer_context_reads_the_real_lengths(window, with_sinks, emulated_cuda):
    """What a whole-step trace (stage_worker/step/tracing/whole_step.py) asks of the decode kernel: its plan
    made for every request at the bucket's context (512 tokens: split in two partitions, block
    tables padded to 32 columns with the null block), while each request's real length, read from
    `seq_lens` on the device, is far shorter; the partitions past it are empty."""
    from metal_cluster.stage_worker.step.tracing.whole_step import table_width

    specs = [(1, 40), (1, 9), (1, 300)]
    q, k_pool, v_pool, real = make_batch(17, specs, 4, 2, 64, 16, mx.float32)
    width = table_width(real.block_tables.shape[1])
    assert width == 32
    padded = mx.pad(real.block_tables, [(0, 0), (0, width - real.block_tables.shape[1])])
    planned = AttentionMetadata(real.cu_seqlens_q, real.seq_lens, padded, 16, query_lens_host=[1] * 3,
                                seq_lens_host=[width * 16] * 3)
    sinks = random_sinks(4, 9) if with_sinks else None
    scale = 64 ** -0.5
    got = pa.paged_attention_kernel(q, k_pool, v_pool, planned, scale, window, backend="cuda", sinks=sinks)
    kinds = [re.match(r"paged_attn_([a-z_]+?)_d\d", launch[0]).group(1) for launch in emulated_cuda.launches]
    assert kinds == ["decode_split", "reduce"]
    want = reference_f32(q, k_pool, v_pool, real, scale, window, sinks)
    np.testing.assert_allclose(np.array(got), want, **TOLERANCE[mx.float32])

@requires_gxx
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_emulated_cuda_layers_of_one_step_share_a_plan_not_their_pools(split, emulated_cuda):
    """The layers of a step reuse the first one's launch plan (kept on the step's metadata), and
    each still reads its own pools and sinks."""
    specs = [(1, 300 if split else 40), (1, 9)]
    q, k_pool, v_pool, meta = make_batch(11, specs, 4, 2, 64, 16, mx.float32)
    layers = [(k_pool, v_pool, random_sinks(4, 1))]
    for seed in (2, 3):
        _, k, v, _ = make_batch(seed, specs, 4, 2, 64, 16, mx.float32)
        layers.append((k, v, random_sinks(4, seed)))
    scale = 64 ** -0.5
    for k, v, sinks in layers:
        got = pa.paged_attention_kernel(q, k, v, meta, scale, None, backend="cuda", sinks=sinks)
        np.testing.assert_allclose(np.array(got), reference_f32(q, k, v, meta, scale, None, sinks), **TOLERANCE[mx.float32])
    assert len(meta._paged_attention_launches) == 1
    assert len(emulated_cuda.launches) == 3 * (2 if split else 1)
