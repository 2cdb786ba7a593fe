"""The CPU's BLAS as the CLI preloads it (coordinator/blas.py): OpenBLAS, with one-row products
forwarded to its matrix-vector product (coordinator/gemv_forward.c). Each check runs in a fresh
process with that preload, as serve's stages do."""

import subprocess
import sys
from pathlib import Path

import pytest

from metal_cluster.coordinator import blas

TESTS = Path(__file__).parent

pytestmark = pytest.mark.skipif(blas.gemv_forward() is None,
                                reason="no OpenBLAS or no C compiler here: nothing is forwarded")

PROBE = """
import ctypes, os
import mlx.core as mx
import numpy as np
shim = ctypes.CDLL(next(p for p in os.environ["LD_PRELOAD"].split(":") if "gemv_forward" in p))
forwarded = ctypes.c_long.in_dll(shim, "metal_cluster_gemv_forwarded")
mx.random.seed(0)
x, w, b = mx.random.normal((1, 96)), mx.random.normal((80, 96)), mx.random.normal((96, 80))
xs, col = mx.random.normal((3, 96)), mx.random.normal((96, 1))
n = {k: np.array(v, dtype=np.float64) for k, v in dict(x=x, w=w, b=b, xs=xs, col=col).items()}
cases = [  # (name, product, its float64 value, calls forwarded)
    ("x @ w.T", lambda: x @ w.T, n["x"] @ n["w"].T, 1),
    ("x @ b", lambda: x @ b, n["x"] @ n["b"], 1),
    ("col.T @ b", lambda: col.T @ b, n["col"].T @ n["b"], 1),
    ("xs @ w.T", lambda: xs @ w.T, n["xs"] @ n["w"].T, 0),
    ("batched rows", lambda: x[None] @ mx.stack([w.T, 2 * w.T]), n["x"][None] @ np.stack([n["w"].T, 2 * n["w"].T]), 2),
]
for name, product, want, calls in cases:
    before = forwarded.value
    got = product()
    mx.eval(got)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=1e-4, err_msg=name)
    assert forwarded.value - before == calls, (name, forwarded.value - before)
print("ok")
"""


def test_one_row_products_are_forwarded_and_right():
    """One-row products (a decode step's matmuls, either operand transposed, batched ones per
    batch entry) go to GEMV and equal the float64 product; a product of several rows stays GEMM."""
    out = subprocess.run([sys.executable, "-c", PROBE], env=blas.openblas_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_the_runner_equals_mlx_lm_with_both_on_the_preloaded_blas(tmp_path):
    """Greedy tokens of our runner against mlx-lm's generation, both under the CLI's preload, for
    each family and SmolLM2 (tests/test_runner.py's checks, in a process with that preload)."""
    env = {**blas.openblas_env(), "PYTHONDONTWRITEBYTECODE": "1"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TESTS / "test_runner.py"),
                          "-k", "test_one_request or test_smollm2_gguf_matches_mlx_lm"],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:]
    assert " passed" in out.stdout and " skipped" not in out.stdout.splitlines()[-1], out.stdout[-500:]


def test_opting_out_preloads_openblas_alone(monkeypatch):
    monkeypatch.setenv(blas.GEMV_OPT_OUT, "1")
    assert blas.preloads() == [blas.find_openblas()]
    assert "gemv_forward" not in blas.openblas_env({"LD_PRELOAD": ""})["LD_PRELOAD"]
