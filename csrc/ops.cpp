// ops.cpp -- the one TORCH_LIBRARY(dppo, m) block: every op of the extension is declared here (the schema
// strings are op_schemas.h's, shared with the CPU emulator of the CUDA kernels).
// Kernels register their implementations with TORCH_LIBRARY_IMPL in cpu/ and cuda/; the Python
// side (dppo_ext/ops.py) adds register_fake and register_autograd.
//
// dppo_loss_forward(logits [N, V], tokens [N] int64, rollout_logprobs [N], advantages [N],
//                   topk_ids [N, K] int64?, topk_logprobs [N, K]?, anchor_logprobs [N]?, mode,
//                   temperature, delta_low, delta_high, ratio_cap, compute_entropy)
//   -> (loss, logp, divergence, mask, weight, entropy, lse), each [N] in the accumulation dtype
//      (float32, or float64 for float64 logits). Rows whose token is -100 are padding: all zero.
// dppo_loss_backward(grad_target [N], grad_entropy [N]?, logits, tokens, lse, entropy [N]?, T)
//   -> grad_logits [N, V] in the logits dtype:
//      grad[i, j] = (grad_target[i] * (1[j = a_i] - p_ij) - grad_entropy[i] * p_ij (log p_ij + H_i)) / T
// dppo_loss_backward_ is the same, written into logits (which it consumes).
// dppo_vocab_parallel_stats(logits [N, V_local], tokens [N], topk_ids [N, K]?, vocab_start, T, compute_entropy)
//   -> stats [N, 4 + K]: this rank's slice statistics (csrc/vocab_parallel.h); tokens/topk_ids are global ids.
// dppo_vocab_parallel_epilogue(stats [W, N, 4 + K], vocab_offsets [W + 1], tokens, rollout_logprobs,
//                              advantages, topk_ids?, topk_logprobs?, anchor_logprobs?, mode, delta_low,
//                              delta_high, ratio_cap, compute_entropy)
//   -> the seven outputs of dppo_loss_forward for the whole vocabulary, merged from every rank's stats.
#include <torch/library.h>

#include "op_schemas.h"

TORCH_LIBRARY(dppo, m) {
  m.def(dppo::schema::kLossForward);
  m.def(dppo::schema::kLossBackward);
  m.def(dppo::schema::kLossBackwardInplace);
  m.def(dppo::schema::kVocabParallelStats);
  m.def(dppo::schema::kVocabParallelEpilogue);
}
