// emu_ops.cpp -- the CUDA ops of csrc/cuda/entry_points.cuh (and through it every kernels header), compiled
// by the host compiler under the CPU emulation layer (cuda_emu.h), registered as torch.ops.dppo_cuda_emu.*: the
// five ops of torch.ops.dppo (the same schemas, op_schemas.h; CPU tensors in and out) plus the emulator's
// controls. This translation unit also holds the emulator's engine (cuda_emu_engine.h). A test tool, built by
// python_tests/cuda_emu/emu_build.py; never part of the wheel.
//
// The op bodies are entry_points.cuh's, the ones cuda/dppo_loss.cu and cuda/vocab_parallel.cu register: the
// same input preparation (op_operands.h), dispatch, launch policy (DPPO_CUDA_SPLIT included) and parameter
// packing. Only the Device differs: no device check or guard, the emulator's SM count, its current stream.
#include "cuda_emu.h"  // first: the kernels headers compile against it

#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <utility>
#include <vector>

#include "../op_schemas.h"  // <csrc>/cuda/../ through -I <csrc>/cuda: the schemas of ops.cpp
#include "cuda_emu_engine.h"
#include "entry_points.cuh"  // -I <csrc>/cuda of the tree under test (the repo's, or a mutant)

namespace dppo_cuda_emu {

// entry_points.cuh's Device for the emulator: tensors live on the CPU, device 0 has the configured SM count.
struct EmuDevice {
  static void require(const at::Tensor&, const char*) {}
  explicit EmuDevice(const at::Tensor&) {}
  int sm_count() const { return dppo::sm_count(0); }
  cudaStream_t stream() const { return cuda_emu::current_stream(); }
};

// An op of entry_points.cuh for the emulator: a misuse the emulator found in a kernel (cuda_emu::Error, which
// names the kernel's block and grid) surfaces as a RuntimeError.
template <auto kEntry>
struct Guarded;

template <typename R, typename... A, R (*kEntry)(A...)>
struct Guarded<kEntry> {
  static R run(A... args) {
    try {
      return kEntry(std::forward<A>(args)...);
    } catch (const cuda_emu::Error& e) {
      TORCH_CHECK(false, "CUDA emulator: ", e.what());
    }
  }
};

void configure(c10::string_view mode, int64_t sm_count, int64_t seed, double timeout_s) {
  TORCH_CHECK_VALUE(mode == "fiber" || mode == "thread", "mode must be 'fiber' or 'thread', got '", mode, "'");
  TORCH_CHECK_VALUE(sm_count >= 1 && sm_count <= 1024, "sm_count must be in [1, 1024], got ", sm_count);
  TORCH_CHECK_VALUE(timeout_s > 0, "timeout_s must be > 0, got ", timeout_s);
  cuda_emu::Config& c = cuda_emu::config();
  c.mode = mode == "fiber" ? cuda_emu::Mode::kFiber : cuda_emu::Mode::kThread;
  c.sm_count = static_cast<int>(sm_count);
  c.seed = static_cast<uint64_t>(seed);
  c.timeout_s = timeout_s;
}

// [launches, blocks, threads, shared variables found, shared bytes poisoned] since the last reset.
std::vector<int64_t> stats(bool reset) {
  const cuda_emu::Stats s = cuda_emu::stats();
  if (reset) cuda_emu::stats() = cuda_emu::Stats{};
  return {s.launches, s.blocks, s.threads, s.shared_vars, s.shared_bytes_poisoned};
}

// The global-memory traffic of every launch since the last reset, as JSON (cuda_emu_traffic.h); the traffic
// build only.
std::string traffic(bool reset) {
#ifdef CUDA_EMU_TRAFFIC
  return cuda_emu::traffic::report(reset);
#else
  (void)reset;
  TORCH_CHECK(false, "traffic() needs the traffic build of the emulator (emu_build.py --variant traffic)");
#endif
}

// The demangled names of the kernels' __shared__ variables the emulator poisons before every block; fails when the
// kernels' namespace holds a function-local static that is not __shared__ (emu_build.load calls it at once, so such a
// static stops the emulator's load with the engine's message).
std::vector<std::string> shared_vars() {
  try {
    return cuda_emu::shared_var_names();
  } catch (const cuda_emu::Error& e) {
    TORCH_CHECK(false, "CUDA emulator: ", e.what());
  }
}

// The blocks per SM of launch_policy.cuh's register caps, as the kernels' __launch_bounds__ name them: the
// one-block forward (fp32, bf16, fp16, fp64; each without and with the entropy), then the streaming kernels (fp32,
// bf16, fp16, fp64).
std::vector<int64_t> min_blocks() {
  using c10::BFloat16;
  using c10::Half;
  using dppo::kForwardMinBlocks;
  using dppo::kStreamMinBlocks;
  return {kForwardMinBlocks<float, false>,   kForwardMinBlocks<float, true>,  kForwardMinBlocks<BFloat16, false>,
          kForwardMinBlocks<BFloat16, true>, kForwardMinBlocks<Half, false>,  kForwardMinBlocks<Half, true>,
          kForwardMinBlocks<double, false>,  kForwardMinBlocks<double, true>, kStreamMinBlocks<float>,
          kStreamMinBlocks<BFloat16>,        kStreamMinBlocks<Half>,          kStreamMinBlocks<double>};
}

std::string sanitizer() {
#if defined(CUDA_EMU_TRAFFIC)
  return "traffic";
#elif defined(__SANITIZE_ADDRESS__)
  return "address";
#elif defined(__SANITIZE_THREAD__)
  return "thread";
#else
  return "none";
#endif
}

}  // namespace dppo_cuda_emu

