// checks.h -- input validation shared by the CPU and CUDA entry points of every op (the loss ops and the
// vocabulary-parallel ones), so both backends reject bad input with the same message. Every message names the
// argument, what it got and what was expected. Value checks (token ids in range, rollout log-probs <= 0) read
// the data: on CUDA that is one small reduction and one host sync per call, the price of never launching a
// kernel that would index out of bounds.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "dppo_math.h"
#include "ops.h"
#include "vocab_parallel_math.h"

namespace dppo {

inline Mode parse_mode(c10::string_view mode) {
  if (mode == "binary_tv") return Mode::kBinaryTV;
  if (mode == "binary_kl") return Mode::kBinaryKL;
  if (mode == "topk_tv") return Mode::kTopkTV;
  if (mode == "topk_kl") return Mode::kTopkKL;
  if (mode == "ratio") return Mode::kRatio;
  if (mode == "none") return Mode::kNone;
  TORCH_CHECK_VALUE(false, "mode must be one of 'binary_tv', 'binary_kl', 'topk_tv', 'topk_kl', ",
                    "'ratio', 'none'; got '", std::string(mode), "'");
}

// The mode's name as the schema spells it (parse_mode's inverse).
inline const char* mode_name(Mode mode) {
  switch (mode) {
    case Mode::kBinaryTV:
      return "binary_tv";
    case Mode::kBinaryKL:
      return "binary_kl";
    case Mode::kTopkTV:
      return "topk_tv";
    case Mode::kTopkKL:
      return "topk_kl";
    case Mode::kRatio:
      return "ratio";
    case Mode::kNone:
      return "none";
  }
  return "?";
}

inline MaskDirection parse_mask_direction(c10::string_view direction) {
  if (direction == "advantage") return MaskDirection::kAdvantage;
  if (direction == "symmetric") return MaskDirection::kSymmetric;
  TORCH_CHECK_VALUE(false, "mask_direction must be one of 'advantage', 'symmetric'; got '", std::string(direction),
                    "'");
}

// The loss settings of a dppo_loss_forward or dppo_vocab_parallel_epilogue call, built once from the op's
// arguments: the mode and the mask direction parsed (an unknown one throws here, before any other check); the
// thresholds are checked with the op's other inputs (check_trust_region), in the order every entry point checks them.
inline LossSettings loss_settings(c10::string_view mode, double delta_low, double delta_high, double ratio_cap,
                                  bool compute_entropy, c10::string_view mask_direction) {
  return {parse_mode(mode), delta_low, delta_high, ratio_cap, compute_entropy, parse_mask_direction(mask_direction)};
}

// The dtype of every per-row float input and output: float32 for low-precision and fp32 logits,
// float64 for fp64 logits (so gradcheck runs end to end in double).
inline at::ScalarType acc_dtype(at::ScalarType logits_dtype) {
  return logits_dtype == at::kDouble ? at::kDouble : at::kFloat;
}

inline void check_logits(const at::Tensor& logits) {
  TORCH_CHECK_VALUE(logits.dim() == 2, "logits must be 2-D [N, V], got shape ", logits.sizes());
  const auto dt = logits.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16 || dt == at::kDouble,
                   "logits must be float32, float16, bfloat16 or float64, got ", dt);
  TORCH_CHECK_VALUE(logits.size(1) > 0, "logits must have a non-empty vocabulary dimension, got shape ",
                    logits.sizes());
  TORCH_CHECK_VALUE(logits.size(1) == 1 || logits.stride(1) == 1,
                    "logits must be contiguous along the vocabulary dimension (stride(1) == 1), got strides ",
                    logits.strides(), "; call .contiguous() first");
  TORCH_CHECK_VALUE(logits.size(0) <= 1 || logits.stride(0) >= logits.size(1),
                    "logits rows must not overlap (stride(0) >= V), got strides ", logits.strides(), " for shape ",
                    logits.sizes());
}

