"""The residual add + RMSNorm kernel (kernels/add_norm.py) and the block that uses it
(`fuse.AddNormBlock`) against MLX's own ops and mlx-lm's own block.

Without a GPU the kernel's CUDA text runs in the CPU emulation of tests/kernel_standin.py (and
compiles under nvcc where there is one); on a GPU the real kernel runs.
"""

import importlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.utils import load

import tiny_models
from metal_cluster.kernels import add_norm, gpu_backend
from metal_cluster.stage_worker.model import fuse

standin = importlib.import_module("kernel_standin")
BACKEND = gpu_backend()
# bf16: the kernel sums the squares in another order than MLX's, so the normalised value can
# round to the neighbouring bf16 value.
TOLERANCE = {mx.float32: dict(rtol=1e-5, atol=1e-5), mx.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


@pytest.fixture
def kernel_backend(monkeypatch):
    """The real kernel on a GPU; elsewhere `mx.fast.cuda_kernel` emulated on the CPU."""
    yield from standin.real_or_emulated(monkeypatch, BACKEND, add_norm._kernel)


def close(got, want, dtype):
    assert got.shape == want.shape and got.dtype == want.dtype == dtype
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("hidden", [256, 896, 5120])  # 2-wide loads; one element a load; 8 warps
def test_kernel_equals_mlx_add_then_rms_norm(hidden, dtype, kernel_backend):
    norm = nn.RMSNorm(hidden, eps=1e-6)
    norm.weight = (1 + 0.1 * mx.random.normal((hidden,), key=mx.random.key(1))).astype(dtype)
    spec = add_norm.plan(norm, dtype, kernel_backend)
    assert spec is not None
    x = (4 * mx.random.normal((1, 3, hidden), key=mx.random.key(2))).astype(dtype)
    r = mx.random.normal((1, 3, hidden), key=mx.random.key(3)).astype(dtype)
    h, y = add_norm.add_rms_norm(x, r, norm.weight, spec)
    want_h = x + r
    close(h, want_h, dtype)
    close(y, norm(want_h), dtype)


def test_rows_and_norms_the_kernel_leaves_to_mlx():
    assert add_norm.plan(nn.RMSNorm(64), mx.float32, "cuda") is None  # under one element a thread
    assert add_norm.plan(nn.LayerNorm(256), mx.float32, "cuda") is None
    assert add_norm.plan(nn.RMSNorm(256), mx.bfloat16, "cuda") is None  # a float32 weight for bf16 rows
    assert add_norm.layout(4096, 2) == (4, 8)  # Qwen3-8B in bf16: 16-byte loads, 32 elements a thread
    assert add_norm.layout(12288, 2) == (16, 8)  # wider rows take more warps, not more registers


@pytest.fixture(scope="module")
def llama_layers(tmp_path_factory):
    folder = tiny_models.build_tiny_model("llama", tmp_path_factory.mktemp("llama-add-norm"), hidden_size=256)
    model, _ = load(str(folder))
    return model.model.layers


@pytest.fixture
def llama_layer(llama_layers):
    return llama_layers[0]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
def test_block_equals_mlx_lms_block(llama_layer, dtype, kernel_backend, monkeypatch):
    """An `AddNormBlock` made of mlx-lm's llama block computes what the block does, and keeps its
    modules (and their parameters' names)."""
    monkeypatch.setattr(fuse, "gpu_backend", lambda: kernel_backend)
    llama_layer.update(tree_map(lambda p: p.astype(dtype), llama_layer.parameters()))
    block = fuse.add_norm_block(llama_layer)
    assert isinstance(block, fuse.AddNormBlock) and block.mlp is llama_layer.mlp
    assert sorted(k for k, _ in tree_flatten(block.parameters())) == sorted(k for k, _ in tree_flatten(llama_layer.parameters()))
    x = mx.random.normal((1, 5, 256), key=mx.random.key(4)).astype(dtype)
    close(block(x), llama_layer(x), dtype)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
def test_carried_blocks_equal_mlx_lms_layers(llama_layers, dtype, kernel_backend, monkeypatch):
    """Blocks run by `fuse.run_layers` hand each last residual add to the next block's input-norm
    kernel, and the stack still computes what mlx-lm's layers do one after the other."""
    monkeypatch.setattr(fuse, "gpu_backend", lambda: kernel_backend)
    assert len(llama_layers) >= 2
    for layer in llama_layers:
        layer.update(tree_map(lambda p: p.astype(dtype), layer.parameters()))
    blocks = [fuse.add_norm_block(layer) for layer in llama_layers]
    assert all(isinstance(b, fuse.AddNormBlock) and b.input_spec is not None for b in blocks)
    launches = []
    kernel = add_norm.add_rms_norm
    monkeypatch.setattr(add_norm, "add_rms_norm", lambda *a: launches.append(1) or kernel(*a))
    x = mx.random.normal((1, 5, 256), key=mx.random.key(5)).astype(dtype)
    got = fuse.run_layers(blocks, x, lambda i: None)
    want = x
    for layer in llama_layers:
        want = layer(want)
    # Four random layers grow the residual to ~70: the kernels' other summation order shows there
    # at the dtype's tolerance of the largest value (carried or not). On a GPU float32 products
    # run as TF32 where MLX's CUDA backend allows it (its MLX_ENABLE_TF32 switch): a last-bit
    # difference in a product's input can move its TF32 rounding, ~5e-4 relative, and four layers
    # carry that on (an H200 read 9e-4 of the largest value, where 1e-5 was asked).
    scale = float(mx.abs(want).max())
    tolerance = dict(rtol=2e-3, atol=2e-3) if dtype == mx.float32 and BACKEND is not None else TOLERANCE[dtype]
    assert got.dtype == want.dtype == dtype
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)),
                               rtol=tolerance["rtol"], atol=tolerance["atol"] * scale)
    assert len(launches) == 2 * len(blocks) - 1  # the first block's input norm is MLX's: nothing to add before it


