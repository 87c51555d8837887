// ops.h -- the C++ signature of every op, declared once: the types the dispatcher passes for each schema of
// op_schemas.h (`float` is double, `int` is int64_t, `int[]` is at::IntArrayRef, `Tensor?` is
// c10::optional<at::Tensor>, `str` is c10::string_view). Each backend defines its implementation of an op with
// exactly that signature, where it lives, and its registration takes it as a pointer of the declared type, so a
// definition that drifts from its declaration does not compile:
//   CPU   cpu/dppo_loss.cpp, cpu/vocab_parallel.cpp (once per instruction set), routed by cpu/dispatch.cpp
//   CUDA  cuda/entry_points.cuh (for any Device), registered by cuda/dppo_loss.cu, cuda/vocab_parallel.cu and by
//         the CPU emulator of the test suite (python_tests/cuda_emu/emu_ops.cpp)
// Past the signature, an implementation passes its arguments on bundled: the loss settings as one LossSettings
// (dppo_math.h, built by checks.h's loss_settings), the rollout's per-row tensors as one RowInputs (below).
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace dppo {

// The seven [N] outputs of dppo_loss_forward and dppo_vocab_parallel_epilogue, in the schema's order:
// (loss, logp, divergence, mask, weight, entropy, lse).
using ForwardOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

using LossForwardOp = ForwardOutputs(const at::Tensor& logits, const at::Tensor& tokens,
                                     const at::Tensor& rollout_logprobs, const at::Tensor& advantages,
                                     const c10::optional<at::Tensor>& topk_ids,
                                     const c10::optional<at::Tensor>& topk_logprobs,
                                     const c10::optional<at::Tensor>& anchor_logprobs, c10::string_view mode,
                                     double temperature, double delta_low, double delta_high, double ratio_cap,
                                     bool compute_entropy, const c10::optional<at::Tensor>& kept_ids,
                                     c10::string_view mask_direction);

using LossBackwardOp = at::Tensor(const at::Tensor& grad_target, const c10::optional<at::Tensor>& grad_entropy,
                                  const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& lse,
                                  const c10::optional<at::Tensor>& entropy, double temperature,
                                  const c10::optional<at::Tensor>& kept_ids);

// dppo_loss_backward_: the gradient written into logits (Tensor(a!)), nothing returned.
using LossBackwardInplaceOp = void(const at::Tensor& grad_target, const c10::optional<at::Tensor>& grad_entropy,
                                   const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& lse,
                                   const c10::optional<at::Tensor>& entropy, double temperature,
                                   const c10::optional<at::Tensor>& kept_ids);

using VocabParallelStatsOp = at::Tensor(const at::Tensor& logits, const at::Tensor& tokens,
                                        const c10::optional<at::Tensor>& topk_ids, int64_t vocab_start,
                                        double temperature, bool compute_entropy,
                                        const c10::optional<at::Tensor>& kept_ids);

using VocabParallelEpilogueOp = ForwardOutputs(const at::Tensor& stats, at::IntArrayRef vocab_offsets,
                                               const at::Tensor& tokens, const at::Tensor& rollout_logprobs,
                                               const at::Tensor& advantages, const c10::optional<at::Tensor>& topk_ids,
                                               const c10::optional<at::Tensor>& topk_logprobs,
                                               const c10::optional<at::Tensor>& anchor_logprobs, c10::string_view mode,
                                               double delta_low, double delta_high, double ratio_cap,
                                               bool compute_entropy, const c10::optional<at::Tensor>& kept_ids,
                                               c10::string_view mask_direction);

// `impl` as a pointer of op Op's declared type, for a registration: an implementation whose signature drifted
// from its declaration above does not convert, so it does not compile.
template <typename Op>
constexpr Op* op_impl(Op* impl) {
  return impl;
}

// The rollout's per-row arguments of dppo_loss_forward and dppo_vocab_parallel_epilogue as the op received them
// (dppo_ext/_rows.py's RowInputs, the same six in the schema's order): tokens [N] int64, rollout_logprobs and
// advantages [N], topk_ids [N, K]? int64, topk_logprobs [N, K]?, anchor_logprobs [N]?. References to the op's
// arguments: it lives no longer than the call.
struct RowInputs {
  const at::Tensor& tokens;
  const at::Tensor& rollout_logprobs;
  const at::Tensor& advantages;
  const c10::optional<at::Tensor>& topk_ids;
  const c10::optional<at::Tensor>& topk_logprobs;
  const c10::optional<at::Tensor>& anchor_logprobs;
};

}  // namespace dppo
