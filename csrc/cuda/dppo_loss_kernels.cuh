// cuda/dppo_loss_kernels.cuh -- the CUDA kernels of the DPPO loss and their launch policy (see
// docs/contract.md, csrc/dppo_math.h). The one source of the device code: csrc/cuda/dppo_loss.cu
// (nvcc) includes it, and so does the CPU emulator that runs these kernels in the test suite
// without a GPU (python_tests/cuda_emu/, which defines DPPO_CUDA_EMU). No ATen dispatch here and
// no launch syntax: every launch goes through launch_kernel (launch.cuh).
//
// forward : logits [N, V] (fp32/fp16/bf16/fp64, stride(1) == 1, any row stride) -> seven [N]
//           outputs (loss, logp, divergence, mask, weight, entropy, lse) in the accumulation dtype
//           (float, or double for fp64 logits). One streaming pass per row, one block per row: each
//           thread keeps the online state (max, sum of exp and, behind compute_entropy, the entropy
//           moment) of s = z / T over the NON-target tokens, reading 16-byte vectors; the states
//           merge through warp shuffles with lse_merge / ent_merge, then the target's own term is
//           merged in, so lse and log(1 - pi) = logsumexp(s_{j != a}) - lse are both exact. The
//           top-K logits are gathered after the reduction in the same kernel. When N is too small
//           to fill the GPU the vocabulary is split over several blocks: partial states go to a
//           workspace [N, S, 3] and a finishing kernel merges them and runs the same epilogue.
//           Everything per row after the reduction is a call into dppo_math.h, evaluated in
//           double (once per row; exact where --use_fast_math's float log/exp are not).
// backward: grad [N, V] in the logits dtype, grad[i, j] = (g_t (1[j = a] - p_ij) - g_h p_ij
//           (log p_ij + H_i)) / T with p_ij = exp(s_ij - lse_i) recomputed from the saved lse,
//           written once; a grid over rows x column chunks, 16-byte loads and stores; the target
//           column via grad_target (expm1 form). The in-place variant writes into logits.
// Rows whose token is -100 (padding) cost no compute: zero outputs, zero gradient row. All offsets
// are int64 (N * V overflows int32).
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "../dppo_math.h"
#include "../op_inputs.h"
#include "launch.cuh"

namespace dppo {
namespace {

constexpr int kThreads = 256;        // threads per row block (forward, split forward, backward)
constexpr int kFinishThreads = 128;  // threads per row in the split-vocabulary finishing kernel
constexpr int kUnroll = 4;           // 16-byte vectors in flight per thread per loop round
constexpr int kWarp = 32;

// Forward blocks resident per SM we ask ptxas for (<= 64 registers at 256 threads): enough 16-byte
// loads in flight to cover HBM latency. fp64 (gradcheck only) is left unconstrained.
template <typename scalar_t>
constexpr int kMinBlocks = std::is_same_v<scalar_t, double> ? 1 : 4;

template <typename scalar_t>
using acc_type_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// 16 bytes of logits: 8 bf16/fp16, 4 fp32 or 2 fp64 values, moved as one uint4.
template <typename scalar_t>
union Pack {
  static constexpr int kSize = 16 / sizeof(scalar_t);
  uint4 raw;
  scalar_t v[kSize];
  __device__ Pack() {}
};

// Read-only 16-byte load for the forward (the logits are not written by it).
template <typename scalar_t>
__device__ __forceinline__ Pack<scalar_t> load_ro(const scalar_t* p) {
  Pack<scalar_t> pk;
  pk.raw = __ldg(reinterpret_cast<const uint4*>(p));
  return pk;
}

// Streaming (evict-first) 16-byte load and store for the backward; coherent with the kernel's own
// stores, so the in-place variant may read and write the same buffer.
template <typename scalar_t>
__device__ __forceinline__ Pack<scalar_t> load_stream(const scalar_t* p) {
  Pack<scalar_t> pk;
  pk.raw = __ldcs(reinterpret_cast<const uint4*>(p));
  return pk;
}

template <typename scalar_t>
__device__ __forceinline__ void store_stream(scalar_t* p, const Pack<scalar_t>& pk) {
  __stcs(reinterpret_cast<uint4*>(p), pk.raw);
}

// Elements of a row before its first 16-byte boundary (processed as scalars).
template <typename scalar_t>
__device__ __forceinline__ int64_t head_elems(const scalar_t* row, int64_t v) {
  constexpr int64_t kVec = Pack<scalar_t>::kSize;
  const int64_t mis = static_cast<int64_t>((reinterpret_cast<uintptr_t>(row) % 16) / sizeof(scalar_t));
  const int64_t head = mis == 0 ? 0 : kVec - mis;
  return head < v ? head : v;
}

// Is element index a inside the kVec-element vector that starts at element j0?
template <int kVec>
__device__ __forceinline__ bool in_vector(int64_t a, int64_t j0) {
  return static_cast<uint64_t>(a - j0) < static_cast<uint64_t>(kVec);
}

// s = z / T as z * (1 / T), rounded on its own: never contracted into an FMA with a following
// subtraction, so s - max(s) is exactly 0 at the max even for huge logits (an FMA would leave the
// product's rounding residual, up to ~1e22 for |s| ~ 1e30, and exp of it overflows).
__device__ __forceinline__ float scale_logit(float z, float inv_t) { return __fmul_rn(z, inv_t); }
__device__ __forceinline__ double scale_logit(double z, double inv_t) { return __dmul_rn(z, inv_t); }

// ---- online log-sum-exp states ----------------------------------------------------------------

template <typename acc_t>
__device__ __forceinline__ EntState<acc_t> empty_state() {
  return {static_cast<acc_t>(-INFINITY), acc_t(0), acc_t(0)};
}

// ent_merge with the entropy moment, lse_merge (wsum stays 0) without it.
template <bool kEntropy, typename acc_t>
__device__ __forceinline__ EntState<acc_t> merge_state(EntState<acc_t> a, EntState<acc_t> b) {
  if constexpr (kEntropy) {
    return ent_merge(a, b);
  } else {
    const LseState<acc_t> m = lse_merge(LseState<acc_t>{a.mx, a.sum}, LseState<acc_t>{b.mx, b.sum});
    return {m.mx, m.sum, acc_t(0)};
  }
}

template <bool kEntropy, typename acc_t>
__device__ __forceinline__ EntState<acc_t> warp_reduce_state(EntState<acc_t> st) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off /= 2) {
    EntState<acc_t> o;
    o.mx = __shfl_xor_sync(0xffffffffu, st.mx, off);
    o.sum = __shfl_xor_sync(0xffffffffu, st.sum, off);
    o.wsum = kEntropy ? __shfl_xor_sync(0xffffffffu, st.wsum, off) : acc_t(0);
    st = merge_state<kEntropy>(st, o);
  }
  return st;
}

