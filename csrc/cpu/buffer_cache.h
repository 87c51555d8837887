// cpu/buffer_cache.h -- where the CPU backward's [N, V] gradient lives: blocks kept resident between steps.
//
// A training step's backward returns a fresh [N, V] gradient that the LM head's backward consumes and
// frees; the next step asks for the same size again. From the allocator each such buffer is a new
// mapping, and the first write to each of its 4 KiB pages is a page fault that zeroes it: 65,537
// faults for a 2048 x 32768 float32 gradient, measured at ~4x the cost of the whole backward pass
// itself (benchmarks/bench_loss.py, docs/benchmarks.md). empty_cached hands out blocks that earlier
// gradients used and freed, so their pages are already resident and a steady training loop faults
// none. The cache holds at most kMaxCachedBlocks freed blocks (the least recently freed goes back to
// the allocator first), and reuses a block only for a request of at least half its size, so memory
// held beyond the last step's gradient stays bounded. Compiled once (baseline instruction set); the
// per-ISA kernel files call it.
#pragma once

#include <ATen/ATen.h>

namespace dppo {

// An uninitialised contiguous CPU tensor of `sizes` (`options`: CPU, any dtype). Requests under
// 1 MiB, or every request when DPPO_CPU_BUFFER_CACHE=0, go to at::empty.
at::Tensor empty_cached(at::IntArrayRef sizes, const at::TensorOptions& options);

// Bytes held by freed blocks waiting for reuse (for tests and benchmarks).
int64_t cached_free_bytes();

}  // namespace dppo
