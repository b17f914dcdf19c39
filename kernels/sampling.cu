// sampling.cu -- sampled drafts drawn on the device (spec: mtpkern/ops/sampling.py).
//
// sample_kernel: grid (n), block 256 (kSampleThreads): one block per row of logits [n, V] fp32
//   (lm_head_logits). Row r's candidates: the tokens v allowed by bitmask [n, ceil(V / 32)] int32
//   (bit v & 31 of word v >> 5; null: all) whose logit is not NaN. Per row, from keys [n] uint64
//   (ops.sampling.row_keys), temperature [n] / top_p [n] fp64 and top_k [n] int32:
//   - the rank order (logit descending, ties to the lower id) as one 64-bit key per candidate:
//     the FP32 logit's order-preserving bits (sign bit flipped at >= 0, all bits flipped below 0;
//     -0 taken as +0, as the reference's comparison ties them) above the complemented id, so a
//     larger key ranks first and no two candidates share a key;
//   - K (top_k): the candidates whose key >= the k-th largest key (k = 1: the top key), found by a radix select
//     (select_key below: 16 passes of a 4-bit digit, MSB first, each pass a histogram of the
//     candidates that match the digits chosen so far) with weight 1 per candidate: exact counts;
//   - the FP64 weights w and scores s of the spec (z = l / T; m = the top candidate's z), then
//     P (top_p < 1): keys >= the largest key t whose suffix weight sum_{key >= t} w reaches
//     top_p * sum_K w, found by the same radix select with weight w;
//   - the Gumbel-max draw over P (w > 0): argmax (s + g) with g = -log(-log(u)) of the
//     counter-based hash of (key, returned id: id_map[v] with a draft vocabulary; common.cuh's
//     token_gumbel), ties to the lower id. ids[r] = the draft (through id_map), probs[r] =
//     w_draft / sum_P w (fp32), and with dist (not null) the row dist[r, :] = q (w / sum_P w on
//     P, 0 elsewhere).
//   A row without a candidate gets ids[r] = -1, probs[r] = 0 (and a zero dist row); the launcher
//   raises NoAllowedToken naming it.
//
// Summation order: every FP64 sum is fixed by the grid (each thread adds its strided ids in
// order; the 256 partial sums in 16 groups of 16, then the groups in order): no atomics, so a
// run is bit-reproducible. The reference adds the weights in rank order (np.cumsum), so sum_K w,
// sum_P w and the top_p boundary's running sums differ from it by a few ulps: the boundary can
// differ only where a running sum is within such ulps of top_p * sum_K w, and probs within
// FP32 rounding (ops.sampling's docstring: backends agree except ~1e-15 of calls). A rounding
// that leaves a pass's digits short of the target takes the lowest digit (everything down to
// it), as the reference keeps the whole order when its last running sum is the one that
// reaches the target.
//
// Cost per row: one pass over the row's V logits for the candidates, 16 more for top_k (counts
// only), 16 for top_p (an exp per candidate in the first, per candidate matching the prefix in
// the others), one for the draw (an exp, two logs and the hash per kept candidate), one for
// dist: the logits are re-read each pass (V * 4 bytes: L2-resident), never copied or sorted.
//
// Preconditions: blockDim.x == kSampleThreads; temperature > 0 and finite, 0 <= top_k,
// 0 < top_p <= 1 (the launcher's SamplingParams); id_map entries >= 0; V < 2^31.
#include "common.cuh"

namespace mtp {

constexpr int kSampleThreads = 256;
constexpr int kRadix = 16;          // a 4-bit digit: 16 passes over a 64-bit key
constexpr int kRadixGroups = kSampleThreads / kRadix;

// Rank key of candidate v (logit l, not NaN): larger = earlier in the rank order; never 0.
__device__ __forceinline__ unsigned long long rank_key(float l, int v) {
  unsigned u = __float_as_uint(l);
  if (u == 0x80000000u) u = 0u;  // -0 ties +0
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<unsigned long long>(u) << 32) | static_cast<unsigned>(~v);
}

// The logit a rank key was made from.
__device__ __forceinline__ float key_logit(unsigned long long k) {
  const unsigned u = static_cast<unsigned>(k >> 32);
  return __uint_as_float((u & 0x80000000u) ? (u & 0x7fffffffu) : ~u);
}

// Token v of a row is a candidate: allowed by its bitmask words (null: all) and not NaN.
__device__ __forceinline__ bool sample_candidate(const float* row, const int* mrow, int v, float& l) {
  l = row[v];
  return l == l && (mrow == nullptr || ((static_cast<unsigned>(mrow[v >> 5]) >> (v & 31)) & 1u) != 0u);
}

