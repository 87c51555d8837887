// vocab_parallel_math.h -- the DPPO loss over a vocabulary split across ranks (tensor parallelism): the
// per-row slice statistics one rank contributes, and the merge of every rank's statistics followed by
// the row epilogue. Host/device, shared by the CPU and CUDA kernels (cpu/vocab_parallel.cpp,
// cuda/vocab_parallel_kernels.cuh); the formulas themselves are dppo_math.h's.
//
// Rank r holds the logits of the columns [offsets[r], offsets[r+1]) of the global vocabulary. With
// s = z / T, its statistics for row i are C = 4 + K numbers (the accumulation dtype):
//   [0] mx    = max_j s_j over the slice (-inf when every logit of the slice is -inf)
//   [1] other = sum_j exp(s_j - mx) over the slice without the row's sampled token a (if it owns a)
//   [2] wsum  = sum_j exp(x_j) * x_j, x_j = max(s_j - mx, shift_floor), over the whole slice
//               (0 unless the entropy is computed)
//   [3] s_a   = s of the sampled token when this rank owns it, else 0
//   [4 + k]   = s of the k-th rollout top-K id when this rank owns it, else 0
//   [4 + K + c] = s of the c-th kept id (sampling replay, kept_ids [N, S]) when this rank owns it, else 0
// These are the single-device kernel's row state (max, the non-target sum, the entropy moment and the
// gathered logits), so the merge below reproduces its arithmetic: global max M, other = sum_r
// other_r exp(mx_r - M), total = other + exp(s_a - M), lse = M + log(total), logp = (s_a - M) -
// log(total), log(1 - pi) = log(other) - log(total), the entropy from ent_merge's moment. Every rank
// runs the merge on the same gathered statistics in the same order, so every rank gets the same bits.
#pragma once

#include <cstdint>

#include "dppo_math.h"

namespace dppo {

constexpr int64_t kVpMax = 0;
constexpr int64_t kVpOther = 1;
constexpr int64_t kVpWsum = 2;
constexpr int64_t kVpTarget = 3;
constexpr int64_t kVpTopk = 4;  // first of the K top-K columns

DPPO_HOST_DEVICE int64_t vp_stat_width(int64_t k, int64_t s = 0) { return kVpTopk + k + s; }

// The rank whose slice holds global id `id` (offsets: [world + 1], nondecreasing, offsets[0] == 0).
DPPO_HOST_DEVICE int64_t vp_owner(const int64_t* offsets, int64_t world, int64_t id) {
  int64_t r = 0;
  while (r + 1 < world && id >= offsets[r + 1]) ++r;
  return r;
}

// The merged row: stats points at rank 0's statistics of this row, rank r's are at stats + r * rank_stride.
// a: the global sampled id (not padding). topk_ids/topk_lp: this row's K ids and rollout log-probs.
// T: the type the row is evaluated in; S: the stored type of stats and topk_lp (the CUDA kernel evaluates
// float rows in double, as its single-device epilogue does). kept: this row's S kept ids, or null (sampling
// replay: the row's distribution renormalised over them, from their gathered logits, dppo_math.h's kept_row_from).
template <typename T, typename S>
struct VpKeptLogits {
  const S* stats;  // rank 0's statistics of the row
  int64_t rank_stride;
  const int64_t* offsets;
  int64_t world;
  const int64_t* kept;
  int64_t col;  // the first kept column, 4 + K
  DPPO_HOST_DEVICE T operator()(int64_t c) const {
    return T(stats[vp_owner(offsets, world, kept[c]) * rank_stride + col + c]);
  }
};

template <typename T, typename S>
DPPO_HOST_DEVICE RowOutputs<T> vp_merge_row(const S* stats, int64_t rank_stride, const int64_t* offsets, int64_t world,
                                            int64_t a, T m, T la, T adv, const int64_t* topk_ids, const S* topk_lp,
                                            int64_t k, const LossSettings& settings, const int64_t* kept = nullptr,
                                            int64_t s = 0) {
  const int64_t owner = vp_owner(offsets, world, a);
  const T s_a = T(stats[owner * rank_stride + kVpTarget]);
  // One pass over the ranks: the non-target sums merge as log-sum-exp states, the full sums (the owner's
  // plus its target term) and the entropy moments as entropy states; both end at the global max M.
  LseState<T> other = {-INFINITY, T(0)};
  EntState<T> ent = {-INFINITY, T(0), T(0)};
  for (int64_t r = 0; r < world; ++r) {
    const S* st = stats + r * rank_stride;
    const T mx = T(st[kVpMax]);
    const T other_r = T(st[kVpOther]);
    T sum = other_r;
    if (r == owner && mx != -INFINITY) {
      const T x = s_a - mx;
      sum += std::exp(x > shift_floor<T>() ? x : shift_floor<T>());
    }
    other = lse_merge(other, LseState<T>{mx, other_r});
    ent = ent_merge(ent, EntState<T>{mx, sum, T(st[kVpWsum])});
  }
  const T mx = ent.mx;
  // The target's term relative to the global max, as the single-device kernel forms it.
  const T xa_raw = s_a - mx;
  const T xa = xa_raw > shift_floor<T>() ? xa_raw : shift_floor<T>();
  const T ea = std::exp(xa);
  // other.mx == mx unless the non-target mass is empty (a one-column vocabulary): then other = 0.
  const T other_sum = other.mx == -INFINITY ? T(0) : other.sum * std::exp(other.mx - mx);
  const T total = other_sum + ea;
  const T log_total = std::log(total);
  const T lse = mx + log_total;
  const T lp = xa_raw - log_total;
  const T l1p = std::log(other_sum) - log_total;
  if (kept != nullptr) {  // sampling replay: the merged lse only decides whether the row has a distribution
    const VpKeptLogits<T, S> scaled{stats, rank_stride, offsets, world, kept, kVpTopk + k};
    const KeptRow<T> kr = kept_row_from<T>(scaled, kept, s, a, s_a, lse, settings.compute_entropy);
    T div;
    if (mode_is_topk(settings.mode)) {
      TopkAcc<T> acc = topk_init<T>();
      for (int64_t c = 0; c < k; ++c) {
        const int64_t id = topk_ids[c];
        const T s_c = T(stats[vp_owner(offsets, world, id) * rank_stride + kVpTopk + c]);
        const T lq = kept_contains(kept, s, id) ? (s_c - kr.mx) - kr.log_total : T(-INFINITY);
        topk_add(acc, T(topk_lp[c]), lq);
      }
      div = topk_divergence(settings.mode, acc);
    } else {
      div = binary_divergence(settings.mode, kr.lp, kr.l1p, la);
    }
    return finish_row(settings, adv, kr.lp, la, m, div, kr.entropy, kr.lse);
  }
  T div;
  if (mode_is_topk(settings.mode)) {
    TopkAcc<T> acc = topk_init<T>();
    for (int64_t c = 0; c < k; ++c) {
      const int64_t id = topk_ids[c];
      const T s = T(stats[vp_owner(offsets, world, id) * rank_stride + kVpTopk + c]);
      topk_add(acc, T(topk_lp[c]), (s - mx) - log_total);
    }
    div = topk_divergence(settings.mode, acc);
  } else {
    div = binary_divergence(settings.mode, lp, l1p, la);
  }
  const T entropy = settings.compute_entropy ? entropy_from_state(total, ent.wsum) : T(0);
  // dppo_math.h's per-row epilogue, the single-device kernels' own (a row without a distribution is all NaN).
  return finish_row(settings, adv, lp, la, m, div, entropy, lse);
}

}  // namespace dppo
