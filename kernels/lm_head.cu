// lm_head.cu -- LM-head GEMV with a fused, grammar-masked argmax (or temperature-only sampled draw).
//
//   ids[r] = argmax_j { x[r] . w[j] : token j allowed for row r and the logit not NaN }
//   x [n, H] fp32, w [V, H] in W, bitmask [n, ceil(V / 32)] int32 or null -> ids [n] int32
//   Token j is allowed when bit j & 31 of word j >> 5 is set (xgrammar's layout);
//   bits past V are never looked at (so never allowed). Ties go to the lowest id,
//   NaN never wins, and a row with no candidate gets -1 (the launcher raises
//   NoAllowedToken naming the row). The [n, V] logits are never written.
//   (lm_head_logits, when the logits are wanted, is linear_kernel in linear.cu.)
// With CONF, also conf [n] fp32: the drafter's probability of its draft,
//   conf[r] = 1 / sum_{j allowed, l_j not NaN} exp(l_j - l_max), l_max = the winner's logit,
//   by an online log-sum-exp beside the argmax (NaN for a row with no candidate).
//
// Two-stage reduction, deterministic (no atomics):
// lm_head_argmax_partial_kernel<W, CONF, NR>: grid (P), block 128 = 4 warps, persistent:
//   P = min(ceil(ceil(V / 2) / 4), resident blocks per SM * SMs) (the launcher, from the
//   instantiation's registers): one wave, every block resident, instead of ceil(V / 64)
//   blocks in 4.5 waves (V = 151552 on 132 SMs: a ~10 % tail). The ceil(V / 2) row pairs
//   (2q, 2q + 1) are split into P contiguous ranges of equal size (+-1 pair): block b owns
//   pairs [b * pairs / P, (b + 1) * pairs / P), its warp w the pairs lo + w, lo + w + 4, ...
//   Each pair is a GEMV of common.cuh's core (NR input rows at a time, the launcher's
//   instantiation); lane r of the warp keeps input row r's best (value, id) in registers
//   across its pairs. The four warps' bests are combined in shared memory and written
//   to part_v / part_i [n, ld] (columns 0 .. P - 1; ld >= P: the workspace's width, sized
//   for the most blocks any instantiation launches). CONF: each lane also keeps
//   s = sum exp(l - m) over its candidates (m: its best value, rescaled when a larger one
//   comes), the warps' sums are rescaled to the block's best and added in warp order:
//   part_s [n, ld].
// argmax_final_kernel<CONF>: grid (n), block 256: combines a row's P partials (row stride
//   ld; strided per thread, then warp shuffles, then across warps) into ids[r] (through
//   id_map [V] when given: a draft vocabulary's rows -> target ids; -1 stays -1); CONF
//   merges the partial sums the same way, S = sum_b s_b exp(m_b - M), and writes
//   conf[r] = 1 / S.
// Both stages use mtp::beats, a strict total order on (value, id), so the winner
// does not depend on the combination order; the sums are added in an order fixed by
// the grid (no atomics), so conf is bit-reproducible too. exp(a - m) is taken as 1
// when a == m (an infinite best: +inf - +inf would be NaN), so with an infinite best
// the tokens tied with it share the probability; an empty partial has m = -inf,
// s = 0 and adds 0 * (0 or 1) = 0.
//
// W and scale/bn/bk: as linear.cu (an FP8 / FP4 head's scales, null for dense weights).
//
// Sampled drafts, temperature only (top_k = 0, top_p = 1; spec: mtpkern/ops/sampling.py), the
// logits never written either:
// lm_head_sample_partial_kernel<W, NR>: the first stage's grid, work split and GEMV core
//   (lm_pair_logits) with a Gumbel-max epilogue: per candidate z = l / T[r] (FP64 division),
//   g = token_gumbel(keys[r], returned id) (common.cuh, as sampling.cu), and lane r keeps a Draw:
//   the best (score, z, id) under draw_beats (class of z: +inf > finite > -inf, then score
//   z + g, or g for an infinite z, then the lower id: the spec's three cases of m in one strict
//   order) and the online max m of z with S = sum exp(z - m) in FP64. The warps' Draws are merged
//   in warp order into part_d [4, n, ld] fp64 (score, z, m, S) / part_i [n, ld].
// sample_final_kernel: grid (n), block 256: a row's P partials merged (strided per thread, then
//   a tree in shared memory) into ids[r] (through id_map) and probs[r] = exp(z_d - m) / S (fp32).
// Sampled drafts with 1 <= top_k <= 64 (top_p within those k), the logits never written:
// lm_head_topk_partial_kernel<W, NR>: the same first stage keeping each row's best K (the call's
//   largest top_k) candidates in beats order, one sorted list a lane in shared memory, the four
//   warps' lists merged: part_v / part_i [n, ld, K] (-1 past the block's candidates).
// topk_sample_final_kernel: grid (n), block 256: a row's top_k best of its P * K partials by
//   rounds (as masked_topk_kernel), then thread 0 follows ops.sampling.row_distribution on them
//   in rank order (its arithmetic and summation order: the top_p cut and probs as the reference).
// top_p < 1 without top_k needs the rank order of the whole row, top_k > 64 outgrows the lists,
// and dist writes [n, V] anyway: those calls write the logits (linear.cu) and draw with
// sampling.cu's sample_kernel (the launcher picks per call: every row on one fused path, or all
// of them on the written one).
//
// Preconditions: blockDim as stated; 16-byte path when H % (16 / sizeof(W)) == 0
// and x, w are aligned (FP8: as linear.cu), else scalar loads (same candidates, same tie rule).
#include "common.cuh"

