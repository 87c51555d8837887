// cpu/dispatch.h -- run-time choice of the CPU kernels' instruction set.
//
// Each CPU kernel file (cpu/dppo_loss.cpp, cpu/vocab_parallel.cpp) is compiled once per instruction set:
// DEFAULT (the baseline the compiler targets), AVX2 (-mavx2 -mfma -mf16c) and AVX512 (-mavx512f/bw/vl/dq),
// each with CPU_CAPABILITY set to that name, as ATen compiles its own CPU kernels. Everything such a file
// defines lives in namespace dppo::CPU_CAPABILITY (at::vec puts Vectorized in an inline namespace of the same
// name), so the copies never collide; each file exposes its entry points as one table (CpuLossKernels,
// CpuVocabParallelKernels). dispatch.cpp picks one build per process from the running CPU (and the
// DPPO_CPU_CAPABILITY override) and registers every CPU op once, in the one TORCH_LIBRARY_IMPL(dppo, CPU).
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "../op_operands.h"

namespace dppo {

// The CPU entry points, one signature per op schema (op_schemas.h).
using CpuForwardFn = ForwardOutputs (*)(const at::Tensor& logits, const at::Tensor& tokens,
                                        const at::Tensor& rollout_logprobs, const at::Tensor& advantages,
                                        const c10::optional<at::Tensor>& topk_ids,
                                        const c10::optional<at::Tensor>& topk_logprobs,
                                        const c10::optional<at::Tensor>& anchor_logprobs, c10::string_view mode,
                                        double temperature, double delta_low, double delta_high, double ratio_cap,
                                        bool compute_entropy);
using CpuBackwardFn = at::Tensor (*)(const at::Tensor& grad_target, const c10::optional<at::Tensor>& grad_entropy,
                                     const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& lse,
                                     const c10::optional<at::Tensor>& entropy, double temperature);
using CpuBackwardInplaceFn = void (*)(const at::Tensor& grad_target, const c10::optional<at::Tensor>& grad_entropy,
                                      const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& lse,
                                      const c10::optional<at::Tensor>& entropy, double temperature);
using CpuVpStatsFn = at::Tensor (*)(const at::Tensor& logits, const at::Tensor& tokens,
                                    const c10::optional<at::Tensor>& topk_ids, int64_t vocab_start,
                                    double temperature, bool compute_entropy);
using CpuVpEpilogueFn = ForwardOutputs (*)(const at::Tensor& stats, at::IntArrayRef vocab_offsets,
                                           const at::Tensor& tokens, const at::Tensor& rollout_logprobs,
                                           const at::Tensor& advantages, const c10::optional<at::Tensor>& topk_ids,
                                           const c10::optional<at::Tensor>& topk_logprobs,
                                           const c10::optional<at::Tensor>& anchor_logprobs, c10::string_view mode,
                                           double delta_low, double delta_high, double ratio_cap,
                                           bool compute_entropy);

// The entry points of one instruction-set build of cpu/dppo_loss.cpp and of cpu/vocab_parallel.cpp.
struct CpuLossKernels {
  CpuForwardFn forward;
  CpuBackwardFn backward;
  CpuBackwardInplaceFn backward_inplace;
};
struct CpuVocabParallelKernels {
  CpuVpStatsFn stats;
  CpuVpEpilogueFn epilogue;
};

// One pair of tables per compiled instruction set. The build defines DPPO_CPU_HAVE_AVX2 / _AVX512 for
// dispatch.cpp when it compiled that variant (x86-64 only).
namespace DEFAULT {
extern const CpuLossKernels loss_kernels;
extern const CpuVocabParallelKernels vocab_parallel_kernels;
}  // namespace DEFAULT
namespace AVX2 {
extern const CpuLossKernels loss_kernels;
extern const CpuVocabParallelKernels vocab_parallel_kernels;
}  // namespace AVX2
namespace AVX512 {
extern const CpuLossKernels loss_kernels;
extern const CpuVocabParallelKernels vocab_parallel_kernels;
}  // namespace AVX512

// The instruction set the CPU ops run with in this process ("default", "avx2" or "avx512"),
// chosen on first use: DPPO_CPU_CAPABILITY when set (an error when the CPU or the build lacks it),
// otherwise the best level that was compiled, that this CPU supports, and that torch's own
// choice (torch.backends.cpu.get_cpu_capability(), which honours ATEN_CPU_CAPABILITY) allows.
const std::string& cpu_capability();

// The levels this library was compiled with, comma-separated, lowest first ("default,avx2,avx512").
const char* cpu_capabilities_compiled();

}  // namespace dppo
