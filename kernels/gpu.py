"""Paged varlen attention kernels: one algorithm, Metal and CUDA backends from one source.

Each kernel is written once (`_DECODE_BODY`, `_REDUCE_BODY`, `_PREFILL_BODY`) against a handful of
macros (`_MACROS`) and a per-backend prologue that names the thread/threadgroup indices; the
builders glue them together for `mx.fast.metal_kernel` or `mx.fast.cuda_kernel`. A threadgroup
(CUDA block) is always 4 SIMD groups / warps of 32 lanes, so the same reductions work on both.

Three kernels:
- decode (every request has one query): one threadgroup per (request, kv head[, head tile][, KV
  split]). It serves all the GQA query heads of that kv head, so each K/V row is read from memory
  once; past a register budget (`decode_plan`: GQA > 16 at head dim 128, MLA's 16-128 heads) the
  heads are tiled over threadgroups, each K row then read once per tile. A key row is read by a
  few lanes with 16-byte loads (`decode_layout`: 16 lanes for bf16 x 128), so a warp reads several
  rows side by side, each such slot several keys ahead; every slot keeps its own online softmax
  and the slots merge once at the end (shuffles, then shared memory). For MLA (DeepSeek V2/V3's
  absorbed decode) V is the leading `v_dim` values of each K row (the latent, 512 of 576): the
  lanes' K registers serve as V, so no second row is read and no V pool exists.
- split-KV reduce: when there are too few (request, kv head) pairs to fill the GPU, the context is
  cut into partitions computed by separate threadgroups (`plan_decode_splits`); this pass merges
  their partial (max, sum, unnormalised output) into the final row.
- prefill / mixed: one threadgroup per (query tile, kv head). Tiles never straddle requests; a
  tile finds its request by a binary search over `cu_seqlens_q` (vLLM's unified-kernel scheme:
  request r owns tiles starting at cu_seqlens_q[r] // BQ + r). K/V tiles of 16 keys are staged in
  shared memory; for the scores each lane takes one key (half the head dim each), for P@V lanes
  split the head dim, so the softmax needs only a few shuffles per 16 keys.

Runtime values (request count, block size, window, partition, block-table stride) travel in one
small int32 array so that a new step never recompiles; only dtype, head dims (K, V), the GQA ratio
and its head tile are compile-time (they size register arrays).

Every warp collective (shuffle, simd_sum, warp barrier) runs on all 32 lanes, and every loop that
holds one has a warp-uniform trip count: on CUDA a full-mask shuffle that only some lanes reach is
undefined ("illegal instruction", or a hang). That is also why no macro takes a collective as an
argument (see MAXF).
"""

import os
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx

from metal_cluster.kernels.metadata import AttentionMetadata

WARPS = 4  # SIMD groups / warps per threadgroup
LANES = 32
THREADS = WARPS * LANES


# decode: keys each slot (LPK lanes) loads before reducing, for memory-level parallelism; fewer for
# large GQA ratios, whose per-head registers (query and accumulator) grow with the ratio. On an H200
# (GQA 2, bf16 x 128) 4 was best or tied with 2 at every shape; 8 was up to 35 % slower.
def keys_per_warp_step(gqa: int) -> int:
    return 4 if gqa <= 4 else 2


