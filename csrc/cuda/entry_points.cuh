// cuda/entry_points.cuh -- the bodies of the five CUDA ops: validation and preparation (op_operands.h, shared
// with the CPU kernels), the dispatch on the logits dtype, the kernels' parameters, the split forward's
// workspace and the launches the launch policy (launch_policy.cuh) picks. Written once for the two places
// that run these kernels: cuda/dppo_loss.cu and cuda/vocab_parallel.cu (nvcc, TORCH_LIBRARY_IMPL(dppo, CUDA))
// and the CPU emulator of the test suite (python_tests/cuda_emu), each supplying its Device. Each entry
// (dppo_loss_forward_entry<Device>, ...) has the signature its op declares in ops.h, which both registrations
// check (op_impl). The Device:
//
//   struct Device {
//     static void require(const at::Tensor& t, const char* name);  // t is on this backend's device, else throws
//     explicit Device(const at::Tensor& t);  // for its lifetime, t's device is current (CUDA: a device guard)
//     int sm_count() const;                  // of that device
//     cudaStream_t stream() const;           // where the kernels are launched
//   };
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <cstdint>
#include <vector>

#include "../op_operands.h"
#include "dppo_loss_backward_kernels.cuh"
#include "dppo_loss_forward_kernels.cuh"
#include "launch.cuh"
#include "launch_policy.cuh"
#include "vocab_parallel_kernels.cuh"