// Block-wide merge; every thread gets the result. kBlock == blockDim.x, a multiple of 32.
template <bool kEntropy, int kBlock, typename acc_t>
__device__ __forceinline__ EntState<acc_t> block_reduce_state(EntState<acc_t> st) {
  constexpr int kWarps = kBlock / kWarp;
  __shared__ acc_t sm[3][kWarps];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  st = warp_reduce_state<kEntropy>(st);
  if (lane == 0) {
    sm[0][warp] = st.mx;
    sm[1][warp] = st.sum;
    sm[2][warp] = st.wsum;
  }
  __syncthreads();
  st = empty_state<acc_t>();
  if (lane < kWarps) st = {sm[0][lane], sm[1][lane], sm[2][lane]};
  st = warp_reduce_state<kEntropy>(st);  // every warp reduces the kWarps partials: no second sync
  return st;
}

template <typename acc_t>
__device__ __forceinline__ acc_t warp_sum(acc_t x) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// Block-wide sum of the top-K accumulators (their fields are plain sums over k).
template <int kBlock, typename acc_t>
__device__ __forceinline__ TopkAcc<acc_t> block_sum_topk(TopkAcc<acc_t> acc) {
  constexpr int kWarps = kBlock / kWarp;
  __shared__ acc_t sm[4][kWarps];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  acc = {warp_sum(acc.p_mass), warp_sum(acc.q_mass), warp_sum(acc.tv), warp_sum(acc.kl)};
  if (lane == 0) {
    sm[0][warp] = acc.p_mass;
    sm[1][warp] = acc.q_mass;
    sm[2][warp] = acc.tv;
    sm[3][warp] = acc.kl;
  }
  __syncthreads();
  acc = topk_init<acc_t>();
  if (lane < kWarps) acc = {sm[0][lane], sm[1][lane], sm[2][lane], sm[3][lane]};
  return {warp_sum(acc.p_mass), warp_sum(acc.q_mass), warp_sum(acc.tv), warp_sum(acc.kl)};
}

// ---- forward streaming ------------------------------------------------------------------------

