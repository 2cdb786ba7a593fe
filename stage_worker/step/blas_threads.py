"""BLAS threads per step on MLX's CPU backend, where the CLI preloads OpenBLAS (coordinator/blas.py).

OpenBLAS threads a matrix-vector product well, and a prompt chunk's large products too, but a
product of a handful of rows (a decode step of 4 to 8 requests) it splits so badly that one thread
beats two, and its second thread then spins beside vLLM's API server for a core. Measured on a
2-core x86_64 host with SmolLM2-135M in float32, a decode step through one stage, median ms with 2
threads / 1 (the same noisy machine, runs minutes apart): batch 1 49 / 72, 2 60-65 / 77-79, 3 77 /
89, 4 87-95 / 70-77, 6 101 / 102, 8 115 / 103, 16 163 / 187; a 256-token prompt 704 / 950. So a
step of `MIN_ROWS` to `MAX_ROWS` packed tokens runs on one BLAS thread and any other on all of them
(OPENBLAS_NUM_THREADS, or every core). Under `serve`: bench/README.md ("Time per output token with
vLLM's own client").

Nothing happens elsewhere: on a GPU, or where OpenBLAS is not the BLAS MLX calls.
"""

import ctypes
import functools
import os

import mlx.core as mx

MIN_ROWS, MAX_ROWS = 4, 8


class BlasThreads:
    def __init__(self):
        self._set_threads, self._all = _openblas()
        self._current = None  # unknown: a runner of an earlier plan may have left one thread set

    def for_step(self, num_tokens: int) -> None:
        """Before building a step of `num_tokens` packed tokens. MLX runs the step's calls on its CPU
        stream's thread; OpenBLAS reads the count as each call starts, so a call already running
        keeps its threads."""
        if self._set_threads is None:
            return
        wanted = 1 if MIN_ROWS <= num_tokens <= MAX_ROWS else self._all
        if wanted != self._current:
            self._set_threads(wanted)
            self._current = wanted


@functools.cache
def _openblas():
    """(openblas_set_num_threads, the thread count the process started with), or (None, 0) where
    OpenBLAS is not the BLAS MLX's CPU backend calls. Read once, before any step changed the count."""
    lib = next((p for p in os.environ.get("LD_PRELOAD", "").split(":") if "libopenblas" in p), None)
    if lib is None or mx.default_device().type != mx.DeviceType.cpu:
        return None, 0
    try:
        handle = ctypes.CDLL(lib)  # the preloaded library itself: dlopen returns its handle
        return handle.openblas_set_num_threads, handle.openblas_get_num_threads()
    except (OSError, AttributeError):
        return None, 0
