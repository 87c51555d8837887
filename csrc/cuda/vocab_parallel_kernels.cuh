// cuda/vocab_parallel_kernels.cuh -- the CUDA kernels of the vocabulary-parallel DPPO loss and their launch
// policy (csrc/vocab_parallel.h holds the row math). The one source of this device code: cuda/vocab_parallel.cu
// (nvcc) includes it, and so can the CPU emulator of the test suite (DPPO_CUDA_EMU). No ATen dispatch and no
// launch syntax here: launches go through launch_kernel (launch.cuh).
//
// vp_stats_kernel   : logits [N, V_local] (this rank's columns [start, start + V_local)) -> stats [N, 4 + K] in the
//                     accumulation dtype. One block per row, two passes over the slice (block max, then the
//                     non-target exp-sum and the entropy moment), coalesced scalar loads; the owned target and
//                     top-K logits gathered by index.
// vp_epilogue_kernel: stats [W, N, 4 + K] -> the seven [N] outputs of dppo_loss_forward; one thread per row runs
//                     vp_merge_row, evaluated in double as the single-device CUDA epilogue is.
// Rows whose token is -100 are padding: zero statistics / outputs. Offsets are int64 (N * V overflows int32).
#pragma once

#include <array>
#include <cstdint>
#include <type_traits>

#include "../vocab_parallel.h"
#include "launch.cuh"

namespace dppo {
namespace {

constexpr int kVpThreads = 256;
constexpr int kVpEpilogueThreads = 128;

template <typename scalar_t>
using vp_acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// Block-wide reduction of one value; op is max (dppo_math.h's NaN-propagating nan_max) or sum. Every
// thread gets the result.
template <bool kMax, typename T>
__device__ T vp_block_reduce(T x, T* smem) {
  for (int off = 16; off > 0; off /= 2) {
    const T y = __shfl_xor_sync(0xffffffffu, x, off);
    x = kMax ? nan_max(x, y) : x + y;
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();  // smem may still be read by a previous reduction
  if (lane == 0) smem[warp] = x;
  __syncthreads();
  x = smem[0];
  for (int w = 1; w < kVpThreads / 32; ++w) x = kMax ? nan_max(x, smem[w]) : x + smem[w];
  return x;
}

template <typename scalar_t>
__global__ void __launch_bounds__(kVpThreads) vp_stats_kernel(
    const scalar_t* __restrict__ logits,  // [N, V_local], row stride ld
    int64_t ld, int64_t v, int64_t start,
    const int64_t* __restrict__ tokens,    // [N] global ids or -100
    const int64_t* __restrict__ topk_ids,  // [N, K] global ids, or null
    int64_t k, vp_acc_t<scalar_t> inv_t, bool with_ent,
    vp_acc_t<scalar_t>* __restrict__ stats) {  // [N, 4 + K]
  using acc_t = vp_acc_t<scalar_t>;
  __shared__ acc_t smem[kVpThreads / 32];
  const int64_t i = blockIdx.x;
  const int64_t width = vp_stat_width(k);
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
  const acc_t mx = vp_block_reduce<true>(m, smem) * inv_t;
  acc_t sum = 0, wsum = 0;
  if (mx != -INFINITY) {  // an all -inf slice is an empty state
    for (int64_t j = threadIdx.x; j < v; j += kVpThreads) {
      acc_t x = static_cast<acc_t>(z[j]) * inv_t - mx;
      if (with_ent) x = x > shift_floor<acc_t>() ? x : shift_floor<acc_t>();
      const acc_t e = exp(x);
      if (j != al) sum += e;
      if (with_ent) wsum += e * x;
    }
  }
  sum = vp_block_reduce<false>(sum, smem);
  wsum = vp_block_reduce<false>(wsum, smem);
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
}

template <typename S>
__global__ void vp_epilogue_kernel(const S* __restrict__ stats,         // [W, N, 4 + K]
                                   const int64_t* __restrict__ offsets,  // [W + 1]
                                   int64_t world, int64_t n, int64_t width,
                                   const int64_t* __restrict__ tokens,   // [N]
                                   const S* __restrict__ rollout_lp,     // [N]
                                   const S* __restrict__ adv,            // [N]
                                   const S* __restrict__ anchor_lp,      // [N] or null
                                   const int64_t* __restrict__ topk_ids, // [N, K] or null
                                   const S* __restrict__ topk_lp,        // [N, K] or null
                                   int64_t k, LossArgs args,
                                   S* out_loss, S* out_logp, S* out_div, S* out_mask, S* out_weight, S* out_ent,
                                   S* out_lse) {  // each [N]
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const int64_t a = tokens[i];
  if (a == kIgnoreIndex) {
    out_loss[i] = out_logp[i] = out_div[i] = out_mask[i] = out_weight[i] = out_ent[i] = out_lse[i] = S(0);
    return;
  }
  const double m = rollout_lp[i];
  const RowOutputs<double> r = vp_merge_row<double, S>(
      stats + i * width, n * width, offsets, world, a, m, anchor_lp ? double(anchor_lp[i]) : m, double(adv[i]),
      topk_ids ? topk_ids + i * k : nullptr, topk_lp ? topk_lp + i * k : nullptr, k, args);
  out_loss[i] = S(r.loss);
  out_logp[i] = S(r.logp);
  out_div[i] = S(r.divergence);
  out_mask[i] = S(r.mask);
  out_weight[i] = S(r.weight);
  out_ent[i] = S(r.entropy);
  out_lse[i] = S(r.lse);
}

// Launch policy: one block of kVpThreads per row for the statistics, one thread per row for the epilogue.
template <typename scalar_t>
void vp_stats_launch(const scalar_t* logits, int64_t ld, int64_t n, int64_t v, int64_t start, const int64_t* tokens,
                     const int64_t* topk_ids, int64_t k, double temperature, bool with_ent,
                     vp_acc_t<scalar_t>* stats, cudaStream_t stream) {
  using acc_t = vp_acc_t<scalar_t>;
  launch_kernel(vp_stats_kernel<scalar_t>, dim3(static_cast<unsigned>(n)), dim3(kVpThreads), stream, logits, ld, v,
                start, tokens, topk_ids, k, acc_t(1.0 / temperature), with_ent, stats);
}

template <typename S>
void vp_epilogue_launch(const S* stats, const int64_t* offsets, int64_t world, int64_t n, int64_t width,
                        const int64_t* tokens, const S* rollout_lp, const S* adv, const S* anchor_lp,
                        const int64_t* topk_ids, const S* topk_lp, int64_t k, const LossArgs& args,
                        const std::array<S*, 7>& out, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((n + kVpEpilogueThreads - 1) / kVpEpilogueThreads);
  launch_kernel(vp_epilogue_kernel<S>, dim3(blocks), dim3(kVpEpilogueThreads), stream, stats, offsets, world, n, width,
                tokens, rollout_lp, adv, anchor_lp, topk_ids, topk_lp, k, args, out[0], out[1], out[2], out[3],
                out[4], out[5], out[6]);
}

}  // namespace
}  // namespace dppo
