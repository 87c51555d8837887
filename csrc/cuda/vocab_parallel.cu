// cuda/vocab_parallel.cu -- TORCH_LIBRARY_IMPL(dppo, CUDA) of the vocabulary-parallel ops: the entry points around
// vocab_parallel_kernels.cuh (device code and launch policy live there, the row math in csrc/vocab_parallel.h).
// Validation and output allocation are vocab_parallel_checks.h's, shared with the CPU entry points; each entry
// point sets the device guard, dispatches on the dtype and launches on the current stream.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <array>
#include <vector>

#include "../op_inputs.h"
#include "vocab_parallel_kernels.cuh"

namespace dppo {

at::Tensor dppo_vocab_parallel_stats_cuda(const at::Tensor& logits, const at::Tensor& tokens,
                                          const c10::optional<at::Tensor>& topk_ids, int64_t vocab_start,
                                          double temperature, bool compute_entropy) {
  check_vp_stats_inputs(logits, tokens, topk_ids, vocab_start, temperature);
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t n = logits.size(0), v = logits.size(1);
  const int64_t k = topk_ids.has_value() ? topk_ids->size(1) : 0;
  at::Tensor stats = at::empty({n, vp_stat_width(k)}, logits.options().dtype(acc_dtype(logits.scalar_type())));
  if (n == 0) return stats;
  const at::Tensor tok = tokens.contiguous();
  const at::Tensor ids = topk_ids.has_value() ? topk_ids->contiguous() : at::Tensor();
  const int64_t ld = n > 1 ? logits.stride(0) : v;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "dppo_vocab_parallel_stats_cuda",
                                  [&] {
    vp_stats_launch<scalar_t>(logits.const_data_ptr<scalar_t>(), ld, n, v, vocab_start, tok.const_data_ptr<int64_t>(),
                              ids.defined() ? ids.const_data_ptr<int64_t>() : nullptr, k, temperature,
                              compute_entropy, stats.data_ptr<vp_acc_t<scalar_t>>(), stream);
  });
  return stats;
}

ForwardOutputs dppo_vocab_parallel_epilogue_cuda(const at::Tensor& stats, at::IntArrayRef vocab_offsets,
                                                 const at::Tensor& tokens, const at::Tensor& rollout_logprobs,
                                                 const at::Tensor& advantages,
                                                 const c10::optional<at::Tensor>& topk_ids,
                                                 const c10::optional<at::Tensor>& topk_logprobs,
                                                 const c10::optional<at::Tensor>& anchor_logprobs,
                                                 c10::string_view mode, double delta_low, double delta_high,
                                                 double ratio_cap, bool compute_entropy) {
  const c10::cuda::CUDAGuard guard(stats.device());
  const VpEpilogueInputs in = prepare_vp_epilogue(stats, vocab_offsets, tokens, rollout_logprobs, advantages, topk_ids,
                                                  topk_logprobs, anchor_logprobs, mode, delta_low, delta_high,
                                                  ratio_cap, compute_entropy);
  if (in.n == 0) return in.outputs();
  const LossArgs& args = in.args;
  const at::Tensor offsets =
      at::tensor(std::vector<int64_t>(vocab_offsets.begin(), vocab_offsets.end()), at::kLong).to(stats.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(stats.scalar_type(), "dppo_vocab_parallel_epilogue_cuda", [&] {
    using S = scalar_t;
    const std::array<S*, 7> out = {in.out[0].data_ptr<S>(), in.out[1].data_ptr<S>(), in.out[2].data_ptr<S>(),
                                   in.out[3].data_ptr<S>(), in.out[4].data_ptr<S>(), in.out[5].data_ptr<S>(),
                                   in.out[6].data_ptr<S>()};
    vp_epilogue_launch<S>(in.stats.const_data_ptr<S>(), offsets.const_data_ptr<int64_t>(), in.world, in.n, in.width,
                          in.tokens.const_data_ptr<int64_t>(), in.rollout_lp.const_data_ptr<S>(),
                          in.adv.const_data_ptr<S>(),
                          in.anchor_lp.has_value() ? in.anchor_lp->const_data_ptr<S>() : nullptr,
                          in.topk_ids.has_value() ? in.topk_ids->const_data_ptr<int64_t>() : nullptr,
                          in.topk_lp.has_value() ? in.topk_lp->const_data_ptr<S>() : nullptr, in.k, args, out, stream);
  });
  return in.outputs();
}

TORCH_LIBRARY_IMPL(dppo, CUDA, m) {
  m.impl("dppo_vocab_parallel_stats", &dppo_vocab_parallel_stats_cuda);
  m.impl("dppo_vocab_parallel_epilogue", &dppo_vocab_parallel_epilogue_cuda);
}

}  // namespace dppo