// Merges kPacks vectors of logits into the thread's state as one chunk: max over the raw logits
// (T > 0, so max(z) / T is the max of s), then sum exp(s - max) (and the entropy moment with the
// shifted logit floored at shift_floor, as the CPU kernel does). With kExclude, element a (the
// target, an index relative to the pack's element j0 + u * jstride + k) is skipped.
template <bool kEntropy, bool kExclude, int kPacks, typename scalar_t, typename acc_t>
__device__ __forceinline__ void add_packs(EntState<acc_t>& st, const Pack<scalar_t> (&pk)[kPacks], int64_t j0,
                                          int64_t jstride, int64_t a, acc_t inv_t) {
  constexpr int kVec = Pack<scalar_t>::kSize;
  acc_t zmax = static_cast<acc_t>(-INFINITY);
#pragma unroll
  for (int u = 0; u < kPacks; ++u) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      if (kExclude && j0 + u * jstride + k == a) continue;
      zmax = nan_max(zmax, static_cast<acc_t>(pk[u].v[k]));  // fmax would drop a NaN
    }
  }
  if (zmax == static_cast<acc_t>(-INFINITY)) return;  // nothing but -inf (or the target): no mass
  const acc_t cm = scale_logit(zmax, inv_t);
  acc_t sum = 0, wsum = 0;
#pragma unroll
  for (int u = 0; u < kPacks; ++u) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      if (kExclude && j0 + u * jstride + k == a) continue;
      if constexpr (kEntropy) {
        const acc_t x = std::fmax(scale_logit(static_cast<acc_t>(pk[u].v[k]), inv_t) - cm, shift_floor<acc_t>());
        const acc_t e = std::exp(x);
        sum += e;
        wsum += e * x;
      } else {
        sum += std::exp(scale_logit(static_cast<acc_t>(pk[u].v[k]), inv_t) - cm);
      }
    }
  }
  st = merge_state<kEntropy>(st, EntState<acc_t>{cm, sum, wsum});
}

// Vectors [vb, ve) of a row's 16-byte-aligned body (body[0] is row element j_body), skipping
// element a of the row. Threads take vectors vb + tid, vb + tid + blockDim, ... so every load of a
// warp is one contiguous 512-byte segment; kUnroll vectors are loaded before any is reduced.
template <bool kEntropy, typename scalar_t, typename acc_t>
__device__ __forceinline__ void add_vectors(EntState<acc_t>& st, const scalar_t* body, int64_t j_body, int64_t vb,
                                            int64_t ve, int64_t a, acc_t inv_t) {
  constexpr int kVec = Pack<scalar_t>::kSize;
  const int64_t nthr = blockDim.x;
  const int64_t ab = a - j_body;  // the target's index relative to body[0]
  int64_t vi = vb + threadIdx.x;
  for (; vi + (kUnroll - 1) * nthr < ve; vi += kUnroll * nthr) {
    Pack<scalar_t> pk[kUnroll];
    bool has_target = false;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      pk[u] = load_ro(body + (vi + u * nthr) * kVec);
      has_target |= in_vector<kVec>(ab, (vi + u * nthr) * kVec);
    }
    if (has_target) {
      add_packs<kEntropy, true, kUnroll>(st, pk, vi * kVec, nthr * kVec, ab, inv_t);
    } else {
      add_packs<kEntropy, false, kUnroll>(st, pk, vi * kVec, nthr * kVec, ab, inv_t);
    }
  }
  for (; vi < ve; vi += nthr) {
    Pack<scalar_t> pk[1];
    pk[0] = load_ro(body + vi * kVec);
    if (in_vector<kVec>(ab, vi * kVec)) {
      add_packs<kEntropy, true, 1>(st, pk, vi * kVec, 0, ab, inv_t);
    } else {
      add_packs<kEntropy, false, 1>(st, pk, vi * kVec, 0, ab, inv_t);
    }
  }
}

// Row elements [jb, je) one per thread (the unaligned head and the tail of a row), skipping a.
template <bool kEntropy, typename scalar_t, typename acc_t>
__device__ __forceinline__ void add_scalars(EntState<acc_t>& st, const scalar_t* row, int64_t jb, int64_t je,
                                            int64_t a, acc_t inv_t) {
  for (int64_t j = jb + threadIdx.x; j < je; j += blockDim.x) {
    if (j == a) continue;
    st = merge_state<kEntropy>(st, EntState<acc_t>{scale_logit(static_cast<acc_t>(row[j]), inv_t), acc_t(1), acc_t(0)});
  }
}

// ---- forward kernels --------------------------------------------------------------------------

