"""Queries' and keys' per-head RMSNorm and RoPE in one kernel, read from a fused q/k/v product.

A Qwen3 layer norms each head of q and of k, then rotates both: four launches of a few
microseconds each over a few KB at decode (two `rms_norm`s, two `rope`s; an H200 spent 0.39 ms a
step of Qwen3-8B on them, bench/README.md). Where q/k/v are one product (`model/fuse.py`) this
kernel reads the heads straight from it and writes q and k normed and rotated: one launch a layer.
Families without q/k norms (Llama, Qwen2) take the same kernel without the norm.

One warp per (token, head): each lane holds HALF / 32 rotation pairs; the norm's sum of squares is
a warp sum. Rounding follows MLX's own kernels, so results stay within bf16's last bit of the
four-launch chain: the normed value is rounded to the model's dtype, multiplied by the weight and
rounded again, then rotated in float32 and rounded once more.

RoPE kinds taken: `nn.RoPE` (base and scale; "default" and "linear" scaling) and mlx-lm's
`Llama3RoPE` (per-frequency table); any other rotation (YaRN, SuScaled, partial dims) keeps MLX's ops.
"""

import math
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metal_cluster.kernels.gpu import _COMMON_MACROS, _MACROS, _PROLOGUE, LANES, WARPS

_MATH = {
    "metal": "#define RSQRT(x) metal::rsqrt(x)\n#define COS(x) metal::cos(x)\n#define SIN(x) metal::sin(x)\n",
    "cuda": "#define RSQRT(x) rsqrtf(x)\n#define COS(x) cosf(x)\n#define SIN(x) sinf(x)\n",
}

_BODY = """
  constexpr int D = {head_dim};
  constexpr int H = {heads};
  constexpr int KVH = {kv_heads};
  constexpr int W = (H + 2 * KVH) * D;  // one token's row of the fused product: q, k, v heads
  constexpr int HALF = D / 2;
  constexpr int NP = HALF / 32;  // rotation pairs per lane
  constexpr bool TRADITIONAL = {traditional};
  const int lane = tid % 32;
  const int n = tg_id * {warps} + tid / 32;  // this warp's (token, head)
  if (n >= rows[0]) return;  // the whole warp: n is the warp's
  const int t = n / (H + KVH);
  const int h = n % (H + KVH);  // q heads first, then k heads, as the product lays them out
  const GLOBAL T* src = qkv + (INDEX)t * W + (INDEX)h * D;
  float a[NP];
  float b[NP];
  int ia[NP];
  int ib[NP];
  UNROLL for (int j = 0; j < NP; ++j) {{
    const int i = j * 32 + lane;
    ia[j] = TRADITIONAL ? 2 * i : i;
    ib[j] = TRADITIONAL ? 2 * i + 1 : i + HALF;
    a[j] = static_cast<float>(src[ia[j]]);
    b[j] = static_cast<float>(src[ib[j]]);
  }}
{norm}  const float position = consts[0] * static_cast<float>(positions[t]);
  GLOBAL T* dst = h < H ? q_out + ((INDEX)t * H + h) * D : k_out + ((INDEX)t * KVH + (h - H)) * D;
  UNROLL for (int j = 0; j < NP; ++j) {{
    const float theta = position * inv_freq[j * 32 + lane];
    const float c = COS(theta);
    const float s = SIN(theta);
    dst[ia[j]] = static_cast<T>(a[j] * c - b[j] * s);
    dst[ib[j]] = static_cast<T>(a[j] * s + b[j] * c);
  }}
"""


# q_norm / k_norm: RMSNorm of each head over its D values, as MLX's rms_norm rounds it.
_NORM = """  float ss = 0.0f;
  UNROLL for (int j = 0; j < NP; ++j) ss += a[j] * a[j] + b[j] * b[j];
  const float inv = RSQRT(WARP_SUM(ss) / D + consts[1]);
  UNROLL for (int j = 0; j < NP; ++j) {
    const float wa = h < H ? static_cast<float>(q_weight[ia[j]]) : static_cast<float>(k_weight[ia[j]]);
    const float wb = h < H ? static_cast<float>(q_weight[ib[j]]) : static_cast<float>(k_weight[ib[j]]);
    a[j] = static_cast<float>(static_cast<T>(wa * static_cast<float>(static_cast<T>(a[j] * inv))));
    b[j] = static_cast<float>(static_cast<T>(wb * static_cast<float>(static_cast<T>(b[j] * inv))));
  }
"""


