// Covariance pooling on the CPU.
//
// Forward: every product of the Newton–Schulz chain (and the covariance itself) is symmetric,
// so above kTile channels only the tiles on and above the diagonal are multiplied (one BLAS
// call per tile, with the ½(3I − ·) update as its alpha/beta epilogue) and mirrored: 10 of
// 16 tiles' flops at D = 512.
// Backward: the gradient of the polynomial F(A) in A's eigenbasis, A = U·diag(λ)·Uᵀ:
// ∂/∂A <Gf, F(A)> = U·((UᵀGfU) ∘ L)·Uᵀ, L the divided differences of F's scalar polynomial
// at pairs of eigenvalues (Daleckii–Krein; exact for repeated eigenvalues, where L is F′).
// L comes from the iteration's own recursion through the product rule of divided
// differences, [fg](a, b) = [f](a, b)·g(b) + f(a)·[g](a, b), so no difference of close
// eigenvalues is ever divided. One eigendecomposition and four GEMMs replace the adjoint
// chain's 6 GEMMs per iteration; below 128 channels or 3 iterations the chain is cheaper.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "blas.h"
#include "common.h"
#include "covariance_pool.h"
#include "cpu/memory.h"

namespace torchkit::covariance_pool {
namespace {

using at::Tensor;

constexpr int64_t kTile = 128;

// s from the largest |Xc| of a sample's finite channels: see Centre in covariance_pool.h.
template <typename acc_t>
acc_t power_of_two(acc_t max_abs) {
  if (!(max_abs > 0) || !std::isfinite(max_abs)) return acc_t(1);
  int e = 0;
  std::frexp(max_abs, &e);
  return std::ldexp(acc_t(1), e - 1);
}

// Per channel (N·D of them): the mean in float64, the largest |x − mean| and whether the sum
// is finite. The means are kept in float64 and X − mean is formed in float64, so that each
// centred value is rounded once: a mean rounded to float32 first would shift every value of
// a channel far from the origin by up to half an ulp of its offset (0.03 at 1e6), and Σ by
// the square of that. The mean is the channel's first value x₀ plus the mean of x − x₀:
// exactly x₀ for a constant channel, whose plain float64 sum rounds (0.1 summed 784 times
// and divided gives a mean 1e-17 off, a non-zero covariance and gradient) or overflows (a
// constant 1e300), and a sum of the spread rather than of the offset otherwise.
template <typename acc_t>
struct ChannelStats {
  std::vector<double> mean;
  std::vector<acc_t> dev;
  std::vector<char> finite;
  explicit ChannelStats(int64_t channels) : mean(channels), dev(channels), finite(channels) {}
};

// The positions (N, D, M) as strided views of the input: x[n·sN + d·sD + m·sM].
template <typename scalar_t>
struct Positions {
  const scalar_t* x;
  int64_t sN, sD, sM;
};

// Channels along rows (sM = 1): one task per channel. deviations = false skips the largest
// deviation (a given scale does not need it).
template <typename scalar_t, typename acc_t>
void channel_stats_by_rows(const Problem& p, const Positions<scalar_t>& in, bool deviations,
                           ChannelStats<acc_t>& st) {
  const int64_t D = p.D, M = p.M;
  at::parallel_for(0, p.N * D, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* row = in.x + (r / D) * in.sN + (r % D) * in.sD;
      const double x0 = static_cast<double>(row[0]);
      double sum = 0;
      for (int64_t m = 0; m < M; ++m) sum += static_cast<double>(row[m]) - x0;
      const double mu = x0 + sum / static_cast<double>(M);
      double big = 0;
      if (deviations)
        for (int64_t m = 0; m < M; ++m) big = std::max(big, std::abs(double(row[m]) - mu));
      st.mean[r] = mu, st.dev[r] = static_cast<acc_t>(big), st.finite[r] = std::isfinite(sum);
    }
  });
}

