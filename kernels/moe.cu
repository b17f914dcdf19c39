// moe.cu -- the router's selection and the routed experts.
//
// moe_router = linear_kernel (linear.cu: logits [n, E] = x @ gate_w^T, the GEMV
// spread over the GPU) + moe_router_select_kernel; one row (n = 1, the decode step):
// moe_router_kernel<W, NORM>, the same GEMV whose last block runs the selection (below).
//
// moe_router_select_kernel: grid (n), block = E rounded up to 32 (<= 1024); thread e
//   owns expert e of row r (router_select_row: any block size, thread t owning experts
//   t, t + blockDim.x, ..), exactly as transformers' DeepseekV3 / Glm4Moe router in FP32
//   (mtpkern.ops.moe):
//   s = score(logit): scoring 0 sigmoid, 1 softmax over the row, 2 sqrtsoftplus (DeepSeek-V4:
//   sqrt(softplus(l)), torch's softplus: l where l > 20, else log1p(exp(l))) (the index in
//   mtpkern.ops.moe.SCORINGS); c = s + bias (selection only);
//   group score = sum of the group's top-2 c; the topk_group best groups are kept
//   (rank by score, lowest group id on ties); c outside them becomes -inf (an expert of a
//   dropped group never outranks a kept one, even where s + bias is negative);
//   expert e is chosen when its rank by c (ties: lowest id) is < K, and its rank is
//   its output column; weight = s / (sum of the chosen s + 1e-20) when norm, times
//   the scaling factor. Ranks are counted against all E (O(E) shared-memory reads
//   per thread, broadcasts), so there is no sort and the result is exact. NaN ranks
//   after every number (mtp::ranks_before, the reference's argsort order), so a NaN
//   row still fills all K ids with distinct experts.
//
// moe_experts = moe_expert_kernel<W, true, NR> + moe_expert_kernel<W, false, NR> + moe_combine_kernel
// (one row: moe_expert_kernel<W, true, 1> + moe_down_combine_kernel<W>):
//
// moe_expert_kernel<W, GATED, NR>: the gather-GEMV over the selected experts.
//   grid (ceil(units / 4), slots), block 128 = 4 warps, one warp per unit.
//   A (row, k) pair p = r * K + k selects expert ids[p]. Slot y is
//     by_pair (n * K <= E, decode): pair y; the block exits unless y is the first pair
//       naming its expert, so an expert is handled by exactly one slot;
//     else: expert y (the block exits when no pair names it).
//   The block then gathers every pair naming its expert (ordered, NR at a time,
//   warp 0 with ballots) and runs the GEMV for those input rows together: each
//   expert's weights are read once per NR pairs, so an expert picked by several
//   rows is not re-read from memory per row. NR (1, 2, 4, 8): the launcher takes the
//   smallest >= min(n, 8), the most pairs that can name one expert when each row's
//   ids are distinct (the router's are), so decode at n = 1 runs the 1-row GEMV.
//   NORM (with GATED; moe_experts(..., norm=)): x rows RMS-normalised on the fly (norm_w [H],
//     eps; common.cuh gemv_dot_impl), so the normed rows are never stored; else norm_w null.
//   GATED (gate/up): w = w13 [E, 2I, H], unit u = (gate row u, up row I + u),
//     x row of pair p = x[p / K], act[p, u] = swiglu(gate, up, limit, gate_limit)   units = I
//     (mtp::swiglu: min(silu(gate), L) * clip(up, -L, L), Step-3.5 / 3.7, or with gate_limit
//     silu(min(gate, L)) * clip(up, -L, L), DeepSeek-V4; +inf: no clamp)
//   !GATED (down):   w = w2 [E, H, I], unit u = rows (2u, 2u + 1),
//     x row of pair p = act[p], partial[p, h] = w2[e, h] . act[p].   units = ceil(H / 2)
//     (limit, gate_limit unused)
//   SITU (with GATED: Kimi K3's gated activation): act[p, u] = situ(gate, up, beta, linear beta),
//     the two in limit / gate_limit (mtp::gated_act).
//   RELU2 (with !GATED: Nemotron-H's non-gated up pass): w = w1 [E, I, H] (the up rows alone),
//     unit u = rows (2u, 2u + 1), x row of pair p = x[p / K], act[p, i] = relu2(w1[e, i] . x)
//     (mtp::relu2); NORM as GATED's.   units = ceil(I / 2)
//
// moe_down_combine_kernel<W>: the down pass and the combine in one launch for one row (n = 1,
//   the decode step): grid (ceil(ceil(H / 2) / 4)), block 128, warp unit u = rows (2u, 2u + 1)
//   of w2[ids[k]] for every k in turn; y[h] = residual[h] + sum_k weights[k] * (w2[ids[k], h] .
//   act[k]), k in order: the same dot (expert_chunk's, NR = 1) and the same sum as the two
//   launches, without partial. One row names each expert at most once (the router's ids are
//   distinct), so every expert's weights are still read once. Pairs whose id is outside [0, E)
//   add nothing. y may alias residual (each warp reads its two values before writing them).
//
// moe_combine_kernel: grid (ceil(H / 256), n), block 256:
//   y[r, h] = residual[r, h] + sum_k weights[r, k] * partial[r * K + k, h], k in order
//   (deterministic, no atomics); pairs whose id is outside [0, E) add nothing.
//
// W: as linear.cu; FP8 experts pass scale [E, ceil(R / bn), ceil(Kd / bk)] (per-channel:
// [E, R] with bn = 1, bk = Kd), FP4 ones their E8M0 codes [E, R, ceil(Kd / 32)], dense ones null.
//
// Preconditions: E <= 1024 and E % n_group == 0 (router); blockDim as stated;
// ids in [0, E) for pairs that should count; y may alias residual. The 16-byte
// path needs the GEMV's K (H or I) % (16 / sizeof(W)) == 0 and aligned bases.
#include "common.cuh"