// What the per-row inputs of an op are checked against: the tensor that fixes their row count N, their
// device and their float dtype (logits [N, V] for the loss ops, stats [W, N, 4 + K] for the
// vocabulary-parallel epilogue), and how the messages name it.
struct RowSource {
  const at::Tensor& tensor;
  const char* name;  // "logits" / "stats"
  const char* rows;  // where N comes from: "one per logits row" / "stats.size(1)"
  int64_t n;
  at::ScalarType float_dtype;  // the dtype of every per-row float input
};

inline RowSource logits_rows(const at::Tensor& logits) {
  return {logits, "logits", "one per logits row", logits.size(0), acc_dtype(logits.scalar_type())};
}

inline void check_row_vector(const at::Tensor& t, const char* name, at::ScalarType dtype, const RowSource& src) {
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == src.n, name, " must be 1-D with N=", src.n, " rows (", src.rows,
                    "), got shape ", t.sizes());
  const bool same_as_src = src.tensor.scalar_type() == dtype;
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, name, " must have dtype ", dtype, " (",
                   dtype == at::kLong ? "token ids"
                   : same_as_src      ? "the dtype of "
                                      : "the accumulation dtype of ",
                   dtype == at::kLong ? "" : src.name, dtype == at::kLong || same_as_src ? "" : " of dtype ",
                   dtype == at::kLong || same_as_src ? "" : c10::toString(src.tensor.scalar_type()), "), got ",
                   t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == src.tensor.device(), name, " must be on the same device as ", src.name, " (",
                    src.tensor.device(), "), got ", t.device());
}

inline void check_topk_matrix(const at::Tensor& t, const char* name, int64_t k, at::ScalarType dtype,
                              const RowSource& src) {
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == src.n && (k < 0 || t.size(1) == k), name,
                    " must be 2-D [N, K] with N=", src.n,
                    k < 0 ? "" : " and K=", k < 0 ? std::string() : std::to_string(k), ", got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.size(1) >= 1, name, " must have K >= 1 columns, got shape ", t.sizes());
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, name, " must have dtype ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == src.tensor.device(), name, " must be on the same device as ", src.name, " (",
                    src.tensor.device(), "), got ", t.device());
}

inline void check_temperature(double temperature) {
  TORCH_CHECK_VALUE(std::isfinite(temperature) && temperature > 0.0, "temperature must be a finite number > 0, got ",
                    temperature);
}

inline void check_trust_region(const LossSettings& s) {
  TORCH_CHECK_VALUE(std::isfinite(s.delta_low) && s.delta_low >= 0.0, "delta_low must be a finite number >= 0, got ",
                    s.delta_low);
  TORCH_CHECK_VALUE(std::isfinite(s.delta_high) && s.delta_high >= 0.0, "delta_high must be a finite number >= 0, got ",
                    s.delta_high);
  TORCH_CHECK_VALUE(!std::isnan(s.ratio_cap) && s.ratio_cap > 0.0, "ratio_cap must be > 0, got ", s.ratio_cap);
}

// Value checks that read the data. On CPU a plain loop over the values (no temporaries: these run
// on every call); on CUDA one fused reduction each and a host sync, the price of never launching a
// kernel that would index out of bounds. Each returns the flat position of the first bad value, or
// -1 when every value is fine. A padding row (token kIgnoreIndex: outside the response mask) is never
// read by a kernel, so the values of the rollout's inputs there are not checked either: `live` is the
// rows' tokens ([N], already checked), or undefined for a check of every value (the tokens themselves).
inline at::Tensor live_values(const at::Tensor& t, const at::Tensor& live) {
  // [N] -> true where the row is not padding, broadcast over the K columns of an [N, K] input.
  const at::Tensor rows = live.ne(kIgnoreIndex);
  return t.dim() == 2 ? rows.unsqueeze(1).expand(t.sizes()).reshape(-1) : rows.reshape(-1);
}

// Whether flat position i of a CPU tensor with `per_row` values per row lies in a padding row.
inline bool padding_at(const int64_t* live, int64_t i, int64_t per_row) {
  return live != nullptr && live[i / per_row] == kIgnoreIndex;
}