namespace dppo {
namespace {

// ---- the loss: forward ------------------------------------------------------------------------------------

template <typename scalar_t>
ForwardParams<scalar_t, acc_type_t<scalar_t>> forward_params(const ForwardOperands& in, const at::Tensor& logits,
                                                             double temperature) {
  using acc_t = acc_type_t<scalar_t>;
  ForwardParams<scalar_t, acc_t> p;
  p.logits = logits.const_data_ptr<scalar_t>();
  p.n = in.n;
  p.v = in.v;
  p.ld = in.ld;
  p.tokens = in.tokens.data_ptr<int64_t>();
  p.rollout_lp = in.rollout_lp.data_ptr<acc_t>();
  p.adv = in.adv.data_ptr<acc_t>();
  p.anchor_lp = opt_ptr<acc_t>(in.anchor_lp);
  p.topk_ids = opt_ptr<int64_t>(in.topk_ids);
  p.topk_lp = opt_ptr<acc_t>(in.topk_lp);
  p.k = in.k;
  p.kept = in.kept_ptr();
  p.s = in.s;
  p.settings = in.settings;
  p.inv_t = static_cast<acc_t>(1.0 / temperature);
  p.out = in.output_ptrs<acc_t>();
  return p;
}

// One block per row, or (n_split > 1) the split vocabulary: partial states into a workspace [N, S, 3], then
// the finishing kernel. A kept set (sampling replay) always takes the split path, with n_split >= 1: only the
// finishing kernel compiles the kept set's epilogue (see dppo_loss_forward_kernel).
template <typename scalar_t, bool kEntropy>
void launch_forward(const ForwardParams<scalar_t, acc_type_t<scalar_t>>& p, int64_t n_split, const at::Tensor& logits,
                    cudaStream_t stream) {
  using acc_t = acc_type_t<scalar_t>;
  if (n_split < 1) n_split = 1;
  if (n_split == 1 && p.kept == nullptr) {
    launch_kernel(dppo_loss_forward_kernel<scalar_t, acc_t, kEntropy>, dim3(static_cast<unsigned>(p.n)), dim3(kThreads),
                  stream, p);
    return;
  }
  const at::Tensor ws = at::empty({p.n, n_split, 3}, logits.options().dtype(acc_dtype(logits.scalar_type())));
  const dim3 grid(static_cast<unsigned>(p.n), static_cast<unsigned>(n_split));
  launch_kernel(dppo_loss_forward_partial_kernel<scalar_t, acc_t, kEntropy>, grid, dim3(kThreads), stream, p,
                ws.data_ptr<acc_t>());
  launch_kernel(dppo_loss_forward_finish_kernel<scalar_t, acc_t, kEntropy>, dim3(static_cast<unsigned>(p.n)),
                dim3(kFinishThreads), stream, p, static_cast<const acc_t*>(ws.data_ptr<acc_t>()), n_split);
}

template <typename Device>
ForwardOutputs dppo_loss_forward_entry(const at::Tensor& logits, const at::Tensor& tokens,
                                       const at::Tensor& rollout_logprobs, const at::Tensor& advantages,
                                       const c10::optional<at::Tensor>& topk_ids,
                                       const c10::optional<at::Tensor>& topk_logprobs,
                                       const c10::optional<at::Tensor>& anchor_logprobs, c10::string_view mode,
                                       double temperature, double delta_low, double delta_high, double ratio_cap,
                                       bool compute_entropy, const c10::optional<at::Tensor>& kept_ids,
                                       c10::string_view mask_direction) {
  Device::require(logits, "logits");
  const Device device(logits);
  const LossSettings settings = loss_settings(mode, delta_low, delta_high, ratio_cap, compute_entropy, mask_direction);
  const RowInputs rows{tokens, rollout_logprobs, advantages, topk_ids, topk_logprobs, anchor_logprobs};
  const ForwardOperands in = prepare_forward(logits, rows, settings, temperature, kept_ids);
  TORCH_CHECK_VALUE(in.n <= INT32_MAX, "logits may have at most 2^31 - 1 rows on CUDA, got ", in.n);
  if (in.n == 0) return in.outputs();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "dppo_loss_forward_cuda", [&] {
    const auto p = forward_params<scalar_t>(in, logits, temperature);
    const int64_t n_split = forward_splits(in.n, in.v, Pack<scalar_t>::kSize, device.sm_count());
    // With a kept set the entropy is the kept set's (the epilogue's), so the whole row's pass skips its moment.
    if (settings.compute_entropy && !kept_ids.has_value()) {
      launch_forward<scalar_t, true>(p, n_split, logits, device.stream());
    } else {
      launch_forward<scalar_t, false>(p, n_split, logits, device.stream());
    }
  });
  return in.outputs();
}

// ---- the loss: backward -----------------------------------------------------------------------------------

// One backward pass into grad (logits itself for the in-place op); the inputs are validated.
template <typename Device>
void dppo_loss_backward_run(const at::Tensor& grad_target, const c10::optional<at::Tensor>& grad_entropy,
                            const at::Tensor& logits, const at::Tensor& grad, const at::Tensor& tokens,
                            const at::Tensor& lse, const c10::optional<at::Tensor>& entropy, double temperature,
                            const c10::optional<at::Tensor>& kept_ids) {
  Device::require(logits, "logits");
  const Device device(logits);
  const int64_t n = logits.size(0);
  if (n == 0) return;
  TORCH_CHECK_VALUE(n <= INT32_MAX, "logits may have at most 2^31 - 1 rows on CUDA, got ", n);
  const BackwardOperands in = prepare_backward(grad_target, grad_entropy, logits, grad, tokens, lse, entropy, kept_ids,
                                               /*gather_kept_logits=*/true);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "dppo_loss_backward_cuda", [&] {
    using acc_t = acc_type_t<scalar_t>;
    BackwardParams<scalar_t, acc_t> p;
    p.logits = logits.const_data_ptr<scalar_t>();
    p.grad = grad.data_ptr<scalar_t>();
    p.n = in.n;
    p.v = in.v;
    p.ld_in = in.ld_in;
    p.ld_out = in.ld_out;
    p.tokens = in.tokens.data_ptr<int64_t>();
    p.lse = in.lse.data_ptr<acc_t>();
    p.grad_target = in.grad_target.data_ptr<acc_t>();
    p.grad_entropy = opt_ptr<acc_t>(in.grad_entropy);
    p.entropy = opt_ptr<acc_t>(in.entropy);
    p.inv_t = static_cast<acc_t>(1.0 / temperature);
    p.kept = in.kept_ptr();
    p.kept_logits = in.kept_logits.defined() ? in.kept_logits.const_data_ptr<scalar_t>() : nullptr;
    p.s = in.s;
    if (p.kept != nullptr) {
      launch_kernel(dppo_loss_backward_kept_kernel<scalar_t, acc_t>, dim3(static_cast<unsigned>(in.n)), dim3(kThreads),
                    device.stream(), p);
      return;
    }
    const int64_t n_split = backward_splits(in.n, in.v, Pack<scalar_t>::kSize, device.sm_count());
    const dim3 grid(static_cast<unsigned>(in.n), static_cast<unsigned>(n_split));
    launch_kernel(dppo_loss_backward_kernel<scalar_t, acc_t>, grid, dim3(kThreads), device.stream(), p);
  });
}

template <typename Device>
at::Tensor dppo_loss_backward_entry(const at::Tensor& grad_target, const c10::optional<at::Tensor>& grad_entropy,
                                    const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& lse,
                                    const c10::optional<at::Tensor>& entropy, double temperature,
                                    const c10::optional<at::Tensor>& kept_ids) {
  check_backward_inputs(grad_target, grad_entropy, logits, tokens, lse, entropy, temperature, kept_ids);
  at::Tensor grad = at::empty(logits.sizes(), logits.options().memory_format(at::MemoryFormat::Contiguous));
  dppo_loss_backward_run<Device>(grad_target, grad_entropy, logits, grad, tokens, lse, entropy, temperature, kept_ids);
  return grad;
}