namespace mtp {
constexpr int kRouterMaxExperts = 1024;

// The reference's order of router values (a stable argsort of -c): larger first,
// NaN after every number, lower index on ties. A strict total order, so the ranks
// counted with it are a permutation of 0 .. count-1 even when a row holds NaN
// (otherwise NaN entries would share rank 0 and leave id slots unwritten).
__device__ __forceinline__ bool ranks_before(float v, int i, float w, int j) {
  const bool vn = isnan(v), wn = isnan(w);
  if (vn != wn) return wn;
  return vn ? i < j : (v > w || (v == w && i < j));
}

// v is larger than w in that order (NaN the smallest value).
__device__ __forceinline__ bool larger(float v, float w) { return !isnan(v) && (isnan(w) || v > w); }
}  // namespace mtp

namespace mtp {

// The shared memory of one row's selection.
struct RouterSmem {
  float c[kRouterMaxExperts];     // c, then c masked by group
  float s[kRouterMaxExperts];     // s (the weights' values)
  float gs[kRouterMaxExperts];    // group scores
  int keep[kRouterMaxExperts];    // group kept
  float sel[kRouterMaxExperts];   // s of the chosen experts, by rank
  float red[33];
};

// One row's selection (the header's rule) by a block of any multiple of 32 threads: thread
// t owns experts t, t + blockDim.x, ..; logits read through L2 (__ldcg: in the fused kernel
// other blocks wrote them during this launch). With one expert per thread (the select
// kernel's block of E rounded up) the sums and maxima are those of one value per thread.
__device__ __forceinline__ void router_select_row(const float* logits, const float* __restrict__ bias, int* ids, float* weights,
                                                  int E, int K, int n_group, int topk_group, float scale, int norm_topk,
                                                  int scoring, RouterSmem& sm) {
  const int t = threadIdx.x, nt = blockDim.x;
  if (scoring == 1) {  // softmax; the branch is uniform
    float mx = neg_inf();
    for (int e = t; e < E; e += nt) mx = fmaxf(mx, __ldcg(logits + e));
    mx = block_max(mx, sm.red);
    float z = 0.0f;
    for (int e = t; e < E; e += nt) {
      const float v = expf(__ldcg(logits + e) - mx);
      sm.s[e] = v;
      z += v;
    }
    z = block_sum(z, sm.red);
    for (int e = t; e < E; e += nt) sm.s[e] = sm.s[e] / z;
  } else if (scoring == 2) {  // sqrtsoftplus; NaN stays NaN (not > 20, and log1pf(expf(NaN)))
    for (int e = t; e < E; e += nt) {
      const float l = __ldcg(logits + e);
      sm.s[e] = sqrtf(l > 20.0f ? l : log1pf(expf(l)));
    }
  } else {
    for (int e = t; e < E; e += nt) sm.s[e] = 1.0f / (1.0f + expf(-__ldcg(logits + e)));
  }
  for (int e = t; e < E; e += nt) sm.c[e] = sm.s[e] + bias[e];
  __syncthreads();

  const int EG = E / n_group;  // experts per group
  for (int g = t; g < n_group; g += nt) {
    // top-2 of the group in the reference's order (NaN the smallest: a group with one
    // number and a NaN scores NaN, as sum(sort(..)[:2]) does); a duplicate max fills both
    float a = quiet_nan(), b = quiet_nan();
    for (int j = 0; j < EG; ++j) {
      const float v = sm.c[g * EG + j];
      if (larger(v, a)) { b = a; a = v; }
      else if (larger(v, b)) { b = v; }
    }
    sm.gs[g] = EG >= 2 ? a + b : a;
  }
  __syncthreads();
  for (int g = t; g < n_group; g += nt) {
    const float gs = sm.gs[g];
    int rank = 0;
    for (int h = 0; h < n_group; ++h) rank += ranks_before(sm.gs[h], h, gs, g);
    sm.keep[g] = rank < topk_group;
  }
  __syncthreads();
  for (int e = t; e < E; e += nt) {
    if (!sm.keep[e / EG]) sm.c[e] = neg_inf();  // the references' masked_fill(.., -inf)
  }
  __syncthreads();
  for (int e = t; e < E; e += nt) {
    const float cm = sm.c[e];
    int rank = 0;
    for (int f = 0; f < E; ++f) rank += ranks_before(sm.c[f], f, cm, e);
    if (rank < K) {
      ids[rank] = e;
      sm.sel[rank] = sm.s[e];
    }
  }
  __syncthreads();
  for (int k = t; k < K; k += nt) {
    float w = sm.sel[k];
    if (norm_topk) {
      float sum = 0.0f;
      for (int j = 0; j < K; ++j) sum += sm.sel[j];
      w = w / (sum + 1e-20f);
    }
    weights[k] = w * scale;
  }
  __syncthreads();  // sm is rewritten by the next row
}

}  // namespace mtp