// One row's q (ops.sampling steps 1 and 3): z = l / T, m = the top candidate's z.
struct RowQ {
  double T, m;
  int mode;  // 0: m finite (w = exp(z - m), s = z); 1: m = +inf (w = [z == m]); 2: m = -inf (w = 1)
  __device__ __forceinline__ double weight(float l) const {
    const double z = static_cast<double>(l) / T;
    if (mode == 0) return exp(z - m);  // exp(-inf) = 0
    if (mode == 1) return z == m ? 1.0 : 0.0;
    return 1.0;
  }
  __device__ __forceinline__ double score(float l) const { return mode == 0 ? static_cast<double>(l) / T : 0.0; }
};

struct SampleShared {
  double part[kRadix][kSampleThreads + 1];  // thread t's sum for digit d at [d][t] (+1: distinct banks)
  double red[kRadix][kRadixGroups];
  double bins[kRadix];
  unsigned long long kred[kSampleThreads];
  double sbest[kSampleThreads];
  int ibest[kSampleThreads];
  int ired[33];
};

// part[d][t] (every thread's 16 sums) -> bins[d] = sum over t, in a fixed order: thread t adds
// group t / 16's 16 columns of digit t % 16, then thread d < 16 adds the groups in order.
__device__ __forceinline__ void reduce_bins(SampleShared& sh) {
  __syncthreads();
  const int t = threadIdx.x, d = t % kRadix, g = t / kRadix;
  double s = 0.0;
  for (int j = 0; j < kRadixGroups; ++j) s += sh.part[d][g * kRadixGroups + j];
  sh.red[d][g] = s;
  __syncthreads();
  if (t < kRadix) {
    double b = 0.0;
    for (int j = 0; j < kRadixGroups; ++j) b += sh.red[t][j];
    sh.bins[t] = b;
  }
  __syncthreads();
}

// Block-wide FP64 sum of one value per thread, in reduce_bins's order; every thread gets it.
__device__ __forceinline__ double block_sum_f64(double v, SampleShared& sh) {
  const int t = threadIdx.x;
#pragma unroll
  for (int d = 0; d < kRadix; ++d) sh.part[d][t] = d == 0 ? v : 0.0;
  reduce_bins(sh);
  return sh.bins[0];  // bins is written again only after two more barriers
}

__device__ __forceinline__ unsigned long long block_max_u64(unsigned long long v, SampleShared& sh) {
  const int t = threadIdx.x;
  sh.kred[t] = v;
  __syncthreads();
  for (int s = kSampleThreads / 2; s > 0; s >>= 1) {
    if (t < s && sh.kred[t + s] > sh.kred[t]) sh.kred[t] = sh.kred[t + s];
    __syncthreads();
  }
  const unsigned long long out = sh.kred[0];
  __syncthreads();
  return out;
}

// The largest key t such that the candidates with key >= max(t, lo) weigh >= target in all
// (weight wt(l)), digit by digit from the top: with the digits above chosen (prefix), the
// candidates matching them are binned by the next digit, and the highest digit whose bin plus
// everything ranked above it (`above`, and the higher bins) reaches the target is taken.
// Every thread makes the same choice from the same bins. Precondition: the candidates with
// key >= lo weigh >= target (else the lowest digits are taken: t = the lowest matching prefix).
template <typename Wt>
__device__ unsigned long long select_key(const float* row, const int* mrow, int V, unsigned long long lo,
                                         double target, Wt wt, SampleShared& sh) {
  const int t = threadIdx.x;
  unsigned long long prefix = 0ull;
  double above = 0.0;
  for (int s = 64 - 4; s >= 0; s -= 4) {
#pragma unroll
    for (int d = 0; d < kRadix; ++d) sh.part[d][t] = 0.0;
    for (int v = t; v < V; v += kSampleThreads) {
      float l;
      if (!sample_candidate(row, mrow, v, l)) continue;
      const unsigned long long k = rank_key(l, v);
      if (k < lo || (s < 60 && (k >> (s + 4)) != (prefix >> (s + 4)))) continue;
      sh.part[(k >> s) & 15u][t] += wt(l);
    }
    reduce_bins(sh);
    int pick = 0;
    double acc = above;  // weight ranked above digit d
    for (int d = kRadix - 1; d >= 0; --d) {
      if (d == 0 || acc + sh.bins[d] >= target) { pick = d; break; }
      acc += sh.bins[d];
    }
    above = acc;
    prefix |= static_cast<unsigned long long>(pick) << s;  // bins is rewritten after two barriers
  }
  return prefix;
}

}  // namespace mtp

