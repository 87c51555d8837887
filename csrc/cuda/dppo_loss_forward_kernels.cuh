// cuda/dppo_loss_forward_kernels.cuh -- the CUDA forward kernels of the DPPO loss (see docs/contract.md,
// csrc/dppo_math.h). Device code only: the launch policy is launch_policy.cuh's, the launches are
// entry_points.cuh's; nvcc (cuda/dppo_loss.cu) and the CPU emulator of the test suite compile it unchanged.
//
// logits [N, V] (fp32/fp16/bf16/fp64, stride(1) == 1, any row stride) -> seven [N] outputs (loss, logp,
// divergence, mask, weight, entropy, lse) in the accumulation dtype (float, or double for fp64 logits). One
// streaming pass per row, one block per row: each thread keeps the online state (max, sum of exp and, behind
// compute_entropy, the entropy moment) of s = z / T over the NON-target tokens, reading 16-byte vectors; the
// states merge through warp shuffles with lse_merge / ent_merge, then the target's own term is merged in, so
// lse and log(1 - pi) = logsumexp(s_{j != a}) - lse are both exact. The top-K logits are gathered after the
// reduction in the same kernel. When N is too small to fill the GPU the vocabulary is split over several
// blocks: partial states go to a workspace [N, S, 3] and a finishing kernel merges them and runs the same
// epilogue. Everything per row after the reduction is a call into dppo_math.h, evaluated in double (once per
// row; exact where --use_fast_math's float log/exp are not). Rows whose token is -100 (padding) cost no
// compute: zero outputs. All offsets are int64 (N * V overflows int32).
#pragma once

#include <cstdint>

#include "../dppo_math.h"
#include "common.cuh"
#include "launch_policy.cuh"