__global__ void __launch_bounds__(mtp::kRouterMaxExperts)
moe_router_select_kernel(const float* __restrict__ logits, const float* __restrict__ bias,
                         int* __restrict__ ids, float* __restrict__ weights, int E, int K,
                         int n_group, int topk_group, float scale, int norm_topk, int scoring) {
  __shared__ mtp::RouterSmem sm;
  const long long r = blockIdx.x;
  mtp::router_select_row(logits + r * E, bias, ids + r * K, weights + r * K, E, K, n_group, topk_group, scale,
                         norm_topk, scoring, sm);
}

// The router in one launch for one row (n = 1, the decode step): linear.cu's GEMV of the
// logits (gemv_groups, NR = 1, the launcher's grid and wpr), then the last block to finish
// runs the selection. Each block's logits are written, fenced (__threadfence: visible to the
// whole device before the ticket), and one thread takes a ticket with atomicInc(ticket,
// gridDim.x - 1); the block that draws gridDim.x - 1 is the last, and atomicInc wraps the
// counter back to 0 as it draws it, so the ticket is zero again for the next launch (a CUDA
// graph replays it as it is). ``ticket``: one unsigned, zero before the first launch.
template <typename W, bool NORM>
__global__ void
moe_router_kernel(const float* __restrict__ x, const W* __restrict__ w, const mtp::ScaleT<W>* __restrict__ scale, int bn,
                  int bk, const float* __restrict__ bias, float* logits, int* __restrict__ ids,
                  float* __restrict__ weights, unsigned* ticket, int E, int H, int wpr,
                  const float* __restrict__ norm_w, float eps, int K, int n_group, int topk_group, float rscale,
                  int norm_topk, int scoring) {
  using namespace mtp;
  const LinearEpi epi{nullptr, nullptr, logits, E};
  gemv_groups<W, 1, NORM>(x, w, make_scales<W>(scale, bn, bk, H), 1, H, wpr, epi, RowNorm{norm_w, eps});
  __shared__ bool last;
  __shared__ RouterSmem sm;
  __threadfence();   // each writer's logits, device-wide, before the barrier
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();   // and again by the thread that releases them with its ticket (cumulative)
    last = atomicInc(ticket, gridDim.x - 1) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();   // the acquire side: the other blocks' logits, read through L2 (__ldcg)
  router_select_row(logits, bias, ids, weights, E, K, n_group, topk_group, rscale, norm_topk, scoring, sm);
}

