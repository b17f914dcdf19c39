// mla.cu -- MLA (multi-head latent attention, DeepSeek-V3 / GLM-5) over a paged latent cache.
//
// Letters as mtpkern/ops/mla.py: Hq heads, L = kv_lora_rank, R = qk_rope_head_dim,
// P = qk_nope_head_dim, Dv = v_head_dim, W = L + R values per latent row.
//
// mla_latent_write_kernel<KV, Interleave>: grid (n, 1 + has_q), block 256.
//   blockIdx.y == 0: row r of kv_a [n, W] fp32 (rows ldk >= W apart: a column slice of a wider
//   projection output, as kv_a_proj_with_mqa | g_proj's with an output gate) -> cache row slots[r] of latent_cache
//   [NB, BS, W] in KV: c = rmsnorm(kv_a[r, :L], norm_w) (block_sum of squares), then the
//   R rope dims rotated at positions[r] (pairs (i, i + R/2), or (2i, 2i + 1) with
//   Interleave; cos and sin times rope_scale, as rope_kv.cu). Every block first scans all
//   n slots (n ints, L1 hits): if one is outside [0, num_slots) no block writes (the
//   launcher refuses host slots before launching; device slots are not read back), and
//   a row whose slot a later row also names is left to that row (a slot given twice ends
//   with the later row, whatever the block order).
//   blockIdx.y == 1 (q not null): q_out [n, Hq, P + R] fp32 = q with each head's last R
//   dims rotated by the same angles, the first P copied.
//
// mla_q_absorb_kernel<W>: q_full [n, Hq, W] fp32 = [w_uk[h]^T q_nope[r, h] | q_pe[r, h]]
//   (FlashMLA's query layout: one latent-space query of L + R per head).
//   grid (ceil(L / 128), Hq, ceil(n / 8)), block 128 = 4 warps. Lane l owns the 4 adjacent
//   columns blockIdx.x * 128 + 4 l .. of w_uk[h] [P, L] (a warp reads 256 B of BF16 per
//   weight row, coalesced), warp w the weight rows p = w, w + 4, ...; each weight is loaded
//   once for the chunk's up to 8 query rows (q_nope in shared memory, broadcast reads).
//   The 4 warps' sums are added in warp order through shared memory (deterministic).
//
// mla_attention_kernel<KV, LPT>: o_lat [n, Hq, L] fp32 = softmax_j(scale * q_full[h] .
//   row_j) c_j over the visible latent rows j of the row (row_start[r] .. row_len[r] - 1).
//   grid (ceil(Hq / heads), n, num_parts), block 256 = 8 warps. One block = one query row
//   x a tile of `heads` <= 16 query heads x one partition of part_size latent rows
//   (split-KV, as attention.cu). The partition is walked in tiles of `tile` (<= 64) rows:
//     0. the tile's slots from the block table (entries before the window never read);
//     1. the tile's rows are copied once from global memory into shared memory as stored
//        (16-byte loads, coalesced along the row; zero padded to Wq = W rounded up to 8;
//        row stride Wq + 8 so the 16-byte reads of step 2 hit distinct banks);
//     2. scores: thread t takes row t % tile and heads t / tile + k * (256 / tile), k < 4;
//        it streams its row from shared memory 8 values at a time against q (pre-scaled,
//        in shared memory: broadcast reads, every lane of a warp has the same heads);
//     3. online softmax: warp w owns heads w, w + 8: tile max, new running max m, rescale
//        factor alpha = e^(m_old - m), p = e^(s - m) in place, running sum l = alpha l + sum p;
//     4. o = alpha o + sum_j p_j c_j: thread t owns latent dims t + 256 k (k < LPT) for all
//        16 head slots (o[16][LPT] in registers; p read as float4 broadcasts, the heads past
//        the tile have p = 0).
//   Every latent row is read from global memory once per block and used by all its heads.
//   num_parts == 1: o_lat = o / l directly; otherwise o (unnormalised) and (m, l) go to
//   part_o [n, Hq, num_parts, L] / part_ml [n, Hq, num_parts, 2] and attention.cu's
//   paged_attention_merge_kernel (Dv = L, no sinks) combines them in partition order.
//   Shared memory (dynamic, bytes) = 4 * (heads * Wq + tile * 20 + 48 + tile)
//   + tile * (Wq + 8) * sizeof(KV); the launcher (mla.smem_bytes) computes the same sum.
//
// mla_attention_tc_kernel<LPT>: the same o_lat / part_o / part_ml from the same arguments, over a
//   BF16 cache, with both products on tensor cores (mma.cuh: mma.sync m16n8k16 BF16 -> FP32,
//   sm_80+; FlashMLA's idea). The launcher takes it for head tiles of 16 (mla.attention_variant).
//   Same grid, block, partitions and tiles; the 16 head slots are the mma's M (rows past hc zero):
//     q_s [16][Ws] BF16 = bf16(q_full * scale), once per block (Ws = W rounded up to 16, + 8: the
//       fragment reads of a warp hit 32 distinct banks);
//     1. the tile's rows as stored into c_s [tile][Ws] (16-byte copies, each thread issuing 6
//        loads before their stores: 24 KB in flight per block), columns W .. and rows Lt ..
//        (rounded up to 16) zeroed: the mma reads whole 16 x 16 blocks;
//     2. S [16 x 8 rows] = Q C^T per warp (warp w: rows 8 w .. 8 w + 7), Wk / 16 mma over k =
//        the latent dims, A from q_s, B from c_s (k contiguous in a row): one 32-bit shared
//        load per register; the D fragments go to p_s [row][head] (rows past Lt, heads past hc: 0);
//     3. the scalar kernel's online softmax (FP32 p, m, l in shared memory);
//     4. O [16 x L] = alpha O + P C: O in D fragments, warp w owning the n-tiles of 8 latent dims
//        w, w + 8, .. (4 LPT of them: 16 LPT floats per thread, as the scalar kernel's o); alpha
//        per fragment row (heads g, g + 8); A = P rounded to BF16 from p_s, B = C from c_s
//        (n contiguous: two 16-bit loads per register); ceil(Lt / 16) k-steps of 16 rows.
//   BF16 rounding of q * scale and of P is the extra error against the scalar kernel (the running
//   sum l adds the FP32 p): ~1e-3 relative on the outputs. Shared memory (bytes) = 2 * 16 * Ws
//   + 4 * (tile * 20 + 48 + tile) + 2 * tile * Ws (mla.smem_bytes(..., "tc")): 97 KB at
//   DeepSeek-V3's shapes, two blocks per SM (__launch_bounds__(256, 2): <= 128 registers).
//
// DSA's sparse attention (index [n, T] not null; mla_attention_absorbed(index=)): both attention
//   kernels walk a row's list instead of its rows: position i of the walk is row index[r][i], not
//   row_start[r] + i, partition p holds list positions p * part_size .. (the launcher plans for
//   min(T, max_blocks * BS) rows), and its count Lp is the entries >= 0 among them (a block-wide
//   __syncthreads_count; a list is its rows, ascending, then -1s). Step 0 turns an entry outside
//   row_start .. row_len - 1 into slot -1 (device lists are not checked on the host): such a row is
//   never read from the cache nor its block table, is staged as zeros and scores -inf, so it weighs
//   nothing. Split, a partition past the list's end writes neutral partials (o = 0, m = -inf, l = 0)
//   and the merge runs with row_start null and max_len = min(T, cap), so it reads partitions up to
//   min(row_len, T) / part_size, which add exactly nothing past the list. A list of every visible
//   row walks the dense form's tiles and partitions when the two plans agree (T >= cap, or one
//   partition each): the same bits.
//
// mla_out_kernel<W>: out [n, Hq * Dv] fp32, out[r, h * Dv + v] = w_uv[h, v, :] . o_lat[r, h].
//   grid (ceil(Dv / 8), Hq, ceil(n / 8)), block 128: warp w computes weight rows
//   v = blockIdx.x * 8 + 2 w, + 1 with common.cuh's GEMV core (each weight vector loaded
//   once for the chunk's up to 8 rows; 16-byte loads when L and the bases allow).
//
// Preconditions: block sizes as above; L <= 256 * LPT; heads <= 16; tile <= 64, a multiple
// of 4 (of 16 for the tc kernel), 256 % tile == 0; P <= 1024 (q_nope of 8 rows in shared memory); block_tables
// entries of the blocks holding rows row_start .. row_len - 1 valid (the others are never
// read); slots < 2^31. row_len is clamped to max_blocks * BS and row_start to >= 0; a row
// with nothing to see gets zeros. Vector paths need W % 8 == 0 (staging), L % 4 == 0
// (absorb), L % (16 / sizeof(W)) == 0 (out) and aligned bases; otherwise scalar loads
// (same results).
// Cost of mla_attention_kernel (scalar FP32 FMAs): per (latent row, head) W + L FMAs, so for
// DeepSeek-V3's 128 heads it is FMA-bound, not memory-bound; the tc kernel moves both products
// to tensor cores (docs/cuda.md, "MLA kernels").
#include "common.cuh"
#include "mma.cuh"

