// cdist::Centring on the CPU, which cdist and knn share (declared in cpu/distance.h).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cdist.h"
#include "cpu/distance.h"
#include "cpu/memory.h"

namespace torchkit {

namespace {

// One row of cpu::centre_rows: x = r − m, returning Σ x² (kShift = false: r's own Σ r², no m
// and nothing written). Four accumulators, so that the sum of squares waits on no single
// chain of additions.
template <bool kShift, typename scalar_t>
scalar_t centre_row(const scalar_t* r, const scalar_t* m, scalar_t* x, int64_t M) {
  using V = at::vec::Vectorized<scalar_t>;
  auto diff = [&](int64_t o) {
    if constexpr (!kShift) return V::loadu(r + o);
    const V d = V::loadu(r + o) - V::loadu(m + o);
    d.store(x + o);
    return d;
  };
  V s[4] = {V(0), V(0), V(0), V(0)};
  int64_t k = 0;
  for (; k + 4 * V::size() <= M; k += 4 * V::size()) {
    for (int u = 0; u < 4; ++u) {
      const V d = diff(k + u * V::size());
      s[u] = at::vec::fmadd(d, d, s[u]);
    }
  }
  for (; k + V::size() <= M; k += V::size()) {
    const V d = diff(k);
    s[0] = at::vec::fmadd(d, d, s[0]);
  }
  scalar_t n = at::vec::vec_reduce_all<scalar_t>([](V a, V b) { return a + b; },
                                                 (s[0] + s[1]) + (s[2] + s[3]));
  for (; k < M; ++k) {
    const scalar_t d = kShift ? r[k] - m[k] : r[k];
    if constexpr (kShift) x[k] = d;
    n += d * d;
  }
  return n;
}

// Centring pays where it shrinks the rows' norms, and with them the expansion's rounding and
// the entries to recompute. Where the mean's |μ|² is at most 1/kCentringGain of the rows'
// mean |x|² (data about the origin: embeddings, random features), it would shrink them by
// less than 7 %, so the rows are used as they are, without a centred copy (as large as the
// inputs: 205 MB for a 100,000 × 512 gallery). The accuracy does not depend on it: every
// entry whose expansion cancels against the norms in use is recomputed directly.
constexpr double kCentringGain = 16.0;

// The exponent e of cdist::Centred for an element whose largest finite magnitude is `largest`:
// 0 inside [2^-H, 2^H], H a quarter of the exponent range (there |x|² and the product keep
// clear of under- and overflow for any M below 2^50), else that of the power of two that
// brings it into [1/2, 1), kept where 2^-e is a number of the type.
template <typename scalar_t>
int scale_exponent(scalar_t largest) {
  using L = std::numeric_limits<scalar_t>;
  constexpr int H = L::max_exponent / 4;
  if (largest == 0 ||
      (largest >= std::ldexp(scalar_t(1), -H) && largest <= std::ldexp(scalar_t(1), H))) {
    return 0;
  }
  int e;
  std::frexp(largest, &e);
  return std::clamp(e, L::min_exponent + 1, L::max_exponent);
}

// The largest finite |x| of batch element b of raw (B, rows, M); NaN and ±∞ are skipped.
template <typename scalar_t>
scalar_t largest_finite(const at::Tensor& raw, int64_t b) {
  if (!raw.defined()) return 0;
  const int64_t n = raw.size(1) * raw.size(2);
  const scalar_t* x = raw.const_data_ptr<scalar_t>() + b * n;
  scalar_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isfinite(x[i])) m = std::max(m, std::abs(x[i]));
  }
  return m;
}

}  // namespace