namespace mtp {

// One chunk of m <= NR pairs of expert weights `we`: warp unit u, rows a / b. NORM (GATED
// only): x rows RMS-normalised on the fly (nm), as gemv_groups' NORM.
template <typename W, bool GATED, int NR, bool NORM, bool RELU2 = false, bool SITU = false>
__device__ __forceinline__ void expert_chunk(const float* x, int x_div, const W* we, const Scales& se, int R,
                                             int Kd, int u, const int* pairs, int m, float* out, bool vec,
                                             float limit, float gate_limit, const RowNorm& nm) {
  if constexpr (NR > 1) {
    if (m <= NR / 2) {  // the smallest instantiation that holds the m pairs
      expert_chunk<W, GATED, NR / 2, NORM, RELU2, SITU>(x, x_div, we, se, R, Kd, u, pairs, m, out, vec, limit, gate_limit,
                                                   nm);
      return;
    }
  }
  const int lane = threadIdx.x % kWarp;
  int a, b;
  if constexpr (GATED) { a = u; b = R / 2 + u; }  // gate row, up row of w13[e] [2I, H]
  else { a = 2 * u; b = min(a + 1, R - 1); }       // rows of w2[e] [H, I]
  const W* const wr[2] = {weight_row(we, a, Kd), weight_row(we, b, Kd)};
  const ScaleT<W>* const sr[2] = {scale_row<W>(se, a), scale_row<W>(se, b)};
  const float* xr[NR];
#pragma unroll
  for (int r = 0; r < NR; ++r) xr[r] = opaque(x + static_cast<long long>(pairs[min(r, m - 1)] / x_div) * Kd);
  float acc[2][NR], ss[NR];
  zero(acc);
#pragma unroll
  for (int r = 0; r < NR; ++r) ss[r] = 0.0f;
  gemv_dot_impl<W, NR, 2, NORM>(wr, sr, se.bk, xr, Kd, lane, kWarp, vec, acc, nm.g, ss);
  warp_sum_all(acc);
  if constexpr (NORM) {
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const float denom = sqrtf(warp_sum(ss[r]) / static_cast<float>(Kd) + nm.eps);  // as rmsnorm
      acc[0][r] /= denom;
      acc[1][r] /= denom;
    }
  }
  if (lane != 0) return;
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    if (r >= m) break;
    const long long p = pairs[r];
    if constexpr (GATED) {
      out[p * (R / 2) + u] = gated_act<SITU>(acc[0][r], acc[1][r], limit, gate_limit);  // act [n * K, I]
    } else if constexpr (RELU2) {
      out[p * R + a] = relu2(acc[0][r]);                    // act [n * K, I]
      if (a + 1 < R) out[p * R + a + 1] = relu2(acc[1][r]);
    } else {
      out[p * R + a] = acc[0][r];                           // partial [n * K, H]
      if (a + 1 < R) out[p * R + a + 1] = acc[1][r];
    }
  }
}

}  // namespace mtp

