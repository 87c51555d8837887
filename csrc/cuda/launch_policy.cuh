// cuda/launch_policy.cuh -- how every CUDA kernel of the extension is launched: threads per block (also
// each kernel's __launch_bounds__), the blocks per row of the split-vocabulary forward and of the backward,
// and the DPPO_CUDA_SPLIT override. Shared by the kernels (dppo_loss_forward_kernels.cuh,
// dppo_loss_backward_kernels.cuh, vocab_parallel_kernels.cuh), the entry points that launch them
// (entry_points.cuh) and so by the CPU emulator of the test suite, which compiles all of them unchanged.
//
//   kernel                               block                 grid
//   dppo_loss_forward_kernel             kThreads              (N)                 splits == 1, no kept set
//   dppo_loss_forward_partial_kernel     kThreads              (N, S)              splits S > 1
//   dppo_loss_forward_finish_kernel      kFinishThreads        (N)                 after the partial kernel
//   dppo_loss_backward_kernel            kThreads              (N, S)
//   dppo_loss_backward_kept_kernel       kThreads              (N)                 sampling replay
//   vp_stats_kernel                      kVpThreads            (N)
//   vp_epilogue_kernel                   kVpEpilogueThreads    (ceil(N / kVpEpilogueThreads))
// S = forward_splits() / backward_splits(): 1 once N fills the GPU (4 / 8 blocks per SM), else enough
// blocks per row to get there, each with at least two vectors per thread. With a kept set (sampling replay) the
// forward takes the partial and finishing kernels even at S = 1.
//
//   kernel                               __launch_bounds__ (threads, blocks per SM)
//   dppo_loss_forward_kernel             kThreads, (kForwardMinBlocks<scalar_t, kEntropy>)
//   dppo_loss_forward_partial_kernel     kThreads, kStreamMinBlocks<scalar_t>
//   dppo_loss_forward_finish_kernel      kFinishThreads, 1
//   dppo_loss_backward_kernel            kThreads, kStreamMinBlocks<scalar_t>
//   dppo_loss_backward_kept_kernel       kThreads
//   vp_stats_kernel                      kVpThreads
//   vp_epilogue_kernel                   kVpEpilogueThreads, 1
// (python_tests/cuda_emu/test_cuda_emu.py holds each kernel's __launch_bounds__ to this table and the blocks per SM
// below to their numbers: the emulator defines __launch_bounds__ away, and only ptxas would see a swapped cap.)
#pragma once

#include <c10/core/Device.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdlib>
#include <type_traits>

namespace dppo {
namespace {

constexpr int kThreads = 256;            // threads per row block (forward, split forward, backward)
constexpr int kFinishThreads = 128;      // threads per row in the split-vocabulary finishing kernel
constexpr int kUnroll = 4;               // 16-byte vectors in flight per thread per loop round
constexpr int kVpThreads = 256;          // threads per row of the vocabulary-parallel statistics
constexpr int kVpEpilogueThreads = 128;  // rows (one per thread) per block of the vocabulary-parallel epilogue

// Blocks per SM each kernel asks ptxas to fit (the second argument of its __launch_bounds__, so a register cap
// of 65536 / (threads x blocks)), chosen so that no kernel spills (ptxas -v of nvcc 13.0, sm_80 and sm_90)
// while the streaming kernels keep enough 16-byte loads in flight. Each resident 256-thread block has
// 4 x 256 x 16 B = 16 KB of loads issued per round; an estimate, not a measurement: at the H200's rated 4.8 TB/s
// and ~1 us to HBM, Little's law asks for ~4.8 MB in flight, ~36 KB per SM (gpu_check.sh's bandwidth step
// measures the real figure).
//  - one-block-per-row forward: 4 blocks (64 registers) without the entropy; 3 (85) with it, which at 64
//    registers spilled 8 (fp16, bf16) and 16 (fp32) bytes; 3 x 16 KB = 48 KB per SM;
//  - the split forward's partial kernel and the backward: 4 blocks (64 registers, no spill in any dtype);
//  - fp64 (gradcheck only): 1, no cap (the fp64 backward spilled 112 bytes at 64);
//  - the finishing and the vocabulary-parallel epilogue kernels: 1 (a few loads per row; ptxas' own choice
//    for a bare __launch_bounds__(128) was 48 registers with a 24-byte spill).
template <typename scalar_t, bool kEntropy>
constexpr int kForwardMinBlocks = std::is_same_v<scalar_t, double> ? 1 : (kEntropy ? 3 : 4);
template <typename scalar_t>
constexpr int kStreamMinBlocks = std::is_same_v<scalar_t, double> ? 1 : 4;

// Blocks per SM the launch policy aims for when it splits rows: forward, backward.
constexpr int64_t kForwardBlocksPerSm = 4;
constexpr int64_t kBackwardBlocksPerSm = 8;

inline int sm_count(c10::DeviceIndex device) {
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

// How many blocks share one row so that about `target_blocks` blocks run, each with at least two
// vectors per thread of work; 1 = no split. At most 65535 (grid.y).
inline int64_t split_count(int64_t n, int64_t v, int64_t vec, int64_t target_blocks) {
  if (n >= target_blocks) return 1;
  const int64_t by_work = v / (vec * kThreads * 2);
  const int64_t wanted = (target_blocks + n - 1) / n;
  int64_t s = wanted < by_work ? wanted : by_work;
  if (s > 65535) s = 65535;
  return s < 1 ? 1 : s;
}

// DPPO_CUDA_SPLIT=S forces S blocks per row in the forward and the backward (1 = the one-block-per-
// row forward; S may exceed the row's vectors, leaving some blocks without work). For the tests and
// scripts/gpu_check.sh: on a real GPU the split path is otherwise never taken once N >= 4 x SMs.
// 0 when unset or empty.
inline int64_t split_override() {
  const char* env = std::getenv("DPPO_CUDA_SPLIT");
  if (env == nullptr || *env == '\0') return 0;
  char* end = nullptr;
  const long long s = std::strtoll(env, &end, 10);
  TORCH_CHECK_VALUE(*end == '\0' && s >= 1 && s <= 65535,
                    "DPPO_CUDA_SPLIT must be an integer in [1, 65535] (blocks per row), got '", env, "'");
  return s;
}

inline int64_t choose_split(int64_t n, int64_t v, int64_t vec, int64_t target_blocks) {
  const int64_t forced = split_override();
  return forced > 0 ? forced : split_count(n, v, vec, target_blocks);
}

// Blocks per row of the forward and of the backward for N rows of V elements in 16-byte vectors of `vec`.
inline int64_t forward_splits(int64_t n, int64_t v, int64_t vec, int sms) {
  return choose_split(n, v, vec, kForwardBlocksPerSm * sms);
}
inline int64_t backward_splits(int64_t n, int64_t v, int64_t vec, int sms) {
  return choose_split(n, v, vec, kBackwardBlocksPerSm * sms);
}

}  // namespace
}  // namespace dppo