namespace mtp {

constexpr int kLmBlocksPerSm = 4;  // resident blocks of lm_head_argmax_partial_kernel per SM

// exp(a - m) for a <= m; 1 when a == m, so an infinite m gives no inf - inf = NaN.
__device__ __forceinline__ float exp_below(float a, float m) { return a == m ? 1.0f : expf(a - m); }

// Sum of exps s (relative to the best value m) after adding a partial (v, sv) of the same
// form: rescaled to max(m, v). Called before the argmax update; an empty side is (-inf, 0).
__device__ __forceinline__ float lse_merge(float s, float m, float sv, float v) {
  return v > m ? s * exp_below(m, v) + sv : s + sv * exp_below(v, m);
}

// The logits of head rows a and a + 1 (a + 1 < V, else row a again) for the warp's NR input
// rows xr: lane r (< NR) gets input row r's in l[0], l[1]. The GEMV core every first stage of
// this file shares (the argmax's and the fused draw's).
template <typename W, int NR>
__device__ __forceinline__ void lm_pair_logits(const float* const (&xr)[NR], const W* w, const Scales& sc, int a,
                                               int V, int H, int lane, bool vec, float (&l)[2]) {
  const int b = min(a + 1, V - 1);
  const W* const wr[2] = {weight_row(w, a, H), weight_row(w, b, H)};
  const ScaleT<W>* const sr[2] = {scale_row<W>(sc, a), scale_row<W>(sc, b)};
  const float* xq[NR];  // the same rows each pair, but not loop invariants (common.cuh opaque)
#pragma unroll
  for (int r = 0; r < NR; ++r) xq[r] = opaque(xr[r]);
  float acc[2][NR];
  zero(acc);
  gemv_dot<W, NR, 2>(wr, sr, sc.bk, xq, H, lane, kWarp, vec, acc);
  warp_sum_all(acc);  // every lane holds every sum; lane r takes row r's
  l[0] = acc[0][0];
  l[1] = acc[1][0];
#pragma unroll
  for (int r = 1; r < NR; ++r) {
    if (lane == r) { l[0] = acc[0][r]; l[1] = acc[1][r]; }
  }
}

template <typename W, bool CONF, int NR>
__device__ __forceinline__ void lm_argmax_chunk(const float* x, const W* w, const Scales& sc, const int* bitmask,
                                                float* part_v, int* part_i, float* part_s, int r0, int m,
                                                int V, int H, int P, int ld, bool vec,
                                                float (&sv)[kGemvWarps][kMaxRows],
                                                int (&si)[kGemvWarps][kMaxRows],
                                                float (&ss)[kGemvWarps][kMaxRows]) {
  if constexpr (NR > 1) {
    if (m <= NR / 2) {  // uniform over the block: the smaller instantiation's barriers match
      lm_argmax_chunk<W, CONF, NR / 2>(x, w, sc, bitmask, part_v, part_i, part_s, r0, m, V, H, P, ld, vec, sv, si,
                                       ss);
      return;
    }
  }
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int words = (V + 31) / 32;
  const float* xr[NR];
#pragma unroll
  for (int r = 0; r < NR; ++r) xr[r] = x + static_cast<long long>(r0 + min(r, m - 1)) * H;
  // Lane r (< m) keeps input row r's best: (bv, bi), and with CONF bs = sum exp(l - bv)
  // over the candidates seen. One best per lane, not NR in every lane (24 registers at
  // NR = 8), and the lanes read their rows' bitmask words side by side.
  const bool mine = lane < m;
  const int* mrow = bitmask ? bitmask + static_cast<long long>(r0 + min(lane, m - 1)) * words : nullptr;
  float bv = neg_inf(), bs = 0.0f;
  int bi = -1;

  const long long pairs = (V + 1) / 2;  // this block's row pairs: [lo, hi)
  const int lo = static_cast<int>(blockIdx.x * pairs / P), hi = static_cast<int>((blockIdx.x + 1) * pairs / P);
  for (int q = lo + warp; q < hi; q += kGemvWarps) {  // per warp; no barrier inside the loop
    const int a = 2 * q;
    float l[2];
    lm_pair_logits<W, NR>(xr, w, sc, a, V, H, lane, vec, l);
    if (!mine) continue;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int id = a + j;
      if (id >= V) break;
      const float v = l[j];
      bool ok = !isnan(v);
      if (ok && mrow) ok = (static_cast<unsigned>(mrow[id >> 5]) >> (id & 31)) & 1u;
      if constexpr (CONF) {
        if (ok) bs = lse_merge(bs, bv, 1.0f, v);  // against the best before v
      }
      if (ok && beats(v, id, bv, bi)) { bv = v; bi = id; }
    }
  }
  if (mine) {
    sv[warp][lane] = bv;
    si[warp][lane] = bi;
    if constexpr (CONF) ss[warp][lane] = bs;
  }
  __syncthreads();
  if (threadIdx.x < m) {
    const int r = threadIdx.x;
    float v = neg_inf();
    int i = -1;
    for (int q = 0; q < kGemvWarps; ++q)
      if (beats(sv[q][r], si[q][r], v, i)) { v = sv[q][r]; i = si[q][r]; }
    const long long at = static_cast<long long>(r0 + r) * ld + blockIdx.x;  // [n, ld]
    part_v[at] = v;
    part_i[at] = i;
    if constexpr (CONF) {
      float s = 0.0f;  // every warp's best is <= v: rescale each to v, add in warp order
      for (int q = 0; q < kGemvWarps; ++q) s += ss[q][r] * exp_below(sv[q][r], v);
      part_s[at] = s;
    }
  }
  __syncthreads();  // sv / si / ss are rewritten by the next chunk
}

}  // namespace mtp

