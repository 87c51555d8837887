// cpu/buffer_cache.h -- where the CPU backward's [N, V] gradient lives: blocks kept resident between steps.
//
// A training step's backward returns a fresh [N, V] gradient that the LM head's backward consumes and
// frees; the next step asks for the same size again. From the allocator each such buffer is a new
// mapping, and the first write to each of its 4 KiB pages is a page fault that zeroes it: 65,537
// faults for a 2048 x 32768 float32 gradient, measured at ~4x the cost of the whole backward pass
// itself (benchmarks/bench_loss.py, docs/benchmarks.md). empty_cached hands out blocks that earlier
// gradients used and freed, so their pages are already resident and a steady training loop faults
// none. The cache holds at most kMaxCachedBlocks (2) freed blocks (the least recently freed goes back to
// the allocator first), reuses a block only for a request of at least half its size, and returns a freed
// block to the allocator once 8 requests (backward calls of any size) have passed it over. So the memory
// held beyond live tensors stays bounded also after a workload shrinks: after 8 requests of at most B bytes
// each, the idle blocks are at most two of at most 2 B + 2 MiB each, plus those of tensors freed since.
// empty_cache frees every idle block at once. A block's tensor owns a resizable storage backed by the CPU
// allocator, so resize_() and untyped_storage().resize_(0) work as on any tensor (the block then goes back
// to the cache). Compiled once (baseline instruction set); the per-ISA kernel files call it.
#pragma once

#include <ATen/ATen.h>

namespace dppo {

// An uninitialised contiguous CPU tensor of `sizes` (`options`: CPU, any dtype). Requests under
// 1 MiB, or every request when DPPO_CPU_BUFFER_CACHE is off (0, off, no, false, n in any case; an unknown
// value is an error naming the variable), go to at::empty.
at::Tensor empty_cached(at::IntArrayRef sizes, const at::TensorOptions& options);

// Bytes held by freed blocks waiting for reuse (for tests and benchmarks).
int64_t cached_free_bytes();

// Returns every freed block to the allocator; the bytes released.
int64_t empty_cache();

// DPPO_CPU_BUFFER_CACHE as read (on unless set to 0, off, no, false or n); reads DPPO_CPU_HUGEPAGES too, so
// that an unknown value of either is an error when the library loads, not at the first backward.
bool cache_enabled();

}  // namespace dppo