cdist::Shift cpu::finite_mean(const at::Tensor& raw1, const at::Tensor& raw2) {
  constexpr int64_t kBlock = 256;  // rows per partial sum
  const int64_t B = raw1.size(0), M = raw1.size(2);
  const int64_t rows1 = raw1.size(1), rows2 = raw2.defined() ? raw2.size(1) : 0;
  const int64_t blocks1 = (rows1 + kBlock - 1) / kBlock, blocks2 = (rows2 + kBlock - 1) / kBlock;
  const int64_t blocks = blocks1 + blocks2;
  at::Tensor partial = at::empty({B, blocks, M}, raw1.options());
  at::Tensor mean = at::empty({B, 1, M}, raw1.options());
  bool finite = true, negligible = true;
  std::vector<int> exponents(B);
  bool scaled = false;
  AT_DISPATCH_FLOATING_TYPES(raw1.scalar_type(), "cdist_finite_mean", [&] {
    using V = at::vec::Vectorized<scalar_t>;
    const scalar_t* in1 = raw1.const_data_ptr<scalar_t>();
    const scalar_t* in2 = rows2 > 0 ? raw2.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* part = partial.data_ptr<scalar_t>();
    std::vector<scalar_t> squares(B * blocks);  // each block's Σ|x|²
    std::vector<scalar_t> largest(B * blocks);  // and its max |x| (NaN or ∞ if it holds one)
    const int64_t grain = cpu::rows_per_task(kBlock * std::max<int64_t>(M, 1));
    at::parallel_for(0, B * blocks, grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t b = t / blocks, k = t % blocks;
        const bool first = k < blocks1;
        const int64_t rows = first ? rows1 : rows2;
        const int64_t r0 = (first ? k : k - blocks1) * kBlock;
        const int64_t r_end = std::min(rows, r0 + kBlock);
        const scalar_t* src = (first ? in1 : in2) + (b * rows + r0) * M;
        scalar_t* dst = part + t * M;
        std::fill(dst, dst + M, scalar_t(0));
        V sq(0), big(0);
        scalar_t sq_tail = 0, big_tail = 0;
        for (int64_t r = r0; r < r_end; ++r, src += M) {
          int64_t m = 0;
          for (; m + V::size() <= M; m += V::size()) {
            const V v = V::loadu(src + m);
            (V::loadu(dst + m) + v).store(dst + m);
            sq = at::vec::fmadd(v, v, sq);
            big = at::vec::maximum(big, v.abs());
          }
          for (; m < M; ++m) {
            dst[m] += src[m], sq_tail += src[m] * src[m];
            big_tail = std::isnan(src[m]) ? src[m] : std::max(big_tail, std::abs(src[m]));
          }
        }
        squares[t] =
            sq_tail + at::vec::vec_reduce_all<scalar_t>([](V x, V y) { return x + y; }, sq);
        const scalar_t big_all = at::vec::vec_reduce_all<scalar_t>(
            [](V x, V y) { return at::vec::maximum(x, y); }, big);  // NaN propagates
        largest[t] = std::isnan(big_all) ? big_all : std::max(big_tail, big_all);
      }
    });
    // Scaling first: the sums of extreme data may have overflowed. A block holding NaN or ±∞
    // does not know its largest finite magnitude, so an element with one is swept again for
    // it: a non-finite row must not decide the scale of the others.
    for (int64_t b = 0; b < B; ++b) {
      scalar_t m = 0;
      bool finite_blocks = true;
      for (int64_t k = 0; k < blocks; ++k) {
        const scalar_t l = largest[b * blocks + k];
        finite_blocks = finite_blocks && std::isfinite(l);
        m = std::isfinite(l) ? std::max(m, l) : m;
      }
      if (!finite_blocks)
        m = std::max(largest_finite<scalar_t>(raw1, b), largest_finite<scalar_t>(raw2, b));
      exponents[b] = scale_exponent(m);
      scaled = scaled || exponents[b] != 0;
    }
    if (scaled) return;
    const scalar_t inv = scalar_t(1) / static_cast<scalar_t>(std::max<int64_t>(rows1 + rows2, 1));
    scalar_t* out = mean.data_ptr<scalar_t>();
    for (int64_t b = 0; b < B; ++b) {
      scalar_t mean_sq = 0, shift_sq = 0;  // mean |x|² and |mean|²
      for (int64_t k = 0; k < blocks; ++k) mean_sq += squares[b * blocks + k] * inv;
      for (int64_t m = 0; m < M; ++m) {
        scalar_t s = 0;
        for (int64_t k = 0; k < blocks; ++k) s += part[(b * blocks + k) * M + m];
        out[b * M + m] = s * inv;
        shift_sq += out[b * M + m] * out[b * M + m];
        finite = finite && std::isfinite(out[b * M + m]);
      }
      negligible =
          negligible && std::isfinite(mean_sq) && scalar_t(kCentringGain) * shift_sq <= mean_sq;
    }
  });
  if (scaled) return {at::Tensor(), std::move(exponents)};
  if (!finite) return cdist::finite_mean_aten(raw1, raw2);
  return {negligible ? at::Tensor() : mean, {}};
}

std::pair<at::Tensor, at::Tensor> cpu::centre_rows(const at::Tensor& raw, const at::Tensor& mean) {
  // Without a shift the rows are used as they are: only their norms are computed.
  at::Tensor x = mean.defined() ? cpu::empty_for_writing(raw.sizes(), raw.options()) : raw;
  at::Tensor norms = at::empty({raw.size(0), raw.size(1)}, raw.options());
  const at::Tensor mu = mean.defined() ? mean.contiguous() : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES(raw.scalar_type(), "cdist_centre_rows", [&] {
    const int64_t rows = raw.size(1), M = raw.size(2);
    const scalar_t* r = raw.const_data_ptr<scalar_t>();
    const scalar_t* m = mu.defined() ? mu.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* xo = mu.defined() ? x.data_ptr<scalar_t>() : nullptr;
    scalar_t* no = norms.data_ptr<scalar_t>();
    at::parallel_for(0, raw.size(0) * rows, cpu::rows_per_task(M), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        no[i] = m ? centre_row<true>(r + i * M, m + (i / rows) * M, xo + i * M, M)
                  : centre_row<false>(r + i * M, m, xo, M);
      }
    });
  });
  return {x, norms};
}

}  // namespace torchkit
