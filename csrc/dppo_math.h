// dppo_math.h -- the scalar math of the DPPO loss, shared by the CPU and CUDA kernels.
//
// Every formula of the op contract lives here once, as DPPO_HOST_DEVICE inline functions on the
// accumulation type T (float for fp16/bf16/fp32 logits, double for fp64 logits). The kernels only
// stream over the vocabulary (max, sum of exp, entropy moment, gathers); everything that happens
// per row after that is a call into this header, so the CPU tests vouch for the CUDA formulas too.
//
// Per row i (one response token), with s = z / T, lse = logsumexp(s):
//   logp = s[a] - lse,  pi = exp(logp),  mu = exp(m)          (m = rollout log-prob of a)
//   divergence D by mode (binary_tv, binary_kl, topk_tv, topk_kl, ratio, none),
//   mask M = 0 iff (A > 0 and pi > mu_anchor and D > delta_high) or
//                  (A <= 0 and pi < mu_anchor and D > delta_low)   (ratio mode: r vs 1 +- delta)
//   (mask direction "symmetric": the same two tests without the advantage's sign: IPO, IcePop)
//   weight w = min(exp(min(logp - m, 20)), C),  loss = -A * w * M * logp.
// A row without a distribution (a NaN or +inf in s, or s all -inf: lse is not finite) has NaN
// outputs (finish_row), so the loss shows what its gradient will be, as with cross_entropy.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define DPPO_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define DPPO_HOST_DEVICE inline
#endif

