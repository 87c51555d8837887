// cpu/row_simd.h -- the SIMD row passes shared by the CPU kernel files (cpu/dppo_loss.cpp,
// cpu/vocab_parallel.cpp): 16/32-bit rows are read in their own dtype two float vectors at a time
// (at::vec; no fp32 copy of the logits) and accumulated in float; fp64 rows (gradcheck) run plain loops
// in double.
//
//   row_max(z, v)                     max over z[0, v), a NaN propagating (nan_max)
//   row_sums(z, lo, hi, 1/T, mx, ...) over z[lo, hi): sum += exp(s - mx) and, with the entropy,
//                                     wsum += exp(x) * x with x = max(s - mx, shift_floor), s = z / T
//   vexp(x), floor_at(x, f)           the exp and the NaN-keeping floor those passes and the backward use
//
// Included only by files compiled once per instruction set (CPU_CAPABILITY, cpu/dispatch.h): everything
// here lives in namespace dppo::CPU_CAPABILITY, so the builds' copies never collide.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../dppo_math.h"

#ifndef CPU_CAPABILITY
#error "cpu/row_simd.h is for files compiled once per instruction set (CPU_CAPABILITY=DEFAULT|AVX2|AVX512)"
#endif

namespace dppo {
namespace CPU_CAPABILITY {

using FVec = at::vec::Vectorized<float>;
constexpr int64_t kFV = FVec::size();
constexpr int64_t kStep = 2 * kFV;  // elements per SIMD step: one Vectorized<bf16/half> = two float vectors

template <typename scalar_t>
inline void load2(const scalar_t* p, FVec& a, FVec& b) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    a = FVec::loadu(p);
    b = FVec::loadu(p + kFV);
  } else {
    at::vec::load_to_float<scalar_t>(p, a, b);
  }
}

template <typename scalar_t>
inline void store2(scalar_t* p, const FVec& a, const FVec& b) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    a.store(p);
    b.store(p + kFV);
  } else {
    at::vec::convert_from_float<scalar_t>(a, b).store(p);
  }
}

inline float hsum(const FVec& v) {
  alignas(64) float buf[kFV];
  v.store(buf);
  float s = 0.f;
  for (int64_t i = 0; i < kFV; ++i) s += buf[i];
  return s;
}

inline float hmax(const FVec& v) {
  alignas(64) float buf[kFV];
  v.store(buf);
  float s = buf[0];
  for (int64_t i = 1; i < kFV; ++i) s = nan_max(s, buf[i]);  // a NaN lane must survive (row_has_distribution)
  return s;
}

// ---- exp and floor of float vectors ---------------------------------------------------------------
//
// Every element of the forward's sums and of the backward costs one exp, and with the logits read once
// per pass the loops are bound by the arithmetic more than by memory (AVX-512: ~28 vector operations
// per element vector with at::vec's exp_u20 and its NaN-aware maximum). vexp is exp(x) for the x these
// loops form (x <= 0 up to rounding: a logit minus the row max or the lse) in 11 operations:
//   n = round(x log2 e),  r = x - n ln2 (ln2 split in a high part exact in float and a low part),
//   exp(r) ~ 1 + r (c1 + r (c2 + ...)), a degree-5 polynomial, relative error 1.0e-7 on |r| <= ln2 / 2
//   (fitted here by iterated reweighted least squares on the relative error, c0 = 1 kept exact so that
//   exp(0) = 1 exactly: the row's max element contributes exactly 1),
//   exp(x) = 2^n exp(r),
// within 3 ulp of exp in double over [-86, 0] (test_cpu_dispatch.py checks it through the backward op on
// every instruction set the host runs). x < kExpFlushBelow gives 0 (exp(x) < 2.2e-38 there, far below
// any sum it joins; the AVX2 form builds 2^n in the exponent bits, which must stay normal), NaN stays
// NaN, -inf gives 0.
// The DEFAULT build (no x86 vector extension) keeps exp_u20.
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693145751953125f;        // ln 2 to 15 significant bits: n * kLn2Hi is exact
constexpr float kLn2Lo = 1.42860676533018696e-06f;  // ln 2 - kLn2Hi
constexpr float kExpC1 = 0.99999988079071045f;
constexpr float kExpC2 = 0.49999150633811951f;
constexpr float kExpC3 = 0.16667181253433228f;
constexpr float kExpC4 = 0.04189794510602951f;
constexpr float kExpC5 = 0.0083178756758570671f;
constexpr float kExpFlushBelow = -86.6f;
constexpr float kExpClampAbove = 88.0f;  // AVX2 only: keeps n inside the exponent field for x up to ~88