// dist: [n, V] fp32 or null; id_map: [V] int32 or null (a draft vocabulary's rows -> target ids).
__global__ void __launch_bounds__(256)
sample_kernel(const float* __restrict__ logits, const int* __restrict__ bitmask, int V,
              const unsigned long long* __restrict__ keys, const double* __restrict__ temperature,
              const int* __restrict__ top_k, const double* __restrict__ top_p, const int* __restrict__ id_map,
              int* __restrict__ ids, float* __restrict__ probs, float* __restrict__ dist) {
  using namespace mtp;
  __shared__ SampleShared sh;
  const long long r = blockIdx.x;
  const int t = threadIdx.x;
  const float* row = logits + r * V;
  const int* mrow = bitmask ? bitmask + r * ((V + 31) / 32) : nullptr;
  float* drow = dist ? dist + r * V : nullptr;

  // 1. the candidates: how many, and the top one's key
  int c = 0;
  unsigned long long top = 0ull;
  for (int v = t; v < V; v += kSampleThreads) {
    float l;
    if (!sample_candidate(row, mrow, v, l)) continue;
    ++c;
    const unsigned long long k = rank_key(l, v);
    if (k > top) top = k;
  }
  c = block_sum_int(c, sh.ired);
  top = block_max_u64(top, sh);
  if (c == 0) {  // uniform over the block
    if (t == 0) { ids[r] = -1; probs[r] = 0.0f; }
    if (drow) for (int v = t; v < V; v += kSampleThreads) drow[v] = 0.0f;
    return;
  }

  RowQ q;
  q.T = temperature[r];
  q.m = static_cast<double>(key_logit(top)) / q.T;
  q.mode = q.m - q.m == 0.0 ? 0 : (q.m > 0.0 ? 1 : 2);  // inf - inf is NaN: m infinite
  const int k = top_k[r];
  const double p = top_p[r];

  // 2. K: the first k of the rank order (keys >= the k-th largest)
  unsigned long long lo = 0ull;
  if (k == 1) {
    lo = top;  // the greedy draft: no select
  } else if (k > 0 && k < c) {
    lo = select_key(row, mrow, V, 0ull, static_cast<double>(k), [](float) { return 1.0; }, sh);
  }

  // 3. P: the shortest prefix of K whose weight reaches top_p * sum_K w
  unsigned long long thr = lo;
  if (p < 1.0) {
    double wk = 0.0;
    for (int v = t; v < V; v += kSampleThreads) {
      float l;
      if (sample_candidate(row, mrow, v, l) && rank_key(l, v) >= lo) wk += q.weight(l);
    }
    const double target = __dmul_rn(p, block_sum_f64(wk, sh));  // no FMA into the comparisons
    const unsigned long long cut = select_key(row, mrow, V, lo, target, [&q](float l) { return q.weight(l); }, sh);
    thr = cut > lo ? cut : lo;
  }

  // 4. the Gumbel-max draw over P, and sum_P w
  const unsigned long long key = keys[r];
  double best = 0.0, wp = 0.0;
  int bv = -1;
  for (int v = t; v < V; v += kSampleThreads) {  // ascending ids: a tie keeps the lower
    float l;
    if (!sample_candidate(row, mrow, v, l) || rank_key(l, v) < thr) continue;
    const double w = q.weight(l);
    wp += w;
    if (w > 0.0) {
      const double sc = q.score(l) + token_gumbel(key, id_map ? id_map[v] : v);
      if (bv < 0 || sc > best) { best = sc; bv = v; }
    }
  }
  const double total = block_sum_f64(wp, sh);
  sh.sbest[t] = best;
  sh.ibest[t] = bv;
  __syncthreads();
  for (int s = kSampleThreads / 2; s > 0; s >>= 1) {  // (score, id): higher score, then lower id
    if (t < s) {
      const int oi = sh.ibest[t + s], mi = sh.ibest[t];
      const double os = sh.sbest[t + s], ms = sh.sbest[t];
      if (oi >= 0 && (mi < 0 || os > ms || (os == ms && oi < mi))) { sh.sbest[t] = os; sh.ibest[t] = oi; }
    }
    __syncthreads();
  }
  const int win = sh.ibest[0];  // >= 0: the top candidate has w = 1
  if (t == 0) {
    ids[r] = id_map ? id_map[win] : win;
    probs[r] = static_cast<float>(q.weight(row[win]) / total);
  }
  if (drow) {
    for (int v = t; v < V; v += kSampleThreads) {
      float l;
      const bool in = sample_candidate(row, mrow, v, l) && rank_key(l, v) >= thr;
      drow[v] = in ? static_cast<float>(q.weight(l) / total) : 0.0f;
    }
  }
}