namespace mtp {
constexpr int kMlaWriteThreads = 256;
constexpr int kMlaThreads = 256;
constexpr int kMlaWarps = kMlaThreads / kWarp;
constexpr int kMlaHeads = 16;    // head slots of an attention block (o[16][LPT])
constexpr int kMlaPStride = 20;  // floats per row of the score / p buffer: 16 heads + pad (16-byte rows)
constexpr int kMlaStageBatch = 6;  // tc kernel: 16-byte loads in flight per thread while a tile is staged
constexpr int kAbsorbWarps = 4;
constexpr int kAbsorbCols = 4;                        // adjacent columns of w_uk per lane
constexpr int kAbsorbSpan = kWarp * kAbsorbCols;      // 128 columns per block
constexpr int kOutRowsPerBlock = 2 * kGemvWarps;      // 8 rows of w_uv per block

// The latent rows partition p of query row r walks. Dense (index null): rows start .. start + Lp - 1,
// start = first + p * part_size. DSA (index [n, T], mla_attention_absorbed(index=)): list positions
// start .. start + Lp - 1 of the row's list, start = p * part_size, each naming the row list[i];
// Lp counts the entries >= 0 among the partition's positions (a list is its rows, then -1s), a
// block-wide count, so every thread of the block calls this.
struct MlaWalk {
  const int* list;  // the row's list (index + r * T), or null
  int start, Lp;    // the partition's first row (dense) or list position (DSA); how many it walks
  int first, Lr;    // the rows the query row sees: first .. Lr - 1
};

__device__ __forceinline__ MlaWalk mla_walk(const int* index, int T, long long r, int p, int part_size, int first,
                                            int Lr) {
  MlaWalk w{nullptr, first + p * part_size, 0, first, Lr};
  if (index == nullptr) {
    w.Lp = min(Lr - w.start, part_size);
    return w;
  }
  w.list = index + r * T;
  w.start = p * part_size;
  const int end = min(T, w.start + part_size);
  for (int i0 = w.start; i0 < end; i0 += blockDim.x) {
    const int i = i0 + threadIdx.x;
    w.Lp += __syncthreads_count(i < end && w.list[i] >= 0);
  }
  return w;
}

// Step 0 of an attention tile: the cache slots of the walk's rows j0 .. j0 + Lt - 1. A listed row
// outside first .. Lr - 1 (device lists are not checked on the host) gets slot -1: it is never
// read, staged as zeros, and scores -inf (weighs nothing). Dense rows are always in range.
__device__ __forceinline__ void mla_tile_slots(int* slot_s, const int* block_tables, int seq, int max_blocks, int BS,
                                               const MlaWalk& w, int j0, int Lt) {
  for (int i = threadIdx.x; i < Lt; i += blockDim.x) {
    int jj = w.start + j0 + i;
    if (w.list != nullptr) {
      jj = w.list[jj];
      if (jj < w.first || jj >= w.Lr) {
        slot_s[i] = -1;
        continue;
      }
    }
    slot_s[i] = block_tables[static_cast<long long>(seq) * max_blocks + jj / BS] * BS + jj % BS;
  }
}

// A block with nothing to walk: one partition, zeros (a row with nothing to see); split, a DSA
// list's partitions past its end write the merge's neutral partials (o = 0, m = -inf, l = 0: the
// merge reads every partition up to min(row_len, T) / part_size, and these add exactly nothing),
// dense ones nothing (the merge reads none past the row's rows).
__device__ __forceinline__ void mla_store_empty(const MlaWalk& w, int hc, long long head0, int L, int p,
                                                int num_parts, float* o_lat, float* part_o, float* part_ml) {
  if (num_parts == 1) {
    for (int e = threadIdx.x; e < hc * L; e += blockDim.x) o_lat[head0 * L + e] = 0.0f;
  } else if (w.list != nullptr) {
    for (int e = threadIdx.x; e < hc * L; e += blockDim.x)
      part_o[((head0 + e / L) * num_parts + p) * L + e % L] = 0.0f;
    for (int g = threadIdx.x; g < hc; g += blockDim.x) {
      const long long at = (head0 + g) * num_parts + p;
      part_ml[2 * at] = neg_inf();
      part_ml[2 * at + 1] = 0.0f;
    }
  }
}

// Step 3 of an attention tile, per head g < hc (warp w owns heads w, w + 8): the tile's scores
// s = p_s[i][g], i < Lt, become p = e^(s - m) in place; running max m, sum l and this tile's
// rescale factor alpha = e^(m_old - m) in ml_s [3][kMlaHeads].
__device__ __forceinline__ void mla_online_softmax(float* p_s, float* ml_s, int Lt, int hc, int warp, int lane) {
  constexpr int HM = kMlaHeads;
  for (int g = warp; g < hc; g += kMlaWarps) {
    float mt = neg_inf();
    for (int i = lane; i < Lt; i += kWarp) mt = fmaxf(mt, p_s[i * kMlaPStride + g]);
    mt = warp_max(mt);
    const float m_old = ml_s[g], l_old = ml_s[HM + g];
    const float m_new = fmaxf(m_old, mt);
    // a -inf score weighs 0, also while every score so far is -inf (m_new = -inf)
    const float mo = m_new == neg_inf() ? 0.0f : m_new;
    float l = 0.0f;
    for (int i = lane; i < Lt; i += kWarp) {
      const float e = expf(p_s[i * kMlaPStride + g] - mo);
      p_s[i * kMlaPStride + g] = e;
      l += e;
    }
    l = warp_sum(l);
    const float alpha = expf(m_old - mo);  // m_old = -inf (first tile): 0
    if (lane == 0) {
      ml_s[g] = m_new;
      ml_s[HM + g] = l_old * alpha + l;
      ml_s[2 * HM + g] = alpha;
    }
  }
}

// The epilogue of both attention kernels: head g's latent output value v at column l, normalised
// into o_lat [n, Hq, L] (one partition), or unnormalised into part_o [n, Hq, num_parts, L].
__device__ __forceinline__ void mla_store_out(float v, int g, int l, long long head0, int L, int p,
                                              int num_parts, const float* ml_s, float* o_lat, float* part_o) {
  const long long hq = head0 + g;  // [n, Hq]
  if (num_parts == 1) o_lat[hq * L + l] = v / ml_s[kMlaHeads + g];
  else part_o[(hq * num_parts + p) * L + l] = v;
}

// ... and, split, the (running max, running sum) of head t < hc for the merge kernel.
__device__ __forceinline__ void mla_store_ml(int t, int hc, long long head0, int p, int num_parts,
                                             const float* ml_s, float* part_ml) {
  if (num_parts > 1 && t < hc) {
    const long long at = (head0 + t) * num_parts + p;  // [n, Hq, num_parts]
    part_ml[2 * at] = ml_s[t];
    part_ml[2 * at + 1] = ml_s[kMlaHeads + t];
  }
}

}  // namespace mtp

