// Bilinear pooling on the CPU.
//
// Forward: Z is computed in tiles of kTile × kTile (one BLAS call per tile, tasks spread over
// the threads); for y = None only the tiles on and above the diagonal (syrk-style: ~half the
// flops) and each is mirrored. A tile's epilogue (scale, signed sqrt, sum of squares) runs
// while it is in cache; a second pass over the output applies the per-sample normalisation.
// Backward: one elementwise pass forms ∂L/∂Z (symmetrised for y = None) from the output and
// its gradient, then one GEMM per input (bilinear_pool.cpp).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "bilinear_pool.h"
#include "common.h"
#include "cpu/memory.h"

namespace torchkit::bilinear_pool {
namespace {

using at::Tensor;
using at::vec::Vectorized;

constexpr int64_t kTile = 128;                // Z tile edge (one BLAS call)
constexpr int64_t kChunk = int64_t{1} << 14;  // entries per task of an elementwise pass

struct Tile {
  int64_t n, i0, j0;
};

// z ← signed_sqrt(z / HW) over n entries; returns Σ of the squares.
template <typename acc_t>
acc_t signed_sqrt_row(acc_t* z, int64_t n, acc_t inv_hw, acc_t eps) {
  using V = Vectorized<acc_t>;
  const V vinv(inv_hw), veps(eps), zero(0);
  V vsum(0);
  int64_t k = 0;
  for (; k + V::size() <= n; k += V::size()) {
    const V v = V::loadu(z + k) * vinv;
    const V root = (v.abs() + veps).sqrt();
    const V out = V::blendv(V::blendv(root, zero - root, v < zero), zero, v == zero);
    out.store(z + k);
    vsum = at::vec::fmadd(out, out, vsum);
  }
  acc_t sum = at::vec::vec_reduce_all<acc_t>([](V a, V b) { return a + b; }, vsum);
  for (; k < n; ++k) {
    z[k] = signed_sqrt(z[k] * inv_hw, eps);
    sum += z[k] * z[k];
  }
  return sum;
}

// Writes s = signed_sqrt(Z / HW) of tile T (its product z, di × dj, in scratch) into the
// sample's rows of s and, for an off-diagonal tile of x·xᵀ, into the mirrored rows too.
// Returns the tile's share of Σ s².
template <typename acc_t>
acc_t store_tile(const Problem& p, const Tile& T, const Tensor& z, acc_t inv_hw, acc_t eps,
                 acc_t* s) {
  const int64_t di = z.size(0), dj = z.size(1);
  acc_t* zp = z.data_ptr<acc_t>();
  const int64_t zs = z.stride(0);
  acc_t sumsq = 0;
  for (int64_t r = 0; r < di; ++r) sumsq += signed_sqrt_row(zp + r * zs, dj, inv_hw, eps);
  acc_t* sn = s + T.n * p.D * p.E;
  for (int64_t r = 0; r < di; ++r)
    std::copy(zp + r * zs, zp + r * zs + dj, sn + (T.i0 + r) * p.E + T.j0);
  if (p.self && T.i0 != T.j0) {
    for (int64_t c = 0; c < dj; ++c) {
      acc_t* row = sn + (T.j0 + c) * p.E + T.i0;
      for (int64_t r = 0; r < di; ++r) row[r] = zp[r * zs + c];
    }
    sumsq *= 2;
  }
  return sumsq;
}

// s = signed_sqrt(a·bᵀ / HW) (N, D·E), one BLAS call per tile with its epilogue while the
// tile is in cache (for y = None only the tiles on and above the diagonal). Returns ‖s‖ per
// sample, summed in tile order (deterministic).
template <typename acc_t>
std::vector<double> signed_sqrt_products(const Problem& p, const Tensor& a, const Tensor& b,
                                         acc_t* s) {
  std::vector<Tile> tiles;
  for (int64_t n = 0; n < p.N; ++n)
    for (int64_t i0 = 0; i0 < p.D; i0 += kTile)
      for (int64_t j0 = p.self ? i0 : 0; j0 < p.E; j0 += kTile) tiles.push_back({n, i0, j0});
  std::vector<acc_t> tile_sumsq(tiles.size());
  const acc_t inv_hw = acc_t(1) / static_cast<acc_t>(p.HW);
  const acc_t eps = static_cast<acc_t>(p.sqrt_eps);
  // The tasks call ATen (the tile's GEMM): OpenMP's worker threads must see this thread's
  // dispatcher state (below autograd), or mm_out would refuse inputs that require grad.
  const at::ThreadLocalState state;
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard guard(state);
    Tensor scratch = at::empty({kTile, kTile}, a.options());
    for (int64_t t = begin; t < end; ++t) {
      const Tile& T = tiles[t];
      const int64_t di = std::min(kTile, p.D - T.i0), dj = std::min(kTile, p.E - T.j0);
      Tensor z = scratch.narrow(0, 0, di).narrow(1, 0, dj);
      at::mm_out(z, a[T.n].narrow(0, T.i0, di), b[T.n].narrow(0, T.j0, dj).t());
      tile_sumsq[t] = store_tile(p, T, z, inv_hw, eps, s);
    }
  });
  std::vector<double> norms(p.N, 0.0);
  for (size_t t = 0; t < tiles.size(); ++t) norms[tiles[t].n] += tile_sumsq[t];
  for (double& v : norms) v = std::sqrt(v);
  return norms;
}

