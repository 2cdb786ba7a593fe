"""MLX's CPU wheel bundles a slow reference BLAS; OpenBLAS, when the host has it, is ~30x faster.

In front of it goes `gemv_forward.c`, built here once with the host's C compiler: a one-row
product (every matmul of a one-token decode step) as a matrix-vector product, which reads the
weights once where OpenBLAS's GEMM packs them first (a SmolLM2 step: 42 against 65 ms on two
cores, bench/README.md). Without a compiler OpenBLAS alone is preloaded.

The dynamic loader only honours LD_PRELOAD at process start, so the CLI re-executes itself once.
"""

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
)
OPT_OUT = "METAL_CLUSTER_NO_OPENBLAS"
GEMV_OPT_OUT = "METAL_CLUSTER_NO_GEMV_FORWARD"  # OpenBLAS's own GEMM for one-row products too (A/B)
GEMV_SOURCE = Path(__file__).with_name("gemv_forward.c")


def mlx_on_cpu() -> bool:
    """Whether this host's MLX runs on the CPU, found without importing MLX (a Metal or CUDA
    context must not be set up in a process vLLM may fork its engine from)."""
    import importlib.metadata

    if sys.platform == "darwin":
        return False  # the plain mlx wheel carries Metal
    names = {(d.metadata["Name"] or "").lower() for d in importlib.metadata.distributions()}
    return not any(n.startswith("mlx-cuda") or n.startswith("mlx_cuda") for n in names)


def find_openblas() -> str | None:
    if not sys.platform.startswith("linux") or os.environ.get(OPT_OUT):
        return None
    return next((p for p in OPENBLAS_CANDIDATES if os.path.exists(p)), None)


def gemv_forward() -> str | None:
    """The built `gemv_forward.c` in front of OpenBLAS, or None (opted out, no OpenBLAS, no compiler)."""
    if find_openblas() is None or os.environ.get(GEMV_OPT_OUT):
        return None
    return _built(GEMV_SOURCE.read_bytes())


@lru_cache(maxsize=None)
def _built(source: bytes) -> str | None:
    """The shared library of `source`, compiled once per version into the user's cache."""
    cc = shutil.which("cc") or shutil.which("gcc")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "metal-cluster"
    lib = cache / f"gemv_forward-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if lib.exists() or cc is None:
        return str(lib) if lib.exists() else None
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as work:
            src, out = Path(work) / "gemv_forward.c", Path(work) / "gemv_forward.so"
            src.write_bytes(source)
            subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(src), "-ldl"], check=True,
                           capture_output=True, timeout=120)
            os.replace(out, lib)  # whole or not at all, whoever builds it at the same time
    except (OSError, subprocess.SubprocessError):
        return None
    return str(lib)


def preloads(forward_gemv: bool = True) -> list[str]:
    """What goes into LD_PRELOAD for CPU matmuls, in order."""
    lib = find_openblas()
    return [] if lib is None else [p for p in (forward_gemv and gemv_forward(), lib) if p]


def openblas_env(env: dict | None = None, forward_gemv: bool = True) -> dict:
    """`env` with OpenBLAS (and, unless told not to, the one-row forwarding) preloaded where
    available: for child processes (workers, benchmarks)."""
    env = dict(os.environ if env is None else env)
    have = env.get("LD_PRELOAD", "")
    wanted = [p for p in preloads(forward_gemv) if p not in have]
    if wanted:
        env["LD_PRELOAD"] = ":".join(filter(None, [*wanted, have]))
    return env


def use_openblas_if_present() -> None:
    libs = preloads()
    if not libs or all(p in os.environ.get("LD_PRELOAD", "") for p in libs):
        return
    forwarding = ", one-row products as matrix-vector products" if len(libs) > 1 else ""
    print(f"metal-cluster: using OpenBLAS ({libs[-1]}) for CPU matmuls{forwarding}", file=sys.stderr)
    os.execve(sys.executable, [sys.executable, "-m", "metal_cluster.coordinator", *sys.argv[1:]], openblas_env())
