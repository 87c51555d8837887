// cuda_emu_traffic.h -- the emulator's global-memory traffic counter (the "traffic" build of emu_build.py,
// which defines CUDA_EMU_TRAFFIC). Included by exactly one translation unit (emu_ops.cpp), after the engine.
//
// How it sees every access: that build compiles the translation unit with GCC's -fsanitize=kernel-address in
// its outline form (asan-instrumentation-with-call-threshold=0, no stack or global instrumentation), which
// turns each load and store of instrumented code into a call __asan_{load,store}{1,2,4,8,16,N}_noabort(addr)
// and links no sanitizer runtime: the definitions below are those hooks. While a kernel launch runs, an access
// is global memory when its address lies in a block of the CPU allocator (every tensor, installed at load
// time: TrackingAllocator); fiber stacks, __shared__ variables and the emulator's own buffers are not. For each
// launch it records, per allocation touched, the bytes loaded and stored (every access) and the distinct bytes
// loaded and stored (a bitmap per allocation): a kernel reading a logit twice shows in the first, the DRAM
// traffic of a GPU with perfect caching in the second. Fiber mode only (one OS thread runs the kernels).
//
// And what a GPU's memory system serves: the 32-byte sectors of each warp-wide request. Lanes run one after the
// other here, so a request is rebuilt as the n-th execution of one access (its instruction: the hook's return
// address) by the lanes of one warp of a block, as the warp executes it in lockstep on a GPU; its sectors are the
// distinct 32-byte sectors its lanes touch. A coalesced load of 32 consecutive floats is 4 sectors; the same bytes
// read by lanes 64 bytes apart are 32 sectors, which the byte counts alone do not show.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <sstream>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace cuda_emu::traffic {

#define CUDA_EMU_NO_INSTRUMENT __attribute__((no_sanitize("kernel-address"), noinline))

struct Buffer {
  uintptr_t base = 0;
  size_t size = 0;
  int64_t load = 0, store = 0;                    // bytes, every access
  int64_t load_requests = 0, store_requests = 0;  // warp-wide requests
  int64_t load_sectors = 0, store_sectors = 0;    // 32-byte sectors, summed over the requests
  std::vector<uint8_t> load_bits, store_bits;     // one bit per byte: which bytes were touched
};

struct Launch {
  std::string kernel;
  dim3 grid, block;
  std::map<uintptr_t, Buffer> buffers;  // by allocation base
};

// One warp-wide request being rebuilt: (instruction, warp, n-th execution) -> its buffer and sectors.
struct Request {
  Buffer* buffer;
  bool is_store;
  std::vector<uintptr_t> sectors;  // distinct, address / 32
};

struct State {
  std::map<uintptr_t, size_t> allocations;  // live CPU-allocator blocks: base -> size
  std::vector<Launch> launches;
  // The running block's requests (flushed into their buffers' counts at the next block and at the launch's end).
  std::unordered_map<uint64_t, uint32_t> executions;  // (instruction, thread) -> accesses so far
  std::map<std::tuple<uintptr_t, unsigned, uint32_t>, Request> requests;
};

inline State& state() {
  static State s;
  return s;
}

// Plain globals (constant-initialized, read first by every hook): the running launch, or none, and whether a
// hook is already running (the hooks' own helpers, and State's construction, may be instrumented).
inline Launch* g_current = nullptr;
inline bool g_busy = false;

CUDA_EMU_NO_INSTRUMENT inline void set_bits(std::vector<uint8_t>& bits, size_t off, size_t n) {
  for (size_t b = off; b < off + n; ++b) bits[b >> 3] |= static_cast<uint8_t>(1u << (b & 7));
}

CUDA_EMU_NO_INSTRUMENT inline void add_request(State& st, Buffer& b, uintptr_t addr, size_t n, bool is_store,
                                               uintptr_t pc) {
  const unsigned tid = threadIdx.x;
  const uint32_t nth = st.executions[(static_cast<uint64_t>(pc) << 11) | tid]++;
  Request& r = st.requests.try_emplace(std::make_tuple(pc, tid / 32, nth), Request{&b, is_store, {}}).first->second;
  for (uintptr_t s = addr / 32; s <= (addr + n - 1) / 32; ++s) {
    if (std::find(r.sectors.begin(), r.sectors.end(), s) == r.sectors.end()) r.sectors.push_back(s);
  }
}

CUDA_EMU_NO_INSTRUMENT inline void flush_requests() {
  State& st = state();
  for (auto& [key, r] : st.requests) {
    (r.is_store ? r.buffer->store_requests : r.buffer->load_requests) += 1;
    (r.is_store ? r.buffer->store_sectors : r.buffer->load_sectors) += static_cast<int64_t>(r.sectors.size());
  }
  st.requests.clear();
  st.executions.clear();
}

CUDA_EMU_NO_INSTRUMENT inline void record(uintptr_t addr, size_t n, bool is_store, uintptr_t pc) {
  State& st = state();
  auto it = st.allocations.upper_bound(addr);
  if (it == st.allocations.begin()) return;
  --it;
  if (addr + n > it->first + it->second) return;  // not (wholly) inside an allocation: not global memory
  Buffer& b = g_current->buffers[it->first];
  if (b.size == 0) {
    b.base = it->first;
    b.size = it->second;
    b.load_bits.assign((b.size + 7) / 8, 0);
    b.store_bits.assign((b.size + 7) / 8, 0);
  }
  add_request(st, b, addr, n, is_store, pc);
  const size_t off = addr - b.base;
  if (is_store) {
    b.store += static_cast<int64_t>(n);
    set_bits(b.store_bits, off, n);
  } else {
    b.load += static_cast<int64_t>(n);
    set_bits(b.load_bits, off, n);
  }
}

