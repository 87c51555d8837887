// cuda_emu.h -- a small CUDA emulation layer that runs the project's kernels
// (csrc/cuda/*.cuh, unchanged, from the op bodies of entry_points.cuh down) on the CPU, for the test
// suite only.
//
// What it provides: the CUDA keywords, threadIdx / blockIdx / blockDim / gridDim, dim3 / uint3 /
// uint4 (16-byte aligned), __syncthreads, __shfl_xor_sync, __ldg / __ldcs / __stcs, __fmul_rn /
// __dmul_rn (one rounding, never fused into an FMA, also in the contracting build), cudaDeviceGetAttribute with
// a settable SM count, and cuda_emu::launch, which launch_kernel (csrc/cuda/launch.cuh) calls.
//
// A launch runs its blocks one after another in a shuffled order; every CUDA thread of a block is
// either a fiber (ucontext, all on the calling thread: deterministic and fast) or an OS thread
// (what ThreadSanitizer can see). Before each block the kernels' __shared__ variables are filled
// with 0xff bytes (NaN), so a read of shared memory this block never wrote shows in the results.
// Misuse is an error, not a silent pass: __syncthreads is a barrier over the block's live threads
// (exited threads drop out) and every thread must arrive from the same call site; a shuffle's mask
// must name exactly the live lanes of the warp, and the calling lane; 16-byte loads and stores
// must be 16-byte aligned (x86 would not fault); a deadlock is reported (fibers: at once;
// threads: after a timeout); every launch names the op's current stream (current_stream()); a function-local
// static of the kernels' namespace that is not __shared__ is refused. The first error of a launch is thrown from
// launch() as cuda_emu::Error (the op turns it into a RuntimeError).
//
// Checks logic, not --use_fast_math accuracy: the emulated math is the host libm's.
#pragma once

#define DPPO_CUDA_EMU 1

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <source_location>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

// ---- keywords ---------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// Function-scope __shared__ variables are static in CUDA too; blocks run one at a time here. Each one comes with a
// marker static of its own beside it in the same function (kept by `used`), so the engine tells shared memory from
// every other function-local static of the kernels' namespace, which it refuses (cuda_emu_engine.h).
namespace cuda_emu {
struct SharedMark {
  char unused;
};
}  // namespace cuda_emu
#define CUDA_EMU_CAT2(a, b) a##b
#define CUDA_EMU_CAT(a, b) CUDA_EMU_CAT2(a, b)
#define __shared__                                                                                               \
  [[gnu::used]] [[maybe_unused]] static ::cuda_emu::SharedMark CUDA_EMU_CAT(cuda_emu_shared_mark_, __COUNTER__); \
  static

// ---- types and built-in variables -------------------------------------------------------------
struct uint3 {
  unsigned x, y, z;
};

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};

struct alignas(16) uint4 {
  unsigned x, y, z, w;
};

inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

// Set by the scheduler for the CUDA thread that runs (per OS thread; fibers share theirs).
inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

// ---- runtime API subset -----------------------------------------------------------------------
struct CUstream_st {
  int id;
};
using cudaStream_t = CUstream_st*;

enum cudaError_t : int { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorInvalidDevice = 101 };
enum cudaDeviceAttr : int { cudaDevAttrMultiProcessorCount = 16 };

inline const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    default:
      return "invalid argument";
  }
}

namespace cuda_emu {

// Thrown for every misuse the emulator detects; launch() rethrows the first one of a launch.
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

enum class Mode { kFiber, kThread };

struct Config {
  Mode mode = Mode::kFiber;
  int sm_count = 132;       // what cudaDeviceGetAttribute(MultiProcessorCount) reports
  uint64_t seed = 0;        // block-order shuffle seed (mixed with a per-launch counter)
  double timeout_s = 20.0;  // thread mode: a barrier waiting longer is reported as a deadlock
};

Config& config();

// Counters the tests read to see that the emulator did run what they think it ran.
struct Stats {
  int64_t launches = 0, blocks = 0, threads = 0, shared_vars = 0, shared_bytes_poisoned = 0;
};
Stats& stats();

// The demangled names of the kernels' __shared__ variables (poisoned before every block); throws Error when the
// kernels' namespace holds a function-local static that is not __shared__.
std::vector<std::string> shared_var_names();

// The CUDA thread that is running (fiber or OS thread): barriers and shuffles go through it.
struct ThreadCtx {
  virtual ~ThreadCtx() = default;
  virtual void sync_block(const std::source_location& site) = 0;
  // Warp-level rendezvous of the lanes in `mask` (the caller is one of them).
  virtual void sync_warp(unsigned mask, const std::source_location& site, const char* what) = 0;
  // The [32][8]-byte exchange buffer of the calling lane's warp for its next shuffle. Two buffers
  // alternate, so one rendezvous per shuffle suffices: a lane writes a buffer again only two
  // shuffles later, after a rendezvous that every lane reaches only once it has read it.
  virtual unsigned char* next_exchange() = 0;
};
ThreadCtx* current();

[[noreturn]] void fail(const std::string& msg);

// The emulated device's current stream: what the ops' Device hands their launches (emu_ops.cpp), a stream of its own,
// not the default stream (nullptr), and the only stream a launch may name. A kernel launched on any other stream runs
// unordered with the op's other kernels and with the caller's work on the current stream.
inline cudaStream_t current_stream() {
  static CUstream_st stream{1};
  return &stream;
}

// Runs body() once per CUDA thread of the grid; throws Error on the first detected misuse (a launch on a stream other
// than current_stream() among them). kernel: the kernel's address, for its name in messages and the traffic build's
// per-launch records.
void run_grid(const void* kernel, dim3 grid, dim3 block, cudaStream_t stream, void (*body)(void*), void* arg);

template <typename... P>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, cudaStream_t stream, P... args) {
  struct Call {
    void (*kernel)(P...);
    std::tuple<P...> args;
  } call{kernel, std::tuple<P...>(args...)};
  run_grid(
      reinterpret_cast<const void*>(kernel), grid, block, stream,
      [](void* c) {
        auto* call = static_cast<Call*>(c);
        std::apply(call->kernel, call->args);  // each CUDA thread gets its own copy of the arguments
      },
      &call);
}

