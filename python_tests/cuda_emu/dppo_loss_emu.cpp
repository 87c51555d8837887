// dppo_loss_emu.cpp -- the CUDA kernels of csrc/cuda/dppo_loss_kernels.cuh, compiled by the host
// compiler under the CPU emulation layer (cuda_emu.h), registered as torch.ops.dppo_cuda_emu.*: the
// same three ops as torch.ops.dppo (same schemas, CPU tensors in and out) plus the emulator's
// controls. This translation unit also holds the emulator's engine (cuda_emu_engine.h); the
// vocabulary-parallel ops join the same library from vocab_parallel_emu.cpp. A test tool, built by
// python_tests/cuda_emu/emu_build.py; never part of the wheel.
//
// The entry points mirror csrc/cuda/dppo_loss.cu line for line, minus the device guard and the
// is_cuda checks: the same input preparation (op_inputs.h), the same dispatch, and the same
// dppo_loss_{forward,backward}_launch of the kernels header (launch policy, split-count override
// DPPO_CUDA_SPLIT, parameter packing), with the SM count from the emulator's settings.
#include "cuda_emu.h"  // first: the kernels header compiles against it

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <vector>

#include "../op_schemas.h"  // <csrc>/cuda/../ through -I <csrc>/cuda: the schemas of ops.cpp
#include "dppo_loss_kernels.cuh"  // -I <csrc>/cuda of the tree under test (the repo's, or a mutant)
#include "cuda_emu_engine.h"
#include "emu_op.h"

namespace dppo_cuda_emu {

using dppo::BackwardInputs;
using dppo::ForwardInputs;
using dppo::ForwardOutputs;

ForwardOutputs forward(const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& rollout_logprobs,
                       const at::Tensor& advantages, const c10::optional<at::Tensor>& topk_ids,
                       const c10::optional<at::Tensor>& topk_logprobs,
                       const c10::optional<at::Tensor>& anchor_logprobs, c10::string_view mode, double temperature,
                       double delta_low, double delta_high, double ratio_cap, bool compute_entropy) {
  const ForwardInputs in = dppo::prepare_forward(logits, tokens, rollout_logprobs, advantages, topk_ids, topk_logprobs,
                                                 anchor_logprobs, mode, temperature, delta_low, delta_high, ratio_cap,
                                                 compute_entropy);
  if (in.n == 0) return in.outputs();
  const int sms = dppo::sm_count(0);
  guarded("dppo_loss_forward", [&] {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "dppo_loss_forward_emu", [&] {
      dppo::dppo_loss_forward_launch<scalar_t>(in, logits, temperature, delta_low, delta_high, ratio_cap,
                                               compute_entropy, sms, nullptr);
    });
  });
  return in.outputs();
}

void run_backward(const at::Tensor& grad_target, const c10::optional<at::Tensor>& grad_entropy,
                  const at::Tensor& logits, const at::Tensor& grad, const at::Tensor& tokens, const at::Tensor& lse,
                  const c10::optional<at::Tensor>& entropy, double temperature) {
  if (logits.size(0) == 0) return;
  const BackwardInputs in = dppo::prepare_backward(grad_target, grad_entropy, logits, grad, tokens, lse, entropy);
  const int sms = dppo::sm_count(0);
  guarded("dppo_loss_backward", [&] {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "dppo_loss_backward_emu", [&] {
      dppo::dppo_loss_backward_launch<scalar_t>(in, logits, grad, temperature, sms, nullptr);
    });
  });
}

at::Tensor backward(const at::Tensor& grad_target, const c10::optional<at::Tensor>& grad_entropy,
                    const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& lse,
                    const c10::optional<at::Tensor>& entropy, double temperature) {
  dppo::check_backward_inputs(grad_target, grad_entropy, logits, tokens, lse, entropy, temperature);
  at::Tensor grad = at::empty(logits.sizes(), logits.options().memory_format(at::MemoryFormat::Contiguous));
  run_backward(grad_target, grad_entropy, logits, grad, tokens, lse, entropy, temperature);
  return grad;
}

void backward_inplace(const at::Tensor& grad_target, const c10::optional<at::Tensor>& grad_entropy,
                      const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& lse,
                      const c10::optional<at::Tensor>& entropy, double temperature) {
  dppo::check_backward_inputs(grad_target, grad_entropy, logits, tokens, lse, entropy, temperature);
  run_backward(grad_target, grad_entropy, logits, logits, tokens, lse, entropy, temperature);
}

void configure(c10::string_view mode, int64_t sm_count, int64_t seed, double timeout_s) {
  TORCH_CHECK_VALUE(mode == "fiber" || mode == "thread", "mode must be 'fiber' or 'thread', got '", mode, "'");
  TORCH_CHECK_VALUE(sm_count >= 1 && sm_count <= 1024, "sm_count must be in [1, 1024], got ", sm_count);
  TORCH_CHECK_VALUE(timeout_s > 0, "timeout_s must be > 0, got ", timeout_s);
  cuda_emu::Config& c = cuda_emu::config();
  c.mode = mode == "fiber" ? cuda_emu::Mode::kFiber : cuda_emu::Mode::kThread;
  c.sm_count = static_cast<int>(sm_count);
  c.seed = static_cast<uint64_t>(seed);
  c.timeout_s = timeout_s;
}

// [launches, blocks, threads, shared variables found, shared bytes poisoned] since the last reset.
std::vector<int64_t> stats(bool reset) {
  const cuda_emu::Stats s = cuda_emu::stats();
  if (reset) cuda_emu::stats() = cuda_emu::Stats{};
  return {s.launches, s.blocks, s.threads, s.shared_vars, s.shared_bytes_poisoned};
}

std::string sanitizer() {
#if defined(__SANITIZE_ADDRESS__)
  return "address";
#elif defined(__SANITIZE_THREAD__)
  return "thread";
#else
  return "none";
#endif
}

}  // namespace dppo_cuda_emu

TORCH_LIBRARY(dppo_cuda_emu, m) {
  m.def(dppo::schema::kLossForward);
  m.def(dppo::schema::kLossBackward);
  m.def(dppo::schema::kLossBackwardInplace);
  m.def("configure(str mode, int sm_count, int seed, float timeout_s) -> ()");
  m.def("stats(bool reset) -> int[]");
  m.def("sanitizer() -> str");
  m.impl("dppo_loss_forward", c10::DispatchKey::CPU, &dppo_cuda_emu::forward);
  m.impl("dppo_loss_backward", c10::DispatchKey::CPU, &dppo_cuda_emu::backward);
  m.impl("dppo_loss_backward_", c10::DispatchKey::CPU, &dppo_cuda_emu::backward_inplace);
  m.impl("configure", &dppo_cuda_emu::configure);
  m.impl("stats", &dppo_cuda_emu::stats);
  m.impl("sanitizer", &dppo_cuda_emu::sanitizer);
}