CUDA_EMU_NO_INSTRUMENT inline void access(uintptr_t addr, size_t n, bool is_store, void* pc) {
  if (g_current == nullptr || g_busy) return;
  g_busy = true;
  record(addr, n, is_store, reinterpret_cast<uintptr_t>(pc));
  g_busy = false;
}

// The CPU allocator every tensor comes from, wrapped so that its live blocks are known.
class TrackingAllocator final : public c10::Allocator {
 public:
  explicit TrackingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    void* p = inner.get();
    const c10::Device device = inner.device();
    if (p != nullptr) {
      const bool was = g_busy;
      g_busy = true;
      state().allocations[reinterpret_cast<uintptr_t>(p)] = n;
      g_busy = was;
    }
    return {p, new c10::DataPtr(std::move(inner)), &release, device};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

 private:
  static void release(void* ctx) {
    auto* inner = static_cast<c10::DataPtr*>(ctx);
    const bool was = g_busy;
    g_busy = true;
    state().allocations.erase(reinterpret_cast<uintptr_t>(inner->get()));
    g_busy = was;
    delete inner;
  }
  c10::Allocator* base_;
};

// Installed when the library loads, before the tests create their tensors.
inline const bool kInstalled = [] {
  static TrackingAllocator alloc(c10::GetCPUAllocator());
  c10::SetCPUAllocator(&alloc, /*priority=*/100);
  return true;
}();

inline void begin(const std::string& kernel, dim3 grid, dim3 block) {
  State& st = state();
  st.launches.push_back(Launch{kernel, grid, block, {}});
  g_current = &st.launches.back();
}

// Before each block of the running launch: the previous block's requests are complete.
inline void begin_block() {
  g_busy = true;
  flush_requests();
  g_busy = false;
}

inline void end() {
  begin_block();
  g_current = nullptr;
}

inline int64_t popcount(const std::vector<uint8_t>& bits) {
  int64_t n = 0;
  for (uint8_t b : bits) n += __builtin_popcount(b);
  return n;
}

// Every launch since the last reset, as JSON: [{"kernel", "grid": [x, y], "block", "buffers": [{"base",
// "size", "load", "store", "load_unique", "store_unique", "load_requests", "store_requests", "load_sectors",
// "store_sectors"}]}].
inline std::string report(bool reset) {
  State& st = state();
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < st.launches.size(); ++i) {
    const Launch& l = st.launches[i];
    os << (i ? ", " : "") << "{\"kernel\": \"" << l.kernel << "\", \"grid\": [" << l.grid.x << ", " << l.grid.y
       << "], \"block\": " << l.block.x << ", \"buffers\": [";
    size_t j = 0;
    for (const auto& [base, b] : l.buffers) {
      os << (j++ ? ", " : "") << "{\"base\": " << base << ", \"size\": " << b.size << ", \"load\": " << b.load
         << ", \"store\": " << b.store << ", \"load_unique\": " << popcount(b.load_bits)
         << ", \"store_unique\": " << popcount(b.store_bits) << ", \"load_requests\": " << b.load_requests
         << ", \"store_requests\": " << b.store_requests << ", \"load_sectors\": " << b.load_sectors
         << ", \"store_sectors\": " << b.store_sectors << "}";
    }
    os << "]}";
  }
  os << "]";
  if (reset) st.launches.clear();
  return os.str();
}

}  // namespace cuda_emu::traffic

// The hooks -fsanitize=kernel-address calls for every load and store of the instrumented code.
#define CUDA_EMU_HOOK(kind, is_store, n)                                              \
  extern "C" CUDA_EMU_NO_INSTRUMENT void __asan_##kind##n##_noabort(uintptr_t addr) { \
    cuda_emu::traffic::access(addr, n, is_store, __builtin_return_address(0));        \
  }
CUDA_EMU_HOOK(load, false, 1)
CUDA_EMU_HOOK(load, false, 2)
CUDA_EMU_HOOK(load, false, 4)
CUDA_EMU_HOOK(load, false, 8)
CUDA_EMU_HOOK(load, false, 16)
CUDA_EMU_HOOK(store, true, 1)
CUDA_EMU_HOOK(store, true, 2)
CUDA_EMU_HOOK(store, true, 4)
CUDA_EMU_HOOK(store, true, 8)
CUDA_EMU_HOOK(store, true, 16)
#undef CUDA_EMU_HOOK
extern "C" CUDA_EMU_NO_INSTRUMENT void __asan_loadN_noabort(uintptr_t addr, size_t n) {
  cuda_emu::traffic::access(addr, n, false, __builtin_return_address(0));
}
extern "C" CUDA_EMU_NO_INSTRUMENT void __asan_storeN_noabort(uintptr_t addr, size_t n) {
  cuda_emu::traffic::access(addr, n, true, __builtin_return_address(0));
}
// The rest of what the instrumented code calls: nothing to do without a sanitizer runtime.
extern "C" CUDA_EMU_NO_INSTRUMENT void __asan_handle_no_return() {}
extern "C" CUDA_EMU_NO_INSTRUMENT void __asan_before_dynamic_init(const char*) {}
extern "C" CUDA_EMU_NO_INSTRUMENT void __asan_after_dynamic_init() {}