template <typename scalar_t, typename acc_t>
struct ForwardParams {
  const scalar_t* logits;     // [N, V], row stride ld, stride(1) == 1
  int64_t n, v, ld;
  const int64_t* tokens;      // [N], -100 = padding row
  const acc_t* rollout_lp;    // [N]
  const acc_t* adv;           // [N]
  const acc_t* anchor_lp;     // [N] or nullptr (then the rollout log-prob is the anchor)
  const int64_t* topk_ids;    // [N, K] contiguous, or nullptr (non-top-K modes)
  const acc_t* topk_lp;       // [N, K] contiguous, or nullptr
  int64_t k;
  Mode mode;
  acc_t inv_t;                // 1 / T, applied to every logit as it is loaded
  double delta_low, delta_high, ratio_cap;
  acc_t* out_loss;            // [N]
  acc_t* out_logp;            // [N]
  acc_t* out_div;             // [N]
  acc_t* out_mask;            // [N]
  acc_t* out_weight;          // [N]
  acc_t* out_ent;             // [N]
  acc_t* out_lse;             // [N]
};

template <typename scalar_t, typename acc_t>
__device__ __forceinline__ void write_zero_row(const ForwardParams<scalar_t, acc_t>& p, int64_t i) {
  p.out_loss[i] = p.out_logp[i] = p.out_div[i] = p.out_mask[i] = p.out_weight[i] = p.out_ent[i] = p.out_lse[i] =
      acc_t(0);
}

// Everything after the row reduction. `other` is the block-merged state of the non-target tokens
// (in every thread), s_a the target's scaled logit. The top-K logits are gathered by all threads,
// thread 0 runs the per-row formulas of dppo_math.h and writes the seven outputs. These per-row
// formulas run in double: once per row they cost nothing, and under --use_fast_math the float
// log/exp are approximations (log has ~4e-7 absolute error near 1, i.e. a 0.4% relative error in
// logp = -1e-4 as pi -> 1), while double math is exact to rounding.
template <bool kEntropy, int kBlock, typename scalar_t, typename acc_t>
__device__ __forceinline__ void forward_epilogue(const ForwardParams<scalar_t, acc_t>& p, int64_t i,
                                                 const scalar_t* row, EntState<acc_t> other_acc, acc_t s_a_acc) {
  using ep_t = double;
  const EntState<ep_t> other{other_acc.mx, other_acc.sum, other_acc.wsum};
  const ep_t s_a = s_a_acc;
  const EntState<ep_t> full = merge_state<kEntropy>(other, EntState<ep_t>{s_a, ep_t(1), ep_t(0)});
  // Log-probabilities are formed relative to the row max ((s - mx) - log(sum)), never as s - lse:
  // for huge |s| the absolute lse has lost log(sum) to rounding.
  const ep_t log_sum = std::log(full.sum);
  const ep_t lse = full.mx + log_sum;
  TopkAcc<ep_t> acc = topk_init<ep_t>();
  const bool topk = mode_is_topk(p.mode);
  if (topk) {
    for (int64_t c = threadIdx.x; c < p.k; c += kBlock) {
      const int64_t id = p.topk_ids[i * p.k + c];  // validated in [0, V) by check_forward_inputs
      const ep_t lq = id >= 0 && id < p.v ? (ep_t(scale_logit(static_cast<acc_t>(row[id]), p.inv_t)) - full.mx) - log_sum
                                          : static_cast<ep_t>(-INFINITY);
      topk_add(acc, ep_t(p.topk_lp[i * p.k + c]), lq);
    }
    acc = block_sum_topk<kBlock>(acc);
  }
  if (threadIdx.x != 0) return;
  const ep_t lp = (s_a - full.mx) - log_sum;
  const ep_t l1p = other.mx == static_cast<ep_t>(-INFINITY) ? static_cast<ep_t>(-INFINITY)
                                                             : (other.mx - full.mx) + std::log(other.sum) - log_sum;
  const ep_t m = p.rollout_lp[i];
  const ep_t adv = p.adv[i];
  const ep_t la = p.anchor_lp != nullptr ? ep_t(p.anchor_lp[i]) : m;
  ep_t div;
  if (topk) {
    div = p.mode == Mode::kTopkTV ? topk_tv_finish(acc) : topk_kl_finish(acc);
  } else {
    div = binary_divergence(p.mode, lp, l1p, la);
  }
  const ep_t ent = kEntropy ? entropy_from_state(full.sum, full.wsum) : ep_t(0);
  const RowOutputs<ep_t> r = finish_row(p.mode, adv, lp, la, m, div, ent, lse, p.delta_low, p.delta_high, p.ratio_cap);
  p.out_loss[i] = static_cast<acc_t>(r.loss);
  p.out_logp[i] = static_cast<acc_t>(r.logp);
  p.out_div[i] = static_cast<acc_t>(r.divergence);
  p.out_mask[i] = static_cast<acc_t>(r.mask);
  p.out_weight[i] = static_cast<acc_t>(r.weight);
  p.out_ent[i] = static_cast<acc_t>(r.entropy);
  p.out_lse[i] = static_cast<acc_t>(r.lse);
}

