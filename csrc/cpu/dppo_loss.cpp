// cpu/dppo_loss.cpp -- CPU kernels of the DPPO loss (see docs/contract.md, csrc/dppo_math.h).
//
// forward : logits [N, V] (fp32/fp16/bf16/fp64, stride(1) == 1, any row stride) -> seven [N]
//           outputs in the accumulation dtype. Per row, two SIMD passes over the vocabulary
//           (cpu/row_simd.h) read the input dtype directly (no fp32 copy of the logits): a max
//           pass, then one pass that sums exp(s - max) over the non-target tokens (so log(1 - pi)
//           is exact) and, when asked, the entropy moment. The target and top-K logits are
//           gathered by index. Everything per row after that is dppo_math.h.
// backward: grad [N, V] in the logits dtype, one SIMD pass per row recomputing p from the saved
//           lse; the target column in the accumulation dtype via grad_target (expm1 form). The
//           in-place variant writes into logits.
// Rows run in parallel (at::parallel_for); fp16/bf16/fp32 accumulate in float, fp64 in double.
// The build compiles this file once per instruction set (CPU_CAPABILITY = DEFAULT, AVX2, AVX512,
// each with its compiler flags) into namespace dppo::CPU_CAPABILITY; cpu/dispatch.cpp registers the
// ops and picks one build at run time.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <vector>

#include "../dppo_math.h"
#include "../op_operands.h"
#include "buffer_cache.h"
#include "dispatch.h"
#include "row_simd.h"

namespace dppo {
namespace CPU_CAPABILITY {
namespace {

template <typename scalar_t>
void forward_kernel(const scalar_t* logits,  // [N, V], row stride ld
                    int64_t n, int64_t v, int64_t ld,
                    const int64_t* tokens,                        // [N]
                    const at::opmath_type<scalar_t>* rollout_lp,  // [N]
                    const at::opmath_type<scalar_t>* adv,         // [N]
                    const int64_t* topk_ids,                      // [N, K] or null
                    const at::opmath_type<scalar_t>* topk_lp,     // [N, K] or null
                    int64_t k,
                    const at::opmath_type<scalar_t>* anchor_lp,  // [N] or null
                    const int64_t* kept,                         // [N, S] or null (sampling replay)
                    int64_t s, double temperature, const LossSettings& settings,
                    const RowOutputPtrs<at::opmath_type<scalar_t>>& out) {  // seven [N]
  using acc_t = at::opmath_type<scalar_t>;
  const acc_t inv_t = acc_t(1.0 / temperature);
  const bool topk = mode_is_topk(settings.mode);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t a = tokens[i];
      if (a == kIgnoreIndex) {
        out.store_zero(i);
        continue;
      }
      const scalar_t* z = logits + i * ld;
      const acc_t mx = row_max(z, v) * inv_t;
      const int64_t* row_kept = kept ? kept + i * s : nullptr;
      if (row_kept) {
        // Sampling replay: the row's distribution renormalised over its kept set, formed in double from the S kept
        // logits (as the CUDA epilogue does). The whole row is read once, for its max: finite exactly when the row
        // has a distribution (no NaN, no +inf, not all -inf), as its lse is.
        // s = z / T in the accumulation dtype, as the whole-row pass and the backward form it
        const auto scaled = [&](int64_t c) { return static_cast<double>(static_cast<acc_t>(z[row_kept[c]]) * inv_t); };
        const double s_a = static_cast<double>(static_cast<acc_t>(z[a]) * inv_t);
        const KeptRow<double> kr =
            kept_row_from<double>(scaled, row_kept, s, a, s_a, static_cast<double>(mx), settings.compute_entropy);
        const double m = rollout_lp[i];
        const double la = anchor_lp ? static_cast<double>(anchor_lp[i]) : m;
        double div;
        if (topk) {
          TopkAcc<double> acc = topk_init<double>();
          for (int64_t c = 0; c < k; ++c) {
            const int64_t id = topk_ids[i * k + c];
            const double lq = kept_logq(row_kept, s, id, static_cast<double>(static_cast<acc_t>(z[id]) * inv_t), kr);
            topk_add(acc, static_cast<double>(topk_lp[i * k + c]), lq);
          }
          div = topk_divergence(settings.mode, acc);
        } else {
          div = binary_divergence(settings.mode, kr.lp, kr.l1p, la);
        }
        out.store(i, finish_row(settings, static_cast<double>(adv[i]), kr.lp, la, m, div, kr.entropy, kr.lse));
        continue;
      }
      // Sum over the non-target tokens, then the target's own term: 1 - pi = other / (other + e_a).
      acc_t other = 0, wsum = 0;
      row_sums(z, 0, a, inv_t, mx, settings.compute_entropy, other, wsum);
      row_sums(z, a + 1, v, inv_t, mx, settings.compute_entropy, other, wsum);
      // Log-probabilities are formed relative to the row max ((s - mx) - log(sum)), never as
      // s - lse: for huge |s| the absolute lse has lost log(sum) to rounding.
      const acc_t xa_raw = static_cast<acc_t>(z[a]) * inv_t - mx;
      const acc_t xa = std::max(xa_raw, shift_floor<acc_t>());
      const acc_t ea = std::exp(xa);
      const acc_t total = other + ea;
      if (settings.compute_entropy) wsum += ea * xa;
      const acc_t log_total = std::log(total);
      const acc_t lse = mx + log_total;
      const acc_t lp = xa_raw - log_total;
      const acc_t l1p = std::log(other) - log_total;
      const acc_t m = rollout_lp[i];
      const acc_t la = anchor_lp ? anchor_lp[i] : m;
      acc_t div;
      if (topk) {
        // The top-K log-probs and sums are formed in double, as the CUDA epilogue does: with pi -> 1
        // the rest masses 1 - sum_k lie far below float's resolution near 1 (a trainer rest mass of
        // 1e-10 is lost in the float total other + e_a itself, rounds to the 1e-12 floor and shifts
        // topk_kl by ~0.05 nats at K = 300).
        TopkAcc<double> acc = topk_init<double>();
        const double log_total_d = std::log(static_cast<double>(other) + static_cast<double>(ea));
        for (int64_t c = 0; c < k; ++c) {
          const acc_t s_c = static_cast<acc_t>(z[topk_ids[i * k + c]]) * inv_t;
          topk_add(acc, static_cast<double>(topk_lp[i * k + c]), (static_cast<double>(s_c) - mx) - log_total_d);
        }
        div = static_cast<acc_t>(topk_divergence(settings.mode, acc));
      } else {
        div = binary_divergence(settings.mode, lp, l1p, la);
      }
      const acc_t ent = settings.compute_entropy ? entropy_from_state(total, wsum) : acc_t(0);
      out.store(i, finish_row(settings, adv[i], lp, la, m, div, ent, lse));
    }
  });
}