def test_no_block_without_the_kernel(llama_layer, monkeypatch):
    monkeypatch.setattr(fuse, "gpu_backend", lambda: None)
    assert fuse.add_norm_block(llama_layer) is llama_layer  # MLX's CPU backend
    monkeypatch.setattr(fuse, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(fuse, "ADD_NORM", False)
    assert fuse.add_norm_block(llama_layer) is llama_layer  # METAL_CLUSTER_ADD_NORM=0
    monkeypatch.setattr(fuse, "ADD_NORM", True)
    monkeypatch.setattr(fuse, "CARRY", False)
    assert fuse.add_norm_block(llama_layer).input_spec is None  # METAL_CLUSTER_CARRY=0: not carried


def test_one_body_two_backends():
    """Metal runs the text the CUDA tests check: past each backend's prologue it is the same."""
    from metal_cluster.kernels.gpu import _PROLOGUE

    metal_header, metal = add_norm.kernel_source("metal", 4096, 4, 8, 1e-6)
    cuda_header, cuda = add_norm.kernel_source("cuda", 4096, 4, 8, 1e-6)
    assert "simd_sum" in metal_header and "__shfl_xor_sync" in cuda_header
    assert metal.replace(_PROLOGUE["metal"], "") == cuda.replace(_PROLOGUE["cuda"], "")
    assert "{{" not in metal and "EPS = 1.00000000e-06f" in metal  # format() consumed every placeholder


@pytest.mark.skipif(standin.NVCC is None, reason="no nvcc on this machine")
def test_cuda_source_compiles_without_spills():
    for hidden in (4096, 5120, 8192):
        warps, vec = add_norm.layout(hidden, 2)
        header, source = add_norm.kernel_source("cuda", hidden, warps, vec, 1e-6)
        inputs = [("x", mx.bfloat16), ("r", mx.bfloat16), ("weight", mx.bfloat16)]
        unit = standin.cuda_translation_unit("k", header, source, inputs, [("h_out", mx.bfloat16), ("y_out", mx.bfloat16)],
                                             [("T", mx.bfloat16)], standin.NVCC_DEVICE_HEADER)
        used = standin.nvcc_resources(unit)
        assert used["spill_stores"] == 0 and used["spill_loads"] == 0, used["log"]
