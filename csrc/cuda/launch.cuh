// cuda/launch.cuh -- the one place a kernel of csrc/cuda is launched. Under nvcc a triple-chevron
// launch on `stream` (no dynamic shared memory) followed by the launch-error check; under the CPU
// emulator of the test suite (python_tests/cuda_emu/cuda_emu.h, which defines DPPO_CUDA_EMU) a call
// into its grid scheduler. The kernels header launches through this helper only, so the same
// source compiles on both sides without any rewriting.
#pragma once

#include <c10/cuda/CUDAException.h>

namespace dppo {

// launch_kernel(kernel, grid, block, stream, args...): kernel<<<grid, block, 0, stream>>>(args...).
// Each argument is converted to the kernel's parameter type here, as a launch would.
template <typename... Params, typename... Args>
inline void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream, Args&&... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "launch_kernel: wrong number of kernel arguments");
#if defined(DPPO_CUDA_EMU)
  cuda_emu::launch(kernel, grid, block, stream, static_cast<Params>(args)...);
#else
  kernel<<<grid, block, 0, stream>>>(static_cast<Params>(args)...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
#endif
}

}  // namespace dppo