template <typename KV, bool Interleave>
__global__ void __launch_bounds__(mtp::kMlaWriteThreads)
mla_latent_write_kernel(const float* __restrict__ kv_a, const float* __restrict__ norm_w, float eps,
                        const float* __restrict__ inv_freq, int half, float rope_scale,
                        const int* __restrict__ positions, const int* __restrict__ slots, int n,
                        long long num_slots, KV* __restrict__ cache, int L, const float* __restrict__ q,
                        float* __restrict__ q_out, int Hq, int P, int ldk) {
  __shared__ float red[33];
  const long long r = blockIdx.x;
  const int W = L + 2 * half;
  const float pos = static_cast<float>(positions[r]);

  if (blockIdx.y == 1) {  // the query: heads [P copied | R rotated]
    const int per = P + half;  // work items per head: P copies, half pairs
    const float* src = q + r * Hq * (P + 2 * half);
    float* dst = q_out + r * Hq * (P + 2 * half);
    for (int e = threadIdx.x; e < Hq * per; e += blockDim.x) {
      const int h = e / per, k = e % per;
      const float* x = src + static_cast<long long>(h) * (P + 2 * half);
      float* y = dst + static_cast<long long>(h) * (P + 2 * half);
      if (k < P) {
        y[k] = x[k];
      } else {
        const int i = k - P;
        const int a = P + (Interleave ? 2 * i : i), b = P + (Interleave ? 2 * i + 1 : i + half);
        mtp::rope_rotate(pos, inv_freq[i], rope_scale, x[a], x[b], y[a], y[b]);
      }
    }
    return;
  }

  const long long slot = slots[r];
  int skip = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const long long s = slots[i];
    skip |= s < 0 || s >= num_slots || (i > r && s == slot);
  }
  if (__syncthreads_or(skip)) return;  // uniform over the block

  const float* x = kv_a + r * ldk;
  float ss = 0.0f;
  for (int k = threadIdx.x; k < L; k += blockDim.x) ss = fmaf(x[k], x[k], ss);
  ss = mtp::block_sum(ss, red);
  const float denom = sqrtf(ss / static_cast<float>(L) + eps);  // as the reference: x / sqrt(var + eps) * w
  KV* row = cache + slot * W;
  for (int k = threadIdx.x; k < L; k += blockDim.x) row[k] = mtp::from_f32<KV>(x[k] / denom * norm_w[k]);
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const int a = L + (Interleave ? 2 * i : i), b = L + (Interleave ? 2 * i + 1 : i + half);
    float y1, y2;
    mtp::rope_rotate(pos, inv_freq[i], rope_scale, x[a], x[b], y1, y2);
    row[a] = mtp::from_f32<KV>(y1);
    row[b] = mtp::from_f32<KV>(y2);
  }
}

