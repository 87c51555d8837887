// ops.cpp -- the one TORCH_LIBRARY(dppo, m) block: every op of the extension is declared here (the schema
// strings, and what each op computes, are op_schemas.h's, shared with the CPU emulator of the CUDA kernels).
// Kernels register their implementations with TORCH_LIBRARY_IMPL in cpu/ and cuda/; the Python
// side (dppo_ext/ops.py) adds register_fake and register_autograd.
#include <torch/library.h>

#include "op_schemas.h"

TORCH_LIBRARY(dppo, m) {
  m.def(dppo::schema::kLossForward);
  m.def(dppo::schema::kLossBackward);
  m.def(dppo::schema::kLossBackwardInplace);
  m.def(dppo::schema::kVocabParallelStats);
  m.def(dppo::schema::kVocabParallelEpilogue);
}