TORCH_LIBRARY(dppo_cuda_emu, m) {
  using dppo_cuda_emu::EmuDevice;
  m.def(dppo::schema::kLossForward);
  m.def(dppo::schema::kLossBackward);
  m.def(dppo::schema::kLossBackwardInplace);
  m.def(dppo::schema::kVocabParallelStats);
  m.def(dppo::schema::kVocabParallelEpilogue);
  m.def("configure(str mode, int sm_count, int seed, float timeout_s) -> ()");
  m.def("stats(bool reset) -> int[]");
  m.def("sanitizer() -> str");
  m.def("shared_vars() -> str[]");
  m.def("min_blocks() -> int[]");
  m.def("traffic(bool reset) -> str");
  using dppo::op_impl;
  m.impl("dppo_loss_forward", c10::DispatchKey::CPU,
         &dppo_cuda_emu::Guarded<op_impl<dppo::LossForwardOp>(&dppo::dppo_loss_forward_entry<EmuDevice>)>::run);
  m.impl("dppo_loss_backward", c10::DispatchKey::CPU,
         &dppo_cuda_emu::Guarded<op_impl<dppo::LossBackwardOp>(&dppo::dppo_loss_backward_entry<EmuDevice>)>::run);
  m.impl("dppo_loss_backward_", c10::DispatchKey::CPU,
         &dppo_cuda_emu::Guarded<op_impl<dppo::LossBackwardInplaceOp>(
             &dppo::dppo_loss_backward_inplace_entry<EmuDevice>)>::run);
  m.impl("dppo_vocab_parallel_stats", c10::DispatchKey::CPU,
         &dppo_cuda_emu::Guarded<op_impl<dppo::VocabParallelStatsOp>(
             &dppo::dppo_vocab_parallel_stats_entry<EmuDevice>)>::run);
  m.impl("dppo_vocab_parallel_epilogue", c10::DispatchKey::CPU,
         &dppo_cuda_emu::Guarded<op_impl<dppo::VocabParallelEpilogueOp>(
             &dppo::dppo_vocab_parallel_epilogue_entry<EmuDevice>)>::run);
  m.impl("configure", &dppo_cuda_emu::configure);
  m.impl("stats", &dppo_cuda_emu::stats);
  m.impl("sanitizer", &dppo_cuda_emu::sanitizer);
  m.impl("shared_vars", &dppo_cuda_emu::shared_vars);
  m.impl("min_blocks", &dppo_cuda_emu::min_blocks);
  m.impl("traffic", &dppo_cuda_emu::traffic);
}