def decode_layout(head_dim: int, itemsize: int) -> tuple[int, int]:
    """(elements per load, lanes per key row) for the decode kernel.

    Loads are 16 bytes where the head dim splits into a power-of-two number of such chunks (at most
    32 lanes a row) or a multiple of 32 of them; otherwise narrower, down to one element a lane.
    """
    vec = max(1, 16 // itemsize)
    while vec > 1:
        n = head_dim // vec
        if head_dim % vec == 0 and (n % 32 == 0 or n & (n - 1) == 0):
            break
        vec //= 2
    return vec, min(32, head_dim // vec)


# Per-lane float registers the decode kernel may spend on its query heads (query and accumulator,
# EPL + EPV a head). Up to REGISTERS_WHOLE one threadgroup serves every query head of its kv head
# (all the existing shapes: GQA 16 x (8 + 8) at most, so their code is what it was, though nvcc 13
# for sm_90 spills ~1.2 KB at GQA 16 x bf16 x 128); past it (MLA's 16-128 heads over one 576-wide KV
# head) the heads are tiled over threadgroups, each tile within REGISTERS_TILE (MLA: 4 heads x
# (18 + 16) a tile, 253 registers and no spill on sm_90; tests/test_kernels.py checks with nvcc).
REGISTERS_WHOLE = 256
REGISTERS_TILE = 144


@dataclass(frozen=True)
class DecodePlan:
    """The decode kernel's compile-time layout for one shape (see `decode_plan`)."""

    head_dim: int  # K head dim
    v_dim: int  # V head dim: head_dim, or MLA's latent width (V = the K row's leading v_dim values)
    gqa: int
    vec: int  # elements per load of a row's V part
    lanes_per_key: int
    tail_vec: int  # elements per load of the K row's tail (head_dim - v_dim), 1 when none
    heads_per_group: int  # query heads one threadgroup serves (== gqa: no head tiling)
    keys_per_step: int
    shared_v: bool

    @property
    def head_tiles(self) -> int:
        return self.gqa // self.heads_per_group

    @property
    def head_floats(self) -> int:
        """Per-lane float registers of the query heads a threadgroup serves."""
        return self.heads_per_group * floats_per_head(self.head_dim, self.v_dim, self.lanes_per_key)


def floats_per_head(head_dim: int, v_dim: int, lanes_per_key: int) -> int:
    """A lane's query and accumulator floats for one query head."""
    return head_dim // lanes_per_key + v_dim // lanes_per_key


def decode_plan(head_dim: int, gqa: int, itemsize: int, v_dim: int | None = None, shared_v: bool = False,
                keys_per_step: int | None = None) -> DecodePlan | None:
    """The decode kernel's layout, or None for a shape it does not take. The V part (the row's
    first v_dim values) is laid out as `decode_layout` says; a K tail past it (MLA's rope part) is
    read by the same lanes in loads as wide as its share allows."""
    v_dim = head_dim if v_dim is None else v_dim
    if v_dim <= 0 or v_dim > head_dim or (v_dim != head_dim and not shared_v):
        return None
    vec, lanes = decode_layout(v_dim, itemsize)
    tail = head_dim - v_dim
    if v_dim % (vec * lanes) or head_dim % vec or tail % lanes:
        return None
    tail_vec = 1
    while tail and (tail // lanes) % (2 * tail_vec) == 0 and 2 * tail_vec <= vec:
        tail_vec *= 2
    per_head = floats_per_head(head_dim, v_dim, lanes)
    if per_head > REGISTERS_TILE:
        return None
    heads = gqa
    if gqa * per_head > REGISTERS_WHOLE:
        heads = max(h for h in range(1, gqa + 1) if gqa % h == 0 and h * per_head <= REGISTERS_TILE)
    if keys_per_step is None:
        keys_per_step = keys_per_warp_step(gqa) if heads == gqa else 2
    return DecodePlan(head_dim, v_dim, gqa, vec, lanes, tail_vec, heads, keys_per_step, shared_v)


# A decode launch of few threadgroups (batch 1: one a kv head) leaves most SMs idle, and each
# group's loop waits on memory: more warps a group put more keys in flight. On CUDA only (measured
# on an H200; Metal's limits on a threadgroup's registers are unmeasured here), and only where the
# per-lane head registers stay small enough for 8 warps to share one SM (GQA 4 x 128: 168
# registers a thread at 4 keys in flight).
SMALL_DECODE_GRID = 64
MANY_WARPS = 8


def decode_warps(groups: int, plan: DecodePlan, backend: str) -> int:
    """Warps per decode threadgroup for a launch of `groups` threadgroups."""
    if backend == "cuda" and groups <= SMALL_DECODE_GRID and plan.keys_per_step <= 4 and plan.head_floats <= 64:
        return MANY_WARPS
    return WARPS


# The prefill / mixed kernel serves batches with multi-token queries; METAL_CLUSTER_PREFILL_KERNEL=0
# sends those to the reference instead (for comparisons).
PREFILL_KERNEL_ENABLED = os.environ.get("METAL_CLUSTER_PREFILL_KERNEL", "1") != "0"
PREFILL_KEY_TILE = 16  # prefill: keys staged in shared memory per step
PREFILL_ROWS = 16  # prefill: (query token, head) rows per threadgroup

# The per-step int32 parameter block, by index.
P_NUM_REQS, P_MAX_BLOCKS, P_BLOCK_SIZE, P_WINDOW, P_PARTITION, P_NUM_SPLITS, P_BS_SHIFT = range(7)
NUM_PARAMS = 7

BACKENDS = ("metal", "cuda")

# --- per-backend glue -----------------------------------------------------------------------

_MACROS = {
    "metal": """
#define SHARED threadgroup
#define BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define WARP_SUM(x) simd_sum(x)
#define SHFL_XOR(x, m) simd_shuffle_xor((x), (ushort)(m))
#define WARP_BARRIER() simdgroup_barrier(mem_flags::mem_threadgroup)
#define UNROLL _Pragma("clang loop unroll(full)")
#define EXP(x) metal::fast::exp(x)
#define MAXF(a, b) metal::max(float(a), float(b))
#define INDEX long
#define GLOBAL device
template <typename U, int N> struct PaVec { U v[N]; };
""",
    "cuda": """
#define SHARED __shared__
#define BARRIER() __syncthreads()
#define WARP_SUM(x) pa_warp_sum(x)
#define SHFL_XOR(x, m) __shfl_xor_sync(0xffffffffu, (x), (m))
#define WARP_BARRIER() __syncwarp()
#define UNROLL _Pragma("unroll")
#define EXP(x) __expf(x)
#define MAXF(a, b) fmaxf((a), (b))
#define INDEX long long
#define GLOBAL
// A row chunk read with one load instruction (16 bytes when N * sizeof(U) == 16).
template <typename U, int N> struct alignas(sizeof(U) * N) PaVec { U v[N]; };
__device__ __forceinline__ float pa_warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
""",
}

# MAXF is a function on both backends: a ternary macro evaluates its argument twice, and a warp
# shuffle passed to it then runs on only the lanes that take that branch (on CUDA a divergent
# full-mask __shfl_xor_sync is undefined: "illegal instruction" or a hang). MINI/MAXI take plain
# values only.
_COMMON_MACROS = """
#define MINI(a, b) ((a) < (b) ? (a) : (b))
#define MAXI(a, b) ((a) > (b) ? (a) : (b))
#define NEG_BIG (-1.0e30f)
"""

# The index names each backend gives a kernel. On Metal, naming an attribute in the body is what
# makes MLX add it to the generated signature, so the prologue must live in the body.
_PROLOGUE = {
    "metal": """
  const int tg_id = int(threadgroup_position_in_grid.x);
  const int tid = int(thread_position_in_threadgroup.x);
""",
    "cuda": """
  const int tg_id = int(blockIdx.x);
  const int tid = int(threadIdx.x);
""",
}

_CONSTANTS = """
  constexpr int D = {head_dim};
  constexpr int DV = {v_dim};  // V head dim: D, or (MLA) the leading DV values of each K row
  constexpr int G = {gqa};
  constexpr int NSG = {warps};
  constexpr int DPL = D / 32;  // head-dim elements per lane: lane owns d = i * 32 + lane
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int num_reqs = params[{p_num_reqs}];
  const int max_blocks = params[{p_max_blocks}];
  const int BS = params[{p_block_size}];
  const int window = params[{p_window}];
  const int partition = params[{p_partition}];
  const int num_splits = {num_splits};
  const int bs_shift = params[{p_bs_shift}];  // log2(BS), or -1 when BS is no power of two
  const float qk_scale = scale[0];
  const int KVH = {kv_heads};
  const int H = KVH * G;
"""

# --- decode ---------------------------------------------------------------------------------

_DECODE_BODY = """
  // Lane layout: LPK lanes share one key row, each holding NV vectors of VEC elements (16-byte
  // loads where the head dim allows); a warp reads KPW rows side by side, the threadgroup SLOTS.
  // Every slot keeps its own online softmax, so the main loop needs shuffles only for the dot
  // products (log2(LPK) per key and head, shared by KPW keys); slots merge once at the end.
  // A K row is its first DV values (the V part: NV vectors a lane) and a tail of D - DV (NT
  // vectors of TVEC a lane; none unless MLA). SHARED_V: V is that leading part of the K row itself
  // (MLA's latent), so the K registers serve as V and no second row is read.
  // The threadgroup serves HT of the G query heads of its kv head (head tile ht of NHT): large
  // GQA ratios are tiled, since the per-head registers (query and accumulator) grow with them.
  constexpr int VEC = {vec};
  constexpr int LPK = {lanes_per_key};
  constexpr int NV = DV / (LPK * VEC);
  constexpr int EPV = NV * VEC;  // V-part elements per lane
  constexpr int TVEC = {tail_vec};
  constexpr int NT = (D - DV) / (LPK * TVEC);
  constexpr int EPL = EPV + NT * TVEC;  // K elements per lane
  constexpr int KPW = 32 / LPK;
  constexpr int SLOTS = NSG * KPW;
  constexpr int U = {keys_per_step};  // keys per slot in flight per step
  constexpr int HT = {heads_per_group};
  constexpr int NHT = G / HT;
  constexpr bool SHARED_V = {shared_v};
  typedef PaVec<T, VEC> Row;
  typedef PaVec<T, TVEC> TailRow;
  const int split = tg_id % num_splits;
  const int ht = (tg_id / num_splits) % NHT;
  const int kvh = (tg_id / (num_splits * NHT)) % KVH;
  const int r = tg_id / (num_splits * NHT * KVH);
  const int h0 = kvh * G + ht * HT;  // this threadgroup's first query head
  const int ctx = seq_lens[r];
  const int q_row = r;  // a decode batch: one query row per request
  const int pos = ctx - 1;  // the one query sits at the end of its context
  const int lo = window > 0 ? MAXI(0, pos - window + 1) : 0;
  const int k_begin = MAXI(lo, split * partition);
  const int k_end = MINI(ctx, (split + 1) * partition);
  const int slot = warp * KPW + lane / LPK;
  const int sl = lane % LPK;

  float qv[HT][EPL];
  float acc[HT][EPV];
  float m[HT];
  float l[HT];
  UNROLL for (int g = 0; g < HT; ++g) {{
    const INDEX qbase = ((INDEX)q_row * H + h0 + g) * D;
    UNROLL for (int c = 0; c < NV; ++c) {{
      UNROLL for (int x = 0; x < VEC; ++x) {{
        qv[g][c * VEC + x] = static_cast<float>(q[qbase + (c * LPK + sl) * VEC + x]) * qk_scale;
        acc[g][c * VEC + x] = 0.0f;
      }}
    }}
    UNROLL for (int c = 0; c < NT; ++c) {{
      UNROLL for (int x = 0; x < TVEC; ++x) {{
        qv[g][EPV + c * TVEC + x] = static_cast<float>(q[qbase + DV + (c * LPK + sl) * TVEC + x]) * qk_scale;
      }}
    }}
    m[g] = NEG_BIG;
    l[g] = 0.0f;
  }}
{decode_sinks}
  const GLOBAL int* table = block_tables + (INDEX)r * max_blocks;
  // The trip count depends only on the warp (its first key), never on the lane: the shuffles
  // inside need every lane of the warp. Keys past k_end are loaded clamped and weigh 0.
  for (int kb = k_begin; kb + warp * KPW < k_end; kb += SLOTS * U) {{
    Row kr[U][NV];
    Row vr[U][NV];
    TailRow tr[U][NT > 0 ? NT : 1];
    UNROLL for (int j = 0; j < U; ++j) {{
      const int k = MINI(kb + j * SLOTS + slot, k_end - 1);
      const int blk = bs_shift >= 0 ? (k >> bs_shift) : k / BS;
      const INDEX row = ((INDEX)table[blk] * BS + (k - blk * BS)) * KVH + kvh;
      const INDEX base = row * D;
      UNROLL for (int c = 0; c < NV; ++c) {{
        kr[j][c] = *reinterpret_cast<const GLOBAL Row*>(k_pool + base + (c * LPK + sl) * VEC);
        if (!SHARED_V) vr[j][c] = *reinterpret_cast<const GLOBAL Row*>(v_pool + row * DV + (c * LPK + sl) * VEC);
      }}
      UNROLL for (int c = 0; c < NT; ++c) {{
        tr[j][c] = *reinterpret_cast<const GLOBAL TailRow*>(k_pool + base + DV + (c * LPK + sl) * TVEC);
      }}
    }}
    float s[U][HT];
    UNROLL for (int j = 0; j < U; ++j) {{
      float kf[EPL];
      UNROLL for (int c = 0; c < NV; ++c) {{
        UNROLL for (int x = 0; x < VEC; ++x) kf[c * VEC + x] = static_cast<float>(kr[j][c].v[x]);
      }}
      UNROLL for (int c = 0; c < NT; ++c) {{
        UNROLL for (int x = 0; x < TVEC; ++x) kf[EPV + c * TVEC + x] = static_cast<float>(tr[j][c].v[x]);
      }}
      UNROLL for (int g = 0; g < HT; ++g) {{
        float part = 0.0f;
        UNROLL for (int e = 0; e < EPL; ++e) part += qv[g][e] * kf[e];
        UNROLL for (int o = LPK / 2; o > 0; o >>= 1) part += SHFL_XOR(part, o);
        s[j][g] = part;
      }}
    }}
    UNROLL for (int g = 0; g < HT; ++g) {{
      float m_new = m[g];
      UNROLL for (int j = 0; j < U; ++j) {{
        if (kb + j * SLOTS + slot < k_end) m_new = MAXF(m_new, s[j][g]);
      }}
      const float alpha = EXP(m[g] - m_new);
      l[g] *= alpha;
      UNROLL for (int e = 0; e < EPV; ++e) acc[g][e] *= alpha;
      UNROLL for (int j = 0; j < U; ++j) {{
        const float p = kb + j * SLOTS + slot < k_end ? EXP(s[j][g] - m_new) : 0.0f;
        l[g] += p;
        UNROLL for (int c = 0; c < NV; ++c) {{
          UNROLL for (int x = 0; x < VEC; ++x) {{
            acc[g][c * VEC + x] += p * static_cast<float>(SHARED_V ? kr[j][c].v[x] : vr[j][c].v[x]);
          }}
        }}
      }}
      m[g] = m_new;
    }}
  }}

  // Merge the KPW slots of each warp (butterfly over the lanes that differ in lane / LPK): every
  // lane ends with its warp's softmax state for its elements.
  UNROLL for (int g = 0; g < HT; ++g) {{
    UNROLL for (int o = LPK; o < 32; o <<= 1) {{
      const float m_o = SHFL_XOR(m[g], o);
      const float l_o = SHFL_XOR(l[g], o);
      const float m_new = MAXF(m[g], m_o);
      const float a = EXP(m[g] - m_new);
      const float b = EXP(m_o - m_new);
      l[g] = l[g] * a + l_o * b;
      UNROLL for (int e = 0; e < EPV; ++e) {{
        const float acc_o = SHFL_XOR(acc[g][e], o);
        acc[g][e] = acc[g][e] * a + acc_o * b;
      }}
      m[g] = m_new;
    }}
  }}

  // Merge the warps' online softmaxes, one head at a time (bounded shared memory).
  SHARED float sm_ml[NSG * HT * 2];
  SHARED float sm_o[NSG * DV];
  if (lane == 0) {{
    UNROLL for (int g = 0; g < HT; ++g) {{
      sm_ml[(warp * HT + g) * 2] = m[g];
      sm_ml[(warp * HT + g) * 2 + 1] = l[g];
    }}
  }}
  BARRIER();
  UNROLL for (int g = 0; g < HT; ++g) {{
    float M = NEG_BIG;
    for (int w = 0; w < NSG; ++w) M = MAXF(M, sm_ml[(w * HT + g) * 2]);
    float L = 0.0f;
    for (int w = 0; w < NSG; ++w) L += sm_ml[(w * HT + g) * 2 + 1] * EXP(sm_ml[(w * HT + g) * 2] - M);
    const float f = EXP(m[g] - M);
    if (lane < LPK) {{
      UNROLL for (int c = 0; c < NV; ++c) {{
        UNROLL for (int x = 0; x < VEC; ++x) sm_o[warp * DV + (c * LPK + lane) * VEC + x] = acc[g][c * VEC + x] * f;
      }}
    }}
    BARRIER();
    const int h = h0 + g;
    for (int d = tid; d < DV; d += NSG * 32) {{
      float o = 0.0f;
      for (int w = 0; w < NSG; ++w) o += sm_o[w * DV + d];
      {store}
    }}
    BARRIER();
  }}
"""

# Learned attention sinks (GPT-OSS): a per-head logit that joins the softmax with no value. It
# seeds one online softmax per (query, head) with m = sink, l = exp(sink - m) = 1; in a decode only
# the first slot of the first split takes it, since the merges add the slots' and splits' sums.
_DECODE_SINKS = """
  if (slot == 0 && split == 0) {{
    UNROLL for (int g = 0; g < HT; ++g) {{
      m[g] = static_cast<float>(sinks[h0 + g]);
      l[g] = 1.0f;
    }}
  }}
"""
_PREFILL_SINKS = """
  UNROLL for (int rr = 0; rr < RPW; ++rr) {{
    const int row = warp * RPW + rr;
    if (row < ROWS) {{
      m[rr] = static_cast<float>(sinks[kvh * G + row % G]);
      l[rr] = 1.0f;
    }}
  }}
"""

# Where a decode threadgroup's merged row goes: straight to the output, or to the split partials.
_DECODE_STORE_FINAL = "out[((INDEX)q_row * H + h) * DV + d] = static_cast<T>(o / L);"
_DECODE_STORE_SPLIT = """const INDEX ph = ((INDEX)q_row * H + h) * num_splits + split;
      part_o[ph * DV + d] = o;
      if (d == 0) {{ part_ml[ph * 2] = M; part_ml[ph * 2 + 1] = L; }}"""

# --- split-KV reduce ------------------------------------------------------------------------

_REDUCE_BODY = """
  // One thread per (query row, head, d); DV threads per threadgroup.
  const INDEX idx = (INDEX)tg_id * DV + tid;
  const INDEX rh = (INDEX)tg_id;
  float M = NEG_BIG;
  for (int s = 0; s < num_splits; ++s) M = MAXF(M, part_ml[(rh * num_splits + s) * 2]);
  float L = 0.0f;
  float o = 0.0f;
  for (int s = 0; s < num_splits; ++s) {{
    const INDEX ps = rh * num_splits + s;
    const float w = EXP(part_ml[ps * 2] - M);  // empty partitions have l == 0, o == 0
    L += part_ml[ps * 2 + 1] * w;
    o += part_o[ps * DV + tid] * w;
  }}
  out[idx] = static_cast<T>(o / L);
"""

# --- prefill / mixed ------------------------------------------------------------------------

_PREFILL_BODY = """
  constexpr int BK = {key_tile};
  constexpr int BQ = {tile_tokens};  // query tokens per tile; rows = BQ * G (token-major)
  constexpr int ROWS = BQ * G;
  constexpr int RPW = (ROWS + NSG - 1) / NSG;
  constexpr int KSTRIDE = D + 2;  // K row pitch in shared memory: no bank conflicts below

  const int kvh = tg_id % KVH;
  const int tile = tg_id / KVH;
  // Find the request owning this tile: the last r with cu_seqlens_q[r] / BQ + r <= tile.
  int lo_r = 0;
  int hi_r = num_reqs;
  while (lo_r < hi_r) {{
    const int mid = (lo_r + hi_r) / 2;
    if (cu_seqlens_q[mid] / BQ + mid <= tile) lo_r = mid + 1; else hi_r = mid;
  }}
  const int r = lo_r - 1;
  const int q0 = cu_seqlens_q[r];
  const int q_len = cu_seqlens_q[r + 1] - q0;
  const int q_start = (tile - (q0 / BQ + r)) * BQ;
  // A request's spare tile (q_start >= q_len) gets no queries and no keys, but still runs to the
  // end: no thread leaves before the barriers and warp collectives below.
  const int ctx = seq_lens[r];
  const int q_count = MAXI(0, MINI(BQ, q_len - q_start));
  const int pos0 = ctx - q_len + q_start;  // position of the tile's first query
  const int k_lo = window > 0 ? MAXI(0, pos0 - window + 1) : 0;
  const int k_hi = q_count > 0 ? pos0 + q_count : k_lo;  // exclusive: causal

  SHARED float sq[ROWS * D];
  SHARED float sk[BK * KSTRIDE];
  SHARED float sv[BK * D];
  SHARED float sp[NSG * BK];  // each warp's probabilities for the current key tile
  for (int e = tid; e < ROWS * D; e += NSG * 32) {{
    const int row = e / D;
    const int d = e % D;
    const int t = row / G;
    const int g = row % G;
    sq[e] = t < q_count
        ? static_cast<float>(q[((INDEX)(q0 + q_start + t) * H + kvh * G + g) * D + d]) * qk_scale
        : 0.0f;
  }}

  float acc[RPW][DPL];
  float m[RPW];
  float l[RPW];
  UNROLL for (int rr = 0; rr < RPW; ++rr) {{
    m[rr] = NEG_BIG;
    l[rr] = 0.0f;
    for (int i = 0; i < DPL; ++i) acc[rr][i] = 0.0f;
  }}
{prefill_sinks}
  const GLOBAL int* table = block_tables + (INDEX)r * max_blocks;
  const int kj = lane % BK;   // score phase: this lane's key in the tile
  const int kpart = lane / BK; // ... and which interleaved half of the head dim it sums (`half` is a type)
  for (int kt = k_lo; kt < k_hi; kt += BK) {{
    BARRIER();  // the previous tile is no longer read
    for (int e = tid; e < BK * D; e += NSG * 32) {{
      const int j = e / D;
      const int d = e % D;
      const int k = kt + j;
      float kx = 0.0f;
      float vx = 0.0f;
      if (k < k_hi) {{
        const INDEX base = (((INDEX)table[k / BS] * BS + k % BS) * KVH + kvh) * D + d;
        kx = static_cast<float>(k_pool[base]);
        vx = static_cast<float>(v_pool[base]);
      }}
      sk[j * KSTRIDE + d] = kx;
      sv[j * D + d] = vx;
    }}
    BARRIER();
    UNROLL for (int rr = 0; rr < RPW; ++rr) {{
      const int row = warp * RPW + rr;
      if (row < ROWS) {{  // warp-uniform; an `if` (not `break`) keeps acc[] in registers
      const int t = row / G;
      const int pos = pos0 + t;
      float s = 0.0f;
      for (int i = 0; i < D / 2; ++i) s += sq[row * D + 2 * i + kpart] * sk[kj * KSTRIDE + 2 * i + kpart];
      s += SHFL_XOR(s, 16);
      const int k = kt + kj;
      const bool visible = t < q_count && k <= pos && k < k_hi && (window <= 0 || pos - k < window);
      float tmax = visible ? s : NEG_BIG;
      for (int o = BK / 2; o > 0; o >>= 1) tmax = MAXF(tmax, SHFL_XOR(tmax, o));
      const float m_new = MAXF(m[rr], tmax);
      const float p = visible ? EXP(s - m_new) : 0.0f;
      float psum = p;
      for (int o = BK / 2; o > 0; o >>= 1) psum += SHFL_XOR(psum, o);
      const float alpha = EXP(m[rr] - m_new);
      l[rr] = l[rr] * alpha + psum;
      m[rr] = m_new;
      UNROLL for (int i = 0; i < DPL; ++i) acc[rr][i] *= alpha;
      WARP_BARRIER();  // the previous row's probabilities have been read
      if (lane < BK) sp[warp * BK + lane] = p;
      WARP_BARRIER();
      for (int j = 0; j < BK; ++j) {{
        const float pj = sp[warp * BK + j];
        UNROLL for (int i = 0; i < DPL; ++i) acc[rr][i] += pj * sv[j * D + i * 32 + lane];
      }}
      }}
    }}
  }}

  UNROLL for (int rr = 0; rr < RPW; ++rr) {{
    const int row = warp * RPW + rr;
    const int t = row / G;
    const int g = row % G;
    if (row >= ROWS || t >= q_count) continue;
    const INDEX obase = ((INDEX)(q0 + q_start + t) * H + kvh * G + g) * D;
    const float inv = 1.0f / l[rr];
    for (int i = 0; i < DPL; ++i) out[obase + i * 32 + lane] = static_cast<T>(acc[rr][i] * inv);
  }}
"""


# --- source generation ----------------------------------------------------------------------

def prefill_tile_tokens(gqa: int) -> int:
    """Query tokens per prefill tile: PREFILL_ROWS rows of (token, head) per threadgroup."""
    return max(1, PREFILL_ROWS // gqa)


def kernel_source(kind: str, backend: str, head_dim: int, gqa: int, itemsize: int = 2,
                  keys_per_step: int | None = None, sinks: bool = False, v_dim: int | None = None,
                  shared_v: bool = False, warps: int = WARPS, kv_heads: int | None = None) -> tuple[str, str]:
    """(header, body) of one kernel for one backend. `kind`: decode, decode_split, reduce, prefill.
    `itemsize` (bytes per q/K/V element) sets the decode kernel's load width; `sinks`: the kernel
    takes a `sinks` input, one logit per query head. `v_dim` (decode and reduce): V's head dim when
    it differs from K's, which needs `shared_v`: V is the leading v_dim values of each K row, read
    from `k_pool` (MLA's latent); the kernel then never reads `v_pool`. `warps`: warps per
    threadgroup. `kv_heads`: compiled in, where None reads it from the `k_pool_kvh` input; a decode
    threadgroup finds its request from it, so a constant spares the kernel's first dependent load."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}")
    v_dim = head_dim if v_dim is None else v_dim
    if kind == "prefill" and (v_dim != head_dim or shared_v):
        raise ValueError("the prefill kernel needs V's head dim equal to K's, in its own pool")
    plan = decode_plan(head_dim, gqa, itemsize, v_dim, shared_v, keys_per_step)
    if plan is None and kind != "prefill":
        raise ValueError(f"no decode layout for K/V head dims {head_dim}/{v_dim} (itemsize {itemsize})")
    vec, lanes_per_key = decode_layout(head_dim, itemsize) if plan is None else (plan.vec, plan.lanes_per_key)
    fields = dict(
        head_dim=head_dim, v_dim=v_dim, gqa=gqa, warps=warps, vec=vec, lanes_per_key=lanes_per_key,
        tail_vec=plan.tail_vec if plan else 1, heads_per_group=plan.heads_per_group if plan else gqa,
        keys_per_step=plan.keys_per_step if plan else keys_per_warp_step(gqa),
        shared_v="true" if shared_v else "false",
        key_tile=PREFILL_KEY_TILE, tile_tokens=prefill_tile_tokens(gqa),
        p_num_reqs=P_NUM_REQS, p_max_blocks=P_MAX_BLOCKS, p_block_size=P_BLOCK_SIZE,
        p_window=P_WINDOW, p_partition=P_PARTITION, p_bs_shift=P_BS_SHIFT,
        kv_heads="k_pool_kvh[0]" if kv_heads is None else kv_heads,
        num_splits=1 if kind == "decode" else f"params[{P_NUM_SPLITS}]",  # whole: no parameter to wait for
    )
    if kind == "decode":
        body = _DECODE_BODY.replace("{store}", _DECODE_STORE_FINAL)
    elif kind == "decode_split":
        body = _DECODE_BODY.replace("{store}", _DECODE_STORE_SPLIT)
    elif kind == "reduce":
        body = _REDUCE_BODY
    elif kind == "prefill":
        body = _PREFILL_BODY
    else:
        raise ValueError(f"unknown kernel {kind!r}")
    body = body.replace("{decode_sinks}", _DECODE_SINKS if sinks else "")
    body = body.replace("{prefill_sinks}", _PREFILL_SINKS if sinks else "")
    source = _PROLOGUE[backend] + _CONSTANTS.format(**fields) + body.format(**fields)
    return _MACROS[backend] + _COMMON_MACROS, source


_INPUTS = {
    "decode": ["q", "k_pool", "v_pool", "cu_seqlens_q", "seq_lens", "block_tables", "params", "scale", "k_pool_kvh"],
    "prefill": ["q", "k_pool", "v_pool", "cu_seqlens_q", "seq_lens", "block_tables", "params", "scale", "k_pool_kvh"],
    "reduce": ["part_o", "part_ml", "params", "scale", "k_pool_kvh"],
}
_INPUTS["decode_split"] = _INPUTS["decode"]
_OUTPUTS = {"decode": ["out"], "decode_split": ["part_o", "part_ml"], "reduce": ["out"], "prefill": ["out"]}


def kernel_name(kind: str, head_dim: int, gqa: int, itemsize: int = 2, keys_per_step: int | None = None,
                sinks: bool = False, v_dim: int | None = None, shared_v: bool = False, warps: int = WARPS,
                kv_heads: int | None = None) -> str:
    """MLX caches compiled kernels by name: the name carries every compile-time choice (and is
    what it always was for the shapes without a V dim of their own or head tiles)."""
    v_dim = head_dim if v_dim is None else v_dim
    plan = decode_plan(head_dim, gqa, itemsize, v_dim, shared_v, keys_per_step)
    vec = decode_layout(head_dim, itemsize)[0] if plan is None else plan.vec
    u = keys_per_step or (plan.keys_per_step if plan else keys_per_warp_step(gqa))
    name = f"paged_attn_{kind}_d{head_dim}"
    if v_dim != head_dim:
        name += f"_dv{v_dim}"
    name += f"_g{gqa}"
    if plan is not None and plan.head_tiles > 1:
        name += f"_t{plan.heads_per_group}"
    name += f"_v{vec}_u{u}"
    if plan is not None and plan.tail_vec > 1:
        name += f"_tv{plan.tail_vec}"
    if warps != WARPS:
        name += f"_w{warps}"
    if kv_heads is not None:
        name += f"_h{kv_heads}"
    return name + ("_kv" if shared_v else "") + ("_sinks" if sinks else "")


@lru_cache(maxsize=None)
def build_kernel(kind: str, backend: str, head_dim: int, gqa: int, itemsize: int = 2, keys_per_step: int | None = None,
                 sinks: bool = False, v_dim: int | None = None, shared_v: bool = False, warps: int = WARPS,
                 kv_heads: int | None = None):
    sinks = sinks and kind != "reduce"
    header, source = kernel_source(kind, backend, head_dim, gqa, itemsize, keys_per_step, sinks, v_dim, shared_v,
                                   warps, kv_heads)
    name = kernel_name(kind, head_dim, gqa, itemsize, keys_per_step, sinks, v_dim, shared_v, warps, kv_heads)
    make = mx.fast.metal_kernel if backend == "metal" else mx.fast.cuda_kernel
    inputs = _INPUTS[kind] + (["sinks"] if sinks else [])
    return make(name=name, input_names=inputs, output_names=_OUTPUTS[kind], source=source, header=header)


# --- planning (pure Python) -----------------------------------------------------------------

# Enough threadgroups to keep every SM / GPU core busy with several resident groups each (an
# H200 has 132 SMs; Apple GPUs have 10-80 cores). Below this, decode splits the context.
TARGET_THREADGROUPS = {"cuda": 2048, "metal": 512}
MIN_PARTITION = 256


def plan_decode_splits(num_reqs: int, kv_heads: int, max_ctx: int,
                       target: int = TARGET_THREADGROUPS["metal"], min_partition: int = MIN_PARTITION) -> tuple[int, int]:
    """(num_splits, partition tokens) for a decode batch.

    Split the context only when (request, kv head) pairs alone cannot fill the GPU, and never into
    partitions so short that the merge pass costs more than the parallelism buys.
    """
    groups = max(1, num_reqs * kv_heads)
    if groups >= target or max_ctx <= min_partition:
        return 1, max(1, max_ctx)
    want = -(-target // groups)
    partition = max(min_partition, -(-max_ctx // want))
    partition = -(-partition // 64) * 64  # round to whole warp steps
    return -(-max_ctx // partition), partition


def prefill_num_tiles(num_tokens: int, num_reqs: int, gqa: int) -> int:
    """Tiles launched for a packed batch: request r's tiles start at cu_seqlens_q[r] // BQ + r."""
    return num_tokens // prefill_tile_tokens(gqa) + num_reqs


def tile_request(cu_seqlens_q: list[int], tile: int, tile_tokens: int) -> tuple[int, int]:
    """Python mirror of the prefill kernel's binary search: (request, first query row) of a tile,
    or (request, -1) for a request's spare tile. Kept for tests and for reading the kernel."""
    lo, hi = 0, len(cu_seqlens_q) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if cu_seqlens_q[mid] // tile_tokens + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    r = lo - 1
    q_start = (tile - (cu_seqlens_q[r] // tile_tokens + r)) * tile_tokens
    q_len = cu_seqlens_q[r + 1] - cu_seqlens_q[r]
    return r, (cu_seqlens_q[r] + q_start if q_start < q_len else -1)


@dataclass
class _StepArrays:
    """Per-step kernel inputs, built once per step and shared by every layer."""

    params: mx.array
    scale: mx.array
    kvh: mx.array


def _step_arrays(meta: AttentionMetadata, scale: float, kv_heads: int, window, partition, splits) -> _StepArrays:
    # The metadata object lives for one step and is shared by all layers: caching the small
    # parameter arrays on it saves a host->device copy per layer.
    cache = meta.__dict__.setdefault("_paged_attention_cache", {})
    key = (float(scale), kv_heads, window, partition, splits)
    if key not in cache:
        params = [0] * NUM_PARAMS
        params[P_NUM_REQS] = len(meta.seq_lens_host)
        params[P_MAX_BLOCKS] = meta.block_tables.shape[1]
        params[P_BLOCK_SIZE] = meta.block_size
        params[P_WINDOW] = window or 0
        params[P_PARTITION] = partition
        params[P_NUM_SPLITS] = splits
        bs = meta.block_size
        params[P_BS_SHIFT] = bs.bit_length() - 1 if bs & (bs - 1) == 0 else -1
        cache[key] = _StepArrays(
            mx.array(params, dtype=mx.int32), mx.array([scale], dtype=mx.float32), mx.array([kv_heads], dtype=mx.int32)
        )
    return cache[key]


# --- entry point ----------------------------------------------------------------------------

def is_decode(q, meta: AttentionMetadata) -> bool:
    return q.shape[0] == len(meta.query_lens_host) and all(n == 1 for n in meta.query_lens_host)


# The prefill kernel keeps a (token, head) row per warp slot: it takes GQA ratios up to this. Larger
# ratios (MLA's 16-128 query heads over one latent) have only the decode kernel, which tiles them.
PREFILL_MAX_GQA = 16


def supports(q, k_pool, meta: AttentionMetadata, v_pool=None, kernel_only: bool = False, v_dim: int | None = None) -> bool:
    """Whether the kernels take this batch: shapes they handle and, unless `kernel_only`, batches
    where they are the faster path; anything else goes to the reference. `v_dim`: V is the leading
    v_dim values of each K row (MLA's latent; `v_pool` unused), which only the decode kernel reads."""
    head_dim, heads, kv_heads = q.shape[2], q.shape[1], k_pool.shape[-2]
    if not (heads % kv_heads == 0 and k_pool.shape[-1] == head_dim
            and q.dtype in (mx.float32, mx.bfloat16, mx.float16) and k_pool.dtype == q.dtype):
        return False
    gqa = heads // kv_heads
    if v_dim is not None:
        return (is_decode(q, meta) and v_dim % 32 == 0 and v_dim <= 1024
                and decode_plan(head_dim, gqa, q.dtype.size, v_dim, shared_v=True) is not None)
    v_pool = k_pool if v_pool is None else v_pool
    if not (head_dim % 32 == 0 and head_dim <= 256
            and v_pool.shape[-1] == head_dim  # a narrower V of its own: the reference (MLA passes v_dim)
            and v_pool.dtype == q.dtype):
        return False
    if gqa > PREFILL_MAX_GQA:
        return is_decode(q, meta)
    return kernel_only or is_decode(q, meta) or PREFILL_KERNEL_ENABLED


def paged_attention_kernel(q, k_pool, v_pool, meta: AttentionMetadata, scale: float, sliding_window=None,
                           backend: str = "metal", sinks=None, v_dim: int | None = None):
    """The fast path behind `metal_cluster.kernels.paged_attention` (same contract). `v_dim`: V is
    the leading v_dim values of each K row, read in place from `k_pool` (decodes only)."""
    if v_dim is not None and not is_decode(q, meta):
        raise ValueError("V as a prefix of the K rows (v_dim) is for decode batches only")
    # Every layer of a step sees the same metadata and, layer after layer, the same shapes: the
    # plan, the kernels and the launch sizes are made by the first and reused by the others.
    launches = meta.__dict__.setdefault("_paged_attention_launches", {})
    key = (q.shape, q.dtype, k_pool.shape, float(scale), sliding_window or 0, backend, sinks is not None, v_dim)
    launch = launches.get(key)
    if launch is None:
        launch = launches[key] = _launch(q, k_pool, meta, scale, sliding_window or 0, backend, sinks is not None, v_dim)
    return launch(q, k_pool, k_pool if v_dim is not None else v_pool, sinks)


def _launch(q, k_pool, meta, scale, window, backend, has_sinks, v_dim):
    """call(q, k_pool, v_pool, sinks) launching the kernels for this shape of one step."""
    total_q, heads, head_dim = q.shape
    kv_heads = k_pool.shape[-2]
    gqa = heads // kv_heads
    num_reqs = len(meta.seq_lens_host)
    if is_decode(q, meta):
        return _decode_launch(q, meta, scale, window, backend, num_reqs, kv_heads, gqa, has_sinks, v_dim)
    step = _step_arrays(meta, scale, kv_heads, window, 0, 1)
    kernel = build_kernel("prefill", backend, head_dim, gqa, sinks=has_sinks)
    fixed = [meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, step.params, step.scale, step.kvh]
    sizes = dict(template=[("T", q.dtype)], grid=(prefill_num_tiles(total_q, num_reqs, gqa) * kv_heads * THREADS, 1, 1),
                 threadgroup=(THREADS, 1, 1), output_shapes=[q.shape], output_dtypes=[q.dtype])

    def call(q, k_pool, v_pool, sinks):
        return kernel(inputs=[q, k_pool, v_pool, *fixed, *_sinks(sinks)], **sizes)[0]

    return call


def _decode_launch(q, meta, scale, window, backend, num_reqs, kv_heads, gqa, has_sinks, v_dim=None):
    head_dim = q.shape[2]
    shared_v = v_dim is not None
    v_dim = head_dim if v_dim is None else v_dim
    plan = decode_plan(head_dim, gqa, q.dtype.size, v_dim, shared_v)
    tiles = plan.head_tiles
    # Partitions cover absolute positions; with a sliding window the early ones are simply empty.
    max_ctx = max(meta.seq_lens_host)
    splits, partition = plan_decode_splits(num_reqs, kv_heads * tiles, max_ctx, TARGET_THREADGROUPS[backend])
    step = _step_arrays(meta, scale, kv_heads, window, partition, splits)
    fixed = [meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, step.params, step.scale, step.kvh]
    groups = num_reqs * kv_heads * tiles * splits
    warps = decode_warps(groups, plan, backend)
    layout = (head_dim, gqa, q.dtype.size, plan.keys_per_step, has_sinks)
    shape = dict(v_dim=v_dim, shared_v=True) if shared_v else {}
    shape.update(warps=warps, kv_heads=kv_heads)
    out_shape = (q.shape[0], q.shape[1], v_dim)
    launch = dict(template=[("T", q.dtype)], grid=(groups * warps * LANES, 1, 1), threadgroup=(warps * LANES, 1, 1))
    if splits == 1:
        kernel = build_kernel("decode", backend, *layout, **shape)

        def whole(q, k_pool, v_pool, sinks):
            return kernel(inputs=[q, k_pool, v_pool, *fixed, *_sinks(sinks)], output_shapes=[out_shape],
                          output_dtypes=[q.dtype], **launch)[0]

        return whole
    rows = num_reqs * q.shape[1]
    split = build_kernel("decode_split", backend, *layout, **shape)
    mla = dict(itemsize=q.dtype.size, v_dim=v_dim, shared_v=True) if shared_v else {}
    reduce = build_kernel("reduce", backend, head_dim, gqa, **mla)
    reduce_inputs = [step.params, step.scale, step.kvh]
    reduce_launch = dict(template=[("T", q.dtype)], grid=(rows * v_dim, 1, 1), threadgroup=(v_dim, 1, 1),
                         output_shapes=[out_shape], output_dtypes=[q.dtype])

    def in_parts(q, k_pool, v_pool, sinks):
        part_o, part_ml = split(
            inputs=[q, k_pool, v_pool, *fixed, *_sinks(sinks)], output_shapes=[(rows * splits, v_dim), (rows * splits, 2)],
            output_dtypes=[mx.float32, mx.float32], **launch)
        return reduce(inputs=[part_o, part_ml, *reduce_inputs], **reduce_launch)[0]

    return in_parts


def _sinks(sinks) -> list:
    return [] if sinks is None else [sinks.astype(mx.float32)]


__all__ = [
    "BACKENDS", "DecodePlan", "build_kernel", "decode_plan", "kernel_name", "kernel_source", "paged_attention_kernel",
    "plan_decode_splits",
    "prefill_num_tiles", "prefill_tile_tokens", "supports", "tile_request", "is_decode", "PREFILL_KERNEL_ENABLED",
]