// part_s: [n, ld] with CONF, unused (null) without. P == gridDim.x <= ld.
template <typename W, bool CONF, int NR>
__global__ void
lm_head_argmax_partial_kernel(const float* __restrict__ x, const W* __restrict__ w,
                              const mtp::ScaleT<W>* __restrict__ scale, int bn, int bk,
                              const int* __restrict__ bitmask, float* __restrict__ part_v,
                              int* __restrict__ part_i, float* __restrict__ part_s, int n, int V, int H,
                              int P, int ld) {
  using namespace mtp;
  __shared__ float sv[kGemvWarps][kMaxRows];
  __shared__ int si[kGemvWarps][kMaxRows];
  __shared__ float ss[kGemvWarps][kMaxRows];  // CONF only
  const Scales sc = make_scales<W>(scale, bn, bk, H);
  const bool vec = gemv_vec_ok(w, x, H, sc);
  for (int r0 = 0; r0 < n; r0 += NR) {
    const int m = min(NR, n - r0);
    lm_argmax_chunk<W, CONF, NR>(x, w, sc, bitmask, part_v, part_i, part_s, r0, m, V, H, P, ld, vec, sv, si, ss);
  }
}

// part_s, conf: [n, ld] and [n] with CONF, unused (null) without. best, sum_exp ([n], or
// null): a vocabulary shard's partial result (mtpkern.ops.lm_head): the winning logit
// (-inf without a candidate) and, with CONF, the confidence's denominator (0 without).
template <bool CONF>
__global__ void __launch_bounds__(256)
argmax_final_kernel(const float* __restrict__ part_v, const int* __restrict__ part_i,
                    const float* __restrict__ part_s, int P, int ld, int* __restrict__ ids,
                    float* __restrict__ conf, const int* __restrict__ id_map, float* __restrict__ best,
                    float* __restrict__ sum_exp) {
  using namespace mtp;
  __shared__ float sv[32];
  __shared__ int si[32];
  __shared__ float ss[32];  // CONF only
  const long long r = blockIdx.x;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  float bv = neg_inf(), bs = 0.0f;  // bs: CONF only, sum exp(l - bv) of the partials taken
  int bi = -1;
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    const float v = part_v[r * ld + p];
    const int i = part_i[r * ld + p];
    if constexpr (CONF) {
      if (i >= 0) bs = lse_merge(bs, bv, part_s[r * ld + p], v);  // an empty partial adds nothing
    }
    if (beats(v, i, bv, bi)) { bv = v; bi = i; }
  }
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(kFullMask, bv, o);
    const int oi = __shfl_xor_sync(kFullMask, bi, o);
    if constexpr (CONF) {
      const float os = __shfl_xor_sync(kFullMask, bs, o);
      if (oi >= 0) bs = lse_merge(bs, bv, os, ov);
    }
    if (beats(ov, oi, bv, bi)) { bv = ov; bi = oi; }
  }
  if (lane == 0) {
    sv[warp] = bv;
    si[warp] = bi;
    if constexpr (CONF) ss[warp] = bs;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int q = 1; q < static_cast<int>(blockDim.x / kWarp); ++q) {
      if constexpr (CONF) {
        if (si[q] >= 0) bs = lse_merge(bs, bv, ss[q], sv[q]);
      }
      if (beats(sv[q], si[q], bv, bi)) { bv = sv[q]; bi = si[q]; }
    }
    ids[r] = (id_map != nullptr && bi >= 0) ? id_map[bi] : bi;  // a draft vocabulary's target id
    if constexpr (CONF) conf[r] = bi >= 0 ? 1.0f / bs : quiet_nan();  // bs >= 1: the winner adds 1
    if (best != nullptr) best[r] = bi >= 0 ? bv : neg_inf();
    if constexpr (CONF) {
      if (sum_exp != nullptr) sum_exp[r] = bi >= 0 ? bs : 0.0f;
    }
  }
}

