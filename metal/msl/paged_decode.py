"""Fused paged decode attention over the KVarN block pool on Apple GPUs (``mx.fast.metal_kernel``).

The Metal twin of the CUDA scalar body (``metal.cuda.paged_decode``): the same split-K plan
(``metal.paged_plan``), the same
two launches (attention: one threadgroup of 128 threads per (work item, KV head), online softmax
in float32, K and V dequantized from the pool read in place; combine: the splits merged, inverse
Hadamard, cast), the same inputs and outputs. ``paged_decode_attention`` has the CUDA wrapper's
signature and semantics; every plan runs both launches (a plan of one work item a row too: the
combine then only normalizes and rotates back).

Limits it is written to (Apple GPUs): 128 threads a threadgroup (of at most 1,024), at most
29.3 KB of threadgroup memory (of 32 KB; ``threadgroup_bytes``), 32-lane simdgroups. The comment
above the Metal source (``HEADER``) says what differs from the CUDA body.

**What was verified where** (docs/kernels.md, "Metal twins"): the Metal text run by a g++ emulator
of the Metal execution model on Linux CPUs (``tests/metal/metal_emulator.py``); it was never
compiled by Apple's Metal compiler on this project's machines. On an Apple GPU
the selector (``metal.selector.Kernels``) compiles it and checks it against the reference at first use, and
falls back to the reference if that fails.

The module owns the whole kernel: its Metal text (``HEADER``, ``ATTENTION_SOURCE`` and
``COMBINE_SOURCE``, below the constants), the launches, the ``run`` that the commit twin shares, and
the wrapper.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx

from metal.launch import minify, scalar_inputs
from metal.paged_plan import DecodePlan, RowLengths, make_plan
from metal.records import RECORD_FIELDS

NUM_THREADS = 128  # one threadgroup: 4 simdgroups of 32
MAX_THREADGROUP_MEMORY = 32 * 1024  # Apple GPUs
SUPPORTED_BITS = (2, 3, 4, 8)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_TILE_SIZES = (64, 128)
MAX_REP = 8
COMPILE_OPTIONS = {"math_mode": "safe"}  # MLX's default (IEEE: exp2(-inf) == 0 is relied on)

ATTENTION_INPUTS = ["queries", "win_k", "win_v", *RECORD_FIELDS, "table", "rows", "work", "meta", "meta_f"]
ATTENTION_OUTPUTS = ["part_o", "part_ml"]
COMBINE_INPUTS = ["part_o", "part_ml", "row_work"]
COMBINE_OUTPUTS = ["out"]


# ---- the Metal source: a shared header, the split-K attention body and the combine body, as
# ``mx.fast.metal_kernel`` takes them (bodies only: MLX writes the signature from the input and output
# names, the template arguments and the thread attributes the body names). A port of the CUDA scalar
# body (``metal/cuda/paged_decode.py``); the algorithm is described there and in docs/kernels.md.
#
# What differs from the CUDA body, and why:
#
# - Apple GPUs give a threadgroup at most 32 KB of threadgroup memory, so the codes of a record tile
#   are not staged: each thread reads its code words straight from device memory (the QK lanes of a
#   simdgroup read consecutive tokens of one channel, the PV lanes consecutive channels of one
#   token: neighbouring words). The query scratch (``s_o``) shares its space with ``s_qa`` (it is
#   used before the first tile and after the last). What is left is ``TG`` floats, at most
#   7,328 (29.3 KB) at D = 256, G = 128, 8 query heads per KV head (``static_assert``).
# - Warp reductions are ``simd_sum`` / ``simd_max`` (32-lane simdgroups, as on every Apple GPU);
#   the order of their sums is the hardware's (attention does not need a fixed order).
# - Small inputs (``rows``, ``work``, ``table``, ``meta``... of fewer than 8 elements) come in the
#   ``constant`` address space, larger ones in ``device`` (MLX's rule): the body indexes them
#   directly and passes only the large record and window arrays to helpers, through templates that
#   take any pointer type.
HEADER = r"""
#define KV_THREADS 128

