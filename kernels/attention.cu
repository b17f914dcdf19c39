// attention.cu -- GQA decode attention over a paged KV cache, split-KV.
//
//   q [n, Hq, D] fp32, k_cache [NB, BS, Hkv, D] / v_cache [NB, BS, Hkv, Dv] in KV,
//   block_tables [S, max_blocks] int32, row_seq [n], row_start [n] | null, row_len [n],
//   sinks [Hq] | null -> out [n, Hq * Dv] fp32
//   Row r attends to KV rows first .. L - 1 of sequence row_seq[r] (L = row_len[r];
//   first = row_start[r], 0 without row_start: a sliding window); KV row i lives at slot
//   block_tables[s, i / BS] * BS + i % BS. Query head hq reads KV head hq / group
//   (group = Hq / Hkv). Decode rows, the causal rows of a prefill chunk and the ragged
//   rows of a batched propose are all this one shape. A sink s_hq (sinks not null) joins
//   the softmax as a key of logit s_hq and value 0: out = sum_i e^(l_i - M) v_i /
//   (e^(s_hq - M) + sum_i e^(l_i - M)).
//
// paged_attention_kernel<KV, DC>: grid (Hkv, n, num_parts), block 128 = 4 warps.
//   One block = one KV head x one query row x one partition of part_size KV rows
//   (split-KV: a long context is spread over num_parts blocks; partition p holds rows
//   first + p * part_size ..). All `group` query heads sharing the KV head are served by
//   the block, so every K/V row is read from memory once per (row, KV head), not once
//   per query head. Heads are taken GMAX = 64 / DC at a time (12 of 12 for Dv <= 128);
//   per chunk:
//     A. scores: thread t owns KV rows t, t + 128, ...; it streams its K row in 8-element
//        (16-byte bf16) pieces and accumulates q . k for every head of the chunk
//        (acc[GMAX] in registers, q pre-scaled in shared memory, read as broadcasts).
//     B. softmax: warp w owns heads w, w + 4, ...: max over the partition, p = exp(s - max)
//        written in place, l = sum p.
//     C. PV: warp w owns KV rows w, w + 4, ...; lane l owns value dims [l * DC, l * DC + DC),
//        o[GMAX][DC] in registers; the 4 warps' o are added in warp order in shared memory.
//   num_parts == 1: out = o / (l + e^(s - m)) directly (no sink: o / l). Otherwise the
//   partition's unnormalised o and its (max, sum) go to part_o [n, Hq, num_parts, Dv] /
//   part_ml [n, Hq, num_parts, 2] and paged_attention_merge_kernel combines them.
//   row_start and sinks are read once per block (null: off), never in the loops.
//   Shared memory (dynamic, bytes) = 4 * (group * Dp + gcap * part_size + part_size + 2 * gcap),
//   Dp = D rounded up to 8, gcap = min(group, GMAX); the launcher computes the same sum.
//
// paged_attention_merge_kernel: grid (Hq, n), block 128 over Dv:
//   out = sum_p e^(m_p - M) o_p / (e^(s - M) + sum_p e^(m_p - M) l_p) over the row's valid
//   partitions (M = max(s, m_p); no sink: no s), in partition order (deterministic, no
//   atomics): the sink counts once, however many partitions there are.
//
// Preconditions: blockDim.x == 128; D <= 256; Dv <= 32 * DC; part_size >= 32 * DC (the
// PV reduction reuses the score buffer); block_tables entries of the blocks holding rows
// first .. L - 1 are valid blocks (the others are never read); slots < 2^31. L is clamped
// to max_blocks * BS and first to >= 0; a row with first >= L gets zeros. 16-byte K
// loads need D % 8 == 0 and an aligned cache, DC-wide V loads need Dv % DC == 0;
// otherwise the kernel reads scalars (same results).
// Cost: per (KV row, head) ~D + Dv FMAs on CUDA cores; for group >= 8 the kernel is
// about as much FMA-bound as memory-bound (tensor-core QK / PV would be the next step).
#include "common.cuh"

namespace mtp {
constexpr int kAttnWarps = 4;
constexpr int kAttnThreads = kAttnWarps * kWarp;
}  // namespace mtp