@dataclass(frozen=True)
class NormRope:
    """One attention module's heads and rotation, as the kernel takes them."""

    heads: int
    kv_heads: int
    head_dim: int
    traditional: bool
    inv_freq: mx.array  # [head_dim / 2] float32
    consts: mx.array  # [position scale, norm eps] float32
    norm: bool  # q_norm / k_norm (RMSNorm over the head dim) before the rotation
    backend: str  # "metal" or "cuda"


def rotation(rope: nn.Module, head_dim: int) -> tuple[np.ndarray, float, bool] | None:
    """(inverse frequencies, position scale, traditional) of a RoPE module the kernel can stand in
    for, rotating the whole head; None for any other."""
    if getattr(rope, "dims", None) != head_dim or head_dim % 64:
        return None
    half = head_dim // 2
    if type(rope) is nn.RoPE:
        # MLX's kernels: inv_freq = 2^(-(i / half) * log2(base)).
        exponent = -(np.arange(half, dtype=np.float32) / np.float32(half)) * np.float32(math.log2(rope.base))
        return np.exp2(exponent).astype(np.float32), float(rope.scale), bool(rope.traditional)
    if type(rope).__name__ == "Llama3RoPE" and hasattr(rope, "_freqs"):
        return (1.0 / np.array(rope._freqs, dtype=np.float32)).astype(np.float32), 1.0, bool(rope.traditional)
    return None


def plan(attention: nn.Module, heads: int, kv_heads: int, head_dim: int, backend: str) -> NormRope | None:
    """The kernel's view of an mlx-lm attention module (its `rope`, its optional `q_norm`/`k_norm`)
    on `backend`, or None where it must keep MLX's ops."""
    found = rotation(getattr(attention, "rope", None), head_dim)
    if found is None:
        return None
    norms = [getattr(attention, name, None) for name in ("q_norm", "k_norm")]
    if any(n is not None for n in norms):
        if not all(type(n) is nn.RMSNorm and n.weight.shape == (head_dim,) for n in norms):
            return None
        if norms[0].eps != norms[1].eps:
            return None
    inv_freq, scale, traditional = found
    eps = norms[0].eps if norms[0] is not None else 0.0
    return NormRope(heads, kv_heads, head_dim, traditional, mx.array(inv_freq),
                    mx.array([scale, eps], dtype=mx.float32), norms[0] is not None, backend)


def kernel_source(backend: str, heads: int, kv_heads: int, head_dim: int, traditional: bool, norm: bool) -> tuple[str, str]:
    body = _BODY.format(head_dim=head_dim, heads=heads, kv_heads=kv_heads, warps=WARPS,
                        traditional="true" if traditional else "false", norm=_NORM if norm else "")
    return _MACROS[backend] + _COMMON_MACROS + _MATH[backend], _PROLOGUE[backend] + body


@lru_cache(maxsize=None)
def _kernel(backend: str, heads: int, kv_heads: int, head_dim: int, traditional: bool, norm: bool):
    header, source = kernel_source(backend, heads, kv_heads, head_dim, traditional, norm)
    make = mx.fast.metal_kernel if backend == "metal" else mx.fast.cuda_kernel
    name = f"norm_rope_d{head_dim}_h{heads}x{kv_heads}" + ("_trad" if traditional else "") + ("_norm" if norm else "")
    inputs = ["qkv", "positions", "inv_freq", "consts", "rows"] + (["q_weight", "k_weight"] if norm else [])
    return make(name=name, input_names=inputs, output_names=["q_out", "k_out"], source=source, header=header)


@lru_cache(maxsize=64)
def _rows(n: int) -> mx.array:
    return mx.array([n], dtype=mx.int32)


def norm_rope(qkv: mx.array, positions: mx.array, spec: NormRope, q_weight: mx.array | None = None, k_weight: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """q [T, heads, D] and k [T, kv_heads, D], normed (if the spec says) and rotated at `positions`
    [T], from the fused product `qkv` [T, (heads + 2 kv_heads) D]."""
    tokens = qkv.shape[0]
    rows = tokens * (spec.heads + spec.kv_heads)
    kernel = _kernel(spec.backend, spec.heads, spec.kv_heads, spec.head_dim, spec.traditional, spec.norm)
    inputs = [qkv, positions.astype(mx.int32), spec.inv_freq, spec.consts, _rows(rows)]
    if spec.norm:
        inputs += [q_weight, k_weight]
    groups = -(-rows // WARPS)
    q, k = kernel(inputs=inputs, template=[("T", qkv.dtype)], grid=(groups * WARPS * LANES, 1, 1),
                  threadgroup=(WARPS * LANES, 1, 1),
                  output_shapes=[(tokens, spec.heads, spec.head_dim), (tokens, spec.kv_heads, spec.head_dim)],
                  output_dtypes=[qkv.dtype, qkv.dtype])
    return q, k