inline int64_t first_bad_token(const at::Tensor& tokens, int64_t vocab, bool allow_ignore,
                               const at::Tensor& live = at::Tensor()) {
  if (tokens.numel() == 0) return -1;
  if (tokens.is_cpu()) {
    const at::Tensor t = tokens.contiguous();
    const at::Tensor l = live.defined() ? live.contiguous() : live;
    const int64_t* p = t.const_data_ptr<int64_t>();
    const int64_t* rows = l.defined() ? l.const_data_ptr<int64_t>() : nullptr;
    const int64_t per_row = rows != nullptr ? t.numel() / l.numel() : 1;
    for (int64_t i = 0; i < t.numel(); ++i) {
      if ((p[i] < 0 || p[i] >= vocab) && !(allow_ignore && p[i] == kIgnoreIndex) && !padding_at(rows, i, per_row)) {
        return i;
      }
    }
    return -1;
  }
  const at::Tensor flat = tokens.reshape(-1);
  at::Tensor bad = flat.lt(0).logical_or(flat.ge(vocab));
  if (allow_ignore) bad = bad.logical_and(flat.ne(kIgnoreIndex));
  if (live.defined()) bad = bad.logical_and(live_values(tokens, live));
  if (!bad.any().item<bool>()) return -1;
  return bad.nonzero().min().item<int64_t>();
}

inline void check_token_values(const at::Tensor& tokens, int64_t vocab, const char* name, bool allow_ignore,
                               const at::Tensor& live = at::Tensor()) {
  const int64_t first = first_bad_token(tokens, vocab, allow_ignore, live);
  if (first < 0) return;
  TORCH_CHECK_INDEX(false, name, " must hold ids in [0, V=", vocab, ")",
                    allow_ignore ? " or the ignore index -100" : "", ", got ",
                    tokens.reshape(-1)[first].item<int64_t>(), " at flat position ", first);
}

// Log-probabilities must be <= 0 (or -inf) and not NaN: `x > 0 || x != x`.
template <typename T>
int64_t first_bad_logprob_cpu(const at::Tensor& t, const int64_t* live, int64_t per_row) {
  const T* p = t.const_data_ptr<T>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    if ((p[i] > T(0) || p[i] != p[i]) && !padding_at(live, i, per_row)) return i;
  }
  return -1;
}

inline void check_logprob_values(const at::Tensor& lp, const char* name, const at::Tensor& live) {
  if (lp.numel() == 0) return;
  int64_t first = -1;
  if (lp.is_cpu()) {
    const at::Tensor t = lp.contiguous();
    const at::Tensor l = live.contiguous();
    const int64_t* rows = l.const_data_ptr<int64_t>();
    const int64_t per_row = t.numel() / l.numel();
    first = t.scalar_type() == at::kDouble ? first_bad_logprob_cpu<double>(t, rows, per_row)
                                           : first_bad_logprob_cpu<float>(t, rows, per_row);
  } else {
    const at::Tensor flat = lp.reshape(-1);
    const at::Tensor bad = flat.gt(0).logical_or(flat.isnan()).logical_and(live_values(lp, live));
    if (bad.any().item<bool>()) first = bad.nonzero().min().item<int64_t>();
  }
  if (first < 0) return;
  TORCH_CHECK_VALUE(false, name, " must be log-probabilities (<= 0, -inf allowed, not NaN), got ",
                    lp.reshape(-1)[first].item<double>(), " at flat position ", first,
                    "; pass log-probs, not probabilities or logits");
}

template <typename T>
bool all_finite_cpu(const at::Tensor& t, const int64_t* live) {
  const T* p = t.const_data_ptr<T>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (!std::isfinite(p[i]) && !padding_at(live, i, 1)) return false;
  }
  return true;
}

