// Stub of c10/cuda/CUDAException.h for the CPU emulator (python_tests/cuda_emu): the two macros the
// kernels use, over the emulated runtime of cuda_emu.h. Found before torch's own header because the
// emulator build puts this folder first on the include path.
#pragma once

#include <c10/util/Exception.h>

#include "../../../cuda_emu.h"

#define C10_CUDA_CHECK(EXPR)                                                                               \
  do {                                                                                                     \
    const cudaError_t dppo_emu_err = (EXPR);                                                               \
    TORCH_CHECK(dppo_emu_err == cudaSuccess, "CUDA error (emulated): ", cudaGetErrorString(dppo_emu_err)); \
  } while (0)

// Launch errors surface from cuda_emu::launch itself.
#define C10_CUDA_KERNEL_LAUNCH_CHECK() \
  do {                                 \
  } while (0)
