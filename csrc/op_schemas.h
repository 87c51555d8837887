// op_schemas.h -- the schema strings of the extension's ops, written once. csrc/ops.cpp registers them under
// TORCH_LIBRARY(dppo); the CPU emulator of the CUDA kernels (python_tests/cuda_emu) registers the same
// strings under its own namespace, so the two cannot drift apart. What each op computes: csrc/ops.cpp.
#pragma once

namespace dppo::schema {

inline constexpr const char* kLossForward =
    "dppo_loss_forward(Tensor logits, Tensor tokens, Tensor rollout_logprobs, Tensor advantages, "
    "Tensor? topk_ids, Tensor? topk_logprobs, Tensor? anchor_logprobs, str mode, float temperature, "
    "float delta_low, float delta_high, float ratio_cap, bool compute_entropy) -> "
    "(Tensor loss, Tensor logp, Tensor divergence, Tensor mask, Tensor weight, Tensor entropy, Tensor lse)";
inline constexpr const char* kLossBackward =
    "dppo_loss_backward(Tensor grad_target, Tensor? grad_entropy, Tensor logits, Tensor tokens, "
    "Tensor lse, Tensor? entropy, float temperature) -> Tensor";
inline constexpr const char* kLossBackwardInplace =
    "dppo_loss_backward_(Tensor grad_target, Tensor? grad_entropy, Tensor(a!) logits, Tensor tokens, "
    "Tensor lse, Tensor? entropy, float temperature) -> ()";
inline constexpr const char* kVocabParallelStats =
    "dppo_vocab_parallel_stats(Tensor logits, Tensor tokens, Tensor? topk_ids, int vocab_start, "
    "float temperature, bool compute_entropy) -> Tensor";
inline constexpr const char* kVocabParallelEpilogue =
    "dppo_vocab_parallel_epilogue(Tensor stats, int[] vocab_offsets, Tensor tokens, Tensor rollout_logprobs, "
    "Tensor advantages, Tensor? topk_ids, Tensor? topk_logprobs, Tensor? anchor_logprobs, str mode, "
    "float delta_low, float delta_high, float ratio_cap, bool compute_entropy) -> "
    "(Tensor loss, Tensor logp, Tensor divergence, Tensor mask, Tensor weight, Tensor entropy, Tensor lse)";

}  // namespace dppo::schema