// One block per row: grid (N).
template <typename scalar_t, typename acc_t, bool kEntropy>
__global__ void __launch_bounds__(kThreads, kMinBlocks<scalar_t>) dppo_loss_forward_kernel(const ForwardParams<scalar_t, acc_t> p) {
  constexpr int64_t kVec = Pack<scalar_t>::kSize;
  const int64_t i = blockIdx.x;
  const int64_t a = p.tokens[i];
  if (a < 0 || a >= p.v) {  // padding (-100); other ids were rejected by check_forward_inputs
    if (threadIdx.x == 0) write_zero_row(p, i);
    return;
  }
  const scalar_t* row = p.logits + i * p.ld;
  const acc_t s_a = scale_logit(static_cast<acc_t>(row[a]), p.inv_t);  // issued early, used in the epilogue
  const int64_t head = head_elems(row, p.v);
  const int64_t nvec = (p.v - head) / kVec;
  EntState<acc_t> st = empty_state<acc_t>();
  add_vectors<kEntropy>(st, row + head, head, 0, nvec, a, p.inv_t);
  add_scalars<kEntropy>(st, row, 0, head, a, p.inv_t);
  add_scalars<kEntropy>(st, row, head + nvec * kVec, p.v, a, p.inv_t);
  st = block_reduce_state<kEntropy, kThreads>(st);
  forward_epilogue<kEntropy, kThreads>(p, i, row, st, s_a);
}

// Split vocabulary, step 1: grid (N, S); block (i, s) reduces its share of row i's body vectors
// (split 0 also the unaligned head, split S - 1 the tail) into ws[i, s, 0:3] = (mx, sum, wsum).
template <typename scalar_t, typename acc_t, bool kEntropy>
__global__ void __launch_bounds__(kThreads, kMinBlocks<scalar_t>)
    dppo_loss_forward_partial_kernel(const ForwardParams<scalar_t, acc_t> p,
                                     acc_t* __restrict__ ws) {  // [N, S, 3]
  constexpr int64_t kVec = Pack<scalar_t>::kSize;
  const int64_t i = blockIdx.x;
  const int64_t s = blockIdx.y, n_split = gridDim.y;
  const int64_t a = p.tokens[i];
  if (a < 0 || a >= p.v) return;  // the finishing kernel writes the zero row
  const scalar_t* row = p.logits + i * p.ld;
  const int64_t head = head_elems(row, p.v);
  const int64_t nvec = (p.v - head) / kVec;
  const int64_t per = (nvec + n_split - 1) / n_split;
  const int64_t vb = s * per < nvec ? s * per : nvec;
  const int64_t ve = vb + per < nvec ? vb + per : nvec;
  EntState<acc_t> st = empty_state<acc_t>();
  add_vectors<kEntropy>(st, row + head, head, vb, ve, a, p.inv_t);
  if (s == 0) add_scalars<kEntropy>(st, row, 0, head, a, p.inv_t);
  if (s == n_split - 1) add_scalars<kEntropy>(st, row, head + nvec * kVec, p.v, a, p.inv_t);
  st = block_reduce_state<kEntropy, kThreads>(st);
  if (threadIdx.x == 0) {
    acc_t* w = ws + (i * n_split + s) * 3;
    w[0] = st.mx;
    w[1] = st.sum;
    w[2] = st.wsum;
  }
}

// Split vocabulary, step 2: grid (N); merges row i's S partial states, then the epilogue.
template <typename scalar_t, typename acc_t, bool kEntropy>
__global__ void __launch_bounds__(kFinishThreads)
    dppo_loss_forward_finish_kernel(const ForwardParams<scalar_t, acc_t> p,
                                    const acc_t* __restrict__ ws,  // [N, S, 3]
                                    int64_t n_split) {
  const int64_t i = blockIdx.x;
  const int64_t a = p.tokens[i];
  if (a < 0 || a >= p.v) {
    if (threadIdx.x == 0) write_zero_row(p, i);
    return;
  }
  const scalar_t* row = p.logits + i * p.ld;
  const acc_t s_a = scale_logit(static_cast<acc_t>(row[a]), p.inv_t);
  EntState<acc_t> st = empty_state<acc_t>();
  for (int64_t s = threadIdx.x; s < n_split; s += kFinishThreads) {
    const acc_t* w = ws + (i * n_split + s) * 3;
    st = merge_state<kEntropy>(st, EntState<acc_t>{w[0], w[1], w[2]});
  }
  st = block_reduce_state<kEntropy, kFinishThreads>(st);
  forward_epilogue<kEntropy, kFinishThreads>(p, i, row, st, s_a);
}

