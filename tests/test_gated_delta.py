"""The Gated DeltaNet kernel (Metal / CUDA, `kernels/gdn.py`) against mlx-lm's ops.

The comparisons need a GPU and skip elsewhere; the source generation for both backends and the CPU
dispatch (mlx-lm's ops, the reference) run anywhere."""

import mlx.core as mx
import pytest
from mlx_lm.models.gated_delta import gated_delta_ops

from metal_cluster.kernels import gated_delta, gdn, gpu_backend

BACKEND = gpu_backend()
requires_gpu = pytest.mark.skipif(BACKEND is None, reason="no Metal or CUDA GPU: the recurrence runs mlx-lm's ops here")


def inputs(batch, steps, hk, hv, dk, dv, dtype, seed=0):
    keys = mx.random.split(mx.random.key(seed), 6)
    q = mx.random.normal((batch, steps, hk, dk), key=keys[0]).astype(dtype) * dk**-0.5
    k = mx.random.normal((batch, steps, hk, dk), key=keys[1]).astype(dtype) * dk**-0.5
    v = mx.random.normal((batch, steps, hv, dv), key=keys[2]).astype(dtype)
    g = mx.exp(-mx.random.uniform(0.01, 0.5, (batch, steps, hv), key=keys[3]))  # decays in (0.6, 1)
    beta = mx.random.uniform(0, 1, (batch, steps, hv), key=keys[4])
    state = mx.random.normal((batch, hv, dv, dk), key=keys[5]) * 0.1
    return q, k, v, g, beta, state


@pytest.mark.parametrize("backend", ["metal", "cuda"])
def test_one_body_builds_for_both_backends(backend):
    header, source = gdn.kernel_source(backend, 128, 128, 16, 32)
    assert "WARP_SUM" in header and "state_out" in source


def test_cpu_dispatch_is_mlx_lms_ops():
    if BACKEND is not None:
        pytest.skip("a GPU: the kernel takes it")
    args = inputs(2, 5, 2, 4, 32, 16, mx.float32)
    y, state = gated_delta(*args)
    y_ref, state_ref = gated_delta_ops(*args)
    assert mx.array_equal(y, y_ref) and mx.array_equal(state, state_ref)


@requires_gpu
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("batch,steps,hk,hv,dk,dv", [
    (1, 37, 2, 4, 128, 128),  # a prefill chunk, GQA-style heads
    (8, 1, 2, 4, 128, 128),  # decodes
    (3, 5, 16, 32, 128, 128),  # Qwen3-Next's heads
    (2, 9, 2, 2, 64, 32),  # other head dims
])
def test_kernel_matches_mlx_lms_ops(batch, steps, hk, hv, dk, dv, dtype):
    args = inputs(batch, steps, hk, hv, dk, dv, dtype)
    y, state = gdn.gated_delta_kernel(*args, backend=BACKEND)
    with mx.stream(mx.cpu):
        y_ref, state_ref = gated_delta_ops(*(a.astype(mx.float32) for a in args))
    y_tol = 1e-4 if dtype == mx.float32 else 3e-2
    assert state.dtype == mx.float32 and y.dtype == dtype
    assert mx.allclose(state, state_ref, atol=1e-4 if dtype == mx.float32 else 3e-2), \
        float(mx.abs(state - state_ref).max())
    assert mx.allclose(y.astype(mx.float32), y_ref, atol=y_tol, rtol=y_tol), float(mx.abs(y - y_ref).max())