inline FVec vexp(const FVec& xv) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 x = xv;
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpFlushBelow), _CMP_NLT_UQ);  // NaN: kept
  const __m512 n =
      _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(kExpC5), r, _mm512_set1_ps(kExpC4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpC3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpC2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpC1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(keep, p, n);  // p * 2^n, 0 where not kept (overflow gives inf)
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 x = xv;
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(kExpFlushBelow), _CMP_NLT_UQ);  // NaN: kept
  // max/min return their second operand when one is NaN, so a NaN x passes through both.
  const __m256 xc = _mm256_min_ps(_mm256_set1_ps(kExpClampAbove), _mm256_max_ps(_mm256_set1_ps(kExpFlushBelow), x));
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(kExpC5), r, _mm256_set1_ps(kExpC4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpC3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpC2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpC1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  // p in [0.7, 1.5): adding n to its exponent field multiplies it by 2^n (a NaN p stays NaN: n = 0 then).
  const __m256i scaled = _mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23));
  return _mm256_and_ps(_mm256_castsi256_ps(scaled), keep);
#else
  return xv.exp_u20();
#endif
}

// max(x, f) for a finite floor f that keeps a NaN x (one instruction; at::vec::maximum spends three).
inline FVec floor_at(const FVec& x, const FVec& f) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_max_ps(f, x);  // the second operand is returned when one is NaN
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_max_ps(f, x);
#else
  return at::vec::maximum(x, f);
#endif
}

// ---- float accumulation over fp32/fp16/bf16 rows (SIMD) -------------------------------------------

template <typename scalar_t>
float row_max(const scalar_t* z, int64_t v) {
  FVec m0(-INFINITY), m1(-INFINITY);
  int64_t j = 0;
  for (; j + kStep <= v; j += kStep) {
    FVec a, b;
    load2(z + j, a, b);
    m0 = at::vec::maximum(m0, a);
    m1 = at::vec::maximum(m1, b);
  }
  float m = hmax(at::vec::maximum(m0, m1));
  for (; j < v; ++j) m = nan_max(m, static_cast<float>(z[j]));  // at::vec::maximum above propagates NaN too
  return m;
}

template <typename scalar_t>
void row_sums(const scalar_t* z, int64_t lo, int64_t hi, float inv_t, float mx, bool with_ent, float& sum,
              float& wsum) {
  const FVec vinv(inv_t), vmx(mx), vfloor(shift_floor<float>());
  FVec s0(0.f), s1(0.f), w0(0.f), w1(0.f);
  int64_t j = lo;
  if (with_ent) {
    for (; j + kStep <= hi; j += kStep) {
      FVec a, b;
      load2(z + j, a, b);
      const FVec xa = floor_at(a * vinv - vmx, vfloor);
      const FVec xb = floor_at(b * vinv - vmx, vfloor);
      const FVec ea = vexp(xa), eb = vexp(xb);
      s0 += ea;
      s1 += eb;
      w0 += ea * xa;
      w1 += eb * xb;
    }
  } else {
    for (; j + kStep <= hi; j += kStep) {
      FVec a, b;
      load2(z + j, a, b);
      s0 += vexp(a * vinv - vmx);
      s1 += vexp(b * vinv - vmx);
    }
  }
  float s = hsum(s0 + s1), w = with_ent ? hsum(w0 + w1) : 0.f;
  for (; j < hi; ++j) {
    const float x = std::max(static_cast<float>(z[j]) * inv_t - mx, shift_floor<float>());
    const float e = std::exp(x);
    s += e;
    if (with_ent) w += e * x;
  }
  sum += s;
  wsum += w;
}

// ---- the same for fp64 rows: plain loops in double (fp64 exists for gradcheck) ---------------------

inline double row_max(const double* z, int64_t v) {
  double m = -INFINITY;
  for (int64_t j = 0; j < v; ++j) m = nan_max(m, z[j]);
  return m;
}

inline void row_sums(const double* z, int64_t lo, int64_t hi, double inv_t, double mx, bool with_ent, double& sum,
                     double& wsum) {
  for (int64_t j = lo; j < hi; ++j) {
    const double x = std::max(z[j] * inv_t - mx, shift_floor<double>());
    const double e = std::exp(x);
    sum += e;
    if (with_ent) wsum += e * x;
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace dppo