// ---- backward kernel --------------------------------------------------------------------------

template <typename scalar_t, typename acc_t>
struct BackwardParams {
  const scalar_t* logits;     // [N, V], row stride ld_in, stride(1) == 1
  scalar_t* grad;             // [N, V], row stride ld_out; may be logits itself (in-place)
  int64_t n, v, ld_in, ld_out;
  const int64_t* tokens;      // [N], rows outside [0, V) (padding -100) get a zero row
  const acc_t* lse;           // [N]
  const acc_t* grad_target;   // [N]
  const acc_t* grad_entropy;  // [N] or nullptr
  const acc_t* entropy;       // [N] or nullptr (given with grad_entropy)
  acc_t inv_t;
};

// Per-row constants of the backward and the element formulas of dppo_math.h. kEnt: the row has a
// nonzero entropy gradient (else the cheaper grad_from_p_noent, as the CPU kernel does).
template <typename acc_t, bool kEnt>
struct RowGrad {
  acc_t lse, gt, gh, h, inv_t;
  int64_t a;

  __device__ __forceinline__ acc_t nontarget(acc_t z) const {
    if constexpr (kEnt) {
      const acc_t l = std::fmax(scale_logit(z, inv_t) - lse, shift_floor<acc_t>());
      return grad_from_p(std::exp(l), l, gt, gh, h, -inv_t);
    } else {
      return grad_from_p_noent(std::exp(scale_logit(z, inv_t) - lse), gt, -inv_t);
    }
  }
  __device__ __forceinline__ acc_t target(acc_t z) const { return grad_target(scale_logit(z, inv_t) - lse, gt, gh, h, inv_t); }
  __device__ __forceinline__ acc_t at(acc_t z, int64_t j) const { return j == a ? target(z) : nontarget(z); }
};

// A row share [jb, je) done one element per thread (rows whose input and output differ in
// 16-byte alignment; zero rows when rg is null).
template <typename scalar_t, typename acc_t, bool kEnt>
__device__ __forceinline__ void backward_scalars(const scalar_t* in, scalar_t* out, int64_t jb, int64_t je,
                                                 const RowGrad<acc_t, kEnt>* rg) {
  for (int64_t j = jb + threadIdx.x; j < je; j += blockDim.x) {
    out[j] = rg == nullptr ? scalar_t(0) : static_cast<scalar_t>(rg->at(static_cast<acc_t>(in[j]), j));
  }
}

// Body vectors [vb, ve) of a row (body[0] is row element j_body, input and output both 16-byte
// aligned there): kUnroll vectors are loaded before any is written, so in-place is safe.
template <typename scalar_t, typename acc_t, bool kEnt>
__device__ __forceinline__ void backward_vectors(const scalar_t* in_body, scalar_t* out_body, int64_t j_body,
                                                 int64_t vb, int64_t ve, const RowGrad<acc_t, kEnt>& rg) {
  constexpr int kVec = Pack<scalar_t>::kSize;
  const int64_t nthr = blockDim.x;
  const int64_t ab = rg.a - j_body;  // the target's index relative to the body
  int64_t vi = vb + threadIdx.x;
  for (; vi + (kUnroll - 1) * nthr < ve; vi += kUnroll * nthr) {
    Pack<scalar_t> pk[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) pk[u] = load_stream(in_body + (vi + u * nthr) * kVec);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j0 = (vi + u * nthr) * kVec;
      Pack<scalar_t> o;
#pragma unroll
      for (int k = 0; k < kVec; ++k) o.v[k] = static_cast<scalar_t>(rg.nontarget(static_cast<acc_t>(pk[u].v[k])));
      if (in_vector<kVec>(ab, j0)) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          if (j0 + k == ab) o.v[k] = static_cast<scalar_t>(rg.target(static_cast<acc_t>(pk[u].v[k])));
        }
      }
      store_stream(out_body + j0, o);
    }
  }
  for (; vi < ve; vi += nthr) {
    const int64_t j0 = vi * kVec;
    const Pack<scalar_t> pk = load_stream(in_body + j0);
    Pack<scalar_t> o;
#pragma unroll
    for (int k = 0; k < kVec; ++k) o.v[k] = static_cast<scalar_t>(rg.at(static_cast<acc_t>(pk.v[k]), j0 + k + j_body));
    store_stream(out_body + j0, o);
  }
}

