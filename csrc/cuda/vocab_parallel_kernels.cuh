// cuda/vocab_parallel_kernels.cuh -- the CUDA kernels of the vocabulary-parallel DPPO loss (csrc/vocab_parallel_math.h
// holds the row math). Device code only: the launch policy is launch_policy.cuh's, the launches entry_points.cuh's;
// nvcc (cuda/vocab_parallel.cu) and the CPU emulator of the test suite compile it unchanged.
//
// vp_stats_kernel   : logits [N, V_local] (this rank's columns [start, start + V_local)) -> stats [N, 4 + K] in the
//                     accumulation dtype. One block per row, two passes over the slice (block max, then the
//                     non-target exp-sum and the entropy moment), coalesced scalar loads; the owned target and
//                     top-K logits gathered by index.
// vp_epilogue_kernel: stats [W, N, 4 + K] -> the seven [N] outputs of dppo_loss_forward; one thread per row runs
//                     vp_merge_row, evaluated in double as the single-device CUDA epilogue is.
// Rows whose token is -100 are padding: zero statistics / outputs. Offsets are int64 (N * V overflows int32).
#pragma once

#include <cstdint>

#include "../vocab_parallel_math.h"
#include "common.cuh"
#include "launch_policy.cuh"

namespace dppo {
namespace {

template <typename scalar_t>
__global__ void __launch_bounds__(kVpThreads)
    vp_stats_kernel(const scalar_t* __restrict__ logits,  // [N, V_local], row stride ld
                    int64_t ld, int64_t v, int64_t start,
                    const int64_t* __restrict__ tokens,    // [N] global ids or -100
                    const int64_t* __restrict__ topk_ids,  // [N, K] global ids, or null
                    int64_t k,
                    const int64_t* __restrict__ kept,  // [N, S] global ids (-1 padding), or null
                    int64_t s, acc_type_t<scalar_t> inv_t, bool with_ent,
                    acc_type_t<scalar_t>* __restrict__ stats) {  // [N, 4 + K + S]
  using acc_t = acc_type_t<scalar_t>;
  __shared__ acc_t smem[kVpThreads / kWarp];
  const int64_t i = blockIdx.x;
  const int64_t width = vp_stat_width(k, s);
  acc_t* st = stats + i * width;
  const int64_t a = tokens[i];
  if (a == kIgnoreIndex) {
    for (int64_t c = threadIdx.x; c < width; c += kVpThreads) st[c] = acc_t(0);
    return;
  }
  const scalar_t* z = logits + i * ld;
  const int64_t al = (a >= start && a < start + v) ? a - start : -1;
  acc_t m = -INFINITY;
  for (int64_t j = threadIdx.x; j < v; j += kVpThreads) m = nan_max(m, static_cast<acc_t>(z[j]));
  const acc_t mx = block_reduce_value<true, kVpThreads>(m, smem) * inv_t;
  acc_t sum = 0, wsum = 0;
  if (mx != -INFINITY) {  // an all -inf slice is an empty state
    for (int64_t j = threadIdx.x; j < v; j += kVpThreads) {
      acc_t x = scale_logit(static_cast<acc_t>(z[j]), inv_t) - mx;  // never an FMA: x == 0 at the max
      if (with_ent) x = x > shift_floor<acc_t>() ? x : shift_floor<acc_t>();
      const acc_t e = exp(x);
      if (j != al) sum += e;
      if (with_ent) wsum += e * x;
    }
  }
  sum = block_reduce_value<false, kVpThreads>(sum, smem);
  wsum = block_reduce_value<false, kVpThreads>(wsum, smem);
  if (threadIdx.x == 0) {
    st[kVpMax] = mx;
    st[kVpOther] = sum;
    st[kVpWsum] = wsum;
    st[kVpTarget] = al >= 0 ? static_cast<acc_t>(z[al]) * inv_t : acc_t(0);
  }
  for (int64_t c = threadIdx.x; c < k; c += kVpThreads) {
    const int64_t id = topk_ids[i * k + c] - start;
    st[kVpTopk + c] = (id >= 0 && id < v) ? static_cast<acc_t>(z[id]) * inv_t : acc_t(0);
  }
  for (int64_t c = threadIdx.x; c < s; c += kVpThreads) {  // the kept ids this rank owns (padding -1 never)
    const int64_t g = kept[i * s + c];
    const int64_t id = g - start;
    st[kVpTopk + k + c] = (g >= 0 && id >= 0 && id < v) ? static_cast<acc_t>(z[id]) * inv_t : acc_t(0);
  }
}

template <typename S>
__global__ void __launch_bounds__(kVpEpilogueThreads, 1)
    vp_epilogue_kernel(const S* __restrict__ stats,          // [W, N, 4 + K]
                       const int64_t* __restrict__ offsets,  // [W + 1]
                       int64_t world, int64_t n, int64_t width,
                       const int64_t* __restrict__ tokens,    // [N]
                       const S* __restrict__ rollout_lp,      // [N]
                       const S* __restrict__ adv,             // [N]
                       const S* __restrict__ anchor_lp,       // [N] or null
                       const int64_t* __restrict__ topk_ids,  // [N, K] or null
                       const S* __restrict__ topk_lp,         // [N, K] or null
                       int64_t k, LossSettings settings,
                       const int64_t* __restrict__ kept,   // [N, S] or null (sampling replay)
                       int64_t s, RowOutputPtrs<S> out) {  // seven [N]
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const int64_t a = tokens[i];
  if (a == kIgnoreIndex) {
    out.store_zero(i);
    return;
  }
  const double m = rollout_lp[i];
  out.store(i, vp_merge_row<double, S>(stats + i * width, n * width, offsets, world, a, m,
                                       anchor_lp ? double(anchor_lp[i]) : m, double(adv[i]),
                                       topk_ids ? topk_ids + i * k : nullptr, topk_lp ? topk_lp + i * k : nullptr, k,
                                       settings, kept ? kept + i * s : nullptr, s));
}

}  // namespace
}  // namespace dppo