// -- the fused sampled draw (temperature only) ------------------------------------------------

namespace mtp {

__device__ __forceinline__ double inf_f64() { return -static_cast<double>(neg_inf()); }

// exp(a - m) for a <= m in FP64; 1 when a == m (an infinite m: no inf - inf = NaN).
__device__ __forceinline__ double exp_below_f64(double a, double m) { return a == m ? 1.0 : exp(a - m); }

// A candidate's class in the draw's order: 2 when z = +inf, 1 when z is finite, 0 when z = -inf.
__device__ __forceinline__ int z_class(double z) { return z == inf_f64() ? 2 : (z == -inf_f64() ? 0 : 1); }

// The draw's state over the candidates seen (a lane's, a block's, a row's): the best's score,
// z and head row (-1: none yet), the largest z and s = sum exp_below(z, m) over them.
struct Draw {
  double sc, z;
  int id;
  double m, s;
};

__device__ __forceinline__ Draw no_draw() { return Draw{0.0, 0.0, -1, -inf_f64(), 0.0}; }

// The strict total order of the draw: the higher class, then the higher score, then the lower id.
// ops.sampling's three cases of m = max z in one order: with m = +inf q's support is the class-2
// tokens, scored 0 + g = g; with m finite the class-1 ones, scored z + g (one whose w = exp(z - m)
// underflows to 0 is outside q but cannot win: g lies in [-3.7, 37.5], so its score is below
// m - 3.7, under the top token's); with m = -inf every candidate is class 0, weight 1, score g.
__device__ __forceinline__ bool draw_beats(const Draw& a, const Draw& b) {
  if (a.id < 0) return false;
  if (b.id < 0) return true;
  const int ca = z_class(a.z), cb = z_class(b.z);
  return ca > cb || (ca == cb && (a.sc > b.sc || (a.sc == b.sc && a.id < b.id)));
}

// d takes o: the sums rescaled to the larger max (an empty side is (-inf, 0)), the better best.
__device__ __forceinline__ void draw_merge(Draw& d, const Draw& o) {
  if (o.id < 0) return;
  d.s = o.m > d.m ? d.s * exp_below_f64(d.m, o.m) + o.s : d.s + o.s * exp_below_f64(o.m, d.m);
  d.m = o.m > d.m ? o.m : d.m;
  if (draw_beats(o, d)) { d.sc = o.sc; d.z = o.z; d.id = o.id; }
}

// Candidate `id` (logit v, not NaN, allowed) of a row with temperature T and key `key`, its
// noise keyed on the id it is returned as (id_map[id] under a draft vocabulary).
__device__ __forceinline__ Draw draw_candidate(float v, int id, double T, unsigned long long key,
                                               const int* id_map) {
  const double z = static_cast<double>(v) / T;  // one IEEE FP64 division, as the reference
  const double g = token_gumbel(key, id_map ? id_map[id] : id);
  return Draw{z_class(z) == 1 ? z + g : g, z, id, z, 1.0};
}

template <typename W, int NR>
__device__ __forceinline__ void lm_sample_chunk(const float* x, const W* w, const Scales& sc, const int* bitmask,
                                                const unsigned long long* keys, const double* temperature,
                                                const int* id_map, double* part_d, int* part_i, int r0, int m,
                                                int n, int V, int H, int P, int ld, bool vec,
                                                Draw (&sd)[kGemvWarps][kMaxRows]) {
  if constexpr (NR > 1) {
    if (m <= NR / 2) {  // uniform over the block: the smaller instantiation's barriers match
      lm_sample_chunk<W, NR / 2>(x, w, sc, bitmask, keys, temperature, id_map, part_d, part_i, r0, m, n, V, H, P,
                                 ld, vec, sd);
      return;
    }
  }
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int words = (V + 31) / 32;
  const float* xr[NR];
#pragma unroll
  for (int r = 0; r < NR; ++r) xr[r] = x + static_cast<long long>(r0 + min(r, m - 1)) * H;
  const bool mine = lane < m;  // lane r (< m) draws for input row r
  const int row = r0 + min(lane, m - 1);
  const int* mrow = bitmask ? bitmask + static_cast<long long>(row) * words : nullptr;
  const double T = temperature[row];
  const unsigned long long key = keys[row];
  Draw d = no_draw();

  const long long pairs = (V + 1) / 2;  // this block's row pairs: [lo, hi), as lm_argmax_chunk
  const int lo = static_cast<int>(blockIdx.x * pairs / P), hi = static_cast<int>((blockIdx.x + 1) * pairs / P);
  for (int q = lo + warp; q < hi; q += kGemvWarps) {
    const int a = 2 * q;
    float l[2];
    lm_pair_logits<W, NR>(xr, w, sc, a, V, H, lane, vec, l);
    if (!mine) continue;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int id = a + j;
      if (id >= V) break;
      bool ok = !isnan(l[j]);
      if (ok && mrow) ok = (static_cast<unsigned>(mrow[id >> 5]) >> (id & 31)) & 1u;
      if (ok) draw_merge(d, draw_candidate(l[j], id, T, key, id_map));
    }
  }
  if (mine) sd[warp][lane] = d;
  __syncthreads();
  if (threadIdx.x < m) {
    const int r = threadIdx.x;
    Draw b = sd[0][r];
    for (int q = 1; q < kGemvWarps; ++q) draw_merge(b, sd[q][r]);  // in warp order
    const long long at = static_cast<long long>(r0 + r) * ld + blockIdx.x;  // [n, ld]
    const long long plane = static_cast<long long>(n) * ld;
    part_d[at] = b.sc;
    part_d[plane + at] = b.z;
    part_d[2 * plane + at] = b.m;
    part_d[3 * plane + at] = b.s;
    part_i[at] = b.id;
  }
  __syncthreads();  // sd is rewritten by the next chunk
}

}  // namespace mtp

