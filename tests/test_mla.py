"""DeepSeek V3's multi-head latent attention beyond the runner suite (tests/test_families.py holds it
to that): the pool keeps one latent array per layer, vLLM is told so (MLAAttentionSpec), a checkpoint
without kv_b_proj is one line, and `serve` over two pipeline stages equals mlx-lm's generation."""

import concurrent.futures
import json
import shutil
from itertools import accumulate

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map
from mlx_lm.utils import load

import kernel_standin
import tiny_models
from references import mlx_lm_greedy
from server_process import running_server

from metal_cluster.kernels import gpu_backend
from metal_cluster.stage_worker.errors import ModelLoadError
from metal_cluster.stage_worker.families import LayerCache, family_of
from metal_cluster.stage_worker.model.model_source import resolve_model
from metal_cluster.stage_worker.kv.paged_kv import KVPool, bytes_per_block
from metal_cluster.stage_worker.model.shard import load_shard

NUM_LAYERS = 6
KV_LORA_RANK, ROPE_DIM = 32, 8  # tiny_models' deepseek_v3 config


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory):
    return tiny_models.build_tiny_model("deepseek_v3", tmp_path_factory.mktemp("deepseek_v3"), num_layers=NUM_LAYERS)


def test_latent_pool_is_one_array_per_layer(tiny_deepseek):
    shard = load_shard(resolve_model(tiny_deepseek), 1, 3)
    assert shard.caches == [LayerCache(1, KV_LORA_RANK + ROPE_DIM, shared_kv=True)] * 2
    pool = KVPool.allocate(shard.caches, 10, 8, mx.float32)
    assert [k.shape for k in pool.keys] == [(80, 1, KV_LORA_RANK + ROPE_DIM)] * 2
    assert pool.values == [None, None]
    per_block = 2 * 8 * (KV_LORA_RANK + ROPE_DIM) * 4  # two layers, one 40-wide float32 entry per token
    assert bytes_per_block(shard.caches, 8, mx.float32) == per_block
    assert pool.nbytes == 10 * per_block
    pool.copy_blocks([(1, 2)])  # a shared_kv layer has no V to copy