namespace dppo {

// Mode ids: the order is part of the ABI between the mode strings' parsing (checks.h, parse_mode) and the
// kernels.
enum class Mode : int64_t {
  kBinaryTV = 0,
  kBinaryKL = 1,
  kTopkTV = 2,
  kTopkKL = 3,
  kRatio = 4,
  kNone = 5,
};

DPPO_HOST_DEVICE bool mode_is_topk(Mode mode) { return mode == Mode::kTopkTV || mode == Mode::kTopkKL; }

// Which side of the trust region a token's mask tests (checks.h, parse_mask_direction): kAdvantage, the paper's,
// tests the side the advantage pushes towards (A > 0: pi above the anchor; A <= 0: below it); kSymmetric tests both
// sides whatever the advantage (prime-rl's IPO on binary TV, IcePop's ratio band on the ratio mode).
enum class MaskDirection : int64_t {
  kAdvantage = 0,
  kSymmetric = 1,
};

// The loss settings of one forward or vocabulary-parallel epilogue call, built once from the op's arguments
// (checks.h's loss_settings parses the mode string) and passed down to every kernel and per-row formula as this
// one value. The temperature is not among them: the kernels apply it to the logits as they load them (the
// epilogue's statistics arrive already scaled).
struct LossSettings {
  Mode mode;
  double delta_low, delta_high;  // the trust region's thresholds (ratio mode: 1 - delta_low, 1 + delta_high)
  double ratio_cap;              // C, the cap of the importance weight
  bool compute_entropy;
  MaskDirection direction;  // which side(s) of the trust region mask
};

// Tokens equal to this id mark padding rows: they cost no compute, every output is 0 and their
// gradient is 0 (the same convention as torch.nn.functional.cross_entropy).
constexpr int64_t kIgnoreIndex = -100;

// Probability masses are floored here before a log (Stable-RL's top-K clamp); it keeps the binary
// and top-K divergences finite when a mass underflows to 0 while leaving every mask decision
// unchanged (a floored divergence is still ~27 nats / ~1 in TV, far above any threshold).
template <typename T>
DPPO_HOST_DEVICE T mass_floor() {
  return T(1e-12);
}
template <typename T>
DPPO_HOST_DEVICE T log_mass_floor() {
  return T(-27.631021115928547);
}  // log(1e-12)

// The importance weight's log-ratio is clamped at 20 before exp (verl / Stable-RL convention).
template <typename T>
DPPO_HOST_DEVICE T log_ratio_clamp() {
  return T(20);
}

// max(a, b) that propagates NaN (std::fmax and std::max drop it): the row-max passes use it, so a NaN
// logit cannot hide from the row's lse (and so from row_has_distribution).
template <typename T>
DPPO_HOST_DEVICE T nan_max(T a, T b) {
  return (a > b || a != a) ? a : b;
}

// Online log-sum-exp state: running max mx and sum of exp(x - mx). Merging two partial states is
// how split-vocabulary blocks and SIMD lanes are combined. The empty state is (-inf, 0).
template <typename T>
struct LseState {
  T mx;
  T sum;
};

template <typename T>
DPPO_HOST_DEVICE LseState<T> lse_merge(LseState<T> a, LseState<T> b) {
  // -inf max means an empty (or all -inf) partial: it contributes nothing and must not produce
  // exp(-inf - -inf) = NaN.
  if (a.mx == -INFINITY) return b;
  if (b.mx == -INFINITY) return a;
  if (a.mx >= b.mx) return {a.mx, a.sum + b.sum * std::exp(b.mx - a.mx)};
  return {b.mx, b.sum + a.sum * std::exp(a.mx - b.mx)};
}

// Online state for the entropy moment: alongside (mx, sum) keep wsum = sum exp(x - mx) * (x - mx).
// Then E_p[x] - mx = wsum / sum and entropy H = lse - E_p[x] = log(sum) - wsum / sum.
template <typename T>
struct EntState {
  T mx;
  T sum;
  T wsum;
};

template <typename T>
DPPO_HOST_DEVICE EntState<T> ent_merge(EntState<T> a, EntState<T> b) {
  if (a.mx == -INFINITY) return b;
  if (b.mx == -INFINITY) return a;
  if (a.mx < b.mx) {
    EntState<T> t = a;
    a = b;
    b = t;
  }
  // Shift b to a's max: exp(x - a.mx) = exp(x - b.mx) * c and (x - a.mx) = (x - b.mx) + d.
  const T d = b.mx - a.mx;  // <= 0
  const T c = std::exp(d);
  return {a.mx, a.sum + b.sum * c, a.wsum + c * (b.wsum + d * b.sum)};
}

template <typename T>
DPPO_HOST_DEVICE T entropy_from_state(T sum, T wsum) {
  // H = log(sum) - wsum / sum, clamped at 0 against rounding (an entropy is never negative).
  const T h = std::log(sum) - wsum / sum;
  return h > T(0) ? h : T(0);
}

// log(1 - exp(x)) for x <= 0, accurate at both ends (Maechler's log1mexp).
template <typename T>
DPPO_HOST_DEVICE T log1mexp(T x) {
  if (x >= T(0)) return -INFINITY;
  return x > T(-0.6931471805599453) ? std::log(-std::expm1(x)) : std::log1p(-std::exp(x));
}

template <typename T>
DPPO_HOST_DEVICE T floor_log_mass(T log_mass) {
  return log_mass > log_mass_floor<T>() ? log_mass : log_mass_floor<T>();
}

// Binary KL(Bernoulli(mu) || Bernoulli(pi)) = mu*log(mu/pi) + (1-mu)*log((1-mu)/(1-pi)) from
// log-probabilities: lp = log pi, l1p = log(1 - pi) (passed in so a kernel can supply it from the
// exact sum of the other tokens' mass), lm = log mu. 0 * log 0 terms are 0; log(1 - pi) is floored
// at log(1e-12) so pi == 1 in floating point gives a large finite divergence instead of inf.
template <typename T>
DPPO_HOST_DEVICE T binary_kl(T lp, T l1p, T lm) {
  const T mu = std::exp(lm);
  T kl = T(0);
  if (mu > T(0)) kl += mu * (lm - lp);
  if (mu < T(1)) kl += (T(1) - mu) * (log1mexp(lm) - floor_log_mass(l1p));
  return kl > T(0) ? kl : T(0);  // KL >= 0; rounding can give -1e-9
}

template <typename T>
DPPO_HOST_DEVICE T binary_tv(T lp, T lm) {
  return std::fabs(std::exp(lp) - std::exp(lm));
}

// Top-K buckets: accumulate over the rollout's K tokens, then close with the "other" bucket.
// p = rollout probabilities on S (from its log-probs), q = trainer softmax(s) on S.
template <typename T>
struct TopkAcc {
  T p_mass;  // sum_k p_k
  T q_mass;  // sum_k q_k
  T tv;      // sum_k |p_k - q_k|
  T kl;      // sum_k p_k (log p_k - log q_k)
};

template <typename T>
DPPO_HOST_DEVICE TopkAcc<T> topk_init() {
  return {T(0), T(0), T(0), T(0)};
}

// lpk: rollout log-prob of the k-th top token (may be -inf), lqk: trainer log-prob of that token.
template <typename T>
DPPO_HOST_DEVICE void topk_add(TopkAcc<T>& acc, T lpk, T lqk) {
  const T pk = std::exp(lpk);
  const T qk = std::exp(lqk);
  acc.p_mass += pk;
  acc.q_mass += qk;
  acc.tv += std::fabs(pk - qk);
  if (pk > T(0)) acc.kl += pk * (lpk - lqk);
}

template <typename T>
DPPO_HOST_DEVICE T topk_rest(T mass) {
  const T r = T(1) - mass;
  return r > mass_floor<T>() ? r : mass_floor<T>();
}

template <typename T>
DPPO_HOST_DEVICE T topk_tv_finish(const TopkAcc<T>& acc) {
  return T(0.5) * (acc.tv + std::fabs(topk_rest(acc.p_mass) - topk_rest(acc.q_mass)));
}

template <typename T>
DPPO_HOST_DEVICE T topk_kl_finish(const TopkAcc<T>& acc) {
  const T pr = topk_rest(acc.p_mass);
  const T qr = topk_rest(acc.q_mass);
  return acc.kl + pr * (std::log(pr) - std::log(qr));
}

// The divergence of the binary and ratio modes (top-K modes finish from TopkAcc instead).
// `none` reports the binary TV as an informative divergence; it never masks.
// ratio: r = exp(min(lp - la, 20)) (the clamp only caps a value that is masked anyway).
template <typename T>
DPPO_HOST_DEVICE T binary_divergence(Mode mode, T lp, T l1p, T la) {
  switch (mode) {
    case Mode::kBinaryKL:
      return binary_kl(lp, l1p, la);
    case Mode::kRatio: {
      const T d = lp - la;
      return std::exp(d < log_ratio_clamp<T>() ? d : log_ratio_clamp<T>());
    }
    default:
      return binary_tv(lp, la);
  }
}

// The trust-region mask (1 = keep the token's gradient). la = anchor log-prob (the rollout's
// unless an anchor is given). Strict comparisons, as in the contract. Two one-sided tests, "moved up too far"
// (pi > mu_a and D > delta_high; ratio: r > 1 + delta_high) and "moved down too far" (pi < mu_a and
// D > delta_low; ratio: r < 1 - delta_low); the advantage direction applies the one its sign picks (A > 0: up,
// A <= 0: down), the symmetric direction masks when either holds.
template <typename T>
DPPO_HOST_DEVICE T trust_mask(const LossSettings& settings, T adv, T lp, T la, T div) {
  const T delta_low = T(settings.delta_low);
  const T delta_high = T(settings.delta_high);
  if (settings.mode == Mode::kNone) return T(1);
  bool up, down;
  if (settings.mode == Mode::kRatio) {
    up = div > T(1) + delta_high;
    down = div < T(1) - delta_low;
  } else {
    const T pi = std::exp(lp);
    const T mu = std::exp(la);
    up = pi > mu && div > delta_high;
    down = pi < mu && div > delta_low;
  }
  const bool invalid = settings.direction == MaskDirection::kSymmetric ? (up || down) : (adv > T(0) ? up : down);
  return invalid ? T(0) : T(1);
}

// Importance weight w = min(exp(min(lp - m, 20)), C). lp - m is NaN only when both are -inf
// (a token impossible for both policies; m is never NaN, and finish_row handles rows whose lp is
// NaN before this is called); its weight is then 0.
template <typename T>
DPPO_HOST_DEVICE T is_weight(T lp, T m, T ratio_cap) {
  T d = lp - m;
  if (d != d) return T(0);
  d = d < log_ratio_clamp<T>() ? d : log_ratio_clamp<T>();
  const T w = std::exp(d);
  return w < ratio_cap ? w : ratio_cap;
}

// Gradient coefficient c = -A * w * M (dl/dz_j = c * (1[j = a] - p_j) / T) and loss = c * logp,
// with a zero coefficient giving an exact 0 loss even when logp = -inf.
template <typename T>
DPPO_HOST_DEVICE T loss_coef(T adv, T w, T m) {
  return -adv * w * m;
}

template <typename T>
DPPO_HOST_DEVICE T token_loss(T coef, T lp) {
  return coef == T(0) ? T(0) : coef * lp;
}

// Whether a row's scaled logits define a distribution: lse finite. It is not when s holds a NaN
// (propagated by nan_max or the sums), a +inf (inf - inf in the sum) or is all -inf (empty sum).
template <typename T>
DPPO_HOST_DEVICE bool row_has_distribution(T lse) {
  return lse > -T(INFINITY) && lse < T(INFINITY);  // false for NaN too
}

// The seven per-row outputs of the forward.
template <typename T>
struct RowOutputs {
  T loss, logp, divergence, mask, weight, entropy, lse;
};

// Where a forward writes its seven [N] outputs, in the op's order. Every kernel (CPU, CUDA, single-device and
// vocabulary-parallel) stores a row through store() and a padding row through store_zero().
template <typename S>
struct RowOutputPtrs {
  S* loss;
  S* logp;
  S* divergence;
  S* mask;
  S* weight;
  S* entropy;
  S* lse;

