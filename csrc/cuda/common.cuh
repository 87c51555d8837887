// cuda/common.cuh -- device helpers shared by both CUDA kernel families (dppo_loss_forward_kernels.cuh,
// dppo_loss_backward_kernels.cuh, vocab_parallel_kernels.cuh): 16-byte vector loads and stores, the logit scaling
// s = z * (1 / T), and the warp / block reductions of online log-sum-exp states, top-K sums and single
// values. No ATen, no launch: compiled by nvcc and, unchanged, by the CPU emulator of the test suite.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../dppo_math.h"

namespace dppo {
namespace {

constexpr int kWarp = 32;

// The accumulation type of a logits dtype: double for fp64 logits, float otherwise.
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

// Block-wide reduction of one value; op is max (dppo_math.h's NaN-propagating nan_max) or sum. Every
// thread gets the result. smem: kBlock / 32 values of shared memory owned by the caller.
template <bool kMax, int kBlock, typename T>
__device__ T block_reduce_value(T x, T* smem) {
  for (int off = kWarp / 2; off > 0; off /= 2) {
    const T y = __shfl_xor_sync(0xffffffffu, x, off);
    x = kMax ? nan_max(x, y) : x + y;
  }
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  __syncthreads();  // smem may still be read by a previous reduction
  if (lane == 0) smem[warp] = x;
  __syncthreads();
  x = smem[0];
  for (int w = 1; w < kBlock / kWarp; ++w) x = kMax ? nan_max(x, smem[w]) : x + smem[w];
  return x;
}

}  // namespace
}  // namespace dppo
