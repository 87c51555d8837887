// cpu/vocab_parallel.cpp -- CPU kernels of the vocabulary-parallel DPPO loss (csrc/vocab_parallel.h).
//
// dppo_vocab_parallel_stats   : this rank's logits [N, V_local] (columns [vocab_start, vocab_start +
//                               V_local) of the global vocabulary) -> statistics [N, 4 + K] in the
//                               accumulation dtype. Per row two SIMD passes over the slice, read in the
//                               logits dtype: the max, then the exp-sum without the owned target and the
//                               entropy moment; the target and top-K logits are gathered by index.
// dppo_vocab_parallel_epilogue: every rank's statistics [W, N, 4 + K] (after an all-gather) -> the seven
//                               [N] outputs of dppo_loss_forward, via vp_merge_row.
// The gradient needs no op of its own: dppo_loss_backward on the slice with the merged lse/entropy
// (dppo_ext/vocab_parallel.py).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "../vocab_parallel.h"
#include "../vocab_parallel_checks.h"

namespace dppo {
namespace {

using at::vec::Vectorized;
using FVec = Vectorized<float>;
constexpr int64_t kFV = FVec::size();
constexpr int64_t kStep = 2 * kFV;

template <typename scalar_t>
inline void load2(const scalar_t* p, FVec& a, FVec& b) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    a = FVec::loadu(p);
    b = FVec::loadu(p + kFV);
  } else {
    at::vec::load_to_float<scalar_t>(p, a, b);
  }
}

inline float hreduce(const FVec& v, bool is_max) {
  alignas(64) float buf[kFV];
  v.store(buf);
  float s = buf[0];
  for (int64_t i = 1; i < kFV; ++i) s = is_max ? nan_max(s, buf[i]) : s + buf[i];  // a NaN lane must survive
  return s;
}

template <typename scalar_t>
float slice_max(const scalar_t* z, int64_t v) {
  FVec m0(-INFINITY), m1(-INFINITY);
  int64_t j = 0;
  for (; j + kStep <= v; j += kStep) {
    FVec a, b;
    load2(z + j, a, b);
    m0 = at::vec::maximum(m0, a);
    m1 = at::vec::maximum(m1, b);
  }
  float m = hreduce(at::vec::maximum(m0, m1), true);
  for (; j < v; ++j) m = nan_max(m, static_cast<float>(z[j]));
  return m;
}

// Over z[lo, hi): sum += exp(s - mx), and with_ent: wsum += exp(x) * x with x = max(s - mx, shift_floor).
template <typename scalar_t>
void slice_sums(const scalar_t* z, int64_t lo, int64_t hi, float inv_t, float mx, bool with_ent, float& sum,
                float& wsum) {
  const FVec vinv(inv_t), vmx(mx), vfloor(shift_floor<float>());
  FVec s0(0.f), s1(0.f), w0(0.f), w1(0.f);
  int64_t j = lo;
  for (; j + kStep <= hi; j += kStep) {
    FVec a, b;
    load2(z + j, a, b);
    if (with_ent) {
      const FVec xa = at::vec::maximum(a * vinv - vmx, vfloor);
      const FVec xb = at::vec::maximum(b * vinv - vmx, vfloor);
      const FVec ea = xa.exp_u20(), eb = xb.exp_u20();
      s0 += ea;
      s1 += eb;
      w0 += ea * xa;
      w1 += eb * xb;
    } else {
      s0 += (a * vinv - vmx).exp_u20();
      s1 += (b * vinv - vmx).exp_u20();
    }
  }
  float s = hreduce(s0 + s1, false), w = with_ent ? hreduce(w0 + w1, false) : 0.f;
  for (; j < hi; ++j) {
    const float x = std::max(static_cast<float>(z[j]) * inv_t - mx, shift_floor<float>());
    const float e = std::exp(x);
    s += e;
    if (with_ent) w += e * x;
  }
  sum += s;
  wsum += w;
}

double slice_max(const double* z, int64_t v) {
  double m = -INFINITY;
  for (int64_t j = 0; j < v; ++j) m = nan_max(m, z[j]);
  return m;
}

void slice_sums(const double* z, int64_t lo, int64_t hi, double inv_t, double mx, bool with_ent, double& sum,
                double& wsum) {
  for (int64_t j = lo; j < hi; ++j) {
    const double x = std::max(z[j] * inv_t - mx, shift_floor<double>());
    const double e = std::exp(x);
    sum += e;
    if (with_ent) wsum += e * x;
  }
}

template <typename scalar_t>
void stats_kernel(const scalar_t* logits, int64_t ld,      // [N, V_local], row stride ld
                  int64_t n, int64_t v, int64_t start,
                  const int64_t* tokens,                    // [N] global ids or -100
                  const int64_t* topk_ids, int64_t k,       // [N, K] global ids, or null
                  double temperature, bool with_ent,
                  at::opmath_type<scalar_t>* stats) {       // [N, 4 + K]
  using acc_t = at::opmath_type<scalar_t>;
  const acc_t inv_t = acc_t(1.0 / temperature);
  const int64_t width = vp_stat_width(k);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      acc_t* st = stats + i * width;
      std::fill(st, st + width, acc_t(0));
      const int64_t a = tokens[i];
      if (a == kIgnoreIndex) continue;
      const scalar_t* z = logits + i * ld;
      const int64_t al = (a >= start && a < start + v) ? a - start : -1;
      const acc_t mx = slice_max(z, v) * inv_t;
      acc_t other = 0, wsum = 0;
      if (mx != -INFINITY) {  // an all -inf slice is an empty state: no mass, no moment
        if (al >= 0) {
          slice_sums(z, 0, al, inv_t, mx, with_ent, other, wsum);
          slice_sums(z, al + 1, v, inv_t, mx, with_ent, other, wsum);
          if (with_ent) {
            const acc_t x = std::max(static_cast<acc_t>(z[al]) * inv_t - mx, shift_floor<acc_t>());
            wsum += std::exp(x) * x;
          }
        } else {
          slice_sums(z, 0, v, inv_t, mx, with_ent, other, wsum);
        }
      }
      st[kVpMax] = mx;
      st[kVpOther] = other;
      st[kVpWsum] = wsum;
      if (al >= 0) st[kVpTarget] = static_cast<acc_t>(z[al]) * inv_t;
      for (int64_t c = 0; c < k; ++c) {
        const int64_t id = topk_ids[i * k + c] - start;
        if (id >= 0 && id < v) st[kVpTopk + c] = static_cast<acc_t>(z[id]) * inv_t;
      }
    }
  });
}