// ---- backward ---------------------------------------------------------------------------------

template <typename scalar_t>
void backward_row(const scalar_t* z, scalar_t* g, int64_t v, float inv_t, float lse, float gt, float gh, float ent) {
  const FVec vinv(inv_t), vlse(lse), vgt(gt), vneg(-inv_t);
  int64_t j = 0;
  if (gh == 0.f) {
    for (; j + kStep <= v; j += kStep) {
      FVec a, b;
      load2(z + j, a, b);
      store2(g + j, grad_from_p_noent(vexp(a * vinv - vlse), vgt, vneg),
             grad_from_p_noent(vexp(b * vinv - vlse), vgt, vneg));
    }
    for (; j < v; ++j) {
      g[j] = static_cast<scalar_t>(grad_from_p_noent(std::exp(static_cast<float>(z[j]) * inv_t - lse), gt, -inv_t));
    }
  } else {
    const FVec vgh(gh), vent(ent), vfloor(shift_floor<float>());
    for (; j + kStep <= v; j += kStep) {
      FVec a, b;
      load2(z + j, a, b);
      const FVec la = floor_at(a * vinv - vlse, vfloor);
      const FVec lb = floor_at(b * vinv - vlse, vfloor);
      store2(g + j, grad_from_p(vexp(la), la, vgt, vgh, vent, vneg), grad_from_p(vexp(lb), lb, vgt, vgh, vent, vneg));
    }
    for (; j < v; ++j) {
      const float l = std::max(static_cast<float>(z[j]) * inv_t - lse, shift_floor<float>());
      g[j] = static_cast<scalar_t>(grad_from_p(std::exp(l), l, gt, gh, ent, -inv_t));
    }
  }
}

