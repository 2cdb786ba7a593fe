"""The q/k norm + RoPE kernel (kernels/norm_rope.py) against the ops it stands in for.

The reference is `PagedAttention.prepare`: mlx-lm's own attention module's q_norm / k_norm and rope
on the split projections. Without a GPU the kernel's CUDA text runs in the CPU emulation of
tests/kernel_standin.py (and compiles under nvcc where there is one); on a GPU the real kernel runs.
"""

import importlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_map
from mlx_lm.utils import load

import tiny_models
from metal_cluster.kernels import gpu_backend
from metal_cluster.kernels import norm_rope as nr
from metal_cluster.stage_worker.step.attention import PagedAttention

standin = importlib.import_module("kernel_standin")
BACKEND = gpu_backend()
# float32: the angle position x inverse frequency carries the frequency's last-bit difference (MLX's
# CPU ops take exp and log, its GPU kernels and this one exp2) times the position: ~5e-4 at 4097.
TOLERANCE = {mx.float32: dict(rtol=1e-3, atol=1e-3), mx.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


@pytest.fixture
def kernel_backend(monkeypatch):
    """The real kernel on a GPU; elsewhere `mx.fast.cuda_kernel` emulated on the CPU."""
    yield from standin.real_or_emulated(monkeypatch, BACKEND, nr._kernel)


@pytest.fixture(scope="module")
def attention_modules(tmp_path_factory):
    """Layer 0's attention of tiny checkpoints with head dim 64, as mlx-lm loads them: Qwen3 (q/k
    norms, plain RoPE) and Llama with llama3 frequency scaling (no norms)."""
    found = {}
    for family, overrides in (("qwen3", {}), ("llama", {"rope_scaling": LLAMA3_SCALING})):
        folder = tiny_models.build_tiny_model(family, tmp_path_factory.mktemp(family), hidden_size=256,
                                              config_overrides=overrides)
        model, _ = load(str(folder))
        found[family] = model.model.layers[0].self_attn
    return found


def split_and_fused(inner, dtype, tokens, backend, seed):
    """A PagedAttention around `inner` with its fused product's kernel plan, and one random fused
    product of `tokens` tokens at scattered positions (prompt starts, decodes deep in a context)."""
    heads, kv_heads = inner.n_heads, inner.n_kv_heads
    head_dim = inner.q_proj.weight.shape[0] // heads
    inner.update(tree_map(lambda p: p.astype(dtype), inner.parameters()))
    attn = PagedAttention(inner, heads, kv_heads, scale=head_dim ** -0.5)
    attn.qkv_split = [heads * head_dim, (heads + kv_heads) * head_dim]
    attn.norm_rope = nr.plan(inner, heads, kv_heads, head_dim, backend)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = (3 * mx.random.normal((1, tokens, width), key=mx.random.key(seed))).astype(dtype)
    positions = mx.array([0, 1, 7, 63, 64, 1000, 2050, 4097][:tokens], dtype=mx.int32)
    return attn, qkv, positions


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_fused_prepare_equals_the_modules_own_ops(family, dtype, attention_modules, kernel_backend):
    inner = attention_modules[family]
    attn, qkv, positions = split_and_fused(inner, dtype, 8, kernel_backend, seed=len(family))
    assert attn.norm_rope is not None and attn.norm_rope.norm == (family == "qwen3")
    want = attn.prepare(*mx.split(qkv, attn.qkv_split, axis=-1), positions)
    got = attn.prepare_fused(qkv, positions)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == dtype
        np.testing.assert_allclose(np.array(g.astype(mx.float32)), np.array(w.astype(mx.float32)), **TOLERANCE[dtype])


def test_traditional_rotation_pairs_neighbours(kernel_backend):
    """nn.RoPE(traditional=True) rotates (2i, 2i+1), not (i, i + D/2)."""

    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.rope = nn.RoPE(64, traditional=True, base=500.0, scale=0.5)

    inner = Plain()
    spec = nr.plan(inner, 2, 1, 64, kernel_backend)
    qkv = mx.random.normal((3, 4 * 64), key=mx.random.key(5))
    positions = mx.array([2, 40, 900], dtype=mx.int32)
    q, k = nr.norm_rope(qkv, positions, spec)
    heads = qkv[:, : 3 * 64].reshape(3, 3, 1, 64)
    want = inner.rope(heads, offset=positions).reshape(3, 3, 64)
    np.testing.assert_allclose(np.array(q), np.array(want[:, :2]), **TOLERANCE[mx.float32])
    np.testing.assert_allclose(np.array(k), np.array(want[:, 2:]), **TOLERANCE[mx.float32])


def test_rotations_the_kernel_leaves_to_mlx():
    """Partial rotation, head dims that are not whole warps of pairs, and scaled RoPEs that also
    scale their input (SuScaled) or the softmax (YaRN) keep MLX's ops."""
    from mlx_lm.models.rope_utils import SuScaledRoPE

    class With(nn.Module):
        def __init__(self, rope, norm=None):
            super().__init__()
            self.rope = rope
            if norm is not None:
                self.q_norm, self.k_norm = norm, nn.RMSNorm(64)

    assert nr.plan(With(nn.RoPE(64)), 2, 1, 64, "cuda") is not None
    assert nr.plan(With(nn.RoPE(32)), 2, 1, 64, "cuda") is None  # rotates half the head
    assert nr.plan(With(nn.RoPE(32)), 2, 1, 32, "cuda") is None  # 16 pairs: under a warp
    assert nr.plan(With(SuScaledRoPE(64)), 2, 1, 64, "cuda") is None
    assert nr.plan(With(nn.RoPE(64), norm=nn.LayerNorm(64)), 2, 1, 64, "cuda") is None


@pytest.mark.skipif(standin.NVCC is None, reason="no nvcc on this machine")
def test_cuda_source_compiles_without_spills():
    for traditional in (False, True):
        for norm in (False, True):
            header, source = nr.kernel_source("cuda", 32, 8, 128, traditional, norm)
            inputs = [("qkv", mx.bfloat16), ("positions", mx.int32), ("inv_freq", mx.float32), ("consts", mx.float32),
                      ("rows", mx.int32)] + ([("q_weight", mx.bfloat16), ("k_weight", mx.bfloat16)] if norm else [])
            unit = standin.cuda_translation_unit("k", header, source, inputs, [("q_out", mx.bfloat16), ("k_out", mx.bfloat16)],
                                                 [("T", mx.bfloat16)], standin.NVCC_DEVICE_HEADER)
            used = standin.nvcc_resources(unit)
            assert used["spill_stores"] == 0 and used["spill_loads"] == 0, used["log"]
