// op_schemas.h -- the schema strings of the extension's ops, written once, each with what the op computes.
// csrc/ops.cpp registers them under TORCH_LIBRARY(dppo); the CPU emulator of the CUDA kernels
// (python_tests/cuda_emu) registers the same strings under its own namespace, so the two cannot drift apart.
#pragma once

namespace dppo::schema {

// dppo_loss_forward(logits [N, V], tokens [N] int64, rollout_logprobs [N], advantages [N],
//                   topk_ids [N, K] int64?, topk_logprobs [N, K]?, anchor_logprobs [N]?, mode,
//                   temperature, delta_low, delta_high, ratio_cap, compute_entropy, kept_ids [N, S] int64?,
//                   mask_direction ('advantage' | 'symmetric': which side(s) of the trust region mask, dppo_math.h))
//   -> (loss, logp, divergence, mask, weight, entropy, lse), each [N] in the accumulation dtype
//      (float32, or float64 for float64 logits). Rows whose token is -100 are padding: all zero.
//      kept_ids (-1 padding): sampling replay, every output over the softmax renormalised on the kept set.
inline constexpr const char* kLossForward =
    "dppo_loss_forward(Tensor logits, Tensor tokens, Tensor rollout_logprobs, Tensor advantages, "
    "Tensor? topk_ids, Tensor? topk_logprobs, Tensor? anchor_logprobs, str mode, float temperature, "
    "float delta_low, float delta_high, float ratio_cap, bool compute_entropy, Tensor? kept_ids=None, "
    "str mask_direction='advantage') -> "
    "(Tensor loss, Tensor logp, Tensor divergence, Tensor mask, Tensor weight, Tensor entropy, Tensor lse)";
// dppo_loss_backward(grad_target [N], grad_entropy [N]?, logits, tokens, lse, entropy [N]?, T, kept_ids [N, S]?)
//   -> grad_logits [N, V] in the logits dtype:
//      grad[i, j] = (grad_target[i] * (1[j = a_i] - p_ij) - grad_entropy[i] * p_ij (log p_ij + H_i)) / T
//      (with kept_ids: p over the kept set from its lse, and 0 outside the set)
inline constexpr const char* kLossBackward =
    "dppo_loss_backward(Tensor grad_target, Tensor? grad_entropy, Tensor logits, Tensor tokens, "
    "Tensor lse, Tensor? entropy, float temperature, Tensor? kept_ids=None) -> Tensor";
// dppo_loss_backward_: the same gradient, written into logits (which it consumes); returns nothing.
inline constexpr const char* kLossBackwardInplace =
    "dppo_loss_backward_(Tensor grad_target, Tensor? grad_entropy, Tensor(a!) logits, Tensor tokens, "
    "Tensor lse, Tensor? entropy, float temperature, Tensor? kept_ids=None) -> ()";
// dppo_vocab_parallel_stats(logits [N, V_local], tokens [N], topk_ids [N, K]?, vocab_start, T, compute_entropy,
//                           kept_ids [N, S]?)
//   -> stats [N, 4 + K + S]: this rank's slice statistics (csrc/vocab_parallel_math.h); tokens/topk_ids/kept_ids
//      are global ids.
inline constexpr const char* kVocabParallelStats =
    "dppo_vocab_parallel_stats(Tensor logits, Tensor tokens, Tensor? topk_ids, int vocab_start, "
    "float temperature, bool compute_entropy, Tensor? kept_ids=None) -> Tensor";
// dppo_vocab_parallel_epilogue(stats [W, N, 4 + K + S], vocab_offsets [W + 1], tokens, rollout_logprobs,
//                              advantages, topk_ids?, topk_logprobs?, anchor_logprobs?, mode, delta_low,
//                              delta_high, ratio_cap, compute_entropy, kept_ids [N, S]?, mask_direction)
//   -> the seven outputs of dppo_loss_forward for the whole vocabulary, merged from every rank's stats.
inline constexpr const char* kVocabParallelEpilogue =
    "dppo_vocab_parallel_epilogue(Tensor stats, int[] vocab_offsets, Tensor tokens, Tensor rollout_logprobs, "
    "Tensor advantages, Tensor? topk_ids, Tensor? topk_logprobs, Tensor? anchor_logprobs, str mode, "
    "float delta_low, float delta_high, float ratio_cap, bool compute_entropy, Tensor? kept_ids=None, "
    "str mask_direction='advantage') -> "
    "(Tensor loss, Tensor logp, Tensor divergence, Tensor mask, Tensor weight, Tensor entropy, Tensor lse)";

}  // namespace dppo::schema
