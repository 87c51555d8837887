// cuda/dppo_loss.cu -- TORCH_LIBRARY_IMPL(dppo, CUDA) of the DPPO loss ops. The kernels are
// dppo_loss_forward_kernels.cuh / dppo_loss_backward_kernels.cuh, their launch policy launch_policy.cuh, and
// the op bodies (validation, dispatch, launch) entry_points.cuh's, which the CPU emulator of the test suite
// runs too; this file only binds them to a real GPU (cuda_device.cuh).
#include <torch/library.h>

#include "cuda_device.cuh"
#include "entry_points.cuh"

namespace dppo {

TORCH_LIBRARY_IMPL(dppo, CUDA, m) {
  m.impl("dppo_loss_forward", op_impl<LossForwardOp>(&dppo_loss_forward_entry<CudaDevice>));
  m.impl("dppo_loss_backward", op_impl<LossBackwardOp>(&dppo_loss_backward_entry<CudaDevice>));
  m.impl("dppo_loss_backward_", op_impl<LossBackwardInplaceOp>(&dppo_loss_backward_inplace_entry<CudaDevice>));
}

}  // namespace dppo
