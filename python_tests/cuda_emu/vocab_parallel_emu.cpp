// vocab_parallel_emu.cpp -- the vocabulary-parallel CUDA kernels of csrc/cuda/vocab_parallel_kernels.cuh, compiled
// by the host compiler under the CPU emulation layer (cuda_emu.h), registered into the emulator library's
// namespace as torch.ops.dppo_cuda_emu.dppo_vocab_parallel_{stats,epilogue}: the schemas of torch.ops.dppo (ops.cpp),
// CPU tensors in and out. A test tool, built with dppo_loss_emu.cpp (which holds the emulator's engine and
// controls) into one library by python_tests/cuda_emu/emu_build.py; never part of the wheel.
//
// The entry points mirror csrc/cuda/vocab_parallel.cu line for line, minus the device guard and the current
// stream: the same checks and preparation (vocab_parallel_checks.h), the same dispatch and the same
// vp_{stats,epilogue}_launch of the kernels header. The offsets tensor is built on the CPU, as the stats are.
#include "cuda_emu.h"  // first: the kernels header compiles against it

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <array>
#include <vector>

#include "../op_schemas.h"
#include "../op_inputs.h"  // <csrc>/cuda/../ through -I <csrc>/cuda
#include "emu_op.h"
#include "vocab_parallel_kernels.cuh"  // -I <csrc>/cuda of the tree under test (the repo's, or a mutant)

namespace dppo_cuda_emu {

using dppo::ForwardOutputs;

at::Tensor vp_stats(const at::Tensor& logits, const at::Tensor& tokens, const c10::optional<at::Tensor>& topk_ids,
                    int64_t vocab_start, double temperature, bool compute_entropy) {
  dppo::check_vp_stats_inputs(logits, tokens, topk_ids, vocab_start, temperature);
  const int64_t n = logits.size(0), v = logits.size(1);
  const int64_t k = topk_ids.has_value() ? topk_ids->size(1) : 0;
  at::Tensor stats =
      at::empty({n, dppo::vp_stat_width(k)}, logits.options().dtype(dppo::acc_dtype(logits.scalar_type())));
  if (n == 0) return stats;
  const at::Tensor tok = tokens.contiguous();
  const at::Tensor ids = topk_ids.has_value() ? topk_ids->contiguous() : at::Tensor();
  const int64_t ld = n > 1 ? logits.stride(0) : v;
  guarded("dppo_vocab_parallel_stats", [&] {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "dppo_vocab_parallel_stats_emu",
                                    [&] {
      dppo::vp_stats_launch<scalar_t>(logits.const_data_ptr<scalar_t>(), ld, n, v, vocab_start,
                                      tok.const_data_ptr<int64_t>(),
                                      ids.defined() ? ids.const_data_ptr<int64_t>() : nullptr, k, temperature,
                                      compute_entropy, stats.data_ptr<dppo::vp_acc_t<scalar_t>>(), nullptr);
    });
  });
  return stats;
}

ForwardOutputs vp_epilogue(const at::Tensor& stats, at::IntArrayRef vocab_offsets, const at::Tensor& tokens,
                           const at::Tensor& rollout_logprobs, const at::Tensor& advantages,
                           const c10::optional<at::Tensor>& topk_ids, const c10::optional<at::Tensor>& topk_logprobs,
                           const c10::optional<at::Tensor>& anchor_logprobs, c10::string_view mode, double delta_low,
                           double delta_high, double ratio_cap, bool compute_entropy) {
  const dppo::VpEpilogueInputs in =
      dppo::prepare_vp_epilogue(stats, vocab_offsets, tokens, rollout_logprobs, advantages, topk_ids, topk_logprobs,
                                anchor_logprobs, mode, delta_low, delta_high, ratio_cap, compute_entropy);
  if (in.n == 0) return in.outputs();
  const dppo::LossArgs& args = in.args;
  const at::Tensor offsets = at::tensor(std::vector<int64_t>(vocab_offsets.begin(), vocab_offsets.end()), at::kLong);
  guarded("dppo_vocab_parallel_epilogue", [&] {
    AT_DISPATCH_FLOATING_TYPES(stats.scalar_type(), "dppo_vocab_parallel_epilogue_emu", [&] {
      using S = scalar_t;
      const std::array<S*, 7> out = {in.out[0].data_ptr<S>(), in.out[1].data_ptr<S>(), in.out[2].data_ptr<S>(),
                                     in.out[3].data_ptr<S>(), in.out[4].data_ptr<S>(), in.out[5].data_ptr<S>(),
                                     in.out[6].data_ptr<S>()};
      dppo::vp_epilogue_launch<S>(in.stats.const_data_ptr<S>(), offsets.const_data_ptr<int64_t>(), in.world, in.n,
                                  in.width, in.tokens.const_data_ptr<int64_t>(), in.rollout_lp.const_data_ptr<S>(),
                                  in.adv.const_data_ptr<S>(),
                                  in.anchor_lp.has_value() ? in.anchor_lp->const_data_ptr<S>() : nullptr,
                                  in.topk_ids.has_value() ? in.topk_ids->const_data_ptr<int64_t>() : nullptr,
                                  in.topk_lp.has_value() ? in.topk_lp->const_data_ptr<S>() : nullptr, in.k, args, out,
                                  nullptr);
    });
  });
  return in.outputs();
}

}  // namespace dppo_cuda_emu

TORCH_LIBRARY_FRAGMENT(dppo_cuda_emu, m) {
  m.def(dppo::schema::kVocabParallelStats);
  m.def(dppo::schema::kVocabParallelEpilogue);
  m.impl("dppo_vocab_parallel_stats", c10::DispatchKey::CPU, &dppo_cuda_emu::vp_stats);
  m.impl("dppo_vocab_parallel_epilogue", c10::DispatchKey::CPU, &dppo_cuda_emu::vp_epilogue);
}