template <typename KV, int DC>
__global__ void __launch_bounds__(mtp::kAttnThreads)
paged_attention_kernel(const float* __restrict__ q, const KV* __restrict__ k_cache,
                       const KV* __restrict__ v_cache, const int* __restrict__ block_tables,
                       int max_blocks, const int* __restrict__ row_seq, const int* __restrict__ row_start,
                       const int* __restrict__ row_len, const float* __restrict__ sinks,
                       float* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml,
                       int Hq, int Hkv, int D, int Dv, int BS, int part_size, int num_parts, float scale) {
  using namespace mtp;
  constexpr int GMAX = 64 / DC;  // heads per chunk: o[GMAX][DC] = 64 registers
  extern __shared__ float4 smem_raw[];
  const int h = blockIdx.x, p = blockIdx.z;
  const long long r = blockIdx.y;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int group = Hq / Hkv;
  const int gcap = min(group, GMAX);
  const int Dp = (D + 7) & ~7;
  float* q_s = reinterpret_cast<float*>(smem_raw);           // [group][Dp], q * scale, zero padded
  float* s_s = q_s + group * Dp;                             // [gcap][part_size] scores, then p
  int* slot_s = reinterpret_cast<int*>(s_s + gcap * part_size);  // [part_size]
  float* ml_s = reinterpret_cast<float*>(slot_s + part_size);    // [gcap][2] (max, sum)

  const int seq = row_seq[r];
  const int L = min(row_len[r], max_blocks * BS);
  const int first = row_start ? max(row_start[r], 0) : 0;  // the window's first KV row
  const int start = first + p * part_size;
  const int Lp = min(L - start, part_size);  // KV rows of this partition
  const long long head0 = r * Hq + static_cast<long long>(h) * group;  // [n, Hq]: first head of the group
  if (Lp <= 0) {  // uniform: nothing to attend to in this partition
    if (num_parts == 1)
      for (int t = threadIdx.x; t < group * Dv; t += blockDim.x) out[head0 * Dv + t] = 0.0f;
    return;
  }

  for (int i = threadIdx.x; i < Lp; i += blockDim.x) {
    const int j = start + i;
    slot_s[i] = block_tables[static_cast<long long>(seq) * max_blocks + j / BS] * BS + j % BS;
  }
  for (int t = threadIdx.x; t < group * Dp; t += blockDim.x) {
    const int g = t / Dp, d = t % Dp;
    q_s[t] = d < D ? q[(head0 + g) * D + d] * scale : 0.0f;
  }
  __syncthreads();

  const bool vec_k = D % 8 == 0 && aligned16(k_cache);
  const bool vec_v = Dv % DC == 0 && aligned16(v_cache);
  const int dl = lane * DC;  // this lane's value dims in pass C

  for (int g0 = 0; g0 < group; g0 += GMAX) {
    const int gc = min(GMAX, group - g0);

    // A. scores s[g][i] = (q[g] * scale) . k[i]
    for (int i = threadIdx.x; i < Lp; i += blockDim.x) {
      const KV* krow = k_cache + (static_cast<long long>(slot_s[i]) * Hkv + h) * D;
      float acc[GMAX];
#pragma unroll
      for (int g = 0; g < GMAX; ++g) acc[g] = 0.0f;
      for (int d0 = 0; d0 < D; d0 += 8) {
        float kf[8];
        if (vec_k) load_vec<8>(krow + d0, kf);
        else load_guarded<8>(krow + d0, D - d0, kf);
#pragma unroll
        for (int g = 0; g < GMAX; ++g) {
          if (g < gc) {
            const float4* qg = reinterpret_cast<const float4*>(q_s + (g0 + g) * Dp + d0);
            const float4 qa = qg[0], qb = qg[1];
            float a = acc[g];
            a = fmaf(qa.x, kf[0], a); a = fmaf(qa.y, kf[1], a); a = fmaf(qa.z, kf[2], a); a = fmaf(qa.w, kf[3], a);
            a = fmaf(qb.x, kf[4], a); a = fmaf(qb.y, kf[5], a); a = fmaf(qb.z, kf[6], a); a = fmaf(qb.w, kf[7], a);
            acc[g] = a;
          }
        }
      }
#pragma unroll
      for (int g = 0; g < GMAX; ++g)
        if (g < gc) s_s[g * part_size + i] = acc[g];
    }
    __syncthreads();

    // B. softmax over the partition, per head
    for (int g = warp; g < gc; g += kAttnWarps) {
      float* sg = s_s + g * part_size;
      float m = neg_inf();
      for (int i = lane; i < Lp; i += kWarp) m = fmaxf(m, sg[i]);
      m = warp_max(m);
      // a -inf score weighs 0, also when the whole partition is -inf (m = -inf, where
      // exp(-inf - m) would be NaN); m itself goes to the merge unchanged
      const float mo = m == mtp::neg_inf() ? 0.0f : m;
      float l = 0.0f;
      for (int i = lane; i < Lp; i += kWarp) {
        const float e = expf(sg[i] - mo);
        sg[i] = e;
        l += e;
      }
      l = warp_sum(l);
      // the direct path divides by the whole denominator: l + e^(s - m), the sink's share
      // relative to this row's max (m = -inf: inf, so the output is 0); the merge adds it
      // itself, once
      if (sinks != nullptr && num_parts == 1) l += expf(sinks[h * group + g0 + g] - m);
      if (lane == 0) { ml_s[2 * g] = m; ml_s[2 * g + 1] = l; }
    }
    __syncthreads();

    // C. o[g][d] = sum_i p[g][i] v[i][d]
    float o[GMAX][DC];
#pragma unroll
    for (int g = 0; g < GMAX; ++g)
#pragma unroll
      for (int j = 0; j < DC; ++j) o[g][j] = 0.0f;
    for (int i = warp; i < Lp; i += kAttnWarps) {
      float vf[DC];
      const KV* vrow = v_cache + (static_cast<long long>(slot_s[i]) * Hkv + h) * Dv + dl;
      if (dl >= Dv) {
#pragma unroll
        for (int j = 0; j < DC; ++j) vf[j] = 0.0f;
      } else if (vec_v) {
        load_vec<DC>(vrow, vf);
      } else {
        load_guarded<DC>(vrow, Dv - dl, vf);
      }
#pragma unroll
      for (int g = 0; g < GMAX; ++g) {
        if (g < gc) {
          const float pg = s_s[g * part_size + i];
#pragma unroll
          for (int j = 0; j < DC; ++j) o[g][j] = fmaf(pg, vf[j], o[g][j]);
        }
      }
    }
    __syncthreads();  // every read of p is done: s_s becomes red [gc][32 * DC]
    float* red = s_s;
    for (int w = 0; w < kAttnWarps; ++w) {  // fixed order: warp 0 + warp 1 + ...
      if (warp == w) {
#pragma unroll
        for (int g = 0; g < GMAX; ++g) {
          if (g < gc) {
#pragma unroll
            for (int j = 0; j < DC; ++j) {
              float* at = red + g * (kWarp * DC) + dl + j;
              *at = w == 0 ? o[g][j] : *at + o[g][j];
            }
          }
        }
      }
      __syncthreads();
    }

    for (int t = threadIdx.x; t < gc * Dv; t += blockDim.x) {
      const int g = t / Dv, d = t % Dv;
      const float v = red[g * (kWarp * DC) + d];
      const long long hq = head0 + g0 + g;  // [n, Hq]
      if (num_parts == 1) {
        out[hq * Dv + d] = v / ml_s[2 * g + 1];
      } else {
        const long long at = hq * num_parts + p;  // [n, Hq, num_parts]
        part_o[at * Dv + d] = v;
        if (d == 0) { part_ml[2 * at] = ml_s[2 * g]; part_ml[2 * at + 1] = ml_s[2 * g + 1]; }
      }
    }
    __syncthreads();  // s_s and ml_s are rewritten by the next head chunk
  }
}