inline void check_finite_values(const at::Tensor& t, const char* name, const at::Tensor& live) {
  if (t.numel() == 0) return;
  bool ok = true;
  if (t.is_cpu()) {
    const at::Tensor c = t.contiguous();
    const at::Tensor l = live.contiguous();
    const int64_t* rows = l.const_data_ptr<int64_t>();
    ok = c.scalar_type() == at::kDouble ? all_finite_cpu<double>(c, rows) : all_finite_cpu<float>(c, rows);
  } else {
    ok = !t.reshape(-1).isfinite().logical_not().logical_and(live_values(t, live)).any().item<bool>();
  }
  TORCH_CHECK_VALUE(ok, name, " must be finite, got a NaN or inf value");
}

// The rollout's per-row inputs of the forward and of the vocabulary-parallel epilogue: shapes, dtypes and devices
// (no data read).
inline void check_rollout_shapes(const RowSource& src, Mode mode, const RowInputs& rows) {
  check_row_vector(rows.tokens, "tokens", at::kLong, src);
  check_row_vector(rows.rollout_logprobs, "rollout_logprobs", src.float_dtype, src);
  check_row_vector(rows.advantages, "advantages", src.float_dtype, src);
  if (rows.anchor_logprobs.has_value()) {
    check_row_vector(*rows.anchor_logprobs, "anchor_logprobs", src.float_dtype, src);
  }
  TORCH_CHECK_VALUE(rows.topk_ids.has_value() == rows.topk_logprobs.has_value(),
                    "topk_ids and topk_logprobs must be given together, got ",
                    rows.topk_ids.has_value() ? "topk_ids only" : "topk_logprobs only");
  if (mode_is_topk(mode)) {
    TORCH_CHECK_VALUE(rows.topk_ids.has_value(), "mode '", mode_name(mode),
                      "' needs the rollout's top-K: pass topk_ids [N, K] and topk_logprobs [N, K] "
                      "(e.g. from vLLM SamplingParams(logprobs=K))");
  }
  if (rows.topk_ids.has_value()) {
    check_topk_matrix(*rows.topk_ids, "topk_ids", -1, at::kLong, src);
    check_topk_matrix(*rows.topk_logprobs, "topk_logprobs", rows.topk_ids->size(1), src.float_dtype, src);
  }
}

// The same inputs' values (token ids in [0, vocab), log-probs <= 0, finite advantages): reads the data. Only the
// rows whose token is not kIgnoreIndex: a padding row's values are never read (docs/contract.md).
inline void check_rollout_values(Mode mode, int64_t vocab, const RowInputs& rows) {
  check_token_values(rows.tokens, vocab, "tokens", /*allow_ignore=*/true);
  const at::Tensor& live = rows.tokens;
  check_logprob_values(rows.rollout_logprobs, "rollout_logprobs", live);
  if (rows.anchor_logprobs.has_value()) check_logprob_values(*rows.anchor_logprobs, "anchor_logprobs", live);
  if (rows.topk_ids.has_value() && mode_is_topk(mode)) {
    check_token_values(*rows.topk_ids, vocab, "topk_ids", /*allow_ignore=*/false, live);
    check_logprob_values(*rows.topk_logprobs, "topk_logprobs", live);
  }
  check_finite_values(rows.advantages, "advantages", live);
}

// ---- sampling replay (kept_ids [N, S], -1 padding) -------------------------------------------------------------

// vocab < 0: S is not bounded by V here (the backward, which a fused LM head runs on vocabulary blocks narrower
// than S; the vocabulary-parallel statistics, whose ids are global: the epilogue checks S <= V).
inline void check_kept_shape(const at::Tensor& kept, const RowSource& src, int64_t vocab) {
  TORCH_CHECK_VALUE(kept.dim() == 2 && kept.size(0) == src.n, "kept_ids must be 2-D [N, S] with N=", src.n, " rows (",
                    src.rows, "), got shape ", kept.sizes());
  if (vocab < 0) {
    TORCH_CHECK_VALUE(kept.size(1) >= 1, "kept_ids must have S >= 1 columns, got shape ", kept.sizes());
  } else {
    TORCH_CHECK_VALUE(kept.size(1) >= 1 && kept.size(1) <= vocab, "kept_ids must have 1 <= S <= V=", vocab,
                      " columns (the ids each row's truncation kept, -1 padding), got shape ", kept.sizes());
  }
  TORCH_CHECK_TYPE(kept.scalar_type() == at::kLong, "kept_ids must have dtype ", at::kLong, " (token ids), got ",
                   kept.scalar_type());
  TORCH_CHECK_VALUE(kept.device() == src.tensor.device(), "kept_ids must be on the same device as ", src.name, " (",
                    src.tensor.device(), "), got ", kept.device());
}