// out = s / max(‖s‖, l2_eps) per sample, in chunks spread over the threads.
template <typename scalar_t, typename acc_t>
void normalise(const Problem& p, const acc_t* s, const acc_t* nrm, scalar_t* out) {
  const int64_t DE = p.D * p.E;
  const acc_t l2_eps = static_cast<acc_t>(p.l2_eps);
  const int64_t chunks = (DE + kChunk - 1) / kChunk;
  at::parallel_for(0, p.N * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / chunks, k0 = n * DE + (task % chunks) * kChunk;
      const int64_t k1 = std::min(k0 + kChunk, (n + 1) * DE);
      const acc_t inv = acc_t(1) / std::max(nrm[n], l2_eps);
      if constexpr (std::is_same_v<scalar_t, acc_t>) {
        at::vec::map([inv](Vectorized<acc_t> v) { return v * Vectorized<acc_t>(inv); }, out + k0,
                     s + k0, k1 - k0);
      } else {
        for (int64_t k = k0; k < k1; ++k) out[k] = static_cast<scalar_t>(s[k] * inv);
      }
    }
  });
}

template <typename scalar_t>
std::tuple<Tensor, Tensor> forward_kernel(const Problem& p, const Tensor& x,
                                          const std::optional<Tensor>& y) {
  using acc_t = at::opmath_type<scalar_t>;
  const auto [a, b] = operands(p, x, y);
  // s is stored in the output itself when the types agree, else in an acc-typed buffer.
  Tensor out = cpu::empty_for_writing({p.N, p.D * p.E}, x.options());
  Tensor s =
      std::is_same_v<scalar_t, acc_t> ? out : cpu::empty_for_writing({p.N, p.D * p.E}, a.options());
  const std::vector<double> norms = signed_sqrt_products(p, a, b, s.data_ptr<acc_t>());
  Tensor norm = at::empty({p.N}, a.options());
  acc_t* nrm = norm.data_ptr<acc_t>();
  for (int64_t n = 0; n < p.N; ++n) nrm[n] = static_cast<acc_t>(norms[n]);
  normalise(p, s.const_data_ptr<acc_t>(), nrm, out.data_ptr<scalar_t>());
  return {out, norm};
}

std::tuple<Tensor, Tensor> forward_cpu(const Tensor& x, const std::optional<Tensor>& y,
                                       double sqrt_eps, double l2_eps) {
  const Problem p = check_inputs(x, y, sqrt_eps, l2_eps);
  std::tuple<Tensor, Tensor> result;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bilinear_pool_cpu",
                                  [&] { result = forward_kernel<scalar_t>(p, x, y); });
  return result;
}

// Σ o·g over n entries, vectorised in the accumulation type.
template <typename scalar_t>
double dot_chunk(const scalar_t* o, const scalar_t* g, int64_t gstride, int64_t n) {
  using acc_t = at::opmath_type<scalar_t>;
  int64_t k = 0;
  double sum = 0;
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    using V = Vectorized<acc_t>;
    V acc(0);
    for (; k + V::size() <= n; k += V::size())
      acc = at::vec::fmadd(V::loadu(o + k), gstride ? V::loadu(g + k) : V(g[0]), acc);
    sum = at::vec::vec_reduce_all<acc_t>([](V a, V b) { return a + b; }, acc);
  }
  for (; k < n; ++k) sum += static_cast<double>(o[k]) * static_cast<double>(g[k * gstride]);
  return sum;
}