__global__ void __launch_bounds__(mtp::kAttnThreads)
paged_attention_merge_kernel(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                             const int* __restrict__ row_start, const int* __restrict__ row_len,
                             const float* __restrict__ sinks, int max_len, float* __restrict__ out,
                             int Hq, int Dv, int part_size, int num_parts) {
  const int hq = blockIdx.x;
  const long long r = blockIdx.y;
  const int L = min(row_len[r], max_len);
  const int first = row_start ? max(row_start[r], 0) : 0;
  const int np = L > first ? (L - first + part_size - 1) / part_size : 0;  // partitions that were written
  const long long base = r * Hq + hq;                                      // [n, Hq]
  const float* ml = part_ml + base * num_parts * 2;
  float M = mtp::neg_inf();
  for (int p = 0; p < np; ++p) M = fmaxf(M, ml[2 * p]);
  if (sinks != nullptr) M = fmaxf(M, sinks[hq]);
  float den = 0.0f;
  for (int p = 0; p < np; ++p) den += expf(ml[2 * p] - M) * ml[2 * p + 1];
  if (sinks != nullptr) den += expf(sinks[hq] - M);  // the sink, once: a key of value 0
  for (int d = threadIdx.x; d < Dv; d += blockDim.x) {
    float num = 0.0f;
    for (int p = 0; p < np; ++p) num += expf(ml[2 * p] - M) * part_o[(base * num_parts + p) * Dv + d];
    out[base * Dv + d] = np > 0 ? num / den : 0.0f;
  }
}