template <typename W, bool GATED, int NR, bool NORM, bool RELU2 = false, bool SITU = false>
__global__ void
moe_expert_kernel(const float* __restrict__ x, int x_div, const int* __restrict__ ids, int nK, int E,
                  const W* __restrict__ w, const mtp::ScaleT<W>* __restrict__ scale, int bn, int bk, int R, int Kd,
                  float* __restrict__ out, int by_pair, float limit, float gate_limit,
                  const float* __restrict__ norm_w, float eps) {
  static_assert(GATED || RELU2 || !NORM, "the norm is fused into the gate/up (or relu2 up) pass only");
  static_assert(!(GATED && RELU2), "relu2 is the non-gated up pass");
  static_assert(GATED || !SITU, "situ is a gated activation (the gate/up pass)");
  using namespace mtp;
  __shared__ int s_pairs[NR];
  __shared__ int s_count, s_cursor;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int slot = blockIdx.y;
  int e = slot;
  if (by_pair) {
    e = ids[slot];
    if (e < 0 || e >= E) return;
    bool dup = false;  // an earlier pair naming e owns this expert
    for (int p = threadIdx.x; p < slot; p += blockDim.x) dup |= ids[p] == e;
    if (__syncthreads_or(dup)) return;
  }
  const int units = GATED ? R / 2 : (R + 1) / 2;
  const int u = blockIdx.x * kGemvWarps + warp;
  const W* we = weight_row(w, static_cast<long long>(e) * R, Kd);  // expert e: [R, Kd]
  const Scales sc = make_scales<W>(scale, bn, bk, Kd);
  const Scales se = Elem<W>::scaled ? sc.expert(e, R) : sc;
  const bool vec = gemv_vec_ok(w, x, Kd, sc) && (!NORM || aligned16(norm_w));

  int cursor = 0;  // next pair to scan
  for (;;) {
    if (warp == 0) {  // gather the next <= NR pairs naming e, in pair order
      int cnt = 0;
      while (cnt < NR && cursor < nK) {
        const int p = cursor + lane;
        const bool hit = p < nK && ids[p] == e;
        const unsigned bits = __ballot_sync(kFullMask, hit);
        const int before = __popc(bits & ((1u << lane) - 1u));
        const int total = __popc(bits);
        const int take = min(NR - cnt, total);
        if (hit && before < take) s_pairs[cnt + before] = p;
        if (take < total) {  // resume at the first hit not taken
          cursor += __ffs(__ballot_sync(kFullMask, hit && before == take)) - 1;
        } else {
          cursor += kWarp;
        }
        cnt += take;
      }
      if (lane == 0) { s_count = cnt; s_cursor = cursor; }
    }
    __syncthreads();
    const int m = s_count;
    cursor = s_cursor;
    if (m == 0) break;
    if (u < units) {
      expert_chunk<W, GATED, NR, NORM, RELU2, SITU>(x, x_div, we, se, R, Kd, u, s_pairs, m, out, vec, limit, gate_limit,
                                              RowNorm{norm_w, eps});
    }
    __syncthreads();  // s_pairs is rewritten by the next gather
  }
}

template <typename W>
__global__ void
moe_down_combine_kernel(const float* __restrict__ act, const int* __restrict__ ids,
                        const float* __restrict__ weights, int K, int E, const W* __restrict__ w,
                        const mtp::ScaleT<W>* __restrict__ scale, int bn, int bk, int H, int I, const float* residual,
                        float* y) {
  using namespace mtp;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int u = blockIdx.x * kGemvWarps + warp;
  if (u >= (H + 1) / 2) return;
  const int a = 2 * u, b = min(a + 1, H - 1);
  const Scales sc = make_scales<W>(scale, bn, bk, I);
  const bool vec = gemv_vec_ok(w, act, I, sc);
  float y0 = residual ? residual[a] : 0.0f;
  float y1 = residual && a + 1 < H ? residual[a + 1] : 0.0f;
  for (int k = 0; k < K; ++k) {
    const int e = ids[k];
    if (e < 0 || e >= E) continue;
    const W* we = weight_row(w, static_cast<long long>(e) * H, I);  // expert e: [H, I]
    const Scales se = Elem<W>::scaled ? sc.expert(e, H) : sc;
    const W* const wr[2] = {weight_row(we, a, I), weight_row(we, b, I)};
    const ScaleT<W>* const sr[2] = {scale_row<W>(se, a), scale_row<W>(se, b)};
    const float* const xr[1] = {opaque(act + static_cast<long long>(k) * I)};
    float acc[2][1], ss[1] = {0.0f};
    zero(acc);
    gemv_dot_impl<W, 1, 2, false>(wr, sr, se.bk, xr, I, lane, kWarp, vec, acc, nullptr, ss);
    warp_sum_all(acc);
    const float wk = weights[k];
    y0 += wk * acc[0][0];
    y1 += wk * acc[1][0];
  }
  if (lane != 0) return;
  y[a] = y0;
  if (a + 1 < H) y[a + 1] = y1;
}

__global__ void __launch_bounds__(256)
moe_combine_kernel(const float* __restrict__ partial, const int* __restrict__ ids,
                   const float* __restrict__ weights, const float* residual, float* y, int K, int E, int H) {
  const int h = blockIdx.x * blockDim.x + threadIdx.x;
  const long long r = blockIdx.y;
  if (h >= H) return;
  float acc = residual ? residual[r * H + h] : 0.0f;
  for (int k = 0; k < K; ++k) {
    const long long p = r * K + k;
    const int e = ids[p];
    if (e < 0 || e >= E) continue;
    acc += weights[p] * partial[p * H + h];
  }
  y[r * H + h] = acc;
}