// b-bit code at stream bit `bit` of a little-endian bit stream (3-bit codes straddle words)
template <int B, typename P>
inline uint kv_code(P s, int bit) {
  const int w = bit >> 5, o = bit & 31;
  uint v = s[w] >> o;
  if (32 % B != 0) {
    if (o > 32 - B) v |= s[w + 1] << (32 - o);
  }
  return v & ((1u << B) - 1u);
}
"""

ATTENTION_SOURCE = r"""
  constexpr int W = D > 128 ? 128 : D;      // channels per slice
  constexpr int S = D / W;                  // slices
  constexpr int KGW = G * KB / 32;          // K code words per channel
  constexpr int KCW = D * KGW;              // K code words per tile and head
  constexpr int VDW = D * VB / 32;          // V code words per token
  constexpr int VCW = G * VDW;              // V code words per tile and head
  constexpr int TPT = KV_THREADS / G;       // QK: threads per token (they split the channels)
  constexpr int CT = D < KV_THREADS ? D : KV_THREADS;  // PV: threads per channel set
  constexpr int TPC = KV_THREADS / CT;      // PV: token partitions
  constexpr int NCH = D / CT;               // PV: channels per thread
  constexpr int RS = NR * (1 + S);          // reduction slots per simdgroup
  constexpr float LOG2E = 1.4426950408889634f;

  // threadgroup memory, floats (Apple GPUs: at most 32 KB a threadgroup)
  constexpr int O_QA = D * NR;              // s_q [D][NR] rotated queries
  constexpr int O_KR = O_QA + D * NR;       // s_qa [D][NR] q * k_alpha; s_o [NR][D] scratch (before / after the tiles)
  constexpr int O_VA = O_KR + S * G;        // s_kr [S][G] k_r
  constexpr int O_VB = O_VA + G * S;        // s_va [G][S] v_alpha
  constexpr int O_CV = O_VB + G * S;        // s_vb [G][S] v_beta
  constexpr int O_PA = O_CV + D;            // s_cv [D] v_c
  constexpr int O_QB = O_PA + S * G * NR;   // s_pa [S][G][NR] p * v_alpha (p for window tiles)
  constexpr int O_RED = O_QB + 4 * S * NR;  // s_qb [4][S][NR] per-simdgroup partial q . k_beta
  constexpr int TG = O_RED + 4 * RS;        // s_red [4][RS] per-simdgroup max / sums
  static_assert(TG * 4 <= 32768, "threadgroup memory past 32 KB");
  threadgroup float tg[TG];
  threadgroup float* s_q = tg;
  threadgroup float* s_qa = tg + O_QA;
  threadgroup float* s_o = tg + O_QA;
  threadgroup float* s_kr = tg + O_KR;
  threadgroup float* s_va = tg + O_VA;
  threadgroup float* s_vb = tg + O_VB;
  threadgroup float* s_cv = tg + O_CV;
  threadgroup float* s_pa = tg + O_PA;
  threadgroup float* s_qb = tg + O_QB;
  threadgroup float* s_red = tg + O_RED;

  const int t = (int)thread_index_in_threadgroup;
  const int lane = (int)thread_index_in_simdgroup, warp = (int)simdgroup_index_in_threadgroup;
  const int wi = (int)threadgroup_position_in_grid.x, h = (int)threadgroup_position_in_grid.y;
  const int H = (int)threadgroups_per_grid.y;
  const int b = work[wi * 3], t0 = work[wi * 3 + 1], t1 = work[wi * 3 + 2];
  const int slot = rows[b * 4], sink_len = rows[b * 4 + 1], tail_len = rows[b * 4 + 2], nt = rows[b * 4 + 3];
  const int nb = meta[0];
  const float sl2 = meta_f[0] * LOG2E;

  // queries of this KV head -> s_o [NR][D], rotated (Hadamard per W-slice), rounded to half
  for (int i = t; i < NR * D; i += KV_THREADS)
    s_o[i] = static_cast<float>(queries[((ulong)b * H * NR + (ulong)h * NR) * D + i]);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int len = 1; len < W; len <<= 1) {
    for (int k = t; k < NR * D / 2; k += KV_THREADS) {
      const int r = k / (D / 2), kk = k % (D / 2);
      const int i = r * D + (kk / len) * 2 * len + (kk % len), j = i + len;
      const float a = s_o[i], c = s_o[j];
      s_o[i] = a + c;
      s_o[j] = a - c;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  const float inv_w = 1.0f / metal::precise::sqrt((float)W);
  for (int i = t; i < NR * D; i += KV_THREADS) {
    const int r = i / D, d = i % D;
    const float qr = s_o[i] * inv_w;  // rounded to half as the reference rounds it (half windows)
    s_q[d * NR + r] = sizeof(WT) == 2 ? static_cast<float>(static_cast<half>(qr)) : qr;
  }

  float m[NR], l[NR], o[NCH][NR];
  for (int r = 0; r < NR; ++r) { m[r] = -INFINITY; l[r] = 0.0f; }
  for (int j = 0; j < NCH; ++j) for (int r = 0; r < NR; ++r) o[j][r] = 0.0f;

  const int g = t / TPT, sub = t % TPT;      // QK: this thread's token and channel subset
  const int pc = t % CT, pp = t / CT;        // PV: channel and token partition
  const device uint32_t* kc = k_codes;       // this tile's codes (records only)
  const device uint32_t* vc = v_codes;

  for (int ti = t0; ti < t1; ++ti) {
    const bool is_rec = ti >= 1 && ti <= nt;
    const int len = is_rec ? G : (ti == 0 ? sink_len : tail_len);
    const int base = ti == 0 ? 0 : G;        // window part (tail tiles only; records ignore it)
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the previous tile (or the queries' scratch) is done
    if (is_rec) {
      const ulong nh = (ulong)table[b * nb + ti - 1] * H + h;
      kc = k_codes + nh * KCW;
      vc = v_codes + nh * VCW;
      for (int i = t; i < S * G; i += KV_THREADS) s_kr[i] = static_cast<float>(k_r[nh * S * G + i]);
      for (int i = t; i < G * S; i += KV_THREADS) {
        s_va[i] = static_cast<float>(v_alpha[nh * G * S + i]);
        s_vb[i] = static_cast<float>(v_beta[nh * G * S + i]);
      }
      for (int i = t; i < D; i += KV_THREADS) s_cv[i] = static_cast<float>(v_c[nh * D + i]);
      for (int j = 0; j < (D + KV_THREADS - 1) / KV_THREADS; ++j) {
        const int d = t + j * KV_THREADS;
        const int s = (j * KV_THREADS) / W;  // one slice per pass
        float pq[NR];
        if (d < D) {
          const float al = static_cast<float>(k_alpha[nh * D + d]), be = static_cast<float>(k_beta[nh * D + d]);
          for (int r = 0; r < NR; ++r) {
            const float qv = s_q[d * NR + r];
            s_qa[d * NR + r] = qv * al;
            pq[r] = qv * be;
          }
        } else {
          for (int r = 0; r < NR; ++r) pq[r] = 0.0f;
        }
        for (int r = 0; r < NR; ++r) {
          const float v = simd_sum(pq[r]);
          if (lane == 0) s_qb[(warp * S + s) * NR + r] = v;
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // ---- scores of this thread's token, all NR heads (log2 domain) ----
    float x[NR];
    {
      float part[NR];
      for (int r = 0; r < NR; ++r) part[r] = 0.0f;
      if (is_rec) {
        for (int s = 0; s < S; ++s) {
          float acc[NR];
          for (int r = 0; r < NR; ++r) acc[r] = 0.0f;
          for (int c = 0; c < W / TPT; ++c) {
            const int d = s * W + c * TPT + sub;
            const float code = (float)kv_code<KB>(kc + d * KGW, g * KB);
            for (int r = 0; r < NR; ++r) acc[r] += s_qa[d * NR + r] * code;
          }
          const float kr = s_kr[s * G + g];
          for (int r = 0; r < NR; ++r) part[r] += kr * acc[r];
        }
      } else if (g < len) {
        const device WT* row = win_k + (((ulong)slot * H + h) * 2 * G + base + g) * D;
        for (int c = 0; c < D / 8 / TPT; ++c) {
          const int d0 = (c * TPT + sub) * 8;
          for (int e = 0; e < 8; ++e) {
            const float kv = static_cast<float>(row[d0 + e]);
            for (int r = 0; r < NR; ++r) part[r] += s_q[(d0 + e) * NR + r] * kv;
          }
        }
      }
      if (TPT == 2)
        for (int r = 0; r < NR; ++r) part[r] += simd_shuffle_xor(part[r], (ushort)1);
      if (is_rec) {
        for (int s = 0; s < S; ++s) {
          const float kr = s_kr[s * G + g];
          for (int r = 0; r < NR; ++r) {
            const float qb = s_qb[(0 * S + s) * NR + r] + s_qb[(1 * S + s) * NR + r] +
                             s_qb[(2 * S + s) * NR + r] + s_qb[(3 * S + s) * NR + r];
            part[r] += kr * qb;
          }
        }
      }
      const bool valid = g < len;
      for (int r = 0; r < NR; ++r) x[r] = valid ? part[r] * sl2 : -INFINITY;
    }

    // ---- online softmax: tile max, rescale, p, sums ----
    for (int r = 0; r < NR; ++r) {
      const float v = simd_max(x[r]);
      if (lane == 0) s_red[warp * RS + r] = v;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float corr[NR], mu[NR];
    for (int r = 0; r < NR; ++r) {
      const float mt = metal::fmax(metal::fmax(s_red[r], s_red[RS + r]), metal::fmax(s_red[2 * RS + r], s_red[3 * RS + r]));
      const float mn = metal::fmax(m[r], mt);
      corr[r] = m[r] == -INFINITY ? 0.0f : metal::exp2(m[r] - mn);
      mu[r] = mn == -INFINITY ? 0.0f : mn;
      m[r] = mn;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // s_red is read; it is reused below
    float p[NR];
    const float own = sub == 0 ? 1.0f : 0.0f;  // TPT == 2: both lanes hold the token; count it once
    for (int r = 0; r < NR; ++r) p[r] = metal::exp2(x[r] - mu[r]);
    for (int r = 0; r < NR; ++r) {
      const float v = simd_sum(p[r] * own);
      if (lane == 0) s_red[warp * RS + r] = v;
    }
    if (is_rec) {
      for (int s = 0; s < S; ++s)
        for (int r = 0; r < NR; ++r) {
          const float v = simd_sum(p[r] * own * s_vb[g * S + s]);
          if (lane == 0) s_red[warp * RS + NR + s * NR + r] = v;
        }
    }
    if (sub == 0)
      for (int s = 0; s < S; ++s)
        for (int r = 0; r < NR; ++r) s_pa[(s * G + g) * NR + r] = is_rec ? p[r] * s_va[g * S + s] : p[r];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int r = 0; r < NR; ++r)
      l[r] = l[r] * corr[r] + (s_red[r] + s_red[RS + r] + s_red[2 * RS + r] + s_red[3 * RS + r]);

    // ---- values: this thread's channels, its token partition ----
    for (int j = 0; j < NCH; ++j) {
      const int d = pc + j * CT;
      const int s = d / W;
      float acc[NR];
      for (int r = 0; r < NR; ++r) acc[r] = 0.0f;
      if (is_rec) {
        for (int gi = pp; gi < G; gi += TPC) {
          const float code = (float)kv_code<VB>(vc + gi * VDW, d * VB);
          for (int r = 0; r < NR; ++r) acc[r] += s_pa[(s * G + gi) * NR + r] * code;
        }
        const float cv = s_cv[d];
        for (int r = 0; r < NR; ++r) {
          const float pb = pp == 0 ? (s_red[NR + s * NR + r] + s_red[RS + NR + s * NR + r] +
                                      s_red[2 * RS + NR + s * NR + r] + s_red[3 * RS + NR + s * NR + r]) : 0.0f;
          o[j][r] = o[j][r] * corr[r] + cv * (acc[r] + pb);
        }
      } else {
        const device WT* col = win_v + (((ulong)slot * H + h) * 2 * G + base) * D + d;
        for (int gi = pp; gi < len; gi += TPC) {
          const float v = static_cast<float>(col[(ulong)gi * D]);
          for (int r = 0; r < NR; ++r) acc[r] += s_pa[gi * NR + r] * v;
        }
        for (int r = 0; r < NR; ++r) o[j][r] = o[j][r] * corr[r] + acc[r];
      }
    }
  }

  // ---- this split's partial output: unnormalized o, running max m and sum l ----
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (TPC == 2) {
    if (pp == 1)
      for (int j = 0; j < NCH; ++j) for (int r = 0; r < NR; ++r) s_o[r * D + pc + j * CT] = o[j][r];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (pp == 0)
      for (int j = 0; j < NCH; ++j) for (int r = 0; r < NR; ++r) o[j][r] += s_o[r * D + pc + j * CT];
  }
  if (pp == 0)
    for (int j = 0; j < NCH; ++j)
      for (int r = 0; r < NR; ++r) part_o[(((ulong)wi * H + h) * NR + r) * D + pc + j * CT] = o[j][r];
  if (t == 0)
    for (int r = 0; r < NR; ++r) {
      part_ml[(((ulong)wi * H + h) * NR + r) * 2] = m[r];
      part_ml[(((ulong)wi * H + h) * NR + r) * 2 + 1] = l[r];
    }
"""

COMBINE_SOURCE = r"""
  constexpr int W = D > 128 ? 128 : D;
  threadgroup float s_v[D];
  const int d = (int)thread_position_in_threadgroup.x;
  const int qh = (int)threadgroup_position_in_grid.y, b = (int)threadgroup_position_in_grid.z;
  const int NQ = (int)threadgroups_per_grid.y;
  const int H = NQ / NR, h = qh / NR, r = qh % NR;
  const int w0 = row_work[b], w1 = row_work[b + 1];
  float mx_ = -INFINITY;
  for (int w = w0; w < w1; ++w) mx_ = metal::fmax(mx_, part_ml[(((ulong)w * H + h) * NR + r) * 2]);
  float acc = 0.0f, den = 0.0f;
  for (int w = w0; w < w1; ++w) {
    const ulong i = ((ulong)w * H + h) * NR + r;
    const float mw = part_ml[i * 2];
    const float e = mw == -INFINITY ? 0.0f : metal::exp2(mw - mx_);
    acc += e * part_o[i * D + d];
    den += e * part_ml[i * 2 + 1];
  }
  s_v[d] = den > 0.0f ? acc / den : 0.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int len = 1; len < W; len <<= 1) {
    if (d < D / 2) {
      const int i = (d / len) * 2 * len + (d % len), j = i + len;
      const float a = s_v[i], c = s_v[j];
      s_v[i] = a + c;
      s_v[j] = a - c;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[((ulong)b * NQ + qh) * D + d] = static_cast<QT>(s_v[d] * (1.0f / metal::precise::sqrt((float)W)));
"""


def threadgroup_bytes(head_dim: int, tile_size: int, n_rep: int) -> int:
    """Threadgroup memory of the attention body (``TG`` floats in the source)."""
    D, G, NR = head_dim, tile_size, n_rep
    S = max(1, D // 128)
    return 4 * (2 * D * NR + S * G + 2 * G * S + D + S * G * NR + 4 * S * NR + 4 * NR * (1 + S))


def is_supported(*, head_dim: int, tile_size: int, key_bits: int, value_bits: int, n_rep: int) -> bool:
    """Whether the Metal body has this shape (else callers use the reference)."""
    return (head_dim in SUPPORTED_HEAD_DIMS and tile_size in SUPPORTED_TILE_SIZES and key_bits in SUPPORTED_BITS
            and value_bits in SUPPORTED_BITS and 1 <= n_rep <= MAX_REP
            and threadgroup_bytes(head_dim, tile_size, n_rep) <= MAX_THREADGROUP_MEMORY)


@dataclass(frozen=True)
class MetalLaunch:
    """One kernel call: its source and arguments as ``mx.fast.metal_kernel`` takes them (also what
    the tests' CPU emulator of the Metal source takes). ``grid`` counts threads, as MLX's does."""

    name: str
    header: str
    source: str
    input_names: list
    output_names: list
    inputs: list
    template: list
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: list
    output_dtypes: list


_ATTENTION_TEXT = (minify(HEADER), minify(ATTENTION_SOURCE))
_COMBINE_TEXT = (minify(HEADER), minify(COMBINE_SOURCE))


def attention_launch(queries: mx.array, records: dict[str, mx.array], win_k: mx.array, win_v: mx.array,
                     table: mx.array | None, plan: DecodePlan, scale: float, bits: tuple[int, int]) -> MetalLaunch:
    """The attention launch: per-split partials (o [items, H, NR, D], (m, l) [items, H, NR, 2])."""
    B, n_q, _, D = queries.shape
    H, G = win_k.shape[1], win_k.shape[2] // 2
    NR = n_q // H
    if table is None:
        table = mx.zeros((B, 1), dtype=mx.int32)
    nb_arr, scale_arr = scalar_inputs(table.shape[1], float(scale))
    template = [("QT", queries.dtype), ("WT", win_k.dtype), ("D", D), ("G", G), ("KB", bits[0]), ("VB", bits[1]),
                ("NR", NR)]
    return MetalLaunch(
        name="kvarn_paged_decode", header=_ATTENTION_TEXT[0], source=_ATTENTION_TEXT[1],
        input_names=ATTENTION_INPUTS, output_names=ATTENTION_OUTPUTS,
        inputs=[queries.reshape(B, n_q, D), win_k, win_v, *(records[n] for n in RECORD_FIELDS), table, plan.rows,
                plan.work, nb_arr, scale_arr],
        template=template, grid=(plan.num_items * NUM_THREADS, H, 1), threadgroup=(NUM_THREADS, 1, 1),
        output_shapes=[(plan.num_items, H, NR, D), (plan.num_items, H, NR, 2)],
        output_dtypes=[mx.float32, mx.float32])


def combine_launch(part_o: mx.array, part_ml: mx.array, plan: DecodePlan, queries: mx.array) -> MetalLaunch:
    B, n_q, _, D = queries.shape
    NR = part_o.shape[2]
    return MetalLaunch(name="kvarn_paged_combine", header=_COMBINE_TEXT[0], source=_COMBINE_TEXT[1],
                       input_names=COMBINE_INPUTS, output_names=COMBINE_OUTPUTS,
                       inputs=[part_o, part_ml, plan.row_work],
                       template=[("QT", queries.dtype), ("D", D), ("NR", NR)], grid=(D, n_q, B),
                       threadgroup=(D, 1, 1), output_shapes=[(B, n_q, D)], output_dtypes=[queries.dtype])


@functools.lru_cache(maxsize=8)
def _kernel(name: str, header: str, source: str, input_names: tuple, output_names: tuple):
    kw = dict(name=name, input_names=list(input_names), output_names=list(output_names), source=source, header=header)
    try:
        return mx.fast.metal_kernel(**kw, compile_options=COMPILE_OPTIONS)
    except TypeError:  # an MLX without compile options: fast math is off there
        return mx.fast.metal_kernel(**kw)


def run(call: MetalLaunch) -> list[mx.array]:
    kernel = _kernel(call.name, call.header, call.source, tuple(call.input_names), tuple(call.output_names))
    return kernel(inputs=call.inputs, template=call.template, grid=call.grid, threadgroup=call.threadgroup,
                  output_shapes=call.output_shapes, output_dtypes=call.output_dtypes)


def paged_decode_attention(*, queries: mx.array, records: dict[str, mx.array], win_k: mx.array, win_v: mx.array,
                           table: mx.array | None, lengths: RowLengths, scale: float,
                           key_bits: int, value_bits: int, plan: DecodePlan | None = None,
                           variant=None) -> mx.array:
    """``metal.cuda.paged_decode.paged_decode_attention`` on an Apple GPU: every row's decode
    attention (queries [B, n_q, 1, D], unrotated) over its window and its records read in place;
    returns [B, n_q, 1, D] in the queries' dtype (unrotated). ``plan``: the step's split plan
    (``metal.paged_plan.make_plan``; built here when not given); ``variant`` is accepted for the
    CUDA wrapper's signature and ignored (there is one Metal body)."""
    B, n_q, _, D = queries.shape
    H, G = win_k.shape[1], win_k.shape[2] // 2
    if not is_supported(head_dim=D, tile_size=G, key_bits=key_bits, value_bits=value_bits, n_rep=n_q // H):
        raise ValueError(f"no Metal decode kernel for D {D}, G {G}, k{key_bits}v{value_bits}, {n_q // H} heads a KV head")
    if plan is None:
        plan = make_plan(lengths.slots, lengths.sink_len, lengths.tail_len, lengths.num_tiles, H)
    part_o, part_ml = run(attention_launch(queries, records, win_k, win_v, table, plan, scale, (key_bits, value_bits)))
    (out,) = run(combine_launch(part_o, part_ml, plan, queries))
    return out.reshape(B, n_q, 1, D)
