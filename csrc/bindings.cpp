// bindings.cpp -- the small pybind11 `_C` module: build information only. Importing it loads the
// shared library, whose static initialisers register every op (ops.cpp, cpu/, cuda/) with the
// dispatcher; the ops themselves are reached as torch.ops.dppo.*, never through pybind11.
// It also reports the CPU instruction set the CPU ops run with (cpu/dispatch.h), chosen at import,
// and the CPU backward's buffer cache (cpu/buffer_cache.h): whether it is on, the bytes it holds for
// reuse, and a call that frees them.
#include <torch/extension.h>

#include "cpu/buffer_cache.h"
#include "cpu/dispatch.h"

#ifndef DPPO_VERSION
#define DPPO_VERSION "0.0.0"
#endif
#ifndef DPPO_TORCH_VERSION
#define DPPO_TORCH_VERSION "unknown"
#endif
#ifndef DPPO_CUDA_ARCH_LIST
#define DPPO_CUDA_ARCH_LIST ""
#endif
// The torch this library was compiled against, also as a marker in the file itself, so that
// dppo_ext/_native.py can name it even when the library cannot be loaded at all (a build against
// another torch usually fails on an undefined symbol or a missing libc10_cuda.so).
__attribute__((used)) static const char kBuildTorchMarker[] = "dppo_ext-built-with-torch=" DPPO_TORCH_VERSION;

PYBIND11_MODULE(_C, m) {
  m.doc() = "dppo_ext native library (ops are registered under torch.ops.dppo)";
  m.attr("__version__") = DPPO_VERSION;
#ifdef DPPO_WITH_CUDA
  m.attr("cuda_compiled") = true;
#else
  m.attr("cuda_compiled") = false;
#endif
  m.attr("cuda_arch_list") = DPPO_CUDA_ARCH_LIST;
  m.attr("cpu_capability") = dppo::cpu_capability();  // throws (ImportError) on a bad DPPO_CPU_CAPABILITY
  m.attr("cpu_capabilities") = dppo::cpu_capabilities_compiled();
  m.attr("torch_version") = DPPO_TORCH_VERSION;
  // throws (ImportError) on a value of DPPO_CPU_BUFFER_CACHE or DPPO_CPU_HUGEPAGES that is not a boolean
  m.attr("cpu_buffer_cache") = dppo::cache_enabled();
  m.def("cpu_cached_bytes", &dppo::cached_free_bytes,
        "Bytes of freed CPU gradient buffers the library keeps resident for reuse (cpu/buffer_cache.h)");
  m.def("cpu_empty_cache", &dppo::empty_cache,
        "Return every freed CPU gradient buffer the library keeps for reuse to the allocator; the bytes released");
}