template <typename W>
__global__ void __launch_bounds__(mtp::kAbsorbWarps * mtp::kWarp)
mla_q_absorb_kernel(const float* __restrict__ q, const W* __restrict__ w_uk, float* __restrict__ q_full, int n,
                    int Hq, int P, int R, int L) {
  using namespace mtp;
  __shared__ float red[kAbsorbWarps][kMaxRows][kAbsorbSpan];  // 16 KB
  extern __shared__ float4 smem_raw[];
  float* q_s = reinterpret_cast<float*>(smem_raw);            // [m][P]: q_nope of the chunk's rows
  const int h = blockIdx.y;
  const long long r0 = static_cast<long long>(blockIdx.z) * kMaxRows;
  const int m = min(static_cast<long long>(kMaxRows), n - r0);
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int Wq = P + R, Wl = L + R;  // q row, q_full row
  for (int e = threadIdx.x; e < m * P; e += blockDim.x) {
    const int i = e / P, p = e % P;
    q_s[e] = q[((r0 + i) * Hq + h) * Wq + p];
  }
  __syncthreads();

  const int c0 = blockIdx.x * kAbsorbSpan + lane * kAbsorbCols;  // this lane's first column
  const W* wh = w_uk + static_cast<long long>(h) * P * L;
  const bool vec = L % kAbsorbCols == 0 && aligned16(w_uk);
  float acc[kMaxRows][kAbsorbCols];
  zero(acc);
  if (c0 < L) {
#pragma unroll 4
    for (int p = warp; p < P; p += kAbsorbWarps) {
      float wv[kAbsorbCols];
      const W* wp = wh + static_cast<long long>(p) * L + c0;
      if (vec) load_vec<kAbsorbCols>(wp, wv);
      else load_guarded<kAbsorbCols>(wp, L - c0, wv);
#pragma unroll
      for (int i = 0; i < kMaxRows; ++i) {
        if (i < m) {
          const float qv = q_s[i * P + p];
#pragma unroll
          for (int c = 0; c < kAbsorbCols; ++c) acc[i][c] = fmaf(wv[c], qv, acc[i][c]);
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kMaxRows; ++i)
#pragma unroll
    for (int c = 0; c < kAbsorbCols; ++c) red[warp][i][lane * kAbsorbCols + c] = acc[i][c];
  __syncthreads();
  for (int e = threadIdx.x; e < m * kAbsorbSpan; e += blockDim.x) {
    const int i = e / kAbsorbSpan, c = e % kAbsorbSpan;
    const int l = blockIdx.x * kAbsorbSpan + c;
    if (l < L) {
      float v = red[0][i][c];
      for (int w = 1; w < kAbsorbWarps; ++w) v += red[w][i][c];  // warp order
      q_full[((r0 + i) * Hq + h) * Wl + l] = v;
    }
  }
  if (blockIdx.x == 0) {  // q_pe, already roped, after the latent query
    for (int e = threadIdx.x; e < m * R; e += blockDim.x) {
      const int i = e / R, k = e % R;
      q_full[((r0 + i) * Hq + h) * Wl + L + k] = q[((r0 + i) * Hq + h) * Wq + P + k];
    }
  }
}

// Two blocks per SM, as the tensor-core kernel: without the minimum NVRTC 13.5 gave the BF16
// LPT = 1 build 64 registers and a spill on sm_80 (and 12.9 nearly so); with it every build
// takes 96..112 registers, no spills on either toolkit (kernels/registers.json), and the
// shared memory already keeps a block per SM at DeepSeek-V3's shapes (~117 KB: smem_bytes).
template <typename KV, int LPT>
__global__ void __launch_bounds__(mtp::kMlaThreads, 2)
mla_attention_kernel(const float* __restrict__ q_full, const KV* __restrict__ cache,
                     const int* __restrict__ block_tables, int max_blocks, const int* __restrict__ row_seq,
                     const int* __restrict__ row_start, const int* __restrict__ row_len,
                     float* __restrict__ o_lat, float* __restrict__ part_o, float* __restrict__ part_ml, int Hq,
                     int heads, int L, int R, int BS, int tile, int part_size, int num_parts, float scale,
                     const int* __restrict__ index, int T) {
  using namespace mtp;
  constexpr int HM = kMlaHeads;
  extern __shared__ float4 smem_raw[];
  const int W = L + R, Wq = (W + 7) & ~7, Wc = Wq + 8;
  const int h0 = blockIdx.x * heads, p = blockIdx.z;
  const long long r = blockIdx.y;
  const int hc = min(heads, Hq - h0);  // heads of this block
  const int t = threadIdx.x, warp = t / kWarp, lane = t % kWarp;
  float* q_s = reinterpret_cast<float*>(smem_raw);      // [heads][Wq]: q * scale, zero padded
  float* p_s = q_s + heads * Wq;                        // [tile][kMlaPStride]: scores, then p
  float* ml_s = p_s + tile * kMlaPStride;               // [3][HM]: running max, running sum, alpha
  int* slot_s = reinterpret_cast<int*>(ml_s + 3 * HM);  // [tile]
  KV* c_s = reinterpret_cast<KV*>(slot_s + tile);       // [tile][Wc]: the tile's latent rows

  const int seq = row_seq[r];
  const int Lr = min(row_len[r], max_blocks * BS);
  const int first = row_start ? max(row_start[r], 0) : 0;  // the window's first latent row
  const MlaWalk walk = mla_walk(index, T, r, p, part_size, first, Lr);
  const int Lp = walk.Lp;                     // latent rows of this partition
  const long long head0 = r * Hq + h0;        // [n, Hq]: the block's first head
  if (Lp <= 0) {  // uniform: nothing to attend to in this partition
    mla_store_empty(walk, hc, head0, L, p, num_parts, o_lat, part_o, part_ml);
    return;
  }

  for (int e = t; e < hc * Wq; e += blockDim.x) {
    const int g = e / Wq, d = e % Wq;
    q_s[e] = d < W ? q_full[(head0 + g) * W + d] * scale : 0.0f;
  }
  for (int e = t; e < tile * kMlaPStride; e += blockDim.x) p_s[e] = 0.0f;  // heads past hc: p = 0
  if (t < HM) {
    ml_s[t] = neg_inf();
    ml_s[HM + t] = 0.0f;
    ml_s[2 * HM + t] = 0.0f;
  }

  const bool vec = W % 8 == 0 && aligned16(cache);
  const int groups = blockDim.x / tile;
  const int ja = t % tile, ga = t / tile;  // step 2: row, first head
  float o[HM][LPT];
#pragma unroll
  for (int g = 0; g < HM; ++g)
#pragma unroll
    for (int k = 0; k < LPT; ++k) o[g][k] = 0.0f;

  for (int j0 = 0; j0 < Lp; j0 += tile) {
    const int Lt = min(tile, Lp - j0);
    mla_tile_slots(slot_s, block_tables, seq, max_blocks, BS, walk, j0, Lt);  // 0. slots
    __syncthreads();
    // 1. the rows, once, into shared memory
    if (vec) {
      const int nch = Wq / 8;
      for (int e = t; e < Lt * nch; e += blockDim.x) {
        const int i = e / nch, c = e % nch;
        const long long slot = slot_s[i];
        if (slot >= 0) copy8<KV>(c_s + i * Wc + 8 * c, cache + slot * W + 8 * c);
        else zero8<KV>(c_s + i * Wc + 8 * c);
      }
    } else {
      for (int e = t; e < Lt * Wq; e += blockDim.x) {
        const int i = e / Wq, d = e % Wq;
        const long long slot = slot_s[i];
        c_s[i * Wc + d] = d < W && slot >= 0 ? cache[slot * W + d] : from_f32<KV>(0.0f);
      }
    }
    __syncthreads();
    // 2. scores s[j][g] = (q[g] * scale) . row_j
    {
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (ja < Lt) {
        const KV* crow = c_s + ja * Wc;
        for (int d0 = 0; d0 < Wq; d0 += 8) {
          float cf[8];
          smem8(crow + d0, cf);
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const int g = ga + k * groups;
            if (g < hc) {
              const float4* qg = reinterpret_cast<const float4*>(q_s + g * Wq + d0);
              const float4 qa = qg[0], qb = qg[1];
              float a = acc[k];
              a = fmaf(qa.x, cf[0], a); a = fmaf(qa.y, cf[1], a); a = fmaf(qa.z, cf[2], a); a = fmaf(qa.w, cf[3], a);
              a = fmaf(qb.x, cf[4], a); a = fmaf(qb.y, cf[5], a); a = fmaf(qb.z, cf[6], a); a = fmaf(qb.w, cf[7], a);
              acc[k] = a;
            }
          }
        }
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int g = ga + k * groups;
        if (g < hc) p_s[ja * kMlaPStride + g] = ja < Lt && slot_s[ja] >= 0 ? acc[k] : neg_inf();
      }
    }
    __syncthreads();
    mla_online_softmax(p_s, ml_s, Lt, hc, warp, lane);  // 3. online softmax, per head
    __syncthreads();
    // 4. o = alpha o + sum_j p_j c_j
#pragma unroll
    for (int g = 0; g < HM; ++g) {
      const float alpha = ml_s[2 * HM + g];
#pragma unroll
      for (int k = 0; k < LPT; ++k) o[g][k] *= alpha;
    }
    for (int i = 0; i < Lt; ++i) {
      float cv[LPT];
#pragma unroll
      for (int k = 0; k < LPT; ++k) {
        const int l = t + k * kMlaThreads;
        cv[k] = l < L ? to_f32(c_s[i * Wc + l]) : 0.0f;
      }
      const float4* pr = reinterpret_cast<const float4*>(p_s + i * kMlaPStride);
#pragma unroll
      for (int g4 = 0; g4 < HM / 4; ++g4) {
        const float4 pv = pr[g4];
#pragma unroll
        for (int k = 0; k < LPT; ++k) {
          o[4 * g4 + 0][k] = fmaf(pv.x, cv[k], o[4 * g4 + 0][k]);
          o[4 * g4 + 1][k] = fmaf(pv.y, cv[k], o[4 * g4 + 1][k]);
          o[4 * g4 + 2][k] = fmaf(pv.z, cv[k], o[4 * g4 + 2][k]);
          o[4 * g4 + 3][k] = fmaf(pv.w, cv[k], o[4 * g4 + 3][k]);
        }
      }
    }
    __syncthreads();  // slot_s, c_s, p_s and alpha are rewritten by the next tile
  }

#pragma unroll
  for (int g = 0; g < HM; ++g) {
    if (g < hc) {
#pragma unroll
      for (int k = 0; k < LPT; ++k) {
        const int l = t + k * kMlaThreads;
        if (l < L) mla_store_out(o[g][k], g, l, head0, L, p, num_parts, ml_s, o_lat, part_o);
      }
    }
  }
  mla_store_ml(t, hc, head0, p, num_parts, ml_s, part_ml);
}

template <int LPT>
__global__ void __launch_bounds__(mtp::kMlaThreads, 2)
mla_attention_tc_kernel(const float* __restrict__ q_full, const __nv_bfloat16* __restrict__ cache,
                        const int* __restrict__ block_tables, int max_blocks, const int* __restrict__ row_seq,
                        const int* __restrict__ row_start, const int* __restrict__ row_len,
                        float* __restrict__ o_lat, float* __restrict__ part_o, float* __restrict__ part_ml, int Hq,
                        int heads, int L, int R, int BS, int tile, int part_size, int num_parts, float scale,
                        const int* __restrict__ index, int T) {
  using namespace mtp;
  using bf16 = __nv_bfloat16;
  constexpr int HM = kMlaHeads;  // the mma's M: 16 head rows, those past hc zero
  constexpr int NT = 4 * LPT;    // n-tiles of 8 latent dims per warp in the PV product (L <= 64 NT)
  extern __shared__ float4 smem_raw[];
  const int W = L + R, Wk = (W + 15) & ~15, Ws = Wk + 8;  // k padded to the mma's 16; row stride
  const int h0 = blockIdx.x * heads, p = blockIdx.z;
  const long long r = blockIdx.y;
  const int hc = min(heads, Hq - h0);
  const int t = threadIdx.x, warp = t / kWarp, lane = t % kWarp;
  bf16* q_s = reinterpret_cast<bf16*>(smem_raw);                  // [16][Ws]: bf16(q * scale), zero padded
  float* p_s = reinterpret_cast<float*>(q_s + HM * Ws);            // [tile][kMlaPStride]: scores, then p
  float* ml_s = p_s + tile * kMlaPStride;                          // [3][HM]: running max, running sum, alpha
  int* slot_s = reinterpret_cast<int*>(ml_s + 3 * HM);             // [tile]
  bf16* c_s = reinterpret_cast<bf16*>(slot_s + tile);              // [tile][Ws]: the tile's latent rows

  const int seq = row_seq[r];
  const int Lr = min(row_len[r], max_blocks * BS);
  const int first = row_start ? max(row_start[r], 0) : 0;
  const MlaWalk walk = mla_walk(index, T, r, p, part_size, first, Lr);
  const int Lp = walk.Lp;
  const long long head0 = r * Hq + h0;
  if (Lp <= 0) {
    mla_store_empty(walk, hc, head0, L, p, num_parts, o_lat, part_o, part_ml);
    return;
  }

  for (int e = t; e < HM * Ws; e += blockDim.x) {
    const int g = e / Ws, d = e % Ws;
    q_s[e] = __float2bfloat16_rn(g < hc && d < W ? q_full[(head0 + g) * W + d] * scale : 0.0f);
  }
  if (t < HM) {
    ml_s[t] = neg_inf();
    ml_s[HM + t] = 0.0f;
    ml_s[2 * HM + t] = 0.0f;
  }

  const bool vec = W % 8 == 0 && aligned16(cache);
  float o[NT][4];  // D fragments: heads mma_c_row, latent dims n0 + mma_c_col of n-tile warp + 8 j
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) o[j][i] = 0.0f;

  for (int j0 = 0; j0 < Lp; j0 += tile) {
    const int Lt = min(tile, Lp - j0);
    const int Lz = (Lt + 15) & ~15;  // rows the PV product reads: those past Lt are zeros
    mla_tile_slots(slot_s, block_tables, seq, max_blocks, BS, walk, j0, Lt);  // 0. slots
    __syncthreads();
    // 1. the rows, once, into shared memory (BF16 as stored); columns W .. Wk and rows Lt .. Lz zero
    if (vec) {  // kMlaStageBatch 16-byte loads issued before their stores (bytes in flight)
      const int nch = Wk / 8, total = Lz * nch;
      for (int e0 = t; e0 < total; e0 += kMlaStageBatch * kMlaThreads) {
        uint4 v[kMlaStageBatch];
#pragma unroll
        for (int u = 0; u < kMlaStageBatch; ++u) {
          const int e = e0 + u * kMlaThreads, i = e / nch, c = e % nch;
          const uint4 z = {0u, 0u, 0u, 0u};
          v[u] = e < total && i < Lt && 8 * c < W && slot_s[i] >= 0
                     ? __ldg(reinterpret_cast<const uint4*>(cache + static_cast<long long>(slot_s[i]) * W + 8 * c))
                     : z;
        }
#pragma unroll
        for (int u = 0; u < kMlaStageBatch; ++u) {
          const int e = e0 + u * kMlaThreads;
          if (e < total) *reinterpret_cast<uint4*>(c_s + (e / nch) * Ws + 8 * (e % nch)) = v[u];
        }
      }
    } else {
      for (int e = t; e < Lz * Wk; e += blockDim.x) {
        const int i = e / Wk, d = e % Wk;
        c_s[i * Ws + d] = i < Lt && d < W && slot_s[i] >= 0 ? cache[static_cast<long long>(slot_s[i]) * W + d]
                                                            : from_f32<bf16>(0.0f);
      }
    }
    __syncthreads();
    // 2. scores S [16 heads x 8 rows] per warp: n-tile nt = rows 8 nt .. 8 nt + 7, Wk / 16 mma over k
    for (int nt = warp; nt < tile / 8; nt += kMlaWarps) {  // warp-uniform
      float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (8 * nt < Lt) {
        const bf16* cb = c_s + 8 * nt * Ws;
        for (int k0 = 0; k0 < Wk; k0 += 16) {
          unsigned a[4], b[2];
          mma_load_a(a, q_s + k0, Ws, lane);
          mma_load_b_nk(b, cb + k0, Ws, lane);
          mma_m16n8k16_bf16(sc, a, b);
        }
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // rows past Lt and heads past hc: p = 0 for step 4
        const int g = mma_c_row(lane, i), j = 8 * nt + mma_c_col(lane, i);
        p_s[j * kMlaPStride + g] = j < Lt && g < hc ? (slot_s[j] >= 0 ? sc[i] : neg_inf()) : 0.0f;
      }
    }
    __syncthreads();
    mla_online_softmax(p_s, ml_s, Lt, hc, warp, lane);  // 3. online softmax, per head
    __syncthreads();
    // 4. O = alpha O + P C: A = P [16 heads x 16 rows] (BF16), B = C [16 rows x 8 dims]
    {
      const int g = lane >> 2, q4 = lane & 3;
      const float alo = ml_s[2 * HM + g], ahi = ml_s[2 * HM + g + 8];
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        o[j][0] *= alo; o[j][1] *= alo; o[j][2] *= ahi; o[j][3] *= ahi;
      }
      for (int k0 = 0; k0 < Lz; k0 += 16) {
        const float* pk = p_s + (k0 + 2 * q4) * kMlaPStride;  // P[g][k] = p_s[k][g]
        unsigned a[4];
        a[0] = pack_bf16x2(pk[g], pk[kMlaPStride + g]);
        a[1] = pack_bf16x2(pk[g + 8], pk[kMlaPStride + g + 8]);
        a[2] = pack_bf16x2(pk[8 * kMlaPStride + g], pk[9 * kMlaPStride + g]);
        a[3] = pack_bf16x2(pk[8 * kMlaPStride + g + 8], pk[9 * kMlaPStride + g + 8]);
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const int n0 = 8 * (warp + j * kMlaWarps);
          if (n0 < L) {  // warp-uniform
            unsigned b[2];
            mma_load_b_kn(b, c_s + k0 * Ws + n0, Ws, lane);
            mma_m16n8k16_bf16(o[j], a, b);
          }
        }
      }
    }
    __syncthreads();  // slot_s, c_s, p_s and alpha are rewritten by the next tile
  }