inline void check_aligned16(const void* p, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) {
    fail(std::string(what) + ": 16-byte access at address " + std::to_string(reinterpret_cast<uintptr_t>(p)) +
         " is not 16-byte aligned (a misaligned-address fault on a GPU)");
  }
}

}  // namespace cuda_emu

inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  if (attr != cudaDevAttrMultiProcessorCount) return cudaErrorInvalidValue;
  *value = cuda_emu::config().sm_count;
  return cudaSuccess;
}

// ---- intrinsics -------------------------------------------------------------------------------
inline void __syncthreads(const std::source_location site = std::source_location::current()) {
  cuda_emu::current()->sync_block(site);
}

// Butterfly shuffle over the 32 lanes of a warp: lane l gets lane (l ^ lane_mask)'s value.
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32,
                         const std::source_location site = std::source_location::current()) {
  static_assert(sizeof(T) <= 8, "__shfl_xor_sync: at most 8-byte values");
  const unsigned lane = threadIdx.x % 32;
  if (width != 32) cuda_emu::fail("__shfl_xor_sync: only width 32 is emulated");
  if (lane_mask < 0 || lane_mask >= 32) {
    cuda_emu::fail("__shfl_xor_sync: lane mask " + std::to_string(lane_mask) + " outside [0, 32)");
  }
  if (((mask >> lane) & 1u) == 0) {
    char buf[128];
    std::snprintf(buf, sizeof buf, "__shfl_xor_sync: lane %u calls it with mask 0x%08x, which does not include it",
                  lane, mask);
    cuda_emu::fail(buf);
  }
  const unsigned src = lane ^ static_cast<unsigned>(lane_mask);
  if (((mask >> src) & 1u) == 0) {
    char buf[128];
    std::snprintf(buf, sizeof buf, "__shfl_xor_sync: lane %u reads lane %u, which mask 0x%08x leaves out", lane, src,
                  mask);
    cuda_emu::fail(buf);
  }
  cuda_emu::ThreadCtx* t = cuda_emu::current();
  unsigned char* slots = t->next_exchange();
  std::memcpy(slots + 8 * lane, &var, sizeof(T));
  t->sync_warp(mask, site, "__shfl_xor_sync");
  T out;
  std::memcpy(&out, slots + 8 * src, sizeof(T));
  return out;
}

inline uint4 __ldg(const uint4* p) {
  cuda_emu::check_aligned16(p, "__ldg");
  uint4 r;
  std::memcpy(&r, p, sizeof r);
  return r;
}

inline uint4 __ldcs(const uint4* p) {
  cuda_emu::check_aligned16(p, "__ldcs");
  uint4 r;
  std::memcpy(&r, p, sizeof r);
  return r;
}

inline void __stcs(uint4* p, uint4 v) {
  cuda_emu::check_aligned16(p, "__stcs");
  std::memcpy(p, &v, sizeof v);
}

// Round-to-nearest products that the compiler may not fuse into an FMA (-ffp-contract=off).
// The product is rounded on its own, as on the GPU, also in a build that contracts a * b + c into an FMA
// (emu_build.py's plain variant, -ffp-contract=fast as nvcc): the empty asm hides it from the contraction.
inline float __fmul_rn(float a, float b) {
  float r = a * b;
  __asm__("" : "+x"(r));
  return r;
}
inline double __dmul_rn(double a, double b) {
  double r = a * b;
  __asm__("" : "+x"(r));
  return r;
}