at::Tensor dppo_vocab_parallel_stats_cpu(const at::Tensor& logits, const at::Tensor& tokens,
                                         const c10::optional<at::Tensor>& topk_ids, int64_t vocab_start,
                                         double temperature, bool compute_entropy) {
  check_vp_stats_inputs(logits, tokens, topk_ids, vocab_start, temperature);
  const int64_t n = logits.size(0), v = logits.size(1);
  const int64_t k = topk_ids.has_value() ? topk_ids->size(1) : 0;
  at::Tensor stats = at::empty({n, vp_stat_width(k)}, logits.options().dtype(acc_dtype(logits.scalar_type())));
  if (n == 0) return stats;
  const at::Tensor tok = tokens.contiguous();
  const c10::optional<at::Tensor> ids = topk_ids.has_value() ? c10::optional<at::Tensor>(topk_ids->contiguous())
                                                              : c10::nullopt;
  const int64_t ld = n > 1 ? logits.stride(0) : v;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "dppo_vocab_parallel_stats_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    stats_kernel<scalar_t>(logits.const_data_ptr<scalar_t>(), ld, n, v, vocab_start, tok.const_data_ptr<int64_t>(),
                           ids.has_value() ? ids->const_data_ptr<int64_t>() : nullptr, k, temperature,
                           compute_entropy, stats.data_ptr<acc_t>());
  });
  return stats;
}

ForwardOutputs dppo_vocab_parallel_epilogue_cpu(const at::Tensor& stats, at::IntArrayRef vocab_offsets,
                                                const at::Tensor& tokens, const at::Tensor& rollout_logprobs,
                                                const at::Tensor& advantages,
                                                const c10::optional<at::Tensor>& topk_ids,
                                                const c10::optional<at::Tensor>& topk_logprobs,
                                                const c10::optional<at::Tensor>& anchor_logprobs,
                                                c10::string_view mode, double delta_low, double delta_high,
                                                double ratio_cap, bool compute_entropy) {
  const VpEpilogueInputs in = prepare_vp_epilogue(stats, vocab_offsets, tokens, rollout_logprobs, advantages, topk_ids,
                                                  topk_logprobs, anchor_logprobs, mode, delta_low, delta_high,
                                                  ratio_cap);
  if (in.n == 0) return in.outputs();
  const VpArgs args{in.mode, delta_low, delta_high, ratio_cap, compute_entropy};
  const std::vector<int64_t> offsets(vocab_offsets.begin(), vocab_offsets.end());
  AT_DISPATCH_FLOATING_TYPES(stats.scalar_type(), "dppo_vocab_parallel_epilogue_cpu", [&] {
    using T = scalar_t;
    const T* st = in.stats.const_data_ptr<T>();
    const int64_t* tok = in.tokens.const_data_ptr<int64_t>();
    const T* m = in.rollout_lp.const_data_ptr<T>();
    const T* adv = in.adv.const_data_ptr<T>();
    const T* anchor = in.anchor_lp.has_value() ? in.anchor_lp->const_data_ptr<T>() : nullptr;
    const int64_t* ids = in.topk_ids.has_value() ? in.topk_ids->const_data_ptr<int64_t>() : nullptr;
    const T* tlp = in.topk_lp.has_value() ? in.topk_lp->const_data_ptr<T>() : nullptr;
    T* out[7];
    for (int c = 0; c < 7; ++c) out[c] = in.out[c].data_ptr<T>();
    const int64_t row_stride = in.width;
    const int64_t rank_stride = in.n * in.width;
    at::parallel_for(0, in.n, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t a = tok[i];
        if (a == kIgnoreIndex) {
          for (int c = 0; c < 7; ++c) out[c][i] = T(0);
          continue;
        }
        const VpRowOut<T> r = vp_merge_row<T, T>(st + i * row_stride, rank_stride, offsets.data(), in.world, a, m[i],
                                              anchor ? anchor[i] : m[i], adv[i], ids ? ids + i * in.k : nullptr,
                                              tlp ? tlp + i * in.k : nullptr, in.k, args);
        out[0][i] = r.loss;
        out[1][i] = r.logp;
        out[2][i] = r.divergence;
        out[3][i] = r.mask;
        out[4][i] = r.weight;
        out[5][i] = r.entropy;
        out[6][i] = r.lse;
      }
    });
  });
  return in.outputs();
}

}  // namespace

TORCH_LIBRARY_IMPL(dppo, CPU, m) {
  m.impl("dppo_vocab_parallel_stats", &dppo_vocab_parallel_stats_cpu);
  m.impl("dppo_vocab_parallel_epilogue", &dppo_vocab_parallel_epilogue_cpu);
}

}  // namespace dppo