template <typename Device>
void dppo_loss_backward_inplace_entry(const at::Tensor& grad_target, const c10::optional<at::Tensor>& grad_entropy,
                                      const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& lse,
                                      const c10::optional<at::Tensor>& entropy, double temperature,
                                      const c10::optional<at::Tensor>& kept_ids) {
  check_backward_inputs(grad_target, grad_entropy, logits, tokens, lse, entropy, temperature, kept_ids);
  dppo_loss_backward_run<Device>(grad_target, grad_entropy, logits, logits, tokens, lse, entropy, temperature,
                                 kept_ids);
}

// ---- vocabulary-parallel ----------------------------------------------------------------------------------

template <typename Device>
at::Tensor dppo_vocab_parallel_stats_entry(const at::Tensor& logits, const at::Tensor& tokens,
                                           const c10::optional<at::Tensor>& topk_ids, int64_t vocab_start,
                                           double temperature, bool compute_entropy,
                                           const c10::optional<at::Tensor>& kept_ids) {
  Device::require(logits, "logits");
  const Device device(logits);
  const VpStatsOperands in = prepare_vp_stats(logits, tokens, topk_ids, vocab_start, temperature, kept_ids);
  TORCH_CHECK_VALUE(in.n <= INT32_MAX, "logits may have at most 2^31 - 1 rows on CUDA, got ", in.n);
  if (in.n == 0) return in.stats;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, logits.scalar_type(), "dppo_vocab_parallel_stats_cuda", [&] {
        using acc_t = acc_type_t<scalar_t>;
        launch_kernel(vp_stats_kernel<scalar_t>, dim3(static_cast<unsigned>(in.n)), dim3(kVpThreads), device.stream(),
                      logits.const_data_ptr<scalar_t>(), in.ld, in.v, in.start, in.tokens.const_data_ptr<int64_t>(),
                      in.topk_ids_ptr(), in.k, in.kept_ptr(), in.s, acc_t(1.0 / temperature), compute_entropy,
                      in.stats.data_ptr<acc_t>());
      });
  return in.stats;
}

template <typename Device>
ForwardOutputs dppo_vocab_parallel_epilogue_entry(
    const at::Tensor& stats, at::IntArrayRef vocab_offsets, const at::Tensor& tokens,
    const at::Tensor& rollout_logprobs, const at::Tensor& advantages, const c10::optional<at::Tensor>& topk_ids,
    const c10::optional<at::Tensor>& topk_logprobs, const c10::optional<at::Tensor>& anchor_logprobs,
    c10::string_view mode, double delta_low, double delta_high, double ratio_cap, bool compute_entropy,
    const c10::optional<at::Tensor>& kept_ids, c10::string_view mask_direction) {
  Device::require(stats, "stats");
  const Device device(stats);
  const LossSettings settings = loss_settings(mode, delta_low, delta_high, ratio_cap, compute_entropy, mask_direction);
  const RowInputs rows{tokens, rollout_logprobs, advantages, topk_ids, topk_logprobs, anchor_logprobs};
  const VpEpilogueOperands in = prepare_vp_epilogue(stats, vocab_offsets, rows, settings, kept_ids);
  if (in.n == 0) return in.outputs();
  const at::Tensor offsets =
      at::tensor(std::vector<int64_t>(vocab_offsets.begin(), vocab_offsets.end()), at::kLong).to(stats.device());
  AT_DISPATCH_FLOATING_TYPES(stats.scalar_type(), "dppo_vocab_parallel_epilogue_cuda", [&] {
    using S = scalar_t;
    const unsigned blocks = static_cast<unsigned>((in.n + kVpEpilogueThreads - 1) / kVpEpilogueThreads);
    launch_kernel(vp_epilogue_kernel<S>, dim3(blocks), dim3(kVpEpilogueThreads), device.stream(),
                  in.stats.const_data_ptr<S>(), offsets.const_data_ptr<int64_t>(), in.world, in.n, in.width,
                  in.tokens.const_data_ptr<int64_t>(), in.rollout_lp.const_data_ptr<S>(), in.adv.const_data_ptr<S>(),
                  opt_ptr<S>(in.anchor_lp), opt_ptr<int64_t>(in.topk_ids), opt_ptr<S>(in.topk_lp), in.k, in.settings,
                  in.kept_ptr(), in.s, in.output_ptrs<S>());
  });
  return in.outputs();
}

}  // namespace
}  // namespace dppo
