// cuda/dppo_loss_backward_kernels.cuh -- the CUDA backward kernel of the DPPO loss (see docs/contract.md,
// csrc/dppo_math.h). Device code only: the launch policy is launch_policy.cuh's, the launch entry_points.cuh's;
// nvcc (cuda/dppo_loss.cu) and the CPU emulator of the test suite compile it unchanged.
//
// grad [N, V] in the logits dtype, grad[i, j] = (g_t (1[j = a] - p_ij) - g_h p_ij (log p_ij + H_i)) / T with
// p_ij = exp(s_ij - lse_i) recomputed from the saved lse, written once; a grid over rows x column chunks,
// 16-byte loads and stores; the target column via grad_target (expm1 form). The in-place variant writes into
// logits. Rows whose token is outside [0, V) (padding -100) get a zero row and read nothing. All offsets are
// int64 (N * V overflows int32).
#pragma once

#include <cstdint>

#include "../dppo_math.h"
#include "common.cuh"
#include "launch_policy.cuh"

namespace dppo {
namespace {

template <typename scalar_t, typename acc_t>
struct BackwardParams {
  const scalar_t* logits;  // [N, V], row stride ld_in, stride(1) == 1
  scalar_t* grad;          // [N, V], row stride ld_out; may be logits itself (in-place)
  int64_t n, v, ld_in, ld_out;
  const int64_t* tokens;      // [N], rows outside [0, V) (padding -100) get a zero row
  const acc_t* lse;           // [N]
  const acc_t* grad_target;   // [N]
  const acc_t* grad_entropy;  // [N] or nullptr
  const acc_t* entropy;       // [N] or nullptr (given with grad_entropy)
  acc_t inv_t;
  const int64_t* kept;          // [N, S] contiguous, or nullptr (sampling replay, -1 padding)
  const scalar_t* kept_logits;  // [N, S] contiguous: the kept logits, gathered before any write
  int64_t s;
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
  __device__ __forceinline__ acc_t target(acc_t z) const {
    return grad_target(scale_logit(z, inv_t) - lse, gt, gh, h, inv_t);
  }
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
__device__ __forceinline__ void backward_share(const scalar_t* in, scalar_t* out, int64_t v, int64_t s, int64_t n_split,
                                               const RowGrad<acc_t, kEnt>* rg) {
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
__global__ void __launch_bounds__(kThreads, kStreamMinBlocks<scalar_t>)
    dppo_loss_backward_kernel(const BackwardParams<scalar_t, acc_t> p) {
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

// Sampling replay, grid (N): row i is zero outside its kept set and the kept set's softmax gradient inside
// (dppo_math.h's kept_grad), from the kept logits the entry point gathered first (the in-place backward
// overwrites the row). The zeros go first; the barrier orders them before the S scattered values.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads) dppo_loss_backward_kept_kernel(const BackwardParams<scalar_t, acc_t> p) {
  const int64_t i = blockIdx.x;
  scalar_t* g = p.grad + i * p.ld_out;
  for (int64_t j = threadIdx.x; j < p.v; j += blockDim.x) g[j] = scalar_t(0);
  __syncthreads();
  const int64_t a = p.tokens[i];
  // Padding row: zeros only. Another id outside [0, V) is a sampled token this slice does not hold (a
  // vocabulary-parallel rank's): no column of the row is its target.
  if (a == kIgnoreIndex) return;
  const acc_t lse = p.lse[i], gt = p.grad_target[i];
  const acc_t gh = p.grad_entropy != nullptr ? p.grad_entropy[i] : acc_t(0);
  const acc_t h = p.entropy != nullptr ? p.entropy[i] : acc_t(0);
  for (int64_t c = threadIdx.x; c < p.s; c += blockDim.x) {
    const int64_t id = p.kept[i * p.s + c];
    if (id < 0 || id >= p.v) continue;  // padding
    g[id] = static_cast<scalar_t>(kept_grad<acc_t>(scale_logit(static_cast<acc_t>(p.kept_logits[i * p.s + c]), p.inv_t),
                                                   id == a, lse, gt, gh, h, p.inv_t));
  }
}

}  // namespace
}  // namespace dppo
