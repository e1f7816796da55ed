// Distance helpers the CPU kernels of cdist and knn share.
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <cstdint>

namespace torchkit::cpu {

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

}  // namespace torchkit::cpu
