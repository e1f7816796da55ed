// Distance helpers the CPU kernels of cdist and knn share.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>

#include "cdist.h"

namespace torchkit::cpu {

// The grain of a parallel_for over rows of `row_elements` each: ATen's GRAIN_SIZE elements
// per task, so that small problems run on the calling thread instead of paying an OpenMP
// fork and join (tens of µs, more than their work) for a few rows.
inline int64_t rows_per_task(int64_t row_elements) {
  return std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(row_elements, 1));
}

// Σ(a − b)² over M values, directly (no expansion): what cdist recomputes where
// |a|² + |b|² − 2a·b cancels, and what knn compares exactly.
template <typename acc_t>
acc_t direct_sq(const acc_t* a, const acc_t* b, int64_t M) {
  using V = at::vec::Vectorized<acc_t>;
  V s(0);
  int64_t k = 0;
  for (; k + V::size() <= M; k += V::size()) {
    const V d = V::loadu(a + k) - V::loadu(b + k);
    s = at::vec::fmadd(d, d, s);
  }
  acc_t sum = at::vec::vec_reduce_all<acc_t>([](V x, V y) { return x + y; }, s);
  for (; k < M; ++k) sum += (a[k] - b[k]) * (a[k] - b[k]);
  return sum;
}

// v·2^E, rounded once (so over- and underflow come out as a correctly rounded ±∞, subnormal
// or 0): float through a float64 product, exact there; float64 by ldexp.
inline float times_pow2(float v, int E) {
  return static_cast<float>(static_cast<double>(v) * std::ldexp(1.0, E));
}
inline double times_pow2(double v, int E) { return std::ldexp(v, E); }

// Below this sum of two rows' squared norms the expansion |a|² + |b|² − 2a·b may have lost
// digits to underflow (each of its M products can lose up to the smallest normal number):
// such entries are recomputed directly, as cancelled ones are. Where the sum is above it and
// the expansion did not cancel (d² ≥ sum / kRefineRatio), d² ≥ M·min / ε: underflow costs
// at most an ulp.
template <typename acc_t>
acc_t tiny_norms(int64_t M) {
  using L = std::numeric_limits<acc_t>;
  return static_cast<acc_t>(cdist::kRefineRatio * double(M) * double(L::min()) /
                            double(L::epsilon()));
}

// Σ(a − b)² as m·2^E: the plain sum (E = 0) where it is finite and far enough above the
// smallest normal number that no square underflowed unnoticed; otherwise the differences
// scaled by the power of two nearest their largest (exact), so that a distance whose square
// leaves the type's range (a float32 distance of 1e-30 or 1e30) is still exact. NaN stays
// NaN; a difference past the type's range gives +∞.
template <typename acc_t>
struct Pow2Sum {
  acc_t m;
  int E;
};

template <typename acc_t>
Pow2Sum<acc_t> direct_sq_exact(const acc_t* a, const acc_t* b, int64_t M) {
  using L = std::numeric_limits<acc_t>;
  const acc_t sum = direct_sq(a, b, M);
  if (!(sum < static_cast<acc_t>(double(M) * double(L::min()) / double(L::epsilon())) ||
        sum > L::max())) {
    return {sum, 0};  // ordinary, or NaN
  }
  acc_t t = 0;
  for (int64_t k = 0; k < M; ++k) t = std::max(t, std::abs(a[k] - b[k]));
  if (t == 0 || !std::isfinite(t)) return {t, 0};
  int e;
  std::frexp(t, &e);
  acc_t s = 0;
  for (int64_t k = 0; k < M; ++k) {
    const acc_t d = std::ldexp(a[k] - b[k], -e);
    s += d * d;
  }
  return {s, 2 * e};
}

// cdist::Centring on the CPU. finite_mean: the column sums in one pass over each input, in
// fixed blocks of rows added in block order (the same bits on any number of threads), where
// ATen's form takes four calls and a scalar division; the finite-row form only where that
// mean is not finite; no mean (undefined) where it is negligible beside the rows' norms; the
// exponents (cdist::Centred) where an element's largest magnitude, tracked in the same pass,
// is extreme.
// centre_rows: raw − mean and its squared row norms in one pass over raw, where ATen's form
// takes three (subtract, square, sum) and two temporaries; without a mean, the norms only.
cdist::Shift finite_mean(const at::Tensor& raw1, const at::Tensor& raw2);
std::pair<at::Tensor, at::Tensor> centre_rows(const at::Tensor& raw, const at::Tensor& mean);
inline constexpr cdist::Centring kCentring{finite_mean, centre_rows};

}  // namespace torchkit::cpu