void backward_row(const double* z, double* g, int64_t v, double inv_t, double lse, double gt, double gh, double ent) {
  for (int64_t j = 0; j < v; ++j) {
    const double l = std::max(z[j] * inv_t - lse, shift_floor<double>());
    g[j] = gh == 0.0 ? grad_from_p_noent(std::exp(l), gt, -inv_t) : grad_from_p(std::exp(l), l, gt, gh, ent, -inv_t);
  }
}

// Sampling replay: the row is 0 outside its kept set, and the kept set's softmax gradient inside (dppo_math.h's
// kept_grad), from the row's S kept logits read into `zk` before the row is written (the in-place backward
// overwrites it; g may be z).
template <typename scalar_t>
void backward_kept_row(const scalar_t* z, scalar_t* g, int64_t v, const int64_t* kept, int64_t s, int64_t a,
                       at::opmath_type<scalar_t> inv_t, at::opmath_type<scalar_t> lse, at::opmath_type<scalar_t> gt,
                       at::opmath_type<scalar_t> gh, at::opmath_type<scalar_t> ent,
                       std::vector<at::opmath_type<scalar_t>>& zk) {
  using acc_t = at::opmath_type<scalar_t>;
  zk.resize(static_cast<size_t>(s));
  for (int64_t c = 0; c < s; ++c) {
    const int64_t id = kept[c];
    zk[c] = id >= 0 && id < v ? static_cast<acc_t>(z[id]) : acc_t(0);  // padding: never used
  }
  std::fill(g, g + v, scalar_t(0));
  for (int64_t c = 0; c < s; ++c) {
    const int64_t id = kept[c];
    if (id < 0 || id >= v) continue;  // padding
    g[id] = static_cast<scalar_t>(kept_grad<acc_t>(zk[c] * inv_t, id == a, lse, gt, gh, ent, inv_t));
  }
}

template <typename scalar_t>
void backward_kernel(const scalar_t* logits, int64_t ld_in,  // [N, V], row stride ld_in
                     scalar_t* grad, int64_t ld_out,         // [N, V], row stride ld_out (may alias logits)
                     int64_t n, int64_t v,
                     const int64_t* tokens,                 // [N]
                     const at::opmath_type<scalar_t>* lse,  // [N]
                     const at::opmath_type<scalar_t>* g_t,  // [N]
                     const at::opmath_type<scalar_t>* g_h,  // [N] or null
                     const at::opmath_type<scalar_t>* ent,  // [N] or null
                     const int64_t* kept,                   // [N, S] or null (sampling replay)
                     int64_t s, double temperature) {
  using acc_t = at::opmath_type<scalar_t>;
  const acc_t inv_t = acc_t(1.0 / temperature);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> zk;  // a kept row's S logits (sampling replay)
    for (int64_t i = begin; i < end; ++i) {
      const scalar_t* z = logits + i * ld_in;
      scalar_t* g = grad + i * ld_out;
      const int64_t a = tokens[i];
      // Padding row (-100); out-of-range ids were rejected by the forward. With a kept set an id outside [0, V)
      // is a sampled token this slice does not hold (a vocabulary-parallel rank's): its kept ids still get theirs.
      if (a == kIgnoreIndex || (kept == nullptr && (a < 0 || a >= v))) {
        std::fill(g, g + v, scalar_t(0));
        continue;
      }
      const acc_t gh = g_h ? g_h[i] : acc_t(0);
      const acc_t h = ent ? ent[i] : acc_t(0);
      if (kept) {
        backward_kept_row(z, g, v, kept + i * s, s, a, inv_t, lse[i], g_t[i], gh, h, zk);
        continue;
      }
      // Read the target logit before the row is overwritten (in-place backward).
      const acc_t lpa = static_cast<acc_t>(z[a]) * inv_t - lse[i];
      backward_row(z, g, v, inv_t, lse[i], g_t[i], gh, h);
      g[a] = static_cast<scalar_t>(grad_target(lpa, g_t[i], gh, h, inv_t));
    }
  });
}

