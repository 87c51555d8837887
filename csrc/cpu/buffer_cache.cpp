// cpu/buffer_cache.cpp -- empty_cached (see buffer_cache.h): a small cache of resident CPU blocks.
#include "buffer_cache.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#ifdef __linux__
#include <sys/mman.h>
#endif

namespace dppo {
namespace {

constexpr size_t kMinCachedBytes = size_t(1) << 20;  // smaller blocks: malloc's own free lists reuse them
constexpr size_t kMaxCachedBlocks = 2;
constexpr size_t kGranule = size_t(2) << 20;  // capacities are whole 2 MiB units
constexpr int kMaxIdleRequests = 8;           // a freed block that this many requests do not take goes back

// A boolean switch read as PyTorch's build reads its own (tools/setup_helpers/env.py): 1, on, yes, true, y
// enable and 0, off, no, false, n disable, in any case; unset or empty is `fallback`; anything else is an
// error naming the variable, what it holds and what it may hold.
bool env_flag(const char* name, bool fallback) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return fallback;
  std::string value(env);
  std::transform(value.begin(), value.end(), value.begin(), [](unsigned char c) { return std::tolower(c); });
  if (value == "1" || value == "on" || value == "yes" || value == "true" || value == "y") return true;
  if (value == "0" || value == "off" || value == "no" || value == "false" || value == "n") return false;
  // The value quoted: a stray space ("0 ") must show in the message.
  TORCH_CHECK(false, name, "='", env, "' is not a boolean: expected 1, on, yes, true, y (enable) or 0, off, no, ",
              "false, n (disable), in any case, or unset for the default (", fallback ? "on" : "off", ")");
}

bool cache_switch() {
  static const bool enabled = env_flag("DPPO_CPU_BUFFER_CACHE", true);
  return enabled;
}

bool huge_pages_switch() {
  static const bool enabled = env_flag("DPPO_CPU_HUGEPAGES", false);
  return enabled;
}

// DPPO_CPU_HUGEPAGES=1 advises transparent huge pages for a block before its first touch. A new block
// then faults once per 2 MiB instead of once per 4 KiB, but whenever the kernel has to compact memory
// to find 2 MiB pages (THP defrag "madvise", the usual default) a first touch stalls for ~170-360 ms
// (measured on this project's hosts). With blocks reused, only a block's first use faults at all, so
// this stays opt-in.
void advise_huge_pages(void* ptr, size_t nbytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (!huge_pages_switch()) return;
  const auto begin = reinterpret_cast<uintptr_t>(ptr);
  const uintptr_t lo = (begin + kGranule - 1) & ~(kGranule - 1);
  const uintptr_t hi = (begin + nbytes) & ~(kGranule - 1);
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
#else
  (void)ptr;
  (void)nbytes;
#endif
}

struct Block {
  void* ptr;
  size_t capacity;
  int idle = 0;  // requests that passed this freed block over since it was freed
};

class BufferCache {
 public:
  Block acquire(size_t nbytes) {
    std::vector<Block> evicted;
    Block found{nullptr, 0};
    {
      std::lock_guard<std::mutex> lock(mu_);
      size_t best = free_.size();
      for (size_t i = 0; i < free_.size(); ++i) {
        const size_t cap = free_[i].capacity;
        if (cap >= nbytes && cap / 2 <= nbytes && (best == free_.size() || cap < free_[best].capacity)) best = i;
      }
      if (best < free_.size()) {
        found = free_[best];
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(best));
        free_bytes_ -= found.capacity;
      }
      age_locked(evicted);
    }
    for (const Block& e : evicted) c10::free_cpu(e.ptr);
    if (found.ptr != nullptr) {
      found.idle = 0;
      return found;
    }
    // An eighth of headroom: micro-batches whose row counts differ by that much share one block (pages
    // past what a request writes are never touched, so they cost address space only).
    const size_t capacity = (nbytes + nbytes / 8 + kGranule - 1) / kGranule * kGranule;
    void* ptr = c10::alloc_cpu(capacity);
    advise_huge_pages(ptr, capacity);
    return {ptr, capacity};
  }

