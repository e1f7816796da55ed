// Distance helpers the CPU kernels of cdist and knn share.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
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

// cdist::Centring on the CPU. finite_mean: the column sums in one pass over each input, in
// fixed blocks of rows added in block order (the same bits on any number of threads), where
// ATen's form takes four calls and a scalar division; the finite-row form only where that
// mean is not finite; no mean (undefined) where it is negligible beside the rows' norms.
// centre_rows: raw − mean and its squared row norms in one pass over raw, where ATen's form
// takes three (subtract, square, sum) and two temporaries; without a mean, the norms only.
at::Tensor finite_mean(const at::Tensor& raw1, const at::Tensor& raw2);
std::pair<at::Tensor, at::Tensor> centre_rows(const at::Tensor& raw, const at::Tensor& mean);
inline constexpr cdist::Centring kCentring{finite_mean, centre_rows};

}  // namespace torchkit::cpu