// Block (i, s)'s share of row i: body vectors plus, for the first / last split, the unaligned
// head / tail; or, when input and output rows differ in 16-byte alignment, a plain element range.
template <typename scalar_t, typename acc_t, bool kEnt>
__device__ __forceinline__ void backward_share(const scalar_t* in, scalar_t* out, int64_t v, int64_t s,
                                               int64_t n_split, const RowGrad<acc_t, kEnt>* rg) {
  constexpr int kVec = Pack<scalar_t>::kSize;
  const int64_t head = head_elems(in, v);
  if (head != head_elems(out, v)) {
    const int64_t per = (v + n_split - 1) / n_split;
    const int64_t jb = s * per < v ? s * per : v;
    backward_scalars(in, out, jb, jb + per < v ? jb + per : v, rg);
    return;
  }
  const int64_t nvec = (v - head) / kVec;
  const int64_t per = (nvec + n_split - 1) / n_split;
  const int64_t vb = s * per < nvec ? s * per : nvec;
  const int64_t ve = vb + per < nvec ? vb + per : nvec;
  if (rg != nullptr) {
    backward_vectors(in + head, out + head, head, vb, ve, *rg);
  } else {
    Pack<scalar_t> zero;
    zero.raw = make_uint4(0u, 0u, 0u, 0u);
    for (int64_t vi = vb + threadIdx.x; vi < ve; vi += blockDim.x) store_stream(out + head + vi * kVec, zero);
  }
  if (s == 0) backward_scalars(in, out, 0, head, rg);
  if (s == n_split - 1) backward_scalars(in, out, head + nvec * kVec, v, rg);
}

// Grid (N, S): block (i, s) writes its share of row i of the gradient.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads) dppo_loss_backward_kernel(const BackwardParams<scalar_t, acc_t> p) {
  const int64_t i = blockIdx.x;
  const int64_t s = blockIdx.y, n_split = gridDim.y;
  const scalar_t* in = p.logits + i * p.ld_in;
  scalar_t* out = p.grad + i * p.ld_out;
  const int64_t a = p.tokens[i];
  if (a < 0 || a >= p.v) {  // padding row (-100); out-of-range ids were rejected by the forward
    backward_share<scalar_t, acc_t, false>(in, out, p.v, s, n_split, nullptr);
    return;
  }
  const acc_t lse = p.lse[i], gt = p.grad_target[i];
  const acc_t gh = p.grad_entropy != nullptr ? p.grad_entropy[i] : acc_t(0);
  const acc_t h = p.entropy != nullptr ? p.entropy[i] : acc_t(0);
  if (gh == acc_t(0)) {
    const RowGrad<acc_t, false> rg{lse, gt, gh, h, p.inv_t, a};
    backward_share(in, out, p.v, s, n_split, &rg);
  } else {
    const RowGrad<acc_t, true> rg{lse, gt, gh, h, p.inv_t, a};
    backward_share(in, out, p.v, s, n_split, &rg);
  }
}

// ---- launch policy ----------------------------------------------------------------------------

