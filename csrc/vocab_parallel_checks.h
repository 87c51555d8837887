// vocab_parallel_checks.h -- validation and host-side preparation of the vocabulary-parallel ops, shared
// by the CPU and CUDA entry points so both reject bad input with the same message (checks.h style: each
// message names the argument, what it got and what was expected).
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <string>

#include "checks.h"
#include "op_inputs.h"
#include "vocab_parallel.h"

namespace dppo {

inline void check_vp_stats_inputs(const at::Tensor& logits, const at::Tensor& tokens,
                                  const c10::optional<at::Tensor>& topk_ids, int64_t vocab_start,
                                  double temperature) {
  check_logits(logits);
  TORCH_CHECK_VALUE(std::isfinite(temperature) && temperature > 0.0,
                    "temperature must be a finite number > 0, got ", temperature);
  TORCH_CHECK_VALUE(vocab_start >= 0, "vocab_start (this rank's first global vocabulary id) must be >= 0, got ",
                    vocab_start);
  const int64_t n = logits.size(0);
  check_row_vector(tokens, "tokens", n, at::kLong, logits);
  if (topk_ids.has_value()) check_topk_matrix(*topk_ids, "topk_ids", n, -1, at::kLong, logits);
}

struct VpEpilogueInputs {
  Mode mode;
  int64_t world, n, width, k;                    // ranks, rows, statistics per row, top-K width (0 unless top-K)
  at::Tensor stats, tokens, rollout_lp, adv;     // contiguous (undefined when N == 0, except stats)
  c10::optional<at::Tensor> topk_ids, topk_lp, anchor_lp;
  std::array<at::Tensor, 7> out;                 // loss, logp, divergence, mask, weight, entropy, lse

  ForwardOutputs outputs() const { return {out[0], out[1], out[2], out[3], out[4], out[5], out[6]}; }
};

inline void check_vp_row_vector(const at::Tensor& t, const char* name, int64_t n, at::ScalarType dtype,
                                const at::Tensor& stats) {
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == n, name, " must be 1-D with N=", n,
                    " rows (stats.size(1)), got shape ", t.sizes());
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, name, " must have dtype ", dtype,
                   dtype == at::kLong ? " (token ids)" : " (the dtype of stats)", ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == stats.device(), name, " must be on the same device as stats (", stats.device(),
                    "), got ", t.device());
}

inline VpEpilogueInputs prepare_vp_epilogue(const at::Tensor& stats, at::IntArrayRef offsets,
                                            const at::Tensor& tokens, const at::Tensor& rollout_logprobs,
                                            const at::Tensor& advantages,
                                            const c10::optional<at::Tensor>& topk_ids,
                                            const c10::optional<at::Tensor>& topk_logprobs,
                                            const c10::optional<at::Tensor>& anchor_logprobs, c10::string_view mode,
                                            double delta_low, double delta_high, double ratio_cap) {
  VpEpilogueInputs in;
  in.mode = parse_mode(mode);
  check_scalars(1.0, delta_low, delta_high, ratio_cap);
  TORCH_CHECK_VALUE(stats.dim() == 3 && stats.size(2) >= kVpTopk,
                    "stats must be 3-D [W, N, 4 + K] (every rank's dppo_vocab_parallel_stats, stacked), got shape ",
                    stats.sizes());
  TORCH_CHECK_TYPE(stats.scalar_type() == at::kFloat || stats.scalar_type() == at::kDouble,
                   "stats must be float32 or float64 (the accumulation dtype), got ", stats.scalar_type());
  in.world = stats.size(0);
  in.n = stats.size(1);
  in.width = stats.size(2);
  TORCH_CHECK_VALUE(in.world >= 1 && static_cast<int64_t>(offsets.size()) == in.world + 1,
                    "vocab_offsets must have W + 1 = ", in.world + 1, " entries (stats.size(0) = W ranks), got ",
                    offsets.size());
  TORCH_CHECK_VALUE(offsets[0] == 0, "vocab_offsets[0] must be 0, got ", offsets[0]);
  for (int64_t r = 0; r < in.world; ++r) {
    TORCH_CHECK_VALUE(offsets[r + 1] > offsets[r], "vocab_offsets must be strictly increasing (every rank holds ",
                      "at least one vocabulary column), got ", offsets);
  }
  const int64_t vocab = offsets[in.world];
  const auto dt = stats.scalar_type();
  check_vp_row_vector(tokens, "tokens", in.n, at::kLong, stats);
  check_vp_row_vector(rollout_logprobs, "rollout_logprobs", in.n, dt, stats);
  check_vp_row_vector(advantages, "advantages", in.n, dt, stats);
  if (anchor_logprobs.has_value()) check_vp_row_vector(*anchor_logprobs, "anchor_logprobs", in.n, dt, stats);
  TORCH_CHECK_VALUE(topk_ids.has_value() == topk_logprobs.has_value(),
                    "topk_ids and topk_logprobs must be given together, got ",
                    topk_ids.has_value() ? "topk_ids only" : "topk_logprobs only");
  in.k = 0;
  if (mode_is_topk(in.mode)) {
    TORCH_CHECK_VALUE(topk_ids.has_value(), "mode '", std::string(mode),
                      "' needs the rollout's top-K: pass topk_ids [N, K] and topk_logprobs [N, K]");
    check_topk_matrix(*topk_ids, "topk_ids", in.n, -1, at::kLong, stats);
    check_topk_matrix(*topk_logprobs, "topk_logprobs", in.n, topk_ids->size(1), dt, stats);
    in.k = topk_ids->size(1);
    TORCH_CHECK_VALUE(in.width == vp_stat_width(in.k), "stats must have 4 + K = ", vp_stat_width(in.k),
                      " columns for K=", in.k, " top-K ids (pass the same topk_ids to dppo_vocab_parallel_stats), ",
                      "got shape ", stats.sizes());
  }
  check_token_values(tokens, vocab, "tokens", /*allow_ignore=*/true);
  check_logprob_values(rollout_logprobs, "rollout_logprobs");
  if (anchor_logprobs.has_value()) check_logprob_values(*anchor_logprobs, "anchor_logprobs");
  if (in.k > 0) {
    check_token_values(*topk_ids, vocab, "topk_ids", /*allow_ignore=*/false);
    check_logprob_values(*topk_logprobs, "topk_logprobs");
  }
  check_finite_values(advantages, "advantages");
  for (auto& t : in.out) t = at::empty({in.n}, stats.options());
  in.stats = stats.contiguous();
  if (in.n == 0) return in;
  in.tokens = tokens.contiguous();
  in.rollout_lp = rollout_logprobs.contiguous();
  in.adv = advantages.contiguous();
  if (in.k > 0) {
    in.topk_ids = topk_ids->contiguous();
    in.topk_lp = topk_logprobs->contiguous();
  }
  if (anchor_logprobs.has_value()) in.anchor_lp = anchor_logprobs->contiguous();
  return in;
}

}  // namespace dppo
