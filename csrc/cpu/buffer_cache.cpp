// cpu/buffer_cache.cpp -- empty_cached (see buffer_cache.h): a small cache of resident CPU blocks.
#include "buffer_cache.h"

#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/accumulate.h>

#include <cstdint>
#include <cstdlib>
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

bool env_is(const char* name, const char* value) {
  const char* env = std::getenv(name);
  return env != nullptr && std::string(env) == value;
}

// DPPO_CPU_HUGEPAGES=1 advises transparent huge pages for a block before its first touch. A new block
// then faults once per 2 MiB instead of once per 4 KiB, but whenever the kernel has to compact memory
// to find 2 MiB pages (THP defrag "madvise", the usual default) a first touch stalls for ~170-360 ms
// (measured on this project's hosts). With blocks reused, only a block's first use faults at all, so
// this stays opt-in.
void advise_huge_pages(void* ptr, size_t nbytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  static const bool enabled = env_is("DPPO_CPU_HUGEPAGES", "1");
  if (!enabled) return;
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
};

class BufferCache {
 public:
  Block acquire(size_t nbytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      size_t best = free_.size();
      for (size_t i = 0; i < free_.size(); ++i) {
        const size_t cap = free_[i].capacity;
        if (cap >= nbytes && cap / 2 <= nbytes && (best == free_.size() || cap < free_[best].capacity)) best = i;
      }
      if (best < free_.size()) {
        const Block b = free_[best];
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(best));
        free_bytes_ -= b.capacity;
        return b;
      }
    }
    // An eighth of headroom: micro-batches whose row counts differ by that much share one block (pages
    // past what a request writes are never touched, so they cost address space only).
    const size_t capacity = (nbytes + nbytes / 8 + kGranule - 1) / kGranule * kGranule;
    void* ptr = c10::alloc_cpu(capacity);
    advise_huge_pages(ptr, capacity);
    return {ptr, capacity};
  }

  void release(const Block& b) {
    std::vector<Block> evicted;
    {
      std::lock_guard<std::mutex> lock(mu_);
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

  int64_t free_bytes() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(free_bytes_);
  }

 private:
  std::mutex mu_;
  std::vector<Block> free_;  // least recently freed first
  size_t free_bytes_ = 0;
};

// Never destroyed: a tensor freed during interpreter shutdown still returns its block safely.
BufferCache& cache() {
  static BufferCache* instance = new BufferCache();
  return *instance;
}

}  // namespace

at::Tensor empty_cached(at::IntArrayRef sizes, const at::TensorOptions& options) {
  static const bool disabled = env_is("DPPO_CPU_BUFFER_CACHE", "0");
  const size_t nbytes = static_cast<size_t>(c10::multiply_integers(sizes)) * options.dtype().itemsize();
  if (disabled || nbytes < kMinCachedBytes) {
    return at::empty(sizes, options.memory_format(at::MemoryFormat::Contiguous));
  }
  const Block block = cache().acquire(nbytes);
  return at::from_blob(block.ptr, sizes, [block](void*) { cache().release(block); }, options.device(at::kCPU));
}

int64_t cached_free_bytes() { return cache().free_bytes(); }

}  // namespace dppo
