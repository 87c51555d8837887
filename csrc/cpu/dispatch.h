// cpu/dispatch.h -- run-time choice of the CPU kernels' instruction set.
//
// Each CPU kernel file (cpu/dppo_loss.cpp) is compiled once per instruction set: DEFAULT (the
// baseline the compiler targets), AVX2 (-mavx2 -mfma -mf16c) and AVX512 (-mavx512f/bw/vl/dq), each
// with CPU_CAPABILITY set to that name, as ATen compiles its own CPU kernels. Everything the file
// defines lives in namespace dppo::CPU_CAPABILITY (at::vec puts Vectorized in an inline namespace
// of the same name), so the copies never collide; each exposes its entry points as one
// CpuKernels table. dispatch.cpp picks one table per process from the running CPU (and the
// DPPO_CPU_CAPABILITY override) and registers the CPU implementations of the ops once.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <tuple>

namespace dppo {

using CpuForwardFn = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> (*)(
    const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& rollout_logprobs,
    const at::Tensor& advantages, const c10::optional<at::Tensor>& topk_ids,
    const c10::optional<at::Tensor>& topk_logprobs, const c10::optional<at::Tensor>& anchor_logprobs,
    c10::string_view mode, double temperature, double delta_low, double delta_high, double ratio_cap,
    bool compute_entropy);
using CpuBackwardFn = at::Tensor (*)(const at::Tensor& grad_target, const c10::optional<at::Tensor>& grad_entropy,
                                     const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& lse,
                                     const c10::optional<at::Tensor>& entropy, double temperature);
using CpuBackwardInplaceFn = void (*)(const at::Tensor& grad_target, const c10::optional<at::Tensor>& grad_entropy,
                                      const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& lse,
                                      const c10::optional<at::Tensor>& entropy, double temperature);

// The entry points of one instruction-set build of the CPU kernels.
struct CpuKernels {
  CpuForwardFn forward;
  CpuBackwardFn backward;
  CpuBackwardInplaceFn backward_inplace;
};

// One table per compiled instruction set. The build defines DPPO_CPU_HAVE_AVX2 / _AVX512 for
// dispatch.cpp when it compiled that variant (x86-64 only).
namespace DEFAULT { extern const CpuKernels kernels; }
namespace AVX2 { extern const CpuKernels kernels; }
namespace AVX512 { extern const CpuKernels kernels; }

// The instruction set the CPU ops run with in this process ("default", "avx2" or "avx512"),
// chosen on first use: DPPO_CPU_CAPABILITY when set (an error when the CPU or the build lacks it),
// otherwise the best level that was compiled, that this CPU supports, and that torch's own
// choice (torch.backends.cpu.get_cpu_capability(), which honours ATEN_CPU_CAPABILITY) allows.
const std::string& cpu_capability();

// The levels this library was compiled with, comma-separated, lowest first ("default,avx2,avx512").
const char* cpu_capabilities_compiled();

}  // namespace dppo