// part_d: [4, n, ld] fp64 (the best's score, its z, the block's max z, its sum), part_i [n, ld].
template <typename W, int NR>
__global__ void
lm_head_sample_partial_kernel(const float* __restrict__ x, const W* __restrict__ w,
                              const mtp::ScaleT<W>* __restrict__ scale, int bn, int bk,
                              const int* __restrict__ bitmask, const unsigned long long* __restrict__ keys,
                              const double* __restrict__ temperature, const int* __restrict__ id_map,
                              double* __restrict__ part_d, int* __restrict__ part_i, int n, int V, int H, int P,
                              int ld) {
  using namespace mtp;
  __shared__ Draw sd[kGemvWarps][kMaxRows];
  const Scales sc = make_scales<W>(scale, bn, bk, H);
  const bool vec = gemv_vec_ok(w, x, H, sc);
  for (int r0 = 0; r0 < n; r0 += NR) {
    const int m = min(NR, n - r0);
    lm_sample_chunk<W, NR>(x, w, sc, bitmask, keys, temperature, id_map, part_d, part_i, r0, m, n, V, H, P, ld,
                           vec, sd);
  }
}

// One row per block: its P partials merged (strided per thread, then a tree over the threads in
// shared memory: FP64 state, no 64-bit shuffles) into ids[r] (through id_map) and
// probs[r] = exp_below(z_draft, M) / S (fp32).
__global__ void __launch_bounds__(256)
sample_final_kernel(const double* __restrict__ part_d, const int* __restrict__ part_i, int n, int P, int ld,
                    const int* __restrict__ id_map, int* __restrict__ ids, float* __restrict__ probs) {
  using namespace mtp;
  __shared__ Draw sw[256];
  const long long r = blockIdx.x;
  const long long plane = static_cast<long long>(n) * ld;
  const int t = threadIdx.x;
  Draw d = no_draw();
  for (int p = t; p < P; p += blockDim.x) {
    const long long at = r * ld + p;
    draw_merge(d, Draw{part_d[at], part_d[plane + at], part_i[at], part_d[2 * plane + at], part_d[3 * plane + at]});
  }
  sw[t] = d;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (t < s) draw_merge(sw[t], sw[t + s]);
    __syncthreads();
  }
  if (t == 0) {
    const Draw b = sw[0];
    ids[r] = b.id < 0 ? -1 : (id_map != nullptr ? id_map[b.id] : b.id);
    probs[r] = b.id < 0 ? 0.0f : static_cast<float>(exp_below_f64(b.z, b.m) / b.s);  // s >= 1: the top adds 1
  }
}

