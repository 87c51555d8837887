// op_operands.h -- host-side preparation shared by the CPU and CUDA entry points of every op: validation
// (checks.h), then the operands a kernel reads and writes: its per-row inputs made contiguous, and its outputs
// allocated. Both backends go through these, so they validate, allocate and lay out the same.
#pragma once

#include <ATen/ATen.h>

#include <array>

#include "checks.h"
#include "ops.h"
#include "vocab_parallel_math.h"

namespace dppo {

template <typename T>
const T* opt_ptr(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

// The operands of the row epilogue, as the forward and the vocabulary-parallel epilogue both hand them to their
// kernels: the rollout's per-row inputs made contiguous, and the seven outputs allocated.
struct RowOperands {
  LossSettings settings;                        // mode, deltas, ratio cap, compute_entropy
  int64_t n, k;                                 // rows, top-K width (0 unless a top-K mode)
  at::Tensor tokens, rollout_lp, adv;           // [N] contiguous (undefined when N == 0)
  c10::optional<at::Tensor> topk_ids, topk_lp;  // [N, K] contiguous, top-K modes only
  c10::optional<at::Tensor> anchor_lp;          // [N] contiguous, when given
  std::array<at::Tensor, 7> out;                // loss, logp, divergence, mask, weight, entropy, lse

  ForwardOutputs outputs() const { return {out[0], out[1], out[2], out[3], out[4], out[5], out[6]}; }

  template <typename S>
  RowOutputPtrs<S> output_ptrs() const {
    return {out[0].data_ptr<S>(), out[1].data_ptr<S>(), out[2].data_ptr<S>(), out[3].data_ptr<S>(),
            out[4].data_ptr<S>(), out[5].data_ptr<S>(), out[6].data_ptr<S>()};
  }
};

// Fills `in` once validated: allocates the outputs [N] with `opts`, then (N > 0) the contiguous per-row inputs.
inline void make_row_operands(RowOperands& in, const at::TensorOptions& opts, const RowInputs& rows) {
  in.k = 0;
  for (auto& t : in.out) t = at::empty({in.n}, opts);
  if (in.n == 0) return;
  in.tokens = rows.tokens.contiguous();
  in.rollout_lp = rows.rollout_logprobs.contiguous();
  in.adv = rows.advantages.contiguous();
  if (mode_is_topk(in.settings.mode)) {
    in.topk_ids = rows.topk_ids->contiguous();
    in.topk_lp = rows.topk_logprobs->contiguous();
    in.k = in.topk_ids->size(1);
  }
  if (rows.anchor_logprobs.has_value()) in.anchor_lp = rows.anchor_logprobs->contiguous();
}

struct ForwardOperands : RowOperands {
  int64_t v, ld;    // vocab, logits row stride
  int64_t s = 0;    // kept-set width S (0 without sampling replay)
  at::Tensor kept;  // [N, S] contiguous int64, or undefined

  const int64_t* kept_ptr() const { return kept.defined() ? kept.const_data_ptr<int64_t>() : nullptr; }
};

inline ForwardOperands prepare_forward(const at::Tensor& logits, const RowInputs& rows, const LossSettings& settings,
                                       double temperature, const c10::optional<at::Tensor>& kept_ids) {
  check_forward_inputs(logits, rows, settings, temperature, kept_ids);
  ForwardOperands in;
  in.settings = settings;
  in.n = logits.size(0);
  in.v = logits.size(1);
  in.ld = in.n > 1 ? logits.stride(0) : in.v;
  make_row_operands(in, logits.options().dtype(acc_dtype(logits.scalar_type())), rows);
  if (kept_ids.has_value() && in.n > 0) {
    in.kept = kept_ids->contiguous();
    in.s = in.kept.size(1);
  }
  return in;
}

struct BackwardOperands {
  int64_t n, v, ld_in, ld_out;                      // rows, vocab, row strides of logits and grad
  at::Tensor tokens, lse, grad_target;              // [N] contiguous
  c10::optional<at::Tensor> grad_entropy, entropy;  // [N] contiguous, given together
  // Sampling replay: the kept ids [N, S] and (gather_kept_logits: the device kernels) their logits [N, S] (logits
  // dtype), gathered before any kernel writes, so the in-place backward reads them intact; the CPU kernel reads each
  // row's S logits itself before writing that row. Undefined without kept_ids.
  int64_t s = 0;
  at::Tensor kept, kept_logits;

  const int64_t* kept_ptr() const { return kept.defined() ? kept.const_data_ptr<int64_t>() : nullptr; }
};

// The inputs of one backward pass writing into `grad` (logits itself for the in-place op);
// check_backward_inputs has already validated them.
inline BackwardOperands prepare_backward(const at::Tensor& grad_target, const c10::optional<at::Tensor>& grad_entropy,
                                         const at::Tensor& logits, const at::Tensor& grad, const at::Tensor& tokens,
                                         const at::Tensor& lse, const c10::optional<at::Tensor>& entropy,
                                         const c10::optional<at::Tensor>& kept_ids, bool gather_kept_logits) {
  BackwardOperands in;
  in.n = logits.size(0);
  in.v = logits.size(1);
  in.ld_in = in.n > 1 ? logits.stride(0) : in.v;
  in.ld_out = in.n > 1 ? grad.stride(0) : in.v;
  in.tokens = tokens.contiguous();
  in.lse = lse.contiguous();
  in.grad_target = grad_target.contiguous();
  if (grad_entropy.has_value()) {
    in.grad_entropy = grad_entropy->contiguous();
    in.entropy = entropy->contiguous();
  }
  if (kept_ids.has_value()) {
    in.kept = kept_ids->contiguous();
    in.s = in.kept.size(1);
    // O(N * S): padding (-1) gathers column 0, which the kernels never use.
    if (gather_kept_logits) in.kept_logits = logits.gather(1, in.kept.clamp_min(0).clamp_max(in.v - 1)).contiguous();
  }
  return in;
}

// ---- the vocabulary-parallel ops ----------------------------------------------------------------------------

struct VpStatsOperands {
  int64_t n, v, k, ld, start;  // rows, local vocab, top-K width (0 without ids), row stride
  int64_t s;                   // kept-set width (0 without kept_ids)
  at::Tensor tokens;           // [N] contiguous
  at::Tensor topk_ids;         // [N, K] contiguous, or undefined
  at::Tensor kept;             // [N, S] contiguous, or undefined
  at::Tensor stats;            // the output [N, 4 + K + S] in the accumulation dtype

  const int64_t* topk_ids_ptr() const { return topk_ids.defined() ? topk_ids.const_data_ptr<int64_t>() : nullptr; }
  const int64_t* kept_ptr() const { return kept.defined() ? kept.const_data_ptr<int64_t>() : nullptr; }
};

inline VpStatsOperands prepare_vp_stats(const at::Tensor& logits, const at::Tensor& tokens,
                                        const c10::optional<at::Tensor>& topk_ids, int64_t vocab_start,
                                        double temperature, const c10::optional<at::Tensor>& kept_ids) {
  check_vp_stats_inputs(logits, tokens, topk_ids, vocab_start, temperature, kept_ids);
  VpStatsOperands in;
  in.n = logits.size(0);
  in.v = logits.size(1);
  in.k = topk_ids.has_value() ? topk_ids->size(1) : 0;
  in.s = kept_ids.has_value() ? kept_ids->size(1) : 0;
  in.ld = in.n > 1 ? logits.stride(0) : in.v;
  in.start = vocab_start;
  in.stats = at::empty({in.n, vp_stat_width(in.k, in.s)}, logits.options().dtype(acc_dtype(logits.scalar_type())));
  if (in.n == 0) return in;
  in.tokens = tokens.contiguous();
  if (topk_ids.has_value()) in.topk_ids = topk_ids->contiguous();
  if (kept_ids.has_value()) in.kept = kept_ids->contiguous();
  return in;
}

struct VpEpilogueOperands : RowOperands {
  int64_t world, width;  // ranks, statistics per row (4 + K + S)
  int64_t s = 0;         // kept-set width (0 without kept_ids)
  at::Tensor stats;      // [W, N, 4 + K + S] contiguous
  at::Tensor kept;       // [N, S] contiguous, or undefined

  const int64_t* kept_ptr() const { return kept.defined() ? kept.const_data_ptr<int64_t>() : nullptr; }
};

inline VpEpilogueOperands prepare_vp_epilogue(const at::Tensor& stats, at::IntArrayRef offsets, const RowInputs& rows,
                                              const LossSettings& settings, const c10::optional<at::Tensor>& kept_ids) {
  check_vp_epilogue_inputs(stats, offsets, rows, settings, kept_ids);
  VpEpilogueOperands in;
  in.settings = settings;
  in.world = stats.size(0);
  in.n = stats.size(1);
  in.width = stats.size(2);
  in.stats = stats.contiguous();
  make_row_operands(in, stats.options(), rows);
  if (kept_ids.has_value() && in.n > 0) {
    in.kept = kept_ids->contiguous();
    in.s = in.kept.size(1);
  }
  return in;
}

}  // namespace dppo
