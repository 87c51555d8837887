// bindings.cpp -- the small pybind11 `_C` module: build information only. Importing it loads the
// shared library, whose static initialisers register every op (ops.cpp, cpu/, cuda/) with the
// dispatcher; the ops themselves are reached as torch.ops.dppo.*, never through pybind11.
// It also refuses to load on a CPU that lacks the SIMD extension the CPU kernels were built for,
// with an ImportError that says how to rebuild, instead of dying later on an illegal instruction.
#include <torch/extension.h>

#ifndef DPPO_VERSION
#define DPPO_VERSION "0.0.0"
#endif
#ifndef DPPO_TORCH_VERSION
#define DPPO_TORCH_VERSION "unknown"
#endif
#ifndef DPPO_CUDA_ARCH_LIST
#define DPPO_CUDA_ARCH_LIST ""
#endif
#ifndef DPPO_CPU_CAPABILITY
#define DPPO_CPU_CAPABILITY "default"
#endif

namespace {

bool cpu_supports_build() {
#if defined(CPU_CAPABILITY_AVX512)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma");
#elif defined(CPU_CAPABILITY_AVX2)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return true;
#endif
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  if (!cpu_supports_build()) {
    throw std::runtime_error(
        "dppo_ext._C was built for the " DPPO_CPU_CAPABILITY " CPU instruction set, which this CPU lacks; "
        "rebuild with DPPO_CPU_CAPABILITY=avx2 (or default): "
        "DPPO_CPU_CAPABILITY=default pip install --no-build-isolation --no-deps -e .");
  }
  m.doc() = "dppo_ext native library (ops are registered under torch.ops.dppo)";
  m.attr("__version__") = DPPO_VERSION;
#ifdef DPPO_WITH_CUDA
  m.attr("cuda_compiled") = true;
#else
  m.attr("cuda_compiled") = false;
#endif
  m.attr("cuda_arch_list") = DPPO_CUDA_ARCH_LIST;
  m.attr("cpu_capability") = DPPO_CPU_CAPABILITY;
  m.attr("torch_version") = DPPO_TORCH_VERSION;
}