  template <typename T>
  DPPO_HOST_DEVICE void store(int64_t i, const RowOutputs<T>& r) const {
    loss[i] = S(r.loss);
    logp[i] = S(r.logp);
    divergence[i] = S(r.divergence);
    mask[i] = S(r.mask);
    weight[i] = S(r.weight);
    entropy[i] = S(r.entropy);
    lse[i] = S(r.lse);
  }
  DPPO_HOST_DEVICE void store_zero(int64_t i) const {
    store(i, RowOutputs<S>{S(0), S(0), S(0), S(0), S(0), S(0), S(0)});
  }
};

// The per-row epilogue both kernels end with: the mask, the weight and the loss from the row's
// log-prob, divergence, entropy and lse. A row without a distribution gets NaN in every output
// (torch.nn.functional.cross_entropy's convention): its loss is then non-finite like its gradient
// (grad_target = g_loss * coef + g_logp is NaN through coef), and so are the metrics over it. The
// "both log-probs -inf gives weight 0" rule of is_weight only ever sees rows with finite logits.
template <typename T>
DPPO_HOST_DEVICE RowOutputs<T> finish_row(const LossSettings& settings, T adv, T lp, T la, T m, T div, T entropy,
                                          T lse) {
  if (!row_has_distribution(lse)) {
    const T nan = T(NAN);
    return {nan, nan, nan, nan, nan, nan, nan};
  }
  const T msk = trust_mask(settings, adv, lp, la, div);
  const T w = is_weight(lp, m, T(settings.ratio_cap));
  return {token_loss(loss_coef(adv, w, msk), lp), lp, div, msk, w, entropy, lse};
}

// Shifted logits s - max (or log-probs s - lse) are floored here before exp(x) * x products
// (entropy moment, entropy gradient): a -inf logit then contributes exp(-1e30) * -1e30 = 0
// instead of 0 * -inf = NaN. Any x below ~-104 already has exp(x) == 0 in float.
template <typename T>
DPPO_HOST_DEVICE T shift_floor() {
  return T(-1e30);
}

// Backward, element j of a row, given p = p_j = exp(logp_j) (the kernel computes the exp with its
// own scalar or SIMD routine): g_t * (1[j = a] - p) - g_h * p * (logp_j + H), all / T.
// Only arithmetic, so a kernel may instantiate it with a SIMD vector type (at::vec::Vectorized).
// logp_j must already be floored at shift_floor() when g_h may be nonzero.
template <typename T>
DPPO_HOST_DEVICE T grad_from_p(T p, T logp_j, T g_t, T g_h, T entropy, T neg_inv_t) {
  return (g_t * p + g_h * p * (logp_j + entropy)) * neg_inv_t;
}

// The same element without the entropy term (the common case: no entropy bonus upstream).
template <typename T>
DPPO_HOST_DEVICE T grad_from_p_noent(T p, T g_t, T neg_inv_t) {
  return g_t * p * neg_inv_t;
}

// The target column a: g_t * (1 - p_a) with 1 - p_a = -expm1(logp_a), exact as p_a -> 1 (the
// plain 1 - p_a cancels to 0 in float once p_a > 1 - 6e-8).
template <typename T>
DPPO_HOST_DEVICE T grad_target(T logp_a, T g_t, T g_h, T entropy, T inv_t) {
  const T p = std::exp(logp_a);
  const T one_minus_p = -std::expm1(logp_a);
  const T ent = (g_h == T(0) || p == T(0)) ? T(0) : g_h * p * (logp_a + entropy);  // 0 * -inf -> 0
  return (g_t * one_minus_p - ent) * inv_t;
}

// The divergence of the top-K modes from their accumulated buckets.
template <typename T>
DPPO_HOST_DEVICE T topk_divergence(Mode mode, const TopkAcc<T>& acc) {
  return mode == Mode::kTopkTV ? topk_tv_finish(acc) : topk_kl_finish(acc);
}

// ---- sampling replay (kept_ids) -------------------------------------------------------------------------------
//
// With the rollout's kept set K (kept [S] ids, -1 padding; the sampled token a is in K, checks.h), the row's
// distribution is the softmax of s renormalised over K: lse_K = logsumexp_{j in K} s_j, logp = s_a - lse_K,
// log(1 - pi) = logsumexp_{j in K, j != a} s_j - lse_K, the entropy over K, and a top-K id outside K has
// log q = -inf. A kernel runs its usual pass over the whole row first (its lse, full_lse here, decides whether
// the row has a distribution at all: a NaN or +inf anywhere in the row poisons it, with or without K), then
// gathers the S kept logits with these functions. Serial over S: one thread per row.

template <typename T>
struct KeptRow {
  T mx;         // max_{j in K} s_j
  T log_total;  // log sum_{j in K} exp(s_j - mx)
  T lse;        // lse_K (NaN when the whole row has no distribution)
  T lp;         // s_a - lse_K
  T l1p;        // log(1 - pi_K(a)), from the other kept tokens' mass
  T entropy;    // the entropy over K (0 unless asked)
};

// Whether id is one of the S kept ids (padding -1 never matches a token id).
DPPO_HOST_DEVICE bool kept_contains(const int64_t* kept, int64_t s, int64_t id) {
  for (int64_t c = 0; c < s; ++c) {
    if (kept[c] == id) return true;
  }
  return false;
}

// The kept set's statistics of one row from its scaled kept logits: scaled(c) is s of the c-th kept id (called
// only for ids >= 0; each kernel forms s = z / T as its whole-row pass does, in the accumulation dtype with one
// rounding), kept: the S ids, a: the sampled token (in K) and s_a its scaled logit, full_lse: the lse of the whole
// row from the kernel's own pass (or any number finite exactly when the row has a distribution).
template <typename T, typename Scaled>
DPPO_HOST_DEVICE KeptRow<T> kept_row_from(const Scaled& scaled, const int64_t* kept, int64_t s, int64_t a, T s_a,
                                          T full_lse, bool entropy) {
  T mx = -INFINITY;
  for (int64_t c = 0; c < s; ++c) {
    if (kept[c] >= 0) mx = nan_max(mx, scaled(c));
  }
  // The same arithmetic as the full row: the non-target sum, then the target's own term.
  T other = T(0), wsum = T(0);
  for (int64_t c = 0; c < s; ++c) {
    const int64_t id = kept[c];
    if (id < 0 || id == a) continue;
    const T x_raw = scaled(c) - mx;
    const T x = x_raw > shift_floor<T>() ? x_raw : shift_floor<T>();
    const T e = std::exp(x);
    other += e;
    if (entropy) wsum += e * x;
  }
  const T xa_raw = s_a - mx;
  const T xa = xa_raw > shift_floor<T>() ? xa_raw : shift_floor<T>();
  const T ea = std::exp(xa);
  const T total = other + ea;
  if (entropy) wsum += ea * xa;
  const T log_total = std::log(total);
  const T lse = row_has_distribution(full_lse) ? mx + log_total : T(NAN);
  const T ent = entropy ? entropy_from_state(total, wsum) : T(0);
  return {mx, log_total, lse, xa_raw - log_total, std::log(other) - log_total, ent};
}

// log q of a top-K id under the kept distribution, from its scaled logit s_id: -inf outside K.
template <typename T>
DPPO_HOST_DEVICE T kept_logq(const int64_t* kept, int64_t s, int64_t id, T s_id, const KeptRow<T>& k) {
  if (!kept_contains(kept, s, id)) return -INFINITY;
  return (s_id - k.mx) - k.log_total;
}

// The gradient of one kept logit (dl/dz_j for j in K; every other logit's is 0), from its scaled logit s_j (the
// caller forms it with one rounding, never fused into an FMA with the subtraction below) and the saved lse_K: the
// softmax gradient over K (grad_target's expm1 form at the sampled token).
template <typename T>
DPPO_HOST_DEVICE T kept_grad(T s_j, bool is_target, T lse, T g_t, T g_h, T entropy, T inv_t) {
  const T l_raw = s_j - lse;
  if (is_target) return grad_target(l_raw, g_t, g_h, entropy, inv_t);
  const T l = l_raw > shift_floor<T>() ? l_raw : shift_floor<T>();
  return g_h == T(0) ? grad_from_p_noent(std::exp(l), g_t, -inv_t)
                     : grad_from_p(std::exp(l), l, g_t, g_h, entropy, -inv_t);
}

}  // namespace dppo
