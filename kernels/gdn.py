"""The Gated DeltaNet recurrence (Qwen3-Next, Qwen3.5): one kernel body for Metal and CUDA.

For each request b, value head h and time step t, with the state S [Dv, Dk] in float32:
    S = g[t] * S;  delta = (v[t] - S @ k[t]) * beta[t];  S = S + delta (outer) k[t];  y[t] = S @ q[t]
A warp owns one row of S (one value dim): each lane keeps Dk / 32 of its entries in registers
for the whole sequence, and the two dot products per step are warp sums. A threadgroup is four
such warps (four rows of one head); q and k are shared by the GQA-style heads that read them.

mlx-lm ships a Metal kernel of this recurrence and loops over tokens in Python elsewhere (its
CUDA backend included); this one runs on both from one body (see `gpu.py` for the macros),
prefills and decodes alike: T is a runtime value.
"""

from functools import lru_cache

import mlx.core as mx

from metal_cluster.kernels.gpu import _COMMON_MACROS, _MACROS, _PROLOGUE, LANES, WARPS

_BODY = """
  constexpr int DK = {dk};
  constexpr int DV = {dv};
  constexpr int HK = {hk};
  constexpr int HV = {hv};
  constexpr int NPL = DK / 32;  // state entries per lane: lane owns k index i * 32 + lane
  const int lane = tid % 32;
  const int T = t_len[0];
  const int rows_per_head = DV / {warps};
  const int n = tg_id / rows_per_head;  // request * HV + value head
  const int dv = (tg_id % rows_per_head) * {warps} + tid / 32;
  const int b = n / HV;
  const int hv = n % HV;
  const int hk = hv / (HV / HK);

  const GLOBAL InT* q_ = q + ((INDEX)b * T * HK + hk) * DK;
  const GLOBAL InT* k_ = k + ((INDEX)b * T * HK + hk) * DK;
  const GLOBAL InT* v_ = v + ((INDEX)b * T * HV + hv) * DV + dv;
  const GLOBAL float* g_ = g + (INDEX)b * T * HV + hv;
  const GLOBAL float* beta_ = beta + (INDEX)b * T * HV + hv;
  GLOBAL InT* y_ = y + ((INDEX)b * T * HV + hv) * DV + dv;
  const INDEX state_row = ((INDEX)n * DV + dv) * DK;

  float s[NPL];
  UNROLL for (int i = 0; i < NPL; ++i) s[i] = state_in[state_row + i * 32 + lane];

  for (int t = 0; t < T; ++t) {{
    const float decay = g_[0];
    float kv = 0.0f;
    UNROLL for (int i = 0; i < NPL; ++i) {{
      s[i] *= decay;
      kv += s[i] * static_cast<float>(k_[i * 32 + lane]);
    }}
    kv = WARP_SUM(kv);
    const float delta = (static_cast<float>(v_[0]) - kv) * beta_[0];
    float out = 0.0f;
    UNROLL for (int i = 0; i < NPL; ++i) {{
      s[i] += static_cast<float>(k_[i * 32 + lane]) * delta;
      out += s[i] * static_cast<float>(q_[i * 32 + lane]);
    }}
    out = WARP_SUM(out);
    if (lane == 0) y_[0] = static_cast<InT>(out);
    q_ += HK * DK;
    k_ += HK * DK;
    v_ += HV * DV;
    y_ += HV * DV;
    g_ += HV;
    beta_ += HV;
  }}
  UNROLL for (int i = 0; i < NPL; ++i) state_out[state_row + i * 32 + lane] = s[i];
"""


def supports(q: mx.array, v: mx.array) -> bool:
    """Shapes the kernel takes: Dk a multiple of 32 (a lane's share of a state row), Dv of the
    warps per threadgroup."""
    return q.shape[-1] % LANES == 0 and v.shape[-1] % WARPS == 0 and q.dtype in (mx.float32, mx.bfloat16, mx.float16)


def kernel_source(backend: str, dk: int, dv: int, hk: int, hv: int) -> tuple[str, str]:
    body = _BODY.format(dk=dk, dv=dv, hk=hk, hv=hv, warps=WARPS)
    return _MACROS[backend] + _COMMON_MACROS, _PROLOGUE[backend] + body


@lru_cache(maxsize=None)
def build_kernel(backend: str, dk: int, dv: int, hk: int, hv: int):
    header, source = kernel_source(backend, dk, dv, hk, hv)
    make = mx.fast.metal_kernel if backend == "metal" else mx.fast.cuda_kernel
    return make(name=f"gated_delta_k{dk}_v{dv}_h{hk}x{hv}", input_names=["q", "k", "v", "g", "beta", "state_in", "t_len"],
                output_names=["y", "state_out"], source=source, header=header)


@lru_cache(maxsize=64)
def _t_len(t: int) -> mx.array:
    # One small array per sequence length, not a new one per layer and step.
    return mx.array([t], dtype=mx.int32)


def gated_delta_kernel(q, k, v, g, beta, state, backend: str):
    """q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; state [B, Hv, Dv, Dk] float32.
    Returns y [B, T, Hv, Dv] (q's dtype) and the new state (float32)."""
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    kernel = build_kernel(backend, Dk, Dv, Hk, Hv)
    return kernel(
        inputs=[q, k, v, g.astype(mx.float32), beta.astype(mx.float32), state.astype(mx.float32),
                _t_len(T)],
        template=[("InT", q.dtype)],
        grid=(B * Hv * Dv * LANES, 1, 1),
        threadgroup=(WARPS * LANES, 1, 1),
        output_shapes=[(B, T, Hv, Dv), (B, Hv, Dv, Dk)],
        output_dtypes=[q.dtype, mx.float32],
    )