// The first (row, column) where `bad` [N, S] (or [N], column -1) is true, or (-1, -1).
inline std::pair<int64_t, int64_t> first_true(const at::Tensor& bad) {
  if (!bad.any().item<bool>()) return {-1, -1};
  const at::Tensor where = bad.nonzero();  // row-major order: the first is the first bad row
  const int64_t row = where[0][0].item<int64_t>();
  return {row, bad.dim() == 2 ? where[0][1].item<int64_t>() : -1};
}

// The messages of check_kept_values (one text for the CPU loop and the device reductions).
inline void fail_kept_range(int64_t id, int64_t vocab, int64_t r, int64_t c) {
  TORCH_CHECK_INDEX(false, "kept_ids must hold token ids in [0, V=", vocab, ") or the padding -1, got ", id, " at row ",
                    r, ", column ", c);
}
inline void fail_kept_duplicate(int64_t id, int64_t r) {
  TORCH_CHECK_VALUE(false, "kept_ids must hold each id at most once per row, got id ", id, " twice in row ", r);
}
inline void fail_kept_empty(int64_t token, int64_t r) {
  TORCH_CHECK_VALUE(false, "kept_ids row ", r, " is empty (every entry -1), but its token ", token,
                    " was sampled: an empty kept set cannot have produced a sample; pass the ids the rollout's "
                    "truncation kept at that position (or mask the row out)");
}
inline void fail_kept_missing(int64_t token, int64_t r) {
  TORCH_CHECK_VALUE(false, "tokens[", r, "] = ", token, " is not in its kept set kept_ids[", r,
                    "]: a rollout cannot sample a token its truncation removed; kept_ids must be the kept set of "
                    "the same position (aligned with tokens)");
}

// check_kept_values on the CPU: plain loops over the [N, S] ids (a dozen ATen reductions cost more than the op's
// replay kernels at S = 64), each rule its own pass so that the first failing rule is reported, as on a device.
// Strided reads (no contiguous copy): the per-ISA kernel builds include this header, and a Tensor method they
// instantiate could be shared with baseline code (python_tests/ops/test_cpu_dispatch.py).
inline void check_kept_values_cpu(const at::Tensor& kept, const at::Tensor& tokens, int64_t vocab) {
  const int64_t n = kept.size(0), s = kept.size(1), rs = kept.stride(0), cs = kept.stride(1), ts = tokens.stride(0);
  const int64_t* ids = kept.const_data_ptr<int64_t>();
  const int64_t* tok = tokens.const_data_ptr<int64_t>();
  const auto id_at = [&](int64_t r, int64_t c) { return ids[r * rs + c * cs]; };
  const auto live = [&](int64_t r) { return tok[r * ts] != kIgnoreIndex; };
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t c = 0; c < s && live(r); ++c) {
      if (id_at(r, c) < -1 || id_at(r, c) >= vocab) fail_kept_range(id_at(r, c), vocab, r, c);
    }
  }
  std::vector<int64_t> row(static_cast<size_t>(s));
  for (int64_t r = 0; r < n && s > 1; ++r) {
    if (!live(r)) continue;
    for (int64_t c = 0; c < s; ++c) row[c] = id_at(r, c);
    std::sort(row.begin(), row.end());
    for (int64_t c = 1; c < s; ++c) {
      if (row[c] >= 0 && row[c] == row[c - 1]) fail_kept_duplicate(row[c], r);
    }
  }
  for (int64_t r = 0; r < n; ++r) {
    bool any = false;
    for (int64_t c = 0; c < s && !any; ++c) any = id_at(r, c) >= 0;
    if (live(r) && !any) fail_kept_empty(tok[r * ts], r);
  }
  for (int64_t r = 0; r < n; ++r) {
    bool found = false;
    for (int64_t c = 0; c < s && !found; ++c) found = id_at(r, c) == tok[r * ts];
    if (live(r) && !found) fail_kept_missing(tok[r * ts], r);
  }
}

