// cuda/vocab_parallel.cu -- TORCH_LIBRARY_IMPL(dppo, CUDA) of the vocabulary-parallel ops. The kernels are
// vocab_parallel_kernels.cuh (the row math csrc/vocab_parallel_math.h), the op bodies entry_points.cuh's, which the
// CPU emulator of the test suite runs too; this file only binds them to a real GPU (cuda_device.cuh). A file of
// its own so that nvcc compiles the two kernel families in parallel.
#include <torch/library.h>

#include "cuda_device.cuh"
#include "entry_points.cuh"

namespace dppo {

TORCH_LIBRARY_IMPL(dppo, CUDA, m) {
  m.impl("dppo_vocab_parallel_stats", op_impl<VocabParallelStatsOp>(&dppo_vocab_parallel_stats_entry<CudaDevice>));
  m.impl("dppo_vocab_parallel_epilogue",
         op_impl<VocabParallelEpilogueOp>(&dppo_vocab_parallel_epilogue_entry<CudaDevice>));
}

}  // namespace dppo