// Channels last (sD = 1): one task per sample, sweeping its positions.
template <typename scalar_t, typename acc_t>
void channel_stats_by_columns(const Problem& p, const Positions<scalar_t>& in, bool deviations,
                              ChannelStats<acc_t>& st) {
  const int64_t D = p.D, M = p.M;
  at::parallel_for(0, p.N, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> sum(D);
    for (int64_t n = begin; n < end; ++n) {
      std::fill(sum.begin(), sum.end(), 0.0);
      const scalar_t* first = in.x + n * in.sN;  // x₀ of each channel: position 0
      for (int64_t m = 0; m < M; ++m) {
        const scalar_t* col = in.x + n * in.sN + m * in.sM;
        for (int64_t d = 0; d < D; ++d) sum[d] += double(col[d]) - double(first[d]);
      }
      double* mu = st.mean.data() + n * D;
      acc_t* big = st.dev.data() + n * D;
      for (int64_t d = 0; d < D; ++d) {
        mu[d] = double(first[d]) + sum[d] / static_cast<double>(M);
        big[d] = 0, st.finite[n * D + d] = std::isfinite(sum[d]);
      }
      if (!deviations) continue;
      for (int64_t m = 0; m < M; ++m) {
        const scalar_t* col = in.x + n * in.sN + m * in.sM;
        for (int64_t d = 0; d < D; ++d)
          big[d] = std::max(big[d], static_cast<acc_t>(std::abs(double(col[d]) - mu[d])));
      }
    }
  });
}

// The centring: a pass for the statistics, then one to write X̃c = (X − mean) / s as
// (N, D, M) rows, or (N, M, D) for channels_last (returned as its (N, D, M) transpose).
// Division by a power of two is exact (its reciprocal may not be representable).
template <typename scalar_t>
std::tuple<Tensor, Tensor> centre_kernel(const Problem& p, const Tensor& a,
                                         const std::optional<Tensor>& scale) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t N = p.N, D = p.D, M = p.M;
  const bool by_rows = a.stride(1) != 1 || a.stride(2) == 1;
  const Tensor in = by_rows && a.stride(2) != 1 ? a.contiguous() : a;
  const Positions<scalar_t> x{in.const_data_ptr<scalar_t>(), in.stride(0), in.stride(1),
                              in.stride(2)};
  const auto acc_opts = a.options().dtype(c10::CppTypeToScalarType<acc_t>::value);
  Tensor out = cpu::empty_for_writing(
      by_rows ? std::vector<int64_t>{N, D, M} : std::vector<int64_t>{N, M, D}, acc_opts);
  // A given scale is read by its first N elements: make it contiguous (it may be a view).
  Tensor s = scale.has_value() ? scale->contiguous() : at::empty({N}, acc_opts);
  acc_t* o = out.data_ptr<acc_t>();
  acc_t* sp = s.data_ptr<acc_t>();
  ChannelStats<acc_t> st(N * D);
  if (by_rows)
    channel_stats_by_rows(p, x, !scale.has_value(), st);
  else
    channel_stats_by_columns(p, x, !scale.has_value(), st);
  if (!scale.has_value()) {
    for (int64_t n = 0; n < N; ++n) {
      acc_t big = 0;  // a channel holding NaN or ±∞ has no say in the others' scale
      for (int64_t d = n * D; d < (n + 1) * D; ++d)
        if (st.finite[d]) big = std::max(big, st.dev[d]);
      sp[n] = power_of_two(big);
    }
  }
  const int64_t rows = by_rows ? N * D : N * M;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      acc_t* dst = o + r * (by_rows ? M : D);
      if (by_rows) {
        const scalar_t* row = x.x + (r / D) * x.sN + (r % D) * x.sD;
        const double mu = st.mean[r], sn = sp[r / D];
        for (int64_t m = 0; m < M; ++m) dst[m] = static_cast<acc_t>((double(row[m]) - mu) / sn);
      } else {
        const int64_t n = r / M;
        const scalar_t* col = x.x + n * x.sN + (r % M) * x.sM;
        const double* mu = st.mean.data() + n * D;
        const double sn = sp[n];
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<acc_t>((double(col[d]) - mu[d]) / sn);
      }
    }
  });
  return {by_rows ? out : out.transpose(1, 2), s};
}

