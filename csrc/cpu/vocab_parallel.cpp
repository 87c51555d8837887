// cpu/vocab_parallel.cpp -- CPU kernels of the vocabulary-parallel DPPO loss (csrc/vocab_parallel_math.h).
//
// dppo_vocab_parallel_stats   : this rank's logits [N, V_local] (columns [vocab_start, vocab_start +
//                               V_local) of the global vocabulary) -> statistics [N, 4 + K] in the
//                               accumulation dtype. Per row the single-device kernel's two SIMD passes over
//                               the slice (cpu/row_simd.h), read in the logits dtype: the max, then the
//                               exp-sum without the owned target and the entropy moment; the target and
//                               top-K logits are gathered by index.
// dppo_vocab_parallel_epilogue: every rank's statistics [W, N, 4 + K] (after an all-gather) -> the seven
//                               [N] outputs of dppo_loss_forward, via vp_merge_row.
// The gradient needs no op of its own: dppo_loss_backward on the slice with the merged lse/entropy
// (dppo_ext/vocab_parallel.py).
// Like cpu/dppo_loss.cpp, compiled once per instruction set into namespace dppo::CPU_CAPABILITY;
// cpu/dispatch.cpp registers the ops and picks one build at run time.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "../op_operands.h"
#include "../vocab_parallel_math.h"
#include "dispatch.h"
#include "row_simd.h"

namespace dppo {
namespace CPU_CAPABILITY {
namespace {

template <typename scalar_t>
void stats_kernel(const scalar_t* logits, int64_t ld,  // [N, V_local], row stride ld
                  int64_t n, int64_t v, int64_t start,
                  const int64_t* tokens,               // [N] global ids or -100
                  const int64_t* topk_ids, int64_t k,  // [N, K] global ids, or null
                  const int64_t* kept, int64_t s,      // [N, S] global ids (-1 padding), or null
                  double temperature, bool with_ent,
                  at::opmath_type<scalar_t>* stats) {  // [N, 4 + K + S]
  using acc_t = at::opmath_type<scalar_t>;
  const acc_t inv_t = acc_t(1.0 / temperature);
  const int64_t width = vp_stat_width(k, s);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      acc_t* st = stats + i * width;
      std::fill(st, st + width, acc_t(0));
      const int64_t a = tokens[i];
      if (a == kIgnoreIndex) continue;
      const scalar_t* z = logits + i * ld;
      const int64_t al = (a >= start && a < start + v) ? a - start : -1;
      const acc_t mx = row_max(z, v) * inv_t;
      acc_t other = 0, wsum = 0;
      if (mx != -INFINITY) {  // an all -inf slice is an empty state: no mass, no moment
        if (al >= 0) {
          row_sums(z, 0, al, inv_t, mx, with_ent, other, wsum);
          row_sums(z, al + 1, v, inv_t, mx, with_ent, other, wsum);
          if (with_ent) {
            const acc_t x = std::max(static_cast<acc_t>(z[al]) * inv_t - mx, shift_floor<acc_t>());
            wsum += std::exp(x) * x;
          }
        } else {
          row_sums(z, 0, v, inv_t, mx, with_ent, other, wsum);
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
      for (int64_t c = 0; c < s; ++c) {  // padding (-1) is never in [start, start + v)
        const int64_t id = kept[i * s + c] - start;
        if (kept[i * s + c] >= 0 && id >= 0 && id < v) st[kVpTopk + k + c] = static_cast<acc_t>(z[id]) * inv_t;
      }
    }
  });
}

at::Tensor dppo_vocab_parallel_stats_cpu(const at::Tensor& logits, const at::Tensor& tokens,
                                         const c10::optional<at::Tensor>& topk_ids, int64_t vocab_start,
                                         double temperature, bool compute_entropy,
                                         const c10::optional<at::Tensor>& kept_ids) {
  const VpStatsOperands in = prepare_vp_stats(logits, tokens, topk_ids, vocab_start, temperature, kept_ids);
  if (in.n == 0) return in.stats;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "dppo_vocab_parallel_stats_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    stats_kernel<scalar_t>(logits.const_data_ptr<scalar_t>(), in.ld, in.n, in.v, in.start,
                           in.tokens.const_data_ptr<int64_t>(), in.topk_ids_ptr(), in.k, in.kept_ptr(), in.s,
                           temperature, compute_entropy, in.stats.data_ptr<acc_t>());
  });
  return in.stats;
}

ForwardOutputs dppo_vocab_parallel_epilogue_cpu(const at::Tensor& stats, at::IntArrayRef vocab_offsets,
                                                const at::Tensor& tokens, const at::Tensor& rollout_logprobs,
                                                const at::Tensor& advantages, const c10::optional<at::Tensor>& topk_ids,
                                                const c10::optional<at::Tensor>& topk_logprobs,
                                                const c10::optional<at::Tensor>& anchor_logprobs, c10::string_view mode,
                                                double delta_low, double delta_high, double ratio_cap,
                                                bool compute_entropy, const c10::optional<at::Tensor>& kept_ids,
                                                c10::string_view mask_direction) {
  const LossSettings settings = loss_settings(mode, delta_low, delta_high, ratio_cap, compute_entropy, mask_direction);
  const RowInputs rows{tokens, rollout_logprobs, advantages, topk_ids, topk_logprobs, anchor_logprobs};
  const VpEpilogueOperands in = prepare_vp_epilogue(stats, vocab_offsets, rows, settings, kept_ids);
  if (in.n == 0) return in.outputs();
  const std::vector<int64_t> offsets(vocab_offsets.begin(), vocab_offsets.end());
  AT_DISPATCH_FLOATING_TYPES(stats.scalar_type(), "dppo_vocab_parallel_epilogue_cpu", [&] {
    using T = scalar_t;
    const T* st = in.stats.const_data_ptr<T>();
    const int64_t* tok = in.tokens.const_data_ptr<int64_t>();
    const T* m = in.rollout_lp.const_data_ptr<T>();
    const T* adv = in.adv.const_data_ptr<T>();
    const T* anchor = opt_ptr<T>(in.anchor_lp);
    const int64_t* ids = opt_ptr<int64_t>(in.topk_ids);
    const T* tlp = opt_ptr<T>(in.topk_lp);
    const int64_t* kept = in.kept_ptr();
    const RowOutputPtrs<T> out = in.output_ptrs<T>();
    const int64_t rank_stride = in.n * in.width;
    at::parallel_for(0, in.n, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t a = tok[i];
        if (a == kIgnoreIndex) {
          out.store_zero(i);
          continue;
        }
        out.store(i, vp_merge_row<T, T>(st + i * in.width, rank_stride, offsets.data(), in.world, a, m[i],
                                        anchor ? anchor[i] : m[i], adv[i], ids ? ids + i * in.k : nullptr,
                                        tlp ? tlp + i * in.k : nullptr, in.k, in.settings,
                                        kept ? kept + i * in.s : nullptr, in.s));
      }
    });
  });
  return in.outputs();
}

}  // namespace

const CpuVocabParallelKernels vocab_parallel_kernels{&dppo_vocab_parallel_stats_cpu, &dppo_vocab_parallel_epilogue_cpu};

}  // namespace CPU_CAPABILITY
}  // namespace dppo
