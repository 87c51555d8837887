// cpu/row_simd.h -- the SIMD row passes shared by the CPU kernel files (cpu/dppo_loss.cpp,
// cpu/vocab_parallel.cpp): 16/32-bit rows are read in their own dtype two float vectors at a time
// (at::vec; no fp32 copy of the logits) and accumulated in float; fp64 rows (gradcheck) run plain loops
// in double.
//
//   row_max(z, v)                     max over z[0, v), a NaN propagating (nan_max)
//   row_sums(z, lo, hi, 1/T, mx, ...) over z[lo, hi): sum += exp(s - mx) and, with the entropy,
//                                     wsum += exp(x) * x with x = max(s - mx, shift_floor), s = z / T
//
// Included only by files compiled once per instruction set (CPU_CAPABILITY, cpu/dispatch.h): everything
// here lives in namespace dppo::CPU_CAPABILITY, so the builds' copies never collide.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

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
      const FVec xa = at::vec::maximum(a * vinv - vmx, vfloor);
      const FVec xb = at::vec::maximum(b * vinv - vmx, vfloor);
      const FVec ea = xa.exp_u20(), eb = xb.exp_u20();
      s0 += ea;
      s1 += eb;
      w0 += ea * xa;
      w1 += eb * xb;
    }
  } else {
    for (; j + kStep <= hi; j += kStep) {
      FVec a, b;
      load2(z + j, a, b);
      s0 += (a * vinv - vmx).exp_u20();
      s1 += (b * vinv - vmx).exp_u20();
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