def test_kimi_k2_is_deepseek_v3(tiny_deepseek, tmp_path):
    """Kimi K2's config.json says model_type kimi_k2: mlx-lm and vLLM both read it as DeepSeek V3."""
    from vllm.transformers_utils.config import get_config

    kimi = tmp_path / "kimi"
    shutil.copytree(tiny_deepseek, kimi)
    config = json.loads((kimi / "config.json").read_text())
    (kimi / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
    assert get_config(str(kimi), trust_remote_code=False).kv_lora_rank == KV_LORA_RANK
    shard = load_shard(resolve_model(kimi), 0, 2)
    assert shard.family is family_of(config, "x") and shard.caches[0].shared_kv


def test_vllm_kv_spec_is_mla(tiny_deepseek):
    """vLLM sizes blocks from the spec: one latent entry per token and layer, no V."""
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from metal_cluster.coordinator.engine.kv_specs import kv_cache_specs

    config = json.loads((tiny_deepseek / "config.json").read_text())
    cache = family_of(config, "x").layer_caches(config)[0]
    spec = kv_cache_specs([cache], [(0, 1)], [torch.bfloat16], 16, "auto")[0]["model.layers.0.self_attn.attn"]
    assert isinstance(spec, MLAAttentionSpec)
    assert spec.page_size_bytes == 16 * (KV_LORA_RANK + ROPE_DIM) * 2 == bytes_per_block([cache], 16, mx.bfloat16)


def test_missing_kv_b_proj_is_one_line(tiny_deepseek, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_deepseek, broken)
    weights = mx.load(str(broken / "model.safetensors"))
    del weights["model.layers.2.self_attn.kv_b_proj.weight"]
    mx.save_safetensors(str(broken / "model.safetensors"), weights)
    with pytest.raises(ModelLoadError) as e:
        load_shard(resolve_model(broken))
    message = str(e.value)
    assert "\n" not in message and str(broken) in message and "layers.2.self_attn" in message, message


def test_missing_expert_tensor_is_one_line(tiny_deepseek, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_deepseek, broken)
    weights = mx.load(str(broken / "model.safetensors"))
    del weights["model.layers.3.mlp.experts.5.up_proj.weight"]
    mx.save_safetensors(str(broken / "model.safetensors"), weights)
    with pytest.raises(ModelLoadError) as e:
        load_shard(resolve_model(broken))
    message = str(e.value)
    assert "\n" not in message and str(broken) in message and "experts.5.up_proj" in message, message


PROMPTS = ["Hello world, this is a test", "A", "Numbers 12345 and 67890",
           "The quick brown fox jumps over the lazy dog again and again and again until the dog wakes up"]


def test_serve_two_stages_matches_mlx_lm(tiny_deepseek, tmp_path):
    """Through vLLM's engine (MLA spec, chunked prefill over small batches) and two stage processes."""
    import openai  # not on the GPU machine, which runs this module's other tests

    ref_model, tokenizer = load(str(tiny_deepseek))
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    expected = [mlx_lm_greedy(ref_model, ids, 10) for ids in prompts]
    args = ["--gpu-memory-utilization", "0.05", "--max-model-len", "512", "--max-num-batched-tokens", "32",
            "--max-num-seqs", "8", "--served-model-name", "m", "-pp", "2"]
    with running_server(tiny_deepseek, *args, log_path=tmp_path / "server.log") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)

        def greedy(ids, n=10):
            r = client.completions.create(model="m", prompt=ids, max_tokens=n, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
            return r.choices[0].token_ids

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert list(pool.map(greedy, prompts)) == expected
        longer = prompts[3] + prompts[0]  # a prefix-cache hit on the long prompt's blocks
        assert greedy(longer, 8) == mlx_lm_greedy(ref_model, longer, 8)
    log = (tmp_path / "server.log").read_text()
    assert "2 local stage workers up" in log


def test_placement_counts_the_latent(tiny_deepseek):
    """DeepSeek V3's shape: one 576-wide entry per token and layer, not K and V of 128 heads."""
    from metal_cluster.coordinator.cluster.placement import ModelCost

    config = json.loads((tiny_deepseek / "config.json").read_text())
    assert set(ModelCost.from_config(config).kv_bytes_per_token) == {(KV_LORA_RANK + ROPE_DIM) * 4}
    v3 = {**config, "num_attention_heads": 128, "num_key_value_heads": 128, "hidden_size": 7168,
          "kv_lora_rank": 512, "qk_rope_head_dim": 64, "head_dim": 64, "torch_dtype": "bfloat16"}
    assert set(ModelCost.from_config(v3, on_gpu=True).kv_bytes_per_token) == {576 * 2}


def test_routing_bias_keeps_its_dtype(tiny_deepseek):
    """A half-precision stage casts the weights but not what mlx-lm's cast_predicate keeps."""
    from mlx_lm.utils import load_model

    from metal_cluster.stage_worker.model import dtypes

    model, _ = load_model(tiny_deepseek, lazy=True)
    dtypes.settle(model, mx.bfloat16)
    layer = model.model.layers[1]
    assert layer.mlp.gate.e_score_correction_bias.dtype == mx.float32
    assert layer.mlp.gate.weight.dtype == layer.self_attn.q_a_proj.weight.dtype == mx.bfloat16
    assert layer.self_attn.embed_q.weight.dtype == mx.bfloat16


@pytest.mark.parametrize("q_lora_rank,batched_decodes", [(None, True), (24, True), (24, False)])
def test_paged_latent_attention_equals_mlx_lm_module(q_lora_rank, batched_decodes, monkeypatch):
    """One layer, two steps over the paged pool (prompt chunks, then a chunk with cached context
    beside a decode and a fresh prompt), against mlx-lm's own attention with its KV cache. Both
    query paths (q_proj, and q_a/q_b with q_lora_rank), both forms (expanded, absorbed) and both
    ways the reference serves decodes (batched, or one by one past BATCHED_DECODE_MAX_CONTEXT)."""
    from metal_cluster.kernels import reference

    if not batched_decodes:
        monkeypatch.setattr(reference, "BATCHED_DECODE_MAX_CONTEXT", 0)
    from types import SimpleNamespace

    from mlx_lm.models import deepseek_v3
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.models.cache import KVCache

    from metal_cluster.kernels.metadata import AttentionMetadata
    from metal_cluster.stage_worker.step.attention import LayerContext
    from metal_cluster.stage_worker.step.batch import GroupTables
    from metal_cluster.stage_worker.families.deepseek_v3 import PagedLatentAttention

    mx.random.seed(3)
    args = deepseek_v3.ModelArgs(hidden_size=32, num_attention_heads=4, kv_lora_rank=KV_LORA_RANK,
                                 q_lora_rank=q_lora_rank, qk_rope_head_dim=ROPE_DIM, qk_nope_head_dim=16,
                                 v_head_dim=12)
    attn = deepseek_v3.DeepseekV3Attention(args)
    attn.update(tree_map(lambda p: mx.random.normal(p.shape) / p.shape[-1] ** 0.5, attn.parameters()))
    paged = PagedLatentAttention(attn)
    block_size, tables = 4, {"a": [3, 7, 1], "b": [2, 5], "c": [4, 6]}
    pool = KVPool.allocate([LayerCache(1, KV_LORA_RANK + ROPE_DIM, shared_kv=True)], 8, block_size, mx.float32)
    lengths = {"a": (5, 4), "b": (6, 1), "c": (0, 6)}  # tokens in step 1, then in step 2
    x = {r: mx.random.normal((sum(n), 32)) for r, n in lengths.items()}

    def step(which):
        rows = [(r, 0 if which == 1 else lengths[r][0], lengths[r][which - 1])
                for r in lengths if lengths[r][which - 1]]
        pos = [p for r, start, n in rows for p in range(start, start + n)]
        slots = [tables[r][p // block_size] * block_size + p % block_size for r, start, n in rows
                 for p in range(start, start + n)]
        width = max(len(t) for t in tables.values())
        meta = AttentionMetadata(
            cu_seqlens_q=mx.array([0] + list(accumulate(n for _, _, n in rows)), dtype=mx.int32),
            seq_lens=mx.array([s + n for _, s, n in rows], dtype=mx.int32),
            block_tables=mx.array([tables[r] + [0] * (width - len(tables[r])) for r, _, _ in rows], dtype=mx.int32),
            block_size=block_size, query_lens_host=[n for _, _, n in rows], seq_lens_host=[s + n for _, s, n in rows])
        batch = SimpleNamespace(positions=mx.array(pos, dtype=mx.int32),
                                groups=[GroupTables(mx.array(slots, dtype=mx.int32), meta)])
        h = mx.concatenate([x[r][s : s + n] for r, s, n in rows])[None]
        out = paged(h, None, LayerContext(batch, pool, 0))[0]
        return dict(zip([r for r, _, _ in rows], mx.split(out, list(accumulate(n for _, _, n in rows))[:-1])))

    got = [step(1), step(2)]
    for r, (first, second) in lengths.items():
        cache, expected = KVCache(), []
        for chunk in (x[r][:first], x[r][first:]):
            if chunk.shape[0]:
                h = chunk[None]
                expected.append(attn(h, create_attention_mask(h, cache, return_array=True), cache)[0])
        ours = [g[r] for g in got if r in g]
        assert len(ours) == len(expected)
        # On a GPU float32 matmuls reduce in another order (measured on an H200: up to 5e-5 here).
        tol = 1e-5 if mx.default_device().type == mx.DeviceType.cpu else 2e-4
        for o, e in zip(ours, expected):
            assert mx.allclose(o, e, atol=tol, rtol=tol).item(), (r, mx.abs(o - e).max().item())


# --- the absorbed decode through the GPU kernel ------------------------------------------------

def _latent_batch(heads, specs, seed, dtype=mx.bfloat16, block_size=16):
    """DeepSeek's attention shapes (latent 512, rope 64, nope 128, v_head 128), a random pool in
    shuffled blocks holding every request's context, and the layer's per-head maps."""
    import random

    from mlx_lm.models.mla import MultiLinear

    from metal_cluster.kernels.metadata import AttentionMetadata

    rng = random.Random(seed)
    need = [-(-ctx // block_size) for _, ctx in specs]
    ids = list(range(1, 1 + sum(need)))
    rng.shuffle(ids)
    tables = [ids[sum(need[:r]) : sum(need[: r + 1])] for r in range(len(specs))]
    width = max(need)
    meta = AttentionMetadata(
        cu_seqlens_q=mx.array([0] + list(accumulate(n for n, _ in specs)), dtype=mx.int32),
        seq_lens=mx.array([c for _, c in specs], dtype=mx.int32),
        block_tables=mx.array([t + [0] * (width - len(t)) for t in tables], dtype=mx.int32),
        block_size=block_size, query_lens_host=[n for n, _ in specs], seq_lens_host=[c for _, c in specs])
    mx.random.seed(seed)
    tokens = sum(n for n, _ in specs)
    pool = mx.random.normal((1 + sum(need), block_size, 1, 512 + 64)).astype(dtype)
    q_nope = mx.random.normal((tokens, heads, 128)).astype(dtype)
    q_pe = mx.random.normal((tokens, heads, 64)).astype(dtype)
    embed_q, unembed_out = MultiLinear(128, 512, heads), MultiLinear(512, 128, heads)
    embed_q.set_dtype(dtype)
    unembed_out.set_dtype(dtype)
    mx.eval(pool, q_nope, q_pe, embed_q.parameters(), unembed_out.parameters())
    return q_nope, q_pe, pool, meta, embed_q, unembed_out


def _kernel_against_reference(heads, specs, monkeypatch, backend=None):
    """paged_mla_attention with the decode kernel (counted) and with the reference (the CPU path,
    float32 from the same inputs). Returns (kernel calls, kernel output, reference output)."""
    from metal_cluster import kernels
    from metal_cluster.kernels import gpu as fast
    from metal_cluster.kernels.mla import paged_mla_attention

    q_nope, q_pe, pool, meta, embed_q, unembed_out = _latent_batch(heads, specs, seed=heads + len(specs))
    scale = 192 ** -0.5
    calls, kernel = [], fast.paged_attention_kernel

    def counted(q, *args, **kwargs):
        calls.append((q.shape[0], kwargs.get("v_dim")))
        return kernel(q, *args, **kwargs)

    monkeypatch.setattr(fast, "paged_attention_kernel", counted)
    if backend is not None:
        monkeypatch.setattr(kernels, "gpu_backend", lambda: backend)
    got = paged_mla_attention(q_nope, q_pe, pool, meta, scale, embed_q, unembed_out)
    mx.eval(got)
    monkeypatch.setattr(kernels, "gpu_backend", lambda: None)
    embed_q.set_dtype(mx.float32)
    unembed_out.set_dtype(mx.float32)
    f32 = [a.astype(mx.float32) for a in (q_nope, q_pe, pool)]
    want = paged_mla_attention(*f32, meta, scale, embed_q, unembed_out)
    return calls, np.array(got.astype(mx.float32)), np.array(want)


requires_gpu = pytest.mark.skipif(gpu_backend() is None, reason="no Metal or CUDA GPU: MLX runs on its CPU backend here")


@requires_gpu
@pytest.mark.parametrize("heads", [16, 128], ids=["v2-lite-16-heads", "v3-128-heads"])
def test_latent_decodes_take_the_kernel(heads, monkeypatch):
    """A packed bf16 batch of decodes at mixed contexts beside a prompt chunk: the decodes go through
    the decode kernel once (V read in the pool's rows), the chunk through the expanded form, and the
    whole equals the float32 reference path."""
    specs = [(1, 1), (1, 40), (5, 60), (1, 700), (1, 2500)]
    calls, got, want = _kernel_against_reference(heads, specs, monkeypatch)
    assert calls == [(4, 512)]
    assert np.abs(want).mean() > 0.1  # outputs of real size, not a pass by vanishing values
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(kernel_standin.GXX is None, reason="the CUDA emulation needs g++ on Linux")
def test_latent_decodes_take_the_emulated_cuda_kernel(monkeypatch):
    """The same path on the CPU: MLX's CUDA backend stood in for by tests/kernel_standin.py's
    emulation, so the kernel's generated source really runs (small contexts: it is slow)."""
    from metal_cluster.kernels import gpu as fast

    monkeypatch.setattr(mx.fast, "cuda_kernel", kernel_standin.EmulatedCudaKernels())
    fast.build_kernel.cache_clear()
    try:
        calls, got, want = _kernel_against_reference(16, [(1, 1), (3, 20), (1, 33), (1, 290)], monkeypatch, "cuda")
    finally:
        fast.build_kernel.cache_clear()
    assert calls == [(3, 512)]
    assert np.abs(want).mean() > 0.1  # outputs of real size, not a pass by vanishing values
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)