ForwardOutputs dppo_loss_forward_cpu(const at::Tensor& logits, const at::Tensor& tokens,
                                     const at::Tensor& rollout_logprobs, const at::Tensor& advantages,
                                     const c10::optional<at::Tensor>& topk_ids,
                                     const c10::optional<at::Tensor>& topk_logprobs,
                                     const c10::optional<at::Tensor>& anchor_logprobs, c10::string_view mode,
                                     double temperature, double delta_low, double delta_high, double ratio_cap,
                                     bool compute_entropy, const c10::optional<at::Tensor>& kept_ids,
                                     c10::string_view mask_direction) {
  const LossSettings settings = loss_settings(mode, delta_low, delta_high, ratio_cap, compute_entropy, mask_direction);
  const RowInputs rows{tokens, rollout_logprobs, advantages, topk_ids, topk_logprobs, anchor_logprobs};
  const ForwardOperands in = prepare_forward(logits, rows, settings, temperature, kept_ids);
  if (in.n == 0) return in.outputs();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "dppo_loss_forward_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    forward_kernel<scalar_t>(logits.const_data_ptr<scalar_t>(), in.n, in.v, in.ld, in.tokens.data_ptr<int64_t>(),
                             in.rollout_lp.data_ptr<acc_t>(), in.adv.data_ptr<acc_t>(), opt_ptr<int64_t>(in.topk_ids),
                             opt_ptr<acc_t>(in.topk_lp), in.k, opt_ptr<acc_t>(in.anchor_lp), in.kept_ptr(), in.s,
                             temperature, in.settings, in.output_ptrs<acc_t>());
  });
  return in.outputs();
}

void run_backward(const at::Tensor& grad_target, const c10::optional<at::Tensor>& grad_entropy,
                  const at::Tensor& logits, const at::Tensor& grad, const at::Tensor& tokens, const at::Tensor& lse,
                  const c10::optional<at::Tensor>& entropy, double temperature,
                  const c10::optional<at::Tensor>& kept_ids) {
  if (logits.size(0) == 0) return;
  const BackwardOperands in = prepare_backward(grad_target, grad_entropy, logits, grad, tokens, lse, entropy, kept_ids,
                                               /*gather_kept_logits=*/false);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "dppo_loss_backward_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    backward_kernel<scalar_t>(logits.const_data_ptr<scalar_t>(), in.ld_in, grad.data_ptr<scalar_t>(), in.ld_out, in.n,
                              in.v, in.tokens.data_ptr<int64_t>(), in.lse.data_ptr<acc_t>(),
                              in.grad_target.data_ptr<acc_t>(), opt_ptr<acc_t>(in.grad_entropy),
                              opt_ptr<acc_t>(in.entropy), in.kept_ptr(), in.s, temperature);
  });
}

at::Tensor dppo_loss_backward_cpu(const at::Tensor& grad_target, const c10::optional<at::Tensor>& grad_entropy,
                                  const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& lse,
                                  const c10::optional<at::Tensor>& entropy, double temperature,
                                  const c10::optional<at::Tensor>& kept_ids) {
  check_backward_inputs(grad_target, grad_entropy, logits, tokens, lse, entropy, temperature, kept_ids);
  // Resident blocks (cpu/buffer_cache.h): a fresh buffer's page faults cost several backward passes.
  at::Tensor grad = empty_cached(logits.sizes(), logits.options());
  run_backward(grad_target, grad_entropy, logits, grad, tokens, lse, entropy, temperature, kept_ids);
  return grad;
}

void dppo_loss_backward_inplace_cpu(const at::Tensor& grad_target, const c10::optional<at::Tensor>& grad_entropy,
                                    const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& lse,
                                    const c10::optional<at::Tensor>& entropy, double temperature,
                                    const c10::optional<at::Tensor>& kept_ids) {
  check_backward_inputs(grad_target, grad_entropy, logits, tokens, lse, entropy, temperature, kept_ids);
  run_backward(grad_target, grad_entropy, logits, logits, tokens, lse, entropy, temperature, kept_ids);
}

}  // namespace

const CpuLossKernels loss_kernels{&dppo_loss_forward_cpu, &dppo_loss_backward_cpu, &dppo_loss_backward_inplace_cpu};

}  // namespace CPU_CAPABILITY
}  // namespace dppo