std::tuple<Tensor, Tensor> centre_cpu(const Problem& p, const Tensor& x,
                                      const std::optional<Tensor>& scale) {
  const Tensor a = positions(p, x);
  std::tuple<Tensor, Tensor> result;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "covariance_pool",
                                  [&] { result = centre_kernel<scalar_t>(p, a, scale); });
  return result;
}

Tensor symmetric_product_tiles(const Tensor& A, const Tensor& B, double alpha, const Tensor& S,
                               double beta, double gamma) {
  const int64_t N = A.size(0), D = A.size(1);
  if (D <= kTile) return symmetric_product_bmm(A, B, alpha, S, beta, gamma);
  struct Tile {
    int64_t n, i0, j0;
  };
  std::vector<Tile> tiles;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i0 = 0; i0 < D; i0 += kTile)
      for (int64_t j0 = i0; j0 < D; j0 += kTile) tiles.push_back({n, i0, j0});
  Tensor C = cpu::empty_for_writing({N, D, D}, A.options());
  // The tasks call ATen: OpenMP's workers must see this thread's dispatcher state.
  const at::ThreadLocalState state;
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard guard(state);
    for (int64_t t = begin; t < end; ++t) {
      const Tile& T = tiles[t];
      const int64_t di = std::min(kTile, D - T.i0), dj = std::min(kTile, D - T.j0);
      Tensor c = C[T.n].narrow(0, T.i0, di).narrow(1, T.j0, dj);
      const Tensor a = A[T.n].narrow(0, T.i0, di), b = B[T.n].narrow(1, T.j0, dj);
      if (S.defined()) {
        blas::addmm_out(c, S[T.n].narrow(0, T.i0, di).narrow(1, T.j0, dj), a, b, beta, alpha);
      } else {
        blas::addmm_out(c, c, a, b, 0.0, alpha);  // beta = 0: c's contents are not read
      }
      if (T.i0 == T.j0) {
        if (gamma != 0.0) c.diagonal().add_(gamma);
      } else {
        C[T.n].narrow(0, T.j0, dj).narrow(1, T.i0, di).copy_(c.t());
      }
    }
  });
  return C;
}

// The scalar Newton–Schulz iteration of n steps run at every eigenvalue of every sample:
// per sample and step, rows of D values y, z, t (t₀ at step 0), then w and f.
template <typename acc_t>
struct IterationTable {
  int64_t D, n, steps, rows;
  std::vector<acc_t> v;

  IterationTable(const acc_t* lam, int64_t N, int64_t D_, int64_t n_)
      : D(D_), n(n_), steps(std::max<int64_t>(n_ - 1, 1)), rows(3 * steps + 2), v(N * rows * D) {
    at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
      for (int64_t s = begin; s < end; ++s)
        for (int64_t b = 0; b < D; ++b) fill(s, b, lam[s * D + b]);
    });
  }
  // Row `row` of sample s (D values).
  const acc_t* values(int64_t s, int64_t row) const { return v.data() + (s * rows + row) * D; }
  const acc_t* f(int64_t s) const { return values(s, 3 * steps + 1); }

 private:
  void fill(int64_t s, int64_t b, acc_t l) {
    acc_t* out = v.data() + s * rows * D + b;
    acc_t t = acc_t(1.5) - acc_t(0.5) * l, y = l * t, z = t;
    out[0] = y, out[D] = z, out[2 * D] = t;
    for (int64_t i = 1; i < steps; ++i) {
      t = acc_t(1.5) - acc_t(0.5) * (z * y);
      y = y * t, z = t * z;
      out[(3 * i) * D] = y, out[(3 * i + 1) * D] = z, out[(3 * i + 2) * D] = t;
    }
    const acc_t w = z * y;
    out[(3 * steps) * D] = w;
    out[(3 * steps + 1) * D] = n == 1 ? y : acc_t(1.5) * y - acc_t(0.5) * y * w;
  }
};

