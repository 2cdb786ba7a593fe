"""MLX's CPU wheel bundles a slow reference BLAS; OpenBLAS, when the host has it, is ~30x faster.

The dynamic loader only honours LD_PRELOAD at process start, so the CLI re-executes itself once.
"""

import os
import sys

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
)
OPT_OUT = "METAL_CLUSTER_NO_OPENBLAS"


def find_openblas() -> str | None:
    if not sys.platform.startswith("linux") or os.environ.get(OPT_OUT):
        return None
    return next((p for p in OPENBLAS_CANDIDATES if os.path.exists(p)), None)


def openblas_env(env: dict | None = None) -> dict:
    """`env` with OpenBLAS preloaded where available: for child processes (workers, benchmarks)."""
    env = dict(os.environ if env is None else env)
    lib = find_openblas()
    if lib and lib not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(filter(None, [lib, env.get("LD_PRELOAD")]))
    return env


def use_openblas_if_present() -> None:
    lib = find_openblas()
    if lib is None or lib in os.environ.get("LD_PRELOAD", ""):
        return
    print(f"metal-cluster: using OpenBLAS ({lib}) for CPU matmuls", file=sys.stderr)
    os.execve(sys.executable, [sys.executable, "-m", "metal_cluster.coordinator", *sys.argv[1:]], openblas_env())
