// cuda/cuda_device.cuh -- the Device of entry_points.cuh on a real GPU (the CPU emulator of the test suite has
// its own): the CUDA-tensor check, a device guard for the op's lifetime, the current stream, the SM count.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "launch_policy.cuh"

namespace dppo {

struct CudaDevice {
  static void require(const at::Tensor& t, const char* name) {
    TORCH_CHECK_VALUE(t.is_cuda(), name, " must be a CUDA tensor for the CUDA kernel, got ", t.device());
  }
  explicit CudaDevice(const at::Tensor& t) : guard_(t.device()) {}
  int sm_count() const { return dppo::sm_count(guard_.current_device().index()); }
  cudaStream_t stream() const { return c10::cuda::getCurrentCUDAStream(); }

 private:
  c10::cuda::CUDAGuard guard_;
};

}  // namespace dppo