int sm_count(c10::DeviceIndex device) {
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

// How many blocks share one row so that about `target_blocks` blocks run, each with at least one
// two vectors per thread of work; 1 = no split. At most 65535 (grid.y).
int64_t split_count(int64_t n, int64_t v, int64_t vec, int64_t target_blocks) {
  if (n >= target_blocks) return 1;
  const int64_t by_work = v / (vec * kThreads * 2);
  const int64_t wanted = (target_blocks + n - 1) / n;
  int64_t s = wanted < by_work ? wanted : by_work;
  if (s > 65535) s = 65535;
  return s < 1 ? 1 : s;
}

// DPPO_CUDA_SPLIT=S forces S blocks per row in the forward and the backward (1 = the one-block-per-
// row forward; S may exceed the row's vectors, leaving some blocks without work). For the tests and
// scripts/gpu_check.sh: on a real GPU the split path is otherwise never taken once N >= 4 x SMs.
// 0 when unset or empty.
int64_t split_override() {
  const char* env = std::getenv("DPPO_CUDA_SPLIT");
  if (env == nullptr || *env == '\0') return 0;
  char* end = nullptr;
  const long long s = std::strtoll(env, &end, 10);
  TORCH_CHECK_VALUE(*end == '\0' && s >= 1 && s <= 65535,
                    "DPPO_CUDA_SPLIT must be an integer in [1, 65535] (blocks per row), got '", env, "'");
  return s;
}

int64_t choose_split(int64_t n, int64_t v, int64_t vec, int64_t target_blocks) {
  const int64_t forced = split_override();
  return forced > 0 ? forced : split_count(n, v, vec, target_blocks);
}

template <typename scalar_t, bool kEntropy>
void launch_forward(const ForwardParams<scalar_t, acc_type_t<scalar_t>>& p, int64_t n_split, const at::Tensor& logits,
                    cudaStream_t stream) {
  using acc_t = acc_type_t<scalar_t>;
  if (n_split <= 1) {
    launch_kernel(dppo_loss_forward_kernel<scalar_t, acc_t, kEntropy>, dim3(static_cast<unsigned>(p.n)),
                  dim3(kThreads), stream, p);
    return;
  }
  const at::Tensor ws = at::empty({p.n, n_split, 3}, logits.options().dtype(acc_dtype(logits.scalar_type())));
  const dim3 grid(static_cast<unsigned>(p.n), static_cast<unsigned>(n_split));
  launch_kernel(dppo_loss_forward_partial_kernel<scalar_t, acc_t, kEntropy>, grid, dim3(kThreads), stream, p,
                ws.data_ptr<acc_t>());
  launch_kernel(dppo_loss_forward_finish_kernel<scalar_t, acc_t, kEntropy>, dim3(static_cast<unsigned>(p.n)),
                dim3(kFinishThreads), stream, p, static_cast<const acc_t*>(ws.data_ptr<acc_t>()), n_split);
}

// The forward on prepared inputs (in.n > 0), for one logits dtype; sms = the device's SM count.
template <typename scalar_t>
void dppo_loss_forward_launch(const ForwardInputs& in, const at::Tensor& logits, double temperature, double delta_low,
                              double delta_high, double ratio_cap, bool compute_entropy, int sms,
                              cudaStream_t stream) {
  using acc_t = acc_type_t<scalar_t>;
  ForwardParams<scalar_t, acc_t> p;
  p.logits = logits.const_data_ptr<scalar_t>();
  p.n = in.n;
  p.v = in.v;
  p.ld = in.ld;
  p.tokens = in.tokens.data_ptr<int64_t>();
  p.rollout_lp = in.rollout_lp.data_ptr<acc_t>();
  p.adv = in.adv.data_ptr<acc_t>();
  p.anchor_lp = opt_ptr<acc_t>(in.anchor_lp);
  p.topk_ids = opt_ptr<int64_t>(in.topk_ids);
  p.topk_lp = opt_ptr<acc_t>(in.topk_lp);
  p.k = in.k;
  p.mode = in.args.mode;
  p.inv_t = static_cast<acc_t>(1.0 / temperature);
  p.delta_low = delta_low;
  p.delta_high = delta_high;
  p.ratio_cap = ratio_cap;
  p.out_loss = in.out[0].data_ptr<acc_t>();
  p.out_logp = in.out[1].data_ptr<acc_t>();
  p.out_div = in.out[2].data_ptr<acc_t>();
  p.out_mask = in.out[3].data_ptr<acc_t>();
  p.out_weight = in.out[4].data_ptr<acc_t>();
  p.out_ent = in.out[5].data_ptr<acc_t>();
  p.out_lse = in.out[6].data_ptr<acc_t>();
  const int64_t n_split = choose_split(in.n, in.v, Pack<scalar_t>::kSize, 4 * static_cast<int64_t>(sms));
  if (compute_entropy) {
    launch_forward<scalar_t, true>(p, n_split, logits, stream);
  } else {
    launch_forward<scalar_t, false>(p, n_split, logits, stream);
  }
}

// The backward on prepared inputs (in.n > 0) into grad (logits itself for the in-place op).
template <typename scalar_t>
void dppo_loss_backward_launch(const BackwardInputs& in, const at::Tensor& logits, const at::Tensor& grad,
                               double temperature, int sms, cudaStream_t stream) {
  using acc_t = acc_type_t<scalar_t>;
  BackwardParams<scalar_t, acc_t> p;
  p.logits = logits.const_data_ptr<scalar_t>();
  p.grad = grad.data_ptr<scalar_t>();
  p.n = in.n;
  p.v = in.v;
  p.ld_in = in.ld_in;
  p.ld_out = in.ld_out;
  p.tokens = in.tokens.data_ptr<int64_t>();
  p.lse = in.lse.data_ptr<acc_t>();
  p.grad_target = in.grad_target.data_ptr<acc_t>();
  p.grad_entropy = opt_ptr<acc_t>(in.grad_entropy);
  p.entropy = opt_ptr<acc_t>(in.entropy);
  p.inv_t = static_cast<acc_t>(1.0 / temperature);
  const int64_t n_split = choose_split(in.n, in.v, Pack<scalar_t>::kSize, 8 * static_cast<int64_t>(sms));
  const dim3 grid(static_cast<unsigned>(in.n), static_cast<unsigned>(n_split));
  launch_kernel(dppo_loss_backward_kernel<scalar_t, acc_t>, grid, dim3(kThreads), stream, p);
}

}  // namespace
}  // namespace dppo