// row ← row ∘ L(a, ·) for eigenvalue a of sample s: the divided differences [f](λₐ, λ_b) for
// every b, by the product rule through the iteration's steps. dy, dz: D values of scratch.
template <typename acc_t>
void scale_by_divided_differences(const IterationTable<acc_t>& tab, int64_t s, int64_t a, acc_t la,
                                  acc_t* dy, acc_t* dz, acc_t* row) {
  const int64_t D = tab.D, steps = tab.steps;
  auto at_a = [&](int64_t r) { return tab.values(s, r)[a]; };
  // Step 0: [T₀] = −½, [Y₀] = [λ]·t₀(b) + λ(a)·[T₀], [Z₀] = [T₀].
  const acc_t* t0 = tab.values(s, 2);
  for (int64_t b = 0; b < D; ++b) dy[b] = t0[b] - acc_t(0.5) * la, dz[b] = acc_t(-0.5);
  for (int64_t i = 1; i < steps; ++i) {
    // Tᵢ = 1.5 − ½·Zᵢ₋₁Yᵢ₋₁, Yᵢ = Yᵢ₋₁Tᵢ, Zᵢ = TᵢZᵢ₋₁.
    const acc_t *yb = tab.values(s, 3 * (i - 1)), *zb = tab.values(s, 3 * (i - 1) + 1);
    const acc_t* tb = tab.values(s, 3 * i + 2);
    const acc_t ya = at_a(3 * (i - 1)), za = at_a(3 * (i - 1) + 1), ta = at_a(3 * i + 2);
    for (int64_t b = 0; b < D; ++b) {
      const acc_t dt = acc_t(-0.5) * (dz[b] * yb[b] + za * dy[b]);
      const acc_t y_next = dy[b] * tb[b] + ya * dt;
      dz[b] = dt * zb[b] + ta * dz[b];
      dy[b] = y_next;
    }
  }
  if (tab.n == 1) {
    for (int64_t b = 0; b < D; ++b) row[b] *= dy[b];
    return;
  }
  // W = Z·Y, F = 1.5·Y − ½·Y·W.
  const acc_t *yb = tab.values(s, 3 * (steps - 1)), *wb = tab.values(s, 3 * steps);
  const acc_t ya = at_a(3 * (steps - 1)), za = at_a(3 * (steps - 1) + 1);
  for (int64_t b = 0; b < D; ++b) {
    const acc_t dw = dz[b] * yb[b] + za * dy[b];
    row[b] *= acc_t(1.5) * dy[b] - acc_t(0.5) * (dy[b] * wb[b] + ya * dw);
  }
}

// Ḡ ← L ∘ Ḡ for the eigenvalues lambda (N, D), and dot = <Gf, F(A)> per sample; diag is
// Ḡ's diagonal before.
template <typename acc_t>
void divided_differences(Tensor& gbar, const Tensor& lambda, int64_t n, const acc_t* diag,
                         acc_t* dot) {
  const int64_t N = gbar.size(0), D = gbar.size(1);
  const acc_t* lam = lambda.const_data_ptr<acc_t>();
  const IterationTable<acc_t> tab(lam, N, D, n);
  acc_t* g = gbar.data_ptr<acc_t>();
  at::parallel_for(0, N * D, 16, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> dy(D), dz(D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / D, a = task % D;
      scale_by_divided_differences(tab, s, a, lam[task], dy.data(), dz.data(), g + task * D);
    }
  });
  // <Gf, F(A)> = Σₐ Ḡₐₐ·f(λₐ), from the diagonal as it was before L scaled it.
  for (int64_t s = 0; s < N; ++s) {
    const acc_t* f = tab.f(s);
    double sum = 0;
    for (int64_t a = 0; a < D; ++a) sum += static_cast<double>(diag[s * D + a]) * f[a];
    dot[s] = static_cast<acc_t>(sum);
  }
}