// ∂L/∂Z · 1/HW for one sample's n entries. Per sample, grad_z() reduces to
// (g − o·dot') · c / |o| (0 where o = 0) with c = 1 / (2·denom²·HW), dot' = dot or 0.
template <typename scalar_t, typename acc_t>
void grad_z_row(const scalar_t* o, const scalar_t* g, int64_t gstride, acc_t* dz, int64_t n,
                acc_t dot, acc_t c) {
  int64_t k = 0;
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    using V = Vectorized<acc_t>;
    const V vdot(dot), vc(c), zero(0);
    for (; k + V::size() <= n; k += V::size()) {
      const V vo = V::loadu(o + k), vg = gstride ? V::loadu(g + k) : V(g[0]);
      const V v = (vg - vo * vdot) * vc / vo.abs();
      V::blendv(v, zero, vo == zero).store(dz + k);
    }
  }
  for (; k < n; ++k) {
    const acc_t ok = static_cast<acc_t>(o[k]), gk = static_cast<acc_t>(g[k * gstride]);
    dz[k] = ok == acc_t(0) ? acc_t(0) : (gk - ok * dot) * c / std::abs(ok);
  }
}

// What grad_z_row needs per sample, and where it reads it from.
template <typename scalar_t>
struct GradZ {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* o;  // the output (N, D·E)
  const scalar_t* g;  // its gradient; g[k·gs] (gs = 0 for an expanded scalar)
  int64_t gs;
  std::vector<acc_t> dot, coef;

  void row(int64_t n, int64_t k, acc_t* dz, int64_t len) const {
    grad_z_row<scalar_t, acc_t>(o + k, g + k * gs, gs, dz, len, dot[n], coef[n]);
  }
};

// The normalisation's Jacobian needs dot(o, g) per sample; F.normalize's clamp passes the
// gradient where ‖s‖ >= l2_eps (grad_z() in the header is the scalar statement). Partial
// dots per chunk (acc type, vectorised) are combined in double, in chunk order.
template <typename scalar_t>
void sample_coefficients(const Problem& p, const at::opmath_type<scalar_t>* nrm,
                         GradZ<scalar_t>& gz) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t DE = p.D * p.E, chunks = (DE + kChunk - 1) / kChunk;
  const acc_t l2_eps = static_cast<acc_t>(p.l2_eps);
  std::vector<double> partial(p.N * chunks, 0.0);
  at::parallel_for(0, p.N * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / chunks, k0 = n * DE + (task % chunks) * kChunk;
      if (nrm[n] >= l2_eps)
        partial[task] =
            dot_chunk(gz.o + k0, gz.g + k0 * gz.gs, gz.gs, std::min(kChunk, (n + 1) * DE - k0));
    }
  });
  const acc_t inv_hw = acc_t(1) / static_cast<acc_t>(p.HW);
  gz.dot.resize(p.N);
  gz.coef.resize(p.N);
  for (int64_t n = 0; n < p.N; ++n) {
    double sum = 0;
    for (int64_t k = 0; k < chunks; ++k) sum += partial[n * chunks + k];
    const acc_t denom = nrm[n] >= l2_eps ? nrm[n] : l2_eps;
    gz.dot[n] = static_cast<acc_t>(sum);
    gz.coef[n] = inv_hw / (acc_t(2) * denom * denom);
  }
}

// dZ for a · bᵀ with b ≠ a: one elementwise pass in chunks.
template <typename scalar_t>
void grad_z_general(const Problem& p, const GradZ<scalar_t>& gz, at::opmath_type<scalar_t>* dz) {
  const int64_t DE = p.D * p.E, chunks = (DE + kChunk - 1) / kChunk;
  at::parallel_for(0, p.N * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / chunks, off = n * DE + (task % chunks) * kChunk;
      gz.row(n, off, dz + off, std::min(kChunk, (n + 1) * DE - off));
    }
  });
}