#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int n0 = 8 * (warp + j * kMlaWarps);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int g = mma_c_row(lane, i), l = n0 + mma_c_col(lane, i);
      if (g < hc && l < L) mla_store_out(o[j][i], g, l, head0, L, p, num_parts, ml_s, o_lat, part_o);
    }
  }
  mla_store_ml(t, hc, head0, p, num_parts, ml_s, part_ml);
}

namespace mtp {
template <typename W, int NR>
__device__ __forceinline__ void mla_out_chunk(const float* o_lat, const W* w_uv, float* out, long long r0, int m,
                                              int Hq, int Dv, int L, bool vec) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int h = blockIdx.y;
  const int v0 = blockIdx.x * kOutRowsPerBlock + 2 * warp;
  if (v0 >= Dv) return;  // the whole warp: no barriers in this kernel
  const int v1 = min(v0 + 1, Dv - 1);  // an odd Dv's last warp reads row Dv - 1 twice, stores it once
  const W* const wr[2] = {w_uv + (static_cast<long long>(h) * Dv + v0) * L,
                          w_uv + (static_cast<long long>(h) * Dv + v1) * L};
  const float* const sr[2] = {nullptr, nullptr};
  const float* xr[NR];
#pragma unroll
  for (int i = 0; i < NR; ++i) xr[i] = o_lat + ((r0 + min(i, m - 1)) * Hq + h) * L;
  float acc[2][NR];
  zero(acc);
  gemv_dot<W, NR, 2>(wr, sr, 1, xr, L, lane, kWarp, vec, acc);
  warp_sum_all(acc);
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < NR; ++i) {
      if (i < m) {
        float* y = out + ((r0 + i) * Hq + h) * Dv;
        y[v0] = acc[0][i];
        if (v0 + 1 < Dv) y[v0 + 1] = acc[1][i];
      }
    }
  }
}
}  // namespace mtp

template <typename W>
__global__ void __launch_bounds__(mtp::kGemvThreads)
mla_out_kernel(const float* __restrict__ o_lat, const W* __restrict__ w_uv, float* __restrict__ out, int n, int Hq,
               int Dv, int L) {
  const long long r0 = static_cast<long long>(blockIdx.z) * mtp::kMaxRows;
  const int m = min(static_cast<long long>(mtp::kMaxRows), n - r0);
  const bool vec = mtp::gemv_vec_ok(w_uv, o_lat, L, mtp::make_scales<W>(nullptr, 1, 1, L));
  if (m > 4)       mtp::mla_out_chunk<W, 8>(o_lat, w_uv, out, r0, m, Hq, Dv, L, vec);
  else if (m > 2)  mtp::mla_out_chunk<W, 4>(o_lat, w_uv, out, r0, m, Hq, Dv, L, vec);
  else if (m == 2) mtp::mla_out_chunk<W, 2>(o_lat, w_uv, out, r0, m, Hq, Dv, L, vec);
  else             mtp::mla_out_chunk<W, 1>(o_lat, w_uv, out, r0, m, Hq, Dv, L, vec);
}