namespace dppo {
namespace {

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
__device__ __forceinline__ void add_scalars(EntState<acc_t>& st, const scalar_t* row, int64_t jb, int64_t je, int64_t a,
                                            acc_t inv_t) {
  for (int64_t j = jb + threadIdx.x; j < je; j += blockDim.x) {
    if (j == a) continue;
    st = merge_state<kEntropy>(st, EntState<acc_t>{scale_logit(static_cast<acc_t>(row[j]), inv_t), acc_t(1), acc_t(0)});
  }
}

// ---- forward kernels --------------------------------------------------------------------------

template <typename scalar_t, typename acc_t>
struct ForwardParams {
  const scalar_t* logits;  // [N, V], row stride ld, stride(1) == 1
  int64_t n, v, ld;
  const int64_t* tokens;    // [N], -100 = padding row
  const acc_t* rollout_lp;  // [N]
  const acc_t* adv;         // [N]
  const acc_t* anchor_lp;   // [N] or nullptr (then the rollout log-prob is the anchor)
  const int64_t* topk_ids;  // [N, K] contiguous, or nullptr (non-top-K modes)
  const acc_t* topk_lp;     // [N, K] contiguous, or nullptr
  int64_t k;
  const int64_t* kept;  // [N, S] contiguous, or nullptr (sampling replay, -1 padding)
  int64_t s;
  LossSettings settings;     // mode, deltas, ratio cap (the kernels take the whole row's entropy as kEntropy)
  acc_t inv_t;               // 1 / T, applied to every logit as it is loaded
  RowOutputPtrs<acc_t> out;  // seven [N]
};

// The scaled kept logits of a row for dppo_math.h's kept_row_from: s of the c-th kept id, in the accumulation
// dtype with one rounding (scale_logit, never fused into an FMA), as the whole-row pass forms every s.
template <typename scalar_t, typename acc_t>
struct KeptScaled {
  const scalar_t* row;
  const int64_t* kept;
  acc_t inv_t;
  __device__ __forceinline__ double operator()(int64_t c) const {
    return scale_logit(static_cast<acc_t>(row[kept[c]]), inv_t);
  }
};

// Everything after the row reduction. `other` is the block-merged state of the non-target tokens
// (in every thread), s_a the target's scaled logit. The top-K logits are gathered by all threads,
// thread 0 runs the per-row formulas of dppo_math.h and writes the seven outputs. These per-row
// formulas run in double: once per row they cost nothing, and under --use_fast_math the float
// log/exp are approximations (log has ~4e-7 absolute error near 1, i.e. a 0.4% relative error in
// logp = -1e-4 as pi -> 1), while double math is exact to rounding. kKept: whether the kernel may be given a
// kept set (sampling replay); false compiles the kept set's statistics out (the one-block-per-row kernel).
template <bool kEntropy, bool kKept, int kBlock, typename scalar_t, typename acc_t>
__device__ __forceinline__ void forward_epilogue(const ForwardParams<scalar_t, acc_t>& p, int64_t i,
                                                 const scalar_t* row, EntState<acc_t> other_acc, acc_t s_a_acc) {
  using ep_t = double;
  const EntState<ep_t> other{other_acc.mx, other_acc.sum, other_acc.wsum};
  const ep_t s_a = s_a_acc;
  const EntState<ep_t> full = merge_state<kEntropy>(other, EntState<ep_t>{s_a, ep_t(1), ep_t(0)});
  // Log-probabilities are formed relative to the row max ((s - mx) - log(sum)), never as s - lse:
  // for huge |s| the absolute lse has lost log(sum) to rounding.
  const ep_t log_sum = std::log(full.sum);
  ep_t lse = full.mx + log_sum;
  // Sampling replay: the kept set's statistics (dppo_math.h's kept_row, S gathers; every thread forms them, so
  // the top-K loop below needs no broadcast). The whole row's pass above decided whether it has a distribution.
  const int64_t* kept = kKept && p.kept != nullptr ? p.kept + i * p.s : nullptr;
  KeptRow<ep_t> kr{};
  if (kKept && kept != nullptr) {
    // s = z / T in the accumulation dtype with one rounding (scale_logit), as the whole-row pass forms s_a
    const KeptScaled<scalar_t, acc_t> scaled{row, kept, p.inv_t};
    kr = kept_row_from<ep_t>(scaled, kept, p.s, p.tokens[i], s_a, lse, p.settings.compute_entropy);
  }
  TopkAcc<ep_t> acc = topk_init<ep_t>();
  const bool topk = mode_is_topk(p.settings.mode);
  if (topk) {
    for (int64_t c = threadIdx.x; c < p.k; c += kBlock) {
      const int64_t id = p.topk_ids[i * p.k + c];  // validated in [0, V) by check_forward_inputs
      ep_t lq = static_cast<ep_t>(-INFINITY);
      if (id >= 0 && id < p.v) {
        const ep_t s_id = scale_logit(static_cast<acc_t>(row[id]), p.inv_t);
        lq = kKept && kept != nullptr ? kept_logq(kept, p.s, id, s_id, kr) : (s_id - full.mx) - log_sum;
      }
      topk_add(acc, ep_t(p.topk_lp[i * p.k + c]), lq);
    }
    acc = block_sum_topk<kBlock>(acc);
  }
  if (threadIdx.x != 0) return;
  ep_t lp = (s_a - full.mx) - log_sum;
  ep_t l1p = other.mx == static_cast<ep_t>(-INFINITY) ? static_cast<ep_t>(-INFINITY)
                                                      : (other.mx - full.mx) + std::log(other.sum) - log_sum;
  ep_t ent = kEntropy ? entropy_from_state(full.sum, full.wsum) : ep_t(0);
  if (kKept && kept != nullptr) {
    lse = kr.lse;
    lp = kr.lp;
    l1p = kr.l1p;
    ent = kr.entropy;
  }
  const ep_t m = p.rollout_lp[i];
  const ep_t adv = p.adv[i];
  const ep_t la = p.anchor_lp != nullptr ? ep_t(p.anchor_lp[i]) : m;
  const ep_t div = topk ? topk_divergence(p.settings.mode, acc) : binary_divergence(p.settings.mode, lp, l1p, la);
  p.out.store(i, finish_row(p.settings, adv, lp, la, m, div, ent, lse));
}

// One block per row: grid (N). Never given a kept set: launch_forward sends sampling replay through the split
// path, whose finishing kernel has no register cap (the kept set's statistics, inlined here, spilled under this
// kernel's 64- and 80-register caps on sm_90).
template <typename scalar_t, typename acc_t, bool kEntropy>
__global__ void __launch_bounds__(kThreads, (kForwardMinBlocks<scalar_t, kEntropy>))
    dppo_loss_forward_kernel(const ForwardParams<scalar_t, acc_t> p) {
  constexpr int64_t kVec = Pack<scalar_t>::kSize;
  const int64_t i = blockIdx.x;
  const int64_t a = p.tokens[i];
  if (a < 0 || a >= p.v) {  // padding (-100); other ids were rejected by check_forward_inputs
    if (threadIdx.x == 0) p.out.store_zero(i);
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
  forward_epilogue<kEntropy, false, kThreads>(p, i, row, st, s_a);
}

// Split vocabulary, step 1: grid (N, S); block (i, s) reduces its share of row i's body vectors
// (split 0 also the unaligned head, split S - 1 the tail) into ws[i, s, 0:3] = (mx, sum, wsum).
template <typename scalar_t, typename acc_t, bool kEntropy>
__global__ void __launch_bounds__(kThreads, kStreamMinBlocks<scalar_t>)
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
__global__ void __launch_bounds__(kFinishThreads, 1)
    dppo_loss_forward_finish_kernel(const ForwardParams<scalar_t, acc_t> p,
                                    const acc_t* __restrict__ ws,  // [N, S, 3]
                                    int64_t n_split) {
  const int64_t i = blockIdx.x;
  const int64_t a = p.tokens[i];
  if (a < 0 || a >= p.v) {
    if (threadIdx.x == 0) p.out.store_zero(i);
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
  forward_epilogue<kEntropy, true, kFinishThreads>(p, i, row, st, s_a);
}

}  // namespace
}  // namespace dppo