// The kept sets' values at the rows that are not padding (token != -100): ids in [-1, V), no id twice, the
// sampled token among them. On the CPU one loop per rule; on a device one small set of [N, S] reductions (a host
// sync, like the other value checks): O(N * S), never O(N * V).
inline void check_kept_values(const at::Tensor& kept, const at::Tensor& tokens, int64_t vocab) {
  if (kept.numel() == 0) return;
  if (kept.is_cpu()) {
    check_kept_values_cpu(kept, tokens, vocab);
    return;
  }
  const at::Tensor live = tokens.ne(kIgnoreIndex).unsqueeze(1);  // [N, 1]
  auto [r, c] = first_true(kept.lt(-1).logical_or(kept.ge(vocab)).logical_and(live));
  if (r >= 0) fail_kept_range(kept[r][c].item<int64_t>(), vocab, r, c);
  const at::Tensor sorted = std::get<0>(kept.sort(1));
  if (kept.size(1) > 1) {
    const at::Tensor hi = sorted.narrow(1, 1, kept.size(1) - 1);
    const at::Tensor dup = hi.eq(sorted.narrow(1, 0, kept.size(1) - 1)).logical_and(hi.ge(0)).logical_and(live);
    std::tie(r, c) = first_true(dup);
    if (r >= 0) fail_kept_duplicate(sorted[r][c + 1].item<int64_t>(), r);
  }
  const at::Tensor live_row = live.squeeze(1);
  std::tie(r, c) = first_true(kept.ge(0).any(1).logical_not().logical_and(live_row));
  if (r >= 0) fail_kept_empty(tokens[r].item<int64_t>(), r);
  std::tie(r, c) = first_true(kept.eq(tokens.unsqueeze(1)).any(1).logical_not().logical_and(live_row));
  if (r >= 0) fail_kept_missing(tokens[r].item<int64_t>(), r);
}

// Everything the forward entry point validates, for both backends (the mode was parsed by loss_settings).
inline void check_forward_inputs(const at::Tensor& logits, const RowInputs& rows, const LossSettings& settings,
                                 double temperature, const c10::optional<at::Tensor>& kept_ids) {
  check_logits(logits);
  check_temperature(temperature);
  check_trust_region(settings);
  check_rollout_shapes(logits_rows(logits), settings.mode, rows);
  if (kept_ids.has_value()) check_kept_shape(*kept_ids, logits_rows(logits), logits.size(1));
  check_rollout_values(settings.mode, logits.size(1), rows);
  if (kept_ids.has_value()) check_kept_values(*kept_ids, rows.tokens, logits.size(1));
}

inline void check_backward_inputs(const at::Tensor& grad_target, const c10::optional<at::Tensor>& grad_entropy,
                                  const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& lse,
                                  const c10::optional<at::Tensor>& entropy, double temperature,
                                  const c10::optional<at::Tensor>& kept_ids) {
  check_logits(logits);
  check_temperature(temperature);
  const RowSource src = logits_rows(logits);
  check_row_vector(grad_target, "grad_target", src.float_dtype, src);
  check_row_vector(tokens, "tokens", at::kLong, src);
  check_row_vector(lse, "lse", src.float_dtype, src);
  TORCH_CHECK_VALUE(grad_entropy.has_value() == entropy.has_value(),
                    "grad_entropy and entropy must be given together (the entropy gradient needs both)");
  if (grad_entropy.has_value()) {
    check_row_vector(*grad_entropy, "grad_entropy", src.float_dtype, src);
    check_row_vector(*entropy, "entropy", src.float_dtype, src);
  }
  // The forward checked the kept sets' values; the backward's gather and scatter stay in bounds regardless
  // (ids outside [0, V) are skipped), and a vocabulary block of a fused LM head may be narrower than S.
  if (kept_ids.has_value()) check_kept_shape(*kept_ids, src, /*vocab=*/-1);
}

