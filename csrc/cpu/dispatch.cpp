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

const CpuLossKernels& loss() {
  static const CpuLossKernels& t = select_build().loss;
  return t;
}

const CpuVocabParallelKernels& vocab_parallel() {
  static const CpuVocabParallelKernels& t = select_build().vocab_parallel;
  return t;
}

ForwardOutputs forward_cpu(const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& rollout_logprobs,
                           const at::Tensor& advantages, const c10::optional<at::Tensor>& topk_ids,
                           const c10::optional<at::Tensor>& topk_logprobs,
                           const c10::optional<at::Tensor>& anchor_logprobs, c10::string_view mode, double temperature,
                           double delta_low, double delta_high, double ratio_cap, bool compute_entropy) {
  return loss().forward(logits, tokens, rollout_logprobs, advantages, topk_ids, topk_logprobs, anchor_logprobs, mode,
                        temperature, delta_low, delta_high, ratio_cap, compute_entropy);
}

at::Tensor backward_cpu(const at::Tensor& grad_target, const c10::optional<at::Tensor>& grad_entropy,
                        const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& lse,
                        const c10::optional<at::Tensor>& entropy, double temperature) {
  return loss().backward(grad_target, grad_entropy, logits, tokens, lse, entropy, temperature);
}

void backward_inplace_cpu(const at::Tensor& grad_target, const c10::optional<at::Tensor>& grad_entropy,
                          const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& lse,
                          const c10::optional<at::Tensor>& entropy, double temperature) {
  loss().backward_inplace(grad_target, grad_entropy, logits, tokens, lse, entropy, temperature);
}

at::Tensor vp_stats_cpu(const at::Tensor& logits, const at::Tensor& tokens, const c10::optional<at::Tensor>& topk_ids,
                        int64_t vocab_start, double temperature, bool compute_entropy) {
  return vocab_parallel().stats(logits, tokens, topk_ids, vocab_start, temperature, compute_entropy);
}

ForwardOutputs vp_epilogue_cpu(const at::Tensor& stats, at::IntArrayRef vocab_offsets, const at::Tensor& tokens,
                               const at::Tensor& rollout_logprobs, const at::Tensor& advantages,
                               const c10::optional<at::Tensor>& topk_ids,
                               const c10::optional<at::Tensor>& topk_logprobs,
                               const c10::optional<at::Tensor>& anchor_logprobs, c10::string_view mode,
                               double delta_low, double delta_high, double ratio_cap, bool compute_entropy) {
  return vocab_parallel().epilogue(stats, vocab_offsets, tokens, rollout_logprobs, advantages, topk_ids,
                                   topk_logprobs, anchor_logprobs, mode, delta_low, delta_high, ratio_cap,
                                   compute_entropy);
}

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
  m.impl("dppo_loss_forward", &forward_cpu);
  m.impl("dppo_loss_backward", &backward_cpu);
  m.impl("dppo_loss_backward_", &backward_inplace_cpu);
  m.impl("dppo_vocab_parallel_stats", &vp_stats_cpu);
  m.impl("dppo_vocab_parallel_epilogue", &vp_epilogue_cpu);
}

}  // namespace dppo
