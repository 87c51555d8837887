// emu_op.h -- what every entry point of the emulator library shares: emulator failures (misuse found in
// a kernel) surface as a RuntimeError naming the emulator and the op.
#pragma once

#include <c10/util/Exception.h>

#include "cuda_emu.h"

namespace dppo_cuda_emu {

template <typename F>
void guarded(const char* op, F&& f) {
  try {
    f();
  } catch (const cuda_emu::Error& e) {
    TORCH_CHECK(false, "CUDA emulator: ", op, ": ", e.what());
  }
}

}  // namespace dppo_cuda_emu
