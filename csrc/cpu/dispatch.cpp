// cpu/dispatch.cpp -- the one TORCH_LIBRARY_IMPL(dppo, CPU, m): every CPU op, routed to the
// instruction-set build of cpu/dppo_loss.cpp and cpu/vocab_parallel.cpp that this CPU runs best (see
// dispatch.h). Compiled once, for the baseline instruction set, like ops.cpp: nothing here may use AVX.
#include "dispatch.h"

#include <ATen/Version.h>
#include <torch/library.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <stdexcept>
#include <utility>

namespace dppo {
namespace {

enum Level : int { kDefault = 0, kAvx2 = 1, kAvx512 = 2 };
constexpr const char* kNames[] = {"default", "avx2", "avx512"};

Level best_compiled() {
#if defined(DPPO_CPU_HAVE_AVX512)
  return kAvx512;
#elif defined(DPPO_CPU_HAVE_AVX2)
  return kAvx2;
#else
  return kDefault;
#endif
}

// What this CPU (and its OS: the checks include the saved-register state) can execute. The
// feature sets match the compiler flags of each build (-mavx2 -mfma -mf16c; -mavx512f/bw/vl/dq).
Level best_supported() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return avx512 ? kAvx512 : (avx2 ? kAvx2 : kDefault);
#else
  return kDefault;
#endif
}

// torch's own choice for its CPU kernels ("AVX512", "AVX2", "DEFAULT", ...; ATEN_CPU_CAPABILITY
// lowers it), so that a user who lowered torch's level lowers ours too.
Level torch_level() {
  const std::string cap = at::get_cpu_capability();
  if (cap.find("AVX512") != std::string::npos) return kAvx512;
  if (cap.find("AVX2") != std::string::npos) return kAvx2;
  return kDefault;
}

Level select_level() {
  const char* env = std::getenv("DPPO_CPU_CAPABILITY");
  std::string req = env ? env : "";
  std::transform(req.begin(), req.end(), req.begin(), [](unsigned char c) { return std::tolower(c); });
  if (req.empty()) return std::min({best_compiled(), best_supported(), torch_level()});
  int want = -1;
  for (int i = 0; i < 3; ++i) {
    if (req == kNames[i]) want = i;
  }
  if (want < 0) {
    throw std::invalid_argument("DPPO_CPU_CAPABILITY must be one of default, avx2, avx512 (or unset), got '" +
                                std::string(env) + "'");
  }
  if (want > best_compiled()) {
    throw std::invalid_argument("DPPO_CPU_CAPABILITY=" + req + ", but this build of dppo_ext._C has only " +
                                cpu_capabilities_compiled() + " CPU kernels; unset it or choose one of those");
  }
  if (want > best_supported()) {
    throw std::invalid_argument("DPPO_CPU_CAPABILITY=" + req + ", but this CPU does not support it (best: " +
                                kNames[best_supported()] + "); unset it or choose a lower level");
  }
  return static_cast<Level>(want);
}

Level level() {
  static const Level l = select_level();
  return l;
}

// The entry points of the chosen build.
struct Build {
  const CpuLossKernels& loss;
  const CpuVocabParallelKernels& vocab_parallel;
};

Build select_build() {
  switch (level()) {
#if defined(DPPO_CPU_HAVE_AVX512)
    case kAvx512:
      return {AVX512::loss_kernels, AVX512::vocab_parallel_kernels};
#endif
#if defined(DPPO_CPU_HAVE_AVX2)
    case kAvx2:
      return {AVX2::loss_kernels, AVX2::vocab_parallel_kernels};
#endif
    default:
      return {DEFAULT::loss_kernels, DEFAULT::vocab_parallel_kernels};
  }
}

// The chosen build's table of each kind, selected on first use.
template <typename Table>
const Table& chosen();

template <>
const CpuLossKernels& chosen<CpuLossKernels>() {
  static const CpuLossKernels& t = select_build().loss;
  return t;
}

template <>
const CpuVocabParallelKernels& chosen<CpuVocabParallelKernels>() {
  static const CpuVocabParallelKernels& t = select_build().vocab_parallel;
  return t;
}

// The CPU op of table entry kEntry (&CpuLossKernels::forward, ...): the chosen build's entry, called with the
// dispatcher's arguments. Its signature is the entry's, so the op's (ops.h).
template <auto kEntry>
struct CpuOp;

template <typename Table, typename R, typename... A, R (*Table::*kEntry)(A...)>
struct CpuOp<kEntry> {
  static R run(A... args) { return (chosen<Table>().*kEntry)(std::forward<A>(args)...); }
};

}  // namespace

const std::string& cpu_capability() {
  static const std::string name = kNames[level()];
  return name;
}

const char* cpu_capabilities_compiled() {
#if defined(DPPO_CPU_HAVE_AVX512)
  return "default,avx2,avx512";
#elif defined(DPPO_CPU_HAVE_AVX2)
  return "default,avx2";
#else
  return "default";
#endif
}

TORCH_LIBRARY_IMPL(dppo, CPU, m) {
  m.impl("dppo_loss_forward", &CpuOp<&CpuLossKernels::forward>::run);
  m.impl("dppo_loss_backward", &CpuOp<&CpuLossKernels::backward>::run);
  m.impl("dppo_loss_backward_", &CpuOp<&CpuLossKernels::backward_inplace>::run);
  m.impl("dppo_vocab_parallel_stats", &CpuOp<&CpuVocabParallelKernels::stats>::run);
  m.impl("dppo_vocab_parallel_epilogue", &CpuOp<&CpuVocabParallelKernels::epilogue>::run);
}

}  // namespace dppo
