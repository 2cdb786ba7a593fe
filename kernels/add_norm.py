"""A residual add and the RMSNorm that follows it, in one kernel: h = x + r, y = rms_norm(h) * w.

A pre-norm decoder block adds its attention's output to the residual, then norms the sum for its
MLP: two launches of a few microseconds each over a few KB per token at decode, one after the
other on the step's critical path (an H200 spent ~0.17 ms a Qwen3-8B step on the pair,
bench/README.md). This kernel reads x and r once and writes both the sum (the block's next
residual) and its norm: one launch a layer.

One threadgroup per token row; each thread keeps its share of the row in registers between the
sum of squares and the scaling. Rounding follows MLX's own ops: the sum is rounded to the dtype
(MLX's add), and the norm rounds the normalised value to the dtype before the weight's product
is rounded again (MLX's rms_norm kernels), so results stay within the dtype's last bit.
"""

from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metal_cluster.kernels.gpu import _COMMON_MACROS, _MACROS, _PROLOGUE, LANES, WARPS
from metal_cluster.kernels.norm_rope import _MATH  # RSQRT per backend

# Row elements a thread keeps in registers, at most: wider rows get more warps a threadgroup.
MAX_PER_THREAD = 32
MAX_WARPS = 32  # 1024 threads: the most a threadgroup has on both backends

_BODY = """
  constexpr int N = {hidden};
  constexpr int NSG = {warps};
  constexpr int VEC = {vec};
  constexpr int CH = N / (NSG * 32 * VEC);  // loads of VEC elements a thread
  typedef PaVec<T, VEC> Row;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const INDEX base = (INDEX)tg_id * N;
  constexpr float EPS = {eps};
  Row hv[CH];
  Row wv[CH];  // loaded with the row: the weight's latency is not left for after the reduction
  float ss = 0.0f;
  UNROLL for (int c = 0; c < CH; ++c) {{
    const int off = (c * NSG * 32 + tid) * VEC;
    wv[c] = *reinterpret_cast<const GLOBAL Row*>(weight + off);
    const Row xa = *reinterpret_cast<const GLOBAL Row*>(x + base + off);
    const Row ra = *reinterpret_cast<const GLOBAL Row*>(r + base + off);
    UNROLL for (int e = 0; e < VEC; ++e) {{
      hv[c].v[e] = static_cast<T>(static_cast<float>(xa.v[e]) + static_cast<float>(ra.v[e]));
      const float f = static_cast<float>(hv[c].v[e]);
      ss += f * f;
    }}
    *reinterpret_cast<GLOBAL Row*>(h_out + base + off) = hv[c];
  }}
  SHARED float partial[NSG];
  ss = WARP_SUM(ss);
  if (lane == 0) partial[warp] = ss;
  BARRIER();
  float total = 0.0f;
  UNROLL for (int w = 0; w < NSG; ++w) total += partial[w];
  const float inv = RSQRT(total / N + EPS);
  UNROLL for (int c = 0; c < CH; ++c) {{
    const int off = (c * NSG * 32 + tid) * VEC;
    Row y;
    UNROLL for (int e = 0; e < VEC; ++e) {{
      const float normed = static_cast<float>(static_cast<T>(static_cast<float>(hv[c].v[e]) * inv));
      y.v[e] = static_cast<T>(static_cast<float>(wv[c].v[e]) * normed);
    }}
    *reinterpret_cast<GLOBAL Row*>(y_out + base + off) = y;
  }}
"""


@dataclass(frozen=True)
class AddNorm:
    """One RMSNorm's row layout as the kernel takes it."""

    hidden: int
    warps: int
    vec: int  # elements per load
    eps: float  # compiled in: the row's scaling waits on no load for it
    backend: str  # "metal" or "cuda"


def layout(hidden: int, itemsize: int) -> tuple[int, int] | None:
    """(warps a threadgroup, elements per load) for rows of `hidden` elements: the fewest warps
    that keep a thread's share within MAX_PER_THREAD, then the widest load (16 bytes at most) that
    splits the row evenly; None when no whole number of warps does (MLX's ops then stay)."""
    warps = WARPS
    while warps <= MAX_WARPS:
        if hidden % (warps * LANES) == 0 and hidden // (warps * LANES) <= MAX_PER_THREAD:
            vec = max(1, 16 // itemsize)
            while hidden % (warps * LANES * vec):
                vec //= 2
            return warps, vec
        warps *= 2
    return None


def plan(norm: nn.Module, dtype: mx.Dtype, backend: str) -> AddNorm | None:
    """The kernel's view of an RMSNorm module for activations of `dtype` on `backend`, or None
    where MLX's ops must stay (another norm, a weight of another dtype, a row it cannot split)."""
    if type(norm) is not nn.RMSNorm or norm.weight.ndim != 1 or norm.weight.dtype != dtype:
        return None
    found = layout(norm.weight.shape[0], dtype.size)
    if found is None:
        return None
    warps, vec = found
    return AddNorm(norm.weight.shape[0], warps, vec, float(np.float32(norm.eps)), backend)


def kernel_source(backend: str, hidden: int, warps: int, vec: int, eps: float) -> tuple[str, str]:
    # 9 significant digits name a float32 exactly.
    body = _BODY.format(hidden=hidden, warps=warps, vec=vec, eps=f"{eps:.8e}f")
    return _MACROS[backend] + _COMMON_MACROS + _MATH[backend], _PROLOGUE[backend] + body


@lru_cache(maxsize=None)
def _kernel(backend: str, hidden: int, warps: int, vec: int, eps: float):
    header, source = kernel_source(backend, hidden, warps, vec, eps)
    make = mx.fast.metal_kernel if backend == "metal" else mx.fast.cuda_kernel
    eps_bits = np.float32(eps).view(np.uint32)  # in the name too: MLX caches a kernel by its name
    return make(name=f"add_rms_norm_n{hidden}_w{warps}_v{vec}_e{eps_bits:08x}", input_names=["x", "r", "weight"],
                output_names=["h_out", "y_out"], source=source, header=header)


def add_rms_norm(x: mx.array, r: mx.array, weight: mx.array, spec: AddNorm) -> tuple[mx.array, mx.array]:
    """(x + r, its RMSNorm times `weight`), both shaped and typed as x; rows over the last axis."""
    rows = x.size // spec.hidden
    kernel = _kernel(spec.backend, spec.hidden, spec.warps, spec.vec, spec.eps)
    threads = spec.warps * LANES
    h, y = kernel(inputs=[x, r.astype(x.dtype), weight], template=[("T", x.dtype)],
                  grid=(rows * threads, 1, 1), threadgroup=(threads, 1, 1),
                  output_shapes=[x.shape, x.shape], output_dtypes=[x.dtype, x.dtype])
    return h, y