std::tuple<Tensor, Tensor> sqrtm_backward_spectral(const Tensor& A, const Tensor& Gf, int64_t n) {
  // A sample with a NaN or inf has a NaN gradient; it is decomposed as 0, since the
  // eigensolver may refuse it.
  const Tensor finite = at::isfinite(A).flatten(1).all(1).view({A.size(0), 1, 1});
  const Tensor decomposed = at::where(finite, A, at::zeros_like(A));
  // LAPACK's eigensolver runs one matrix at a time on one thread: the samples are spread
  // over the threads.
  Tensor lambda = at::empty({A.size(0), A.size(1)}, A.options());
  Tensor U = at::empty_like(A);
  const at::ThreadLocalState state;
  at::parallel_for(0, A.size(0), 1, [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard guard(state);
    const auto [w, v] = at::linalg_eigh(decomposed.slice(0, begin, end));
    lambda.slice(0, begin, end).copy_(w);
    U.slice(0, begin, end).copy_(v);
  });
  Tensor gbar = blas::bmm(blas::bmm(U.transpose(1, 2), Gf), U);
  const Tensor diag = gbar.diagonal(0, 1, 2).contiguous();
  Tensor dot = at::empty({A.size(0)}, A.options());
  AT_DISPATCH_FLOATING_TYPES(A.scalar_type(), "covariance_pool_backward", [&] {
    divided_differences<scalar_t>(gbar, lambda.contiguous(), n, diag.data_ptr<scalar_t>(),
                                  dot.data_ptr<scalar_t>());
  });
  const Tensor gA = blas::bmm(blas::bmm(U, gbar), U.transpose(1, 2));
  return {at::where(finite, gA, at::full({}, NAN, A.options())), dot};
}

// The adjoint chain costs 6 GEMMs per iteration, the spectral form one eigendecomposition
// and four GEMMs. Measured on 2 cores (backward, ms, spectral / chain): D = 64, N = 32:
// 5.5 / 3.6 at 3 iterations, 7.0 / 5.8 at 5; D = 128, N = 32: 25.9 / 28.3 at 3, 22.5 / 38.8
// at 5; D = 256, N = 8: 31.2 / 35.6 at 3, 31.7 / 69.5 at 5; 1–2 iterations favour the chain.
std::tuple<Tensor, Tensor> sqrtm_backward_cpu(const Tensor& A, const Tensor& Gf, int64_t n) {
  if (A.size(1) >= 128 && n >= 3) return sqrtm_backward_spectral(A, Gf, n);
  return sqrtm_backward_chain(A, Gf, n);
}

const Backend kBackend{centre_cpu, symmetric_product_tiles, sqrtm_backward_cpu};

std::tuple<Tensor, Tensor, Tensor> covariance_pool_cpu(const Tensor& x,
                                                       const c10::Scalar& iterations,
                                                       const c10::Scalar& sqrt,
                                                       const c10::Scalar& triu) {
  const Problem p = check_inputs(x, iterations, sqrt, triu);
  return forward(p, x, kBackend);
}

Tensor covariance_pool_backward_cpu(const Tensor& grad, const Tensor& x, const Tensor& sigma,
                                    const Tensor& scale, const c10::Scalar& iterations,
                                    const c10::Scalar& sqrt, const c10::Scalar& triu) {
  const Problem p = check_inputs(x, iterations, sqrt, triu);
  check_backward_inputs(p, grad, x, sigma, scale);
  return backward(p, grad, x, sigma, scale, kBackend);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchkit, CPU, m) {
  m.impl("covariance_pool", &covariance_pool_cpu);
  m.impl("_covariance_pool_backward", &covariance_pool_backward_cpu);
}

}  // namespace torchkit::covariance_pool
