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

#include "../ops.h"

namespace dppo {

// The entry points of one instruction-set build of cpu/dppo_loss.cpp and of cpu/vocab_parallel.cpp.
// Each entry has its op's one signature (ops.h).
struct CpuLossKernels {
  LossForwardOp* forward;
  LossBackwardOp* backward;
  LossBackwardInplaceOp* backward_inplace;
};
struct CpuVocabParallelKernels {
  VocabParallelStatsOp* stats;
  VocabParallelEpilogueOp* epilogue;
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