  // A request too small for the cache (at::empty serves it) passes every freed block over all the same.
  void pass_over() {
    std::vector<Block> evicted;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (free_.empty()) return;
      age_locked(evicted);
    }
    for (const Block& e : evicted) c10::free_cpu(e.ptr);
  }

  void release(Block b) {
    std::vector<Block> evicted;
    {
      std::lock_guard<std::mutex> lock(mu_);
      b.idle = 0;
      free_.push_back(b);
      free_bytes_ += b.capacity;
      while (free_.size() > kMaxCachedBlocks) {
        evicted.push_back(free_.front());
        free_bytes_ -= free_.front().capacity;
        free_.erase(free_.begin());
      }
    }
    for (const Block& e : evicted) c10::free_cpu(e.ptr);
  }

  int64_t empty() {
    std::vector<Block> evicted;
    {
      std::lock_guard<std::mutex> lock(mu_);
      evicted.swap(free_);
      free_bytes_ = 0;
    }
    int64_t bytes = 0;
    for (const Block& e : evicted) {
      bytes += static_cast<int64_t>(e.capacity);
      c10::free_cpu(e.ptr);
    }
    return bytes;
  }

  int64_t free_bytes() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(free_bytes_);
  }

 private:
  // A workload that shrinks must not keep its old large blocks forever: every freed block a request did not
  // take ages, and one passed over kMaxIdleRequests times goes to `evicted` (freed outside the lock).
  void age_locked(std::vector<Block>& evicted) {
    for (size_t i = 0; i < free_.size();) {
      if (++free_[i].idle >= kMaxIdleRequests) {
        evicted.push_back(free_[i]);
        free_bytes_ -= free_[i].capacity;
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        ++i;
      }
    }
  }

  std::mutex mu_;
  std::vector<Block> free_;  // least recently freed first
  size_t free_bytes_ = 0;
};

// Never destroyed: a tensor freed during interpreter shutdown still returns its block safely.
BufferCache& cache() {
  static BufferCache* instance = new BufferCache();
  return *instance;
}

// The DataPtr's context: the block, handed back to the cache when the storage lets go of it.
void release_block(void* ctx) {
  Block* block = static_cast<Block*>(ctx);
  cache().release(*block);
  delete block;
}

}  // namespace

at::Tensor empty_cached(at::IntArrayRef sizes, const at::TensorOptions& options) {
  const size_t nbytes = static_cast<size_t>(c10::multiply_integers(sizes)) * options.dtype().itemsize();
  const at::TensorOptions contiguous = options.memory_format(at::MemoryFormat::Contiguous);
  if (!cache_switch()) return at::empty(sizes, contiguous);
  if (nbytes < kMinCachedBytes) {
    cache().pass_over();
    return at::empty(sizes, contiguous);
  }
  auto block = std::make_unique<Block>(cache().acquire(nbytes));
  c10::DataPtr data(block->ptr, block.get(), &release_block, c10::Device(c10::kCPU));
  block.release();  // owned by `data` now: release_block hands it back
  // Resizable, with the CPU allocator behind it, like at::empty's: a caller's resize_() or
  // untyped_storage().resize_(0) (FSDP/ZeRO free a gradient's memory so) moves the storage onto the
  // allocator and the block goes back to the cache.
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(data), c10::GetCPUAllocator(),
                       /*resizable=*/true);
  return at::empty({0}, contiguous).set_(std::move(storage), 0, sizes, /*stride=*/{});
}

bool cache_enabled() {
  huge_pages_switch();  // an unknown value of either switch is an error here, when the library loads
  return cache_switch();
}

int64_t cached_free_bytes() { return cache().free_bytes(); }

int64_t empty_cache() { return cache().empty(); }

}  // namespace dppo