// dZ for Z = x·xᵀ: entries (i, j) and (j, i) are the same sum, so both get dZ_ij + dZ_ji.
// Per pair of kSquare² squares, both are computed from rows of out and grad into local
// buffers, added, and written once: reading a square's columns in place would stride by D,
// and for power-of-two D those reads collide in the same cache sets.
template <typename scalar_t>
void grad_z_symmetric(const Problem& p, const GradZ<scalar_t>& gz, at::opmath_type<scalar_t>* dz) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int64_t kSquare = 64;
  const int64_t D = p.D, squares = (D + kSquare - 1) / kSquare;
  std::vector<std::pair<int64_t, int64_t>> pairs;  // upper-triangle squares (bi <= bj)
  for (int64_t bi = 0; bi < squares; ++bi)
    for (int64_t bj = bi; bj < squares; ++bj) pairs.emplace_back(bi * kSquare, bj * kSquare);
  const int64_t per_sample = static_cast<int64_t>(pairs.size());
  at::parallel_for(0, p.N * per_sample, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> upper(kSquare * kSquare), lower(kSquare * kSquare);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / per_sample, base = n * D * D;
      acc_t* m = dz + base;
      const auto [i0, j0] = pairs[task % per_sample];
      const int64_t di = std::min(kSquare, D - i0), dj = std::min(kSquare, D - j0);
      // upper[r][c] = dZ[i0 + r][j0 + c], lower[c][r] = dZ[j0 + c][i0 + r]
      for (int64_t r = 0; r < di; ++r)
        gz.row(n, base + (i0 + r) * D + j0, upper.data() + r * kSquare, dj);
      for (int64_t c = 0; c < dj; ++c)
        gz.row(n, base + (j0 + c) * D + i0, lower.data() + c * kSquare, di);
      for (int64_t r = 0; r < di; ++r) {
        for (int64_t c = 0; c < dj; ++c) {
          const acc_t v = upper[r * kSquare + c] + lower[c * kSquare + r];
          upper[r * kSquare + c] = v;
          lower[c * kSquare + r] = v;
        }
      }
      // On a diagonal square both buffers hold the same entries, already symmetrised.
      for (int64_t r = 0; r < di; ++r)
        std::copy_n(upper.data() + r * kSquare, dj, m + (i0 + r) * D + j0);
      if (i0 != j0) {
        for (int64_t c = 0; c < dj; ++c)
          std::copy_n(lower.data() + c * kSquare, di, m + (j0 + c) * D + i0);
      }
    }
  });
}

// ∂L/∂Z · 1/HW (N, D, E) in the accumulation type: the 1/HW of the product is folded in
// here so that the GEMMs after it need no extra pass.
template <typename scalar_t>
Tensor grad_z_kernel(const Problem& p, const Tensor& grad, const Tensor& out, const Tensor& norm) {
  using acc_t = at::opmath_type<scalar_t>;
  const GradInput g_in = grad_input(grad);
  const Tensor o_c = out.contiguous();
  GradZ<scalar_t> gz{
      o_c.const_data_ptr<scalar_t>(), g_in.tensor.const_data_ptr<scalar_t>(), g_in.stride, {}, {}};
  sample_coefficients(p, norm.const_data_ptr<acc_t>(), gz);
  Tensor dz = cpu::empty_for_writing({p.N, p.D, p.E}, norm.options());
  if (p.self)
    grad_z_symmetric(p, gz, dz.data_ptr<acc_t>());
  else
    grad_z_general(p, gz, dz.data_ptr<acc_t>());
  return dz;
}

std::tuple<Tensor, Tensor> backward_cpu(const Tensor& grad, const Tensor& x,
                                        const std::optional<Tensor>& y, const Tensor& out,
                                        const Tensor& norm, double sqrt_eps, double l2_eps,
                                        std::array<bool, 2> output_mask) {
  const Problem p = check_inputs(x, y, sqrt_eps, l2_eps);
  check_backward_inputs(p, grad, x, out, norm);
  Tensor dz;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "bilinear_pool_backward_cpu",
      [&] { dz = grad_z_kernel<scalar_t>(p, grad, out, norm.contiguous()); });
  return input_grads(p, dz, x, y, output_mask,
                     [](at::IntArrayRef sizes, const at::TensorOptions& options) {
                       return cpu::empty_for_writing(sizes, options);
                     });
}

}  // namespace

TORCH_LIBRARY_IMPL(torchkit, CPU, m) {
  m.impl("bilinear_pool", &forward_cpu);
  m.impl("_bilinear_pool_backward", &backward_cpu);
}

}  // namespace torchkit::bilinear_pool