// ---- the vocabulary-parallel ops (vocab_parallel_math.h) --------------------------------------------------------

inline void check_vp_stats_inputs(const at::Tensor& logits, const at::Tensor& tokens,
                                  const c10::optional<at::Tensor>& topk_ids, int64_t vocab_start, double temperature,
                                  const c10::optional<at::Tensor>& kept_ids) {
  check_logits(logits);
  check_temperature(temperature);
  TORCH_CHECK_VALUE(vocab_start >= 0, "vocab_start (this rank's first global vocabulary id) must be >= 0, got ",
                    vocab_start);
  const RowSource src = logits_rows(logits);
  check_row_vector(tokens, "tokens", at::kLong, src);
  if (topk_ids.has_value()) check_topk_matrix(*topk_ids, "topk_ids", -1, at::kLong, src);
  // The ids are global: the epilogue checks them against the whole vocabulary.
  if (kept_ids.has_value()) check_kept_shape(*kept_ids, src, /*vocab=*/-1);
}

// Everything the epilogue validates (the mode was parsed by loss_settings). stats: [W, N, 4 + K], every rank's
// statistics stacked.
inline void check_vp_epilogue_inputs(const at::Tensor& stats, at::IntArrayRef offsets, const RowInputs& rows,
                                     const LossSettings& settings, const c10::optional<at::Tensor>& kept_ids) {
  const Mode mode = settings.mode;
  check_trust_region(settings);
  TORCH_CHECK_VALUE(stats.dim() == 3 && stats.size(2) >= kVpTopk,
                    "stats must be 3-D [W, N, 4 + K] (every rank's dppo_vocab_parallel_stats, stacked), got shape ",
                    stats.sizes());
  TORCH_CHECK_TYPE(stats.scalar_type() == at::kFloat || stats.scalar_type() == at::kDouble,
                   "stats must be float32 or float64 (the accumulation dtype), got ", stats.scalar_type());
  const int64_t world = stats.size(0);
  TORCH_CHECK_VALUE(world >= 1 && static_cast<int64_t>(offsets.size()) == world + 1,
                    "vocab_offsets must have W + 1 = ", world + 1, " entries (stats.size(0) = W ranks), got ",
                    offsets.size());
  TORCH_CHECK_VALUE(offsets[0] == 0, "vocab_offsets[0] must be 0, got ", offsets[0]);
  for (int64_t r = 0; r < world; ++r) {
    TORCH_CHECK_VALUE(offsets[r + 1] > offsets[r], "vocab_offsets must be strictly increasing (every rank holds ",
                      "at least one vocabulary column), got ", offsets);
  }
  const RowSource src{stats, "stats", "stats.size(1)", stats.size(1), stats.scalar_type()};
  check_rollout_shapes(src, mode, rows);
  if (kept_ids.has_value()) check_kept_shape(*kept_ids, src, offsets[world]);
  const int64_t k = mode_is_topk(mode) ? rows.topk_ids->size(1) : 0;
  const int64_t s = kept_ids.has_value() ? kept_ids->size(1) : 0;
  if (mode_is_topk(mode) || s > 0) {
    TORCH_CHECK_VALUE(stats.size(2) == vp_stat_width(k, s), "stats must have 4 + K + S = ", vp_stat_width(k, s),
                      " columns for K=", k, " top-K ids and S=", s,
                      " kept ids (pass the same topk_ids and kept_ids to dppo_vocab_parallel_stats), got shape ",
                      stats.sizes());
  }
  check_rollout_values(mode, offsets[world], rows);
  if (kept_ids.has_value()) check_kept_values(*kept_ids, rows.tokens, offsets[world]);
}

}  // namespace dppo