// -- the fused sampled draw with top_k <= 64 (and top_p over those k) --------------------------

namespace mtp {

constexpr int kMaxTopK = 64;  // ops.lm_head.MAX_TOPK

// Candidate (v, id) into a list of the best K so far, sorted by beats (best first): the list grows
// to K, then a candidate enters only when it beats the last. One lane owns each list.
__device__ __forceinline__ void topk_insert(float* lv, int* li, int& cnt, int K, float v, int id) {
  if (cnt == K && !beats(v, id, lv[K - 1], li[K - 1])) return;
  int j = cnt < K ? cnt++ : K - 1;
  for (; j > 0 && beats(v, id, lv[j - 1], li[j - 1]); --j) { lv[j] = lv[j - 1]; li[j] = li[j - 1]; }
  lv[j] = v;
  li[j] = id;
}

template <typename W, int NR>
__device__ __forceinline__ void lm_topk_chunk(const float* x, const W* w, const Scales& sc, const int* bitmask,
                                              float* part_v, int* part_i, int r0, int m, int V, int H, int P,
                                              int ld, int K, bool vec, float (&tv)[kGemvWarps][kMaxRows][kMaxTopK],
                                              int (&ti)[kGemvWarps][kMaxRows][kMaxTopK],
                                              int (&tc)[kGemvWarps][kMaxRows]) {
  if constexpr (NR > 1) {
    if (m <= NR / 2) {  // uniform over the block: the smaller instantiation's barriers match
      lm_topk_chunk<W, NR / 2>(x, w, sc, bitmask, part_v, part_i, r0, m, V, H, P, ld, K, vec, tv, ti, tc);
      return;
    }
  }
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int words = (V + 31) / 32;
  const float* xr[NR];
#pragma unroll
  for (int r = 0; r < NR; ++r) xr[r] = x + static_cast<long long>(r0 + min(r, m - 1)) * H;
  const bool mine = lane < m;  // lane r (< m) keeps input row r's list: tv / ti [warp][r]
  const int* mrow = bitmask ? bitmask + static_cast<long long>(r0 + min(lane, m - 1)) * words : nullptr;
  int cnt = 0;

  const long long pairs = (V + 1) / 2;  // this block's row pairs: [lo, hi), as lm_argmax_chunk
  const int lo = static_cast<int>(blockIdx.x * pairs / P), hi = static_cast<int>((blockIdx.x + 1) * pairs / P);
  for (int q = lo + warp; q < hi; q += kGemvWarps) {
    const int a = 2 * q;
    float l[2];
    lm_pair_logits<W, NR>(xr, w, sc, a, V, H, lane, vec, l);
    if (!mine) continue;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int id = a + j;
      if (id >= V) break;
      bool ok = !isnan(l[j]);
      if (ok && mrow) ok = (static_cast<unsigned>(mrow[id >> 5]) >> (id & 31)) & 1u;
      if (ok) topk_insert(tv[warp][lane], ti[warp][lane], cnt, K, l[j], id);
    }
  }
  if (mine) tc[warp][lane] = cnt;
  __syncthreads();
  if (threadIdx.x < m) {  // the four warps' sorted lists merged: the block's best K, -1 past them
    const int r = threadIdx.x;
    int head[kGemvWarps] = {0, 0, 0, 0};
    const long long at = (static_cast<long long>(r0 + r) * ld + blockIdx.x) * K;  // [n, ld, K]
    for (int c = 0; c < K; ++c) {
      float bv = neg_inf();
      int bi = -1, bq = -1;
#pragma unroll
      for (int q = 0; q < kGemvWarps; ++q) {
        if (head[q] < tc[q][r] && beats(tv[q][r][head[q]], ti[q][r][head[q]], bv, bi)) {
          bv = tv[q][r][head[q]];
          bi = ti[q][r][head[q]];
          bq = q;
        }
      }
#pragma unroll
      for (int q = 0; q < kGemvWarps; ++q) head[q] += q == bq ? 1 : 0;  // constant indices: registers
      part_v[at + c] = bv;
      part_i[at + c] = bi;
    }
  }
  __syncthreads();  // the lists are rewritten by the next chunk
}

}  // namespace mtp

