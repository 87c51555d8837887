// op_inputs.h -- host-side preparation shared by the CPU and CUDA entry points: validation
// (checks.h), allocation of the seven [N] outputs, and the contiguous per-row inputs the kernels
// index directly. Both backends go through these, so they validate, allocate and lay out the same.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <tuple>

#include "checks.h"

namespace dppo {

using ForwardOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

template <typename T>
const T* opt_ptr(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

struct ForwardInputs {
  Mode mode;
  int64_t n, v, k, ld;                           // rows, vocab, top-K width (0 unless top-K), logits row stride
  at::Tensor tokens, rollout_lp, adv;            // [N] contiguous (undefined when N == 0)
  c10::optional<at::Tensor> topk_ids, topk_lp;   // [N, K] contiguous, top-K modes only
  c10::optional<at::Tensor> anchor_lp;           // [N] contiguous, when given
  std::array<at::Tensor, 7> out;                 // loss, logp, divergence, mask, weight, entropy, lse

  ForwardOutputs outputs() const { return {out[0], out[1], out[2], out[3], out[4], out[5], out[6]}; }
};

inline ForwardInputs prepare_forward(const at::Tensor& logits, const at::Tensor& tokens,
                                     const at::Tensor& rollout_logprobs, const at::Tensor& advantages,
                                     const c10::optional<at::Tensor>& topk_ids,
                                     const c10::optional<at::Tensor>& topk_logprobs,
                                     const c10::optional<at::Tensor>& anchor_logprobs, c10::string_view mode,
                                     double temperature, double delta_low, double delta_high, double ratio_cap) {
  ForwardInputs in;
  in.mode = check_forward_inputs(logits, tokens, rollout_logprobs, advantages, topk_ids, topk_logprobs,
                                 anchor_logprobs, mode, temperature, delta_low, delta_high, ratio_cap);
  in.n = logits.size(0);
  in.v = logits.size(1);
  in.ld = in.n > 1 ? logits.stride(0) : in.v;
  in.k = 0;
  const auto opts = logits.options().dtype(acc_dtype(logits.scalar_type()));
  for (auto& t : in.out) t = at::empty({in.n}, opts);
  if (in.n == 0) return in;
  in.tokens = tokens.contiguous();
  in.rollout_lp = rollout_logprobs.contiguous();
  in.adv = advantages.contiguous();
  if (mode_is_topk(in.mode)) {
    in.topk_ids = topk_ids->contiguous();
    in.topk_lp = topk_logprobs->contiguous();
    in.k = in.topk_ids->size(1);
  }
  if (anchor_logprobs.has_value()) in.anchor_lp = anchor_logprobs->contiguous();
  return in;
}

struct BackwardInputs {
  int64_t n, v, ld_in, ld_out;                     // rows, vocab, row strides of logits and grad
  at::Tensor tokens, lse, grad_target;             // [N] contiguous
  c10::optional<at::Tensor> grad_entropy, entropy; // [N] contiguous, given together
};

// The inputs of one backward pass writing into `grad` (logits itself for the in-place op);
// check_backward_inputs has already validated them.
inline BackwardInputs prepare_backward(const at::Tensor& grad_target, const c10::optional<at::Tensor>& grad_entropy,
                                       const at::Tensor& logits, const at::Tensor& grad, const at::Tensor& tokens,
                                       const at::Tensor& lse, const c10::optional<at::Tensor>& entropy) {
  BackwardInputs in;
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
  return in;
}

}  // namespace dppo
