// cuda/dppo_loss.cu -- TORCH_LIBRARY_IMPL(dppo, CUDA) of the DPPO loss: the entry points around
// the kernels of dppo_loss_kernels.cuh (device code, launch policy and math contract live there).
// Each entry point validates and prepares its inputs (op_inputs.h, shared with the CPU kernel),
// sets the device guard, dispatches on the logits dtype and launches on the current stream.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "dppo_loss_kernels.cuh"

namespace dppo {

ForwardOutputs dppo_loss_forward_cuda(const at::Tensor& logits, const at::Tensor& tokens,
                                      const at::Tensor& rollout_logprobs, const at::Tensor& advantages,
                                      const c10::optional<at::Tensor>& topk_ids,
                                      const c10::optional<at::Tensor>& topk_logprobs,
                                      const c10::optional<at::Tensor>& anchor_logprobs, c10::string_view mode,
                                      double temperature, double delta_low, double delta_high, double ratio_cap,
                                      bool compute_entropy) {
  TORCH_CHECK_VALUE(logits.is_cuda(), "logits must be a CUDA tensor for the CUDA kernel, got ", logits.device());
  const c10::cuda::CUDAGuard guard(logits.device());
  const ForwardInputs in = prepare_forward(logits, tokens, rollout_logprobs, advantages, topk_ids, topk_logprobs,
                                           anchor_logprobs, mode, temperature, delta_low, delta_high, ratio_cap,
                                           compute_entropy);
  TORCH_CHECK_VALUE(in.n <= INT32_MAX, "logits may have at most 2^31 - 1 rows on CUDA, got ", in.n);
  if (in.n == 0) return in.outputs();
  const int sms = sm_count(logits.device().index());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "dppo_loss_forward_cuda", [&] {
    dppo_loss_forward_launch<scalar_t>(in, logits, temperature, delta_low, delta_high, ratio_cap, compute_entropy, sms,
                                       stream);
  });
  return in.outputs();
}

namespace {

void run_backward(const at::Tensor& grad_target, const c10::optional<at::Tensor>& grad_entropy,
                  const at::Tensor& logits, const at::Tensor& grad, const at::Tensor& tokens, const at::Tensor& lse,
                  const c10::optional<at::Tensor>& entropy, double temperature) {
  TORCH_CHECK_VALUE(logits.is_cuda(), "logits must be a CUDA tensor for the CUDA kernel, got ", logits.device());
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t n = logits.size(0);
  if (n == 0) return;
  TORCH_CHECK_VALUE(n <= INT32_MAX, "logits may have at most 2^31 - 1 rows on CUDA, got ", n);
  const BackwardInputs in = prepare_backward(grad_target, grad_entropy, logits, grad, tokens, lse, entropy);
  const int sms = sm_count(logits.device().index());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "dppo_loss_backward_cuda", [&] {
    dppo_loss_backward_launch<scalar_t>(in, logits, grad, temperature, sms, stream);
  });
}

}  // namespace

at::Tensor dppo_loss_backward_cuda(const at::Tensor& grad_target, const c10::optional<at::Tensor>& grad_entropy,
                                   const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& lse,
                                   const c10::optional<at::Tensor>& entropy, double temperature) {
  check_backward_inputs(grad_target, grad_entropy, logits, tokens, lse, entropy, temperature);
  at::Tensor grad = at::empty(logits.sizes(), logits.options().memory_format(at::MemoryFormat::Contiguous));
  run_backward(grad_target, grad_entropy, logits, grad, tokens, lse, entropy, temperature);
  return grad;
}

void dppo_loss_backward_inplace_cuda(const at::Tensor& grad_target, const c10::optional<at::Tensor>& grad_entropy,
                                     const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& lse,
                                     const c10::optional<at::Tensor>& entropy, double temperature) {
  check_backward_inputs(grad_target, grad_entropy, logits, tokens, lse, entropy, temperature);
  run_backward(grad_target, grad_entropy, logits, logits, tokens, lse, entropy, temperature);
}

TORCH_LIBRARY_IMPL(dppo, CUDA, m) {
  m.impl("dppo_loss_forward", &dppo_loss_forward_cuda);
  m.impl("dppo_loss_backward", &dppo_loss_backward_cuda);
  m.impl("dppo_loss_backward_", &dppo_loss_backward_inplace_cuda);
}

}  // namespace dppo