// part_v / part_i: [n, ld, K] fp32 / int32, each (row, block)'s best K candidates in beats order
// (-1 past the block's candidates). 1 <= K <= 64.
template <typename W, int NR>
__global__ void
lm_head_topk_partial_kernel(const float* __restrict__ x, const W* __restrict__ w,
                            const mtp::ScaleT<W>* __restrict__ scale, int bn, int bk,
                            const int* __restrict__ bitmask, float* __restrict__ part_v, int* __restrict__ part_i,
                            int n, int V, int H, int P, int ld, int K) {
  using namespace mtp;
  __shared__ float tv[kGemvWarps][kMaxRows][kMaxTopK];
  __shared__ int ti[kGemvWarps][kMaxRows][kMaxTopK];
  __shared__ int tc[kGemvWarps][kMaxRows];
  const Scales sc = make_scales<W>(scale, bn, bk, H);
  const bool vec = gemv_vec_ok(w, x, H, sc);
  for (int r0 = 0; r0 < n; r0 += NR) {
    const int m = min(NR, n - r0);
    lm_topk_chunk<W, NR>(x, w, sc, bitmask, part_v, part_i, r0, m, V, H, P, ld, K, vec, tv, ti, tc);
  }
}

// One row per block (256 threads): the row's k = top_k[r] best of its P * K partial candidates,
// by rounds as masked_topk_kernel (round c takes the best that round c - 1's winner beats), then
// thread 0 follows ops.sampling.row_distribution over those k in rank order, in its arithmetic
// and order: z = l / T, m = z of the first, w by the spec's three cases, top_p by the running
// sum added in rank order (the reference's np.cumsum), the Gumbel-max draw (noise keyed on the
// returned id, ties to the lowest id), probs = w_draft / the kept weights' sum.
__global__ void __launch_bounds__(256)
topk_sample_final_kernel(const float* __restrict__ part_v, const int* __restrict__ part_i, int P, int ld, int K,
                         const unsigned long long* __restrict__ keys, const double* __restrict__ temperature,
                         const int* __restrict__ top_k, const double* __restrict__ top_p,
                         const int* __restrict__ id_map, int* __restrict__ ids, float* __restrict__ probs) {
  using namespace mtp;
  __shared__ float sv[32];
  __shared__ int si[32];
  __shared__ float win_v[kMaxTopK];
  __shared__ int win_i[kMaxTopK];
  const long long r = blockIdx.x;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int nwarps = static_cast<int>(blockDim.x / kWarp);
  const int k = min(top_k[r], K);
  const int total = P * K;
  const float* rv = part_v + r * ld * K;
  const int* ri = part_i + r * ld * K;
  float pv = 0.0f;
  int pi = -1, got = 0;
  for (int c = 0; c < k; ++c) {
    float bv = neg_inf();
    int bi = -1;
    for (int j = threadIdx.x; j < total; j += blockDim.x) {
      const float v = rv[j];
      const int i = ri[j];
      if (i < 0 || (pi >= 0 && !beats(pv, pi, v, i))) continue;  // empty, taken or ahead of the last
      if (beats(v, i, bv, bi)) { bv = v; bi = i; }
    }
#pragma unroll
    for (int o = kWarp / 2; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(kFullMask, bv, o);
      const int oi = __shfl_xor_sync(kFullMask, bi, o);
      if (beats(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
    if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int q = 1; q < nwarps; ++q) {
        if (beats(sv[q], si[q], bv, bi)) { bv = sv[q]; bi = si[q]; }
      }
      win_v[c] = bv;
      win_i[c] = bi;
    }
    __syncthreads();
    pv = win_v[c];
    pi = win_i[c];
    if (pi < 0) break;  // uniform: every thread read the same winner
    got = c + 1;
    __syncthreads();    // sv / si are written again next round
  }
  if (threadIdx.x != 0) return;
  if (got == 0) { ids[r] = -1; probs[r] = 0.0f; return; }
  const double T = temperature[r];
  const double m = static_cast<double>(win_v[0]) / T;  // the first in rank order has the largest z
  const int mode = m - m == 0.0 ? 0 : (m > 0.0 ? 1 : 2);  // finite, +inf, -inf (inf - inf is NaN)
  double wsum = 0.0;
  int cut = got;
  const double p = top_p[r];
  if (p < 1.0) {
    double tot = 0.0;
    for (int c = 0; c < got; ++c) {
      const double z = static_cast<double>(win_v[c]) / T;
      tot += mode == 0 ? exp(z - m) : (mode == 1 ? (z == m ? 1.0 : 0.0) : 1.0);
    }
    const double target = __dmul_rn(p, tot);
    for (cut = 0; cut < got;) {  // the first running sum reaching the target
      const double z = static_cast<double>(win_v[cut]) / T;
      wsum += mode == 0 ? exp(z - m) : (mode == 1 ? (z == m ? 1.0 : 0.0) : 1.0);
      ++cut;
      if (wsum >= target) break;
    }
  }
  const unsigned long long key = keys[r];
  double best = 0.0, wbest = 0.0;
  int bj = -1;
  wsum = 0.0;
  for (int c = 0; c < cut; ++c) {
    const double z = static_cast<double>(win_v[c]) / T;
    const double wc = mode == 0 ? exp(z - m) : (mode == 1 ? (z == m ? 1.0 : 0.0) : 1.0);
    wsum += wc;  // rank order: np.cumsum's last element
    if (wc > 0.0) {
      const int id = win_i[c];
      const double sc = (mode == 0 ? z : 0.0) + token_gumbel(key, id_map ? id_map[id] : id);
      if (bj < 0 || sc > best || (sc == best && id < win_i[bj])) { best = sc; bj = c; wbest = wc; }
    }
  }
  const int i = win_i[bj];  // >= 0: the first has w = 1
  ids[r] = id_map ? id_map[i] : i;
  probs[r] = static_cast<float>(wbest / wsum);
}

// masked_topk_kernel: grid (n), block 256: row r of logits [n, V] fp32 (lm_head_logits) ->
//   ids [n, K] int32 / probs [n, K] fp32: its K best allowed, non-NaN logits in mtp::beats
//   order (value descending, the lowest id on a tie), through id_map [V] when given, -1 / 0
//   past the row's candidates (ids[r, 0] = -1: none at all; the launcher raises). probs by
//   the confidence rule of lm_head_argmax<CONF>, for every candidate c:
//   probs[r, c] = exp_below(l_c, l_top) / S, S = sum_j exp_below(l_j, l_top) over the
//   candidates (l_top: the best logit; a term equal to it counts 1).
// Round c takes the best candidate that round c - 1's winner beats (beats is a strict total
//   order, so no id is taken twice and ties keep id order): one pass over the row per round
//   (K <= 64; a draft tree's rows are few, their logits small next to the head's bytes), then
//   one pass for S. Reductions: per thread (strided ids), warp shuffles, then warps in order
//   by thread 0, so ids and probs are bit-reproducible.
__device__ __forceinline__ bool topk_allowed(const int* bitmask, long long r, int W, int j) {
  return bitmask == nullptr || ((static_cast<unsigned>(bitmask[r * W + (j >> 5)]) >> (j & 31)) & 1u) != 0u;
}

__global__ void __launch_bounds__(256)
masked_topk_kernel(const float* __restrict__ logits, const int* __restrict__ bitmask, int V, int K,
                   int* __restrict__ ids, float* __restrict__ probs, const int* __restrict__ id_map) {
  using namespace mtp;
  __shared__ float sv[32];
  __shared__ int si[32];
  __shared__ float win_v[64];   // the winners' logits, for the probabilities
  __shared__ int win_i[64];
  __shared__ int s_got;
  const long long r = blockIdx.x;
  const int W = (V + 31) / 32;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int nwarps = static_cast<int>(blockDim.x / kWarp);
  const float* row = logits + r * V;
  float pv = 0.0f;
  int pi = -1;  // the last round's winner (none before round 0)
  int got = 0;
  for (int c = 0; c < K; ++c) {
    float bv = neg_inf();
    int bi = -1;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
      const float v = row[j];
      if (v != v || !topk_allowed(bitmask, r, W, j)) continue;
      if (pi >= 0 && !beats(pv, pi, v, j)) continue;  // taken, or ahead of the last winner
      if (beats(v, j, bv, bi)) { bv = v; bi = j; }
    }
#pragma unroll
    for (int o = kWarp / 2; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(kFullMask, bv, o);
      const int oi = __shfl_xor_sync(kFullMask, bi, o);
      if (beats(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
    if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int q = 1; q < nwarps; ++q) {
        if (beats(sv[q], si[q], bv, bi)) { bv = sv[q]; bi = si[q]; }
      }
      win_v[c] = bv;
      win_i[c] = bi;
    }
    __syncthreads();
    pv = win_v[c];
    pi = win_i[c];
    if (pi < 0) break;  // uniform: every thread read the same winner
    got = c + 1;
    __syncthreads();    // sv / si are written again next round
  }
  if (threadIdx.x == 0) s_got = got;
  const float top = got > 0 ? win_v[0] : 0.0f;
  float s = 0.0f;
  if (got > 0) {
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
      const float v = row[j];
      if (v == v && topk_allowed(bitmask, r, W, j)) s += exp_below(v, top);
    }
  }
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) s += __shfl_xor_sync(kFullMask, s, o);
  if (lane == 0) sv[warp] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    float tot = sv[0];
    for (int q = 1; q < nwarps; ++q) tot += sv[q];
    for (int c = 0; c < K; ++c) {
      const bool have = c < s_got;
      const int i = have ? win_i[c] : -1;
      ids[r * K + c] = (have && id_map != nullptr) ? id_map[i] : i;
      probs[r * K + c] = have ? exp_below(win_v[c], top) / tot : 0.0f;
    }
  }
}
