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
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "bilinear_pool.h"
#include "blas.h"
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

// Extreme magnitudes. Z = x·yᵀ over- or underflows the accumulation type once |x| or |y| pass
// about 2^±(max_exponent/2) (float32: 1e±19), and Σ s² overflows once sqrt_eps nears the
// type's maximum: the output becomes NaN, or 0 where only the sign of a tiny Z decided it.
// Such a sample is computed at a power-of-two scale, exactly: the GEMM takes a = x·2^ex and
// b = y·2^ey (largest |entry| in [1/2, 1), ex + ey even) and the epilogue forms
//   s·2^h = sign(Z)·sqrt(|Z|·4^h + sqrt_eps·4^h),   h = (ex + ey)/2,
// lowering h where sqrt_eps·4^h would pass 2^2W: the |Z| term is then below 2^-2W of the
// other and may underflow, but the sign comes from the product itself. The output is
// s·2^h / max(‖s·2^h‖, l2_eps·2^h), the same numbers, and the norm is stored as −‖s·2^h‖ so
// that the backward knows to recompute the scale; its gradients are multiplied back by
// 2^(2h − ey) (x) and 2^(2h − ex) (y). A sample whose |x|, |y| lie in [2^-W, 2^W] (and
// sqrt_eps below 2^2W; W is a quarter of the type's exponent range, 32 for float32, 256 for
// float64) is exact unscaled, so ordinary data pays only for the largest |entry|
// of each row block, taken in its tile's task while the rows are in cache; a sample found
// outside that window is recomputed at its scale.
struct SampleScale {
  int ex = 0, ey = 0, h = 0;
  bool scaled() const { return ex != 0 || ey != 0 || h != 0; }
};

int floor_half(int v) { return v >= 0 ? v / 2 : -((1 - v) / 2); }

template <typename acc_t>
SampleScale sample_scale(double ax, double ay, double sqrt_eps) {
  constexpr int W = std::numeric_limits<acc_t>::max_exponent / 4;
  if (!(std::isfinite(ax) && std::isfinite(ay) && ax > 0 && ay > 0)) return {};  // NaN, ∞, 0
  int fx = 0, fy = 0;
  std::frexp(ax, &fx);
  std::frexp(ay, &fy);
  if (std::abs(fx) <= W && std::abs(fy) <= W && sqrt_eps <= std::ldexp(1.0, 2 * W)) return {};
  SampleScale s{-fx, -fy, 0};
  if ((s.ex + s.ey) % 2 != 0) --s.ey;  // never for y = None: ex = ey
  s.h = (s.ex + s.ey) / 2;
  if (sqrt_eps > 0) {
    int fe = 0;
    std::frexp(sqrt_eps, &fe);  // sqrt_eps < 2^fe
    s.h = std::min(s.h, floor_half(2 * W - fe));
  }
  return s;
}

// Per sample, what the epilogue applies to the product P = a·bᵀ of the (scaled) operands:
// s·2^h = signed_sqrt(P·mul, eps) with P's sign.
template <typename acc_t>
struct Epilogue {
  std::vector<acc_t> mul, eps;
  std::vector<int> h;
  std::vector<char> scaled;

  Epilogue(const Problem& p, const std::vector<SampleScale>& scales) {
    const acc_t inv_hw = acc_t(1) / static_cast<acc_t>(p.HW);
    for (const SampleScale& s : scales) {
      scaled.push_back(s.scaled());
      mul.push_back(s.scaled() ? std::ldexp(inv_hw, 2 * s.h - s.ex - s.ey) : inv_hw);
      eps.push_back(static_cast<acc_t>(s.scaled() ? std::ldexp(p.sqrt_eps, 2 * s.h) : p.sqrt_eps));
      h.push_back(s.h);
    }
  }
  bool any() const { return std::find(scaled.begin(), scaled.end(), 1) != scaled.end(); }
};

// A scaled sample's normalisation: whether v = ‖s·2^h‖ passes l2_eps·2^h (F.normalize's
// clamp), and 1 / max(v, l2_eps·2^h) as m·2^e. Compared and inverted by exponents: l2_eps·2^h
// can leave double's range where the output it gives is still a number.
struct Inverse {
  bool passes;
  double m;
  int e;
};

Inverse inverse_denominator(double v, double l2_eps, int h) {
  int ev = 0, el = 0;
  const double mv = std::frexp(v, &ev), ml = std::frexp(l2_eps, &el);
  const bool passes = l2_eps == 0 || (v != 0 && (ev != el + h ? ev > el + h : mv >= ml));
  if (!passes) return {false, 1 / ml, -el - h};
  int e = 0;
  const double m = std::frexp(1 / v, &e);
  return {true, m, e};
}

// The largest |entry| of a (rows, cols) block of an operand, NaN if it holds one. One of the
// strides is 1 but for odd views (operands() reads x as (N, C, HW) or, channels_last, its
// transpose).
template <typename acc_t>
double max_abs(const Tensor& block) {
  int64_t rows = block.size(0), cols = block.size(1), rs = block.stride(0), cs = block.stride(1);
  if (cs != 1) {
    std::swap(rows, cols);
    std::swap(rs, cs);
  }
  if (cs != 1 && cols > 1) return block.abs().max().item<double>();
  using V = Vectorized<acc_t>;
  const acc_t* base = block.const_data_ptr<acc_t>();
  V vmax(0);
  acc_t m = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const acc_t* row = base + r * rs;
    int64_t k = 0;
    for (; k + V::size() <= cols; k += V::size())
      vmax = at::vec::maximum(vmax, V::loadu(row + k).abs());
    for (; k < cols; ++k) {
      const acc_t v = std::abs(row[k]);
      if (std::isnan(v) || v > m) m = v;
    }
  }
  const acc_t vm =
      at::vec::vec_reduce_all<acc_t>([](V u, V v) { return at::vec::maximum(u, v); }, vmax);
  return std::isnan(vm) || vm > m ? vm : m;
}

// z ← signed_sqrt(z·mul, eps) over n entries, with z's sign (z·mul may underflow: see
// sample_scale); returns Σ of the squares.
template <typename acc_t>
acc_t signed_sqrt_row(acc_t* z, int64_t n, acc_t mul, acc_t eps) {
  using V = Vectorized<acc_t>;
  const V vmul(mul), veps(eps), zero(0);
  V vsum(0);
  int64_t k = 0;
  for (; k + V::size() <= n; k += V::size()) {
    const V p = V::loadu(z + k);
    const V root = ((p * vmul).abs() + veps).sqrt();
    const V out = V::blendv(V::blendv(root, zero - root, p < zero), zero, p == zero);
    out.store(z + k);
    vsum = at::vec::fmadd(out, out, vsum);
  }
  acc_t sum = at::vec::vec_reduce_all<acc_t>([](V a, V b) { return a + b; }, vsum);
  for (; k < n; ++k) {
    const acc_t p = z[k], root = std::sqrt(std::abs(p * mul) + eps);
    z[k] = p > acc_t(0) ? root : (p < acc_t(0) ? -root : (p == p ? acc_t(0) : p));
    sum += z[k] * z[k];
  }
  return sum;
}

// Writes s·2^h of tile T (its product, di × dj, in scratch) into the sample's rows of s and,
// for an off-diagonal tile of x·xᵀ, into the mirrored rows too. Returns the tile's share of
// Σ s².
template <typename acc_t>
acc_t store_tile(const Problem& p, const Tile& T, const Tensor& z, acc_t mul, acc_t eps, acc_t* s) {
  const int64_t di = z.size(0), dj = z.size(1);
  acc_t* zp = z.data_ptr<acc_t>();
  const int64_t zs = z.stride(0);
  acc_t sumsq = 0;
  for (int64_t r = 0; r < di; ++r) sumsq += signed_sqrt_row(zp + r * zs, dj, mul, eps);
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

// The largest |entry| per row block of a and b (one per kTile rows), as the forward's tiles
// meet them.
struct RowBlockMax {
  int64_t blocks_a, blocks_b;
  std::vector<double> a, b;

  explicit RowBlockMax(const Problem& p)
      : blocks_a((p.D + kTile - 1) / kTile),
        blocks_b((p.E + kTile - 1) / kTile),
        a(p.N * blocks_a),
        b(p.self ? 0 : p.N * blocks_b) {}

  // max |a_n|, max |b_n| (NaN-propagating)
  std::pair<double, double> sample(const Problem& p, int64_t n) const {
    auto over = [](const double* v, int64_t k) {
      double m = 0;
      for (int64_t i = 0; i < k; ++i)
        if (std::isnan(v[i]) || v[i] > m) m = v[i];
      return m;
    };
    const double ax = over(a.data() + n * blocks_a, blocks_a);
    return {ax, p.self ? ax : over(b.data() + n * blocks_b, blocks_b)};
  }
};

// s·2^h of a·bᵀ (N, D·E) for the samples `run` marks (all if empty), one BLAS call per tile
// with its epilogue while the tile is in cache (for y = None only the tiles on and above the
// diagonal); with `seen`, also each row block's largest |entry|. Returns Σ s² per sample,
// summed in tile order (deterministic).
template <typename acc_t>
std::vector<double> signed_sqrt_products(const Problem& p, const Tensor& a, const Tensor& b,
                                         const Epilogue<acc_t>& e, const std::vector<char>& run,
                                         acc_t* s, RowBlockMax* seen) {
  std::vector<Tile> tiles;
  for (int64_t n = 0; n < p.N; ++n) {
    if (!run.empty() && !run[n]) continue;
    for (int64_t i0 = 0; i0 < p.D; i0 += kTile)
      for (int64_t j0 = p.self ? i0 : 0; j0 < p.E; j0 += kTile) tiles.push_back({n, i0, j0});
  }
  std::vector<acc_t> tile_sumsq(tiles.size());
  // The tasks call ATen (the tile's GEMM): OpenMP's worker threads must see this thread's
  // dispatcher state (below autograd), or mm_out would refuse inputs that require grad.
  const at::ThreadLocalState state;
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard guard(state);
    Tensor scratch = at::empty({kTile, kTile}, a.options());
    for (int64_t t = begin; t < end; ++t) {
      const Tile& T = tiles[t];
      const int64_t di = std::min(kTile, p.D - T.i0), dj = std::min(kTile, p.E - T.j0);
      const Tensor rows_a = a[T.n].narrow(0, T.i0, di), rows_b = b[T.n].narrow(0, T.j0, dj);
      Tensor z = scratch.narrow(0, 0, di).narrow(1, 0, dj);
      blas::mm_out(z, rows_a, rows_b.t());
      if (seen && T.j0 == (p.self ? T.i0 : 0))
        seen->a[T.n * seen->blocks_a + T.i0 / kTile] = max_abs<acc_t>(rows_a);
      if (seen && !p.self && T.i0 == 0)
        seen->b[T.n * seen->blocks_b + T.j0 / kTile] = max_abs<acc_t>(rows_b);
      tile_sumsq[t] = store_tile(p, T, z, e.mul[T.n], e.eps[T.n], s);
    }
  });
  std::vector<double> sumsq(p.N, 0.0);
  for (size_t t = 0; t < tiles.size(); ++t) sumsq[tiles[t].n] += tile_sumsq[t];
  return sumsq;
}

// a·2^e[n] per sample, as two products by representable powers of two (e reaches ±1075).
template <typename acc_t>
Tensor scaled_by(const Tensor& a, const std::vector<int>& e) {
  const int64_t N = a.size(0);
  Tensor f = at::empty({2, N, 1, 1}, a.options());
  acc_t* fp = f.data_ptr<acc_t>();
  for (int64_t n = 0; n < N; ++n) {
    fp[n] = std::ldexp(acc_t(1), e[n] / 2);
    fp[N + n] = std::ldexp(acc_t(1), e[n] - e[n] / 2);
  }
  return (a * f[0]).mul_(f[1]);
}

template <typename acc_t>
std::pair<Tensor, Tensor> scaled_operands(const Problem& p, const Tensor& a, const Tensor& b,
                                          const std::vector<SampleScale>& scales) {
  std::vector<int> ex, ey;
  for (const SampleScale& s : scales) {
    ex.push_back(s.ex);
    ey.push_back(s.ey);
  }
  const Tensor sa = scaled_by<acc_t>(a, ex);
  return {sa, p.self ? sa : scaled_by<acc_t>(b, ey)};
}

// out = s / max(‖s‖, l2_eps) per sample (inv[n] = its reciprocal), in chunks spread over the
// threads.
template <typename scalar_t, typename acc_t>
void normalise(const Problem& p, const acc_t* s, const std::vector<acc_t>& inv, scalar_t* out) {
  const int64_t DE = p.D * p.E;
  const int64_t chunks = (DE + kChunk - 1) / kChunk;
  at::parallel_for(0, p.N * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / chunks, k0 = n * DE + (task % chunks) * kChunk;
      const int64_t k1 = std::min(k0 + kChunk, (n + 1) * DE);
      const acc_t f = inv[n];
      if constexpr (std::is_same_v<scalar_t, acc_t>) {
        at::vec::map([f](Vectorized<acc_t> v) { return v * Vectorized<acc_t>(f); }, out + k0,
                     s + k0, k1 - k0);
      } else {
        for (int64_t k = k0; k < k1; ++k) out[k] = static_cast<scalar_t>(s[k] * f);
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
  acc_t* sp = s.data_ptr<acc_t>();
  RowBlockMax seen(p);
  std::vector<double> sumsq = signed_sqrt_products(
      p, a, b, Epilogue<acc_t>(p, std::vector<SampleScale>(p.N)), {}, sp, &seen);
  std::vector<SampleScale> scales(p.N);
  for (int64_t n = 0; n < p.N; ++n) {
    const auto [ax, ay] = seen.sample(p, n);
    scales[n] = sample_scale<acc_t>(ax, ay, p.sqrt_eps);
  }
  const Epilogue<acc_t> e(p, scales);
  if (e.any()) {  // recompute the samples outside the window at their scales
    const auto [sa, sb] = scaled_operands<acc_t>(p, a, b, scales);
    const std::vector<double> redone = signed_sqrt_products(p, sa, sb, e, e.scaled, sp, nullptr);
    for (int64_t n = 0; n < p.N; ++n)
      if (e.scaled[n]) sumsq[n] = redone[n];
  }
  Tensor norm = at::empty({p.N}, a.options());
  acc_t* nrm = norm.data_ptr<acc_t>();
  std::vector<acc_t> inv(p.N);
  for (int64_t n = 0; n < p.N; ++n) {
    const acc_t v = static_cast<acc_t>(std::sqrt(sumsq[n]));
    nrm[n] = e.scaled[n] ? -v : v;
    if (e.scaled[n]) {
      const Inverse d = inverse_denominator(v, p.l2_eps, scales[n].h);
      inv[n] = static_cast<acc_t>(std::ldexp(d.m, d.e));
    } else {
      inv[n] = acc_t(1) / std::max(v, static_cast<acc_t>(p.l2_eps));
    }
  }
  normalise(p, s.const_data_ptr<acc_t>(), inv, out.data_ptr<scalar_t>());
  return {out, norm};
}

std::tuple<Tensor, Tensor> forward_cpu(const Tensor& x, const std::optional<Tensor>& y,
                                       const c10::Scalar& sqrt_eps, const c10::Scalar& l2_eps) {
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
  std::vector<int> coef_exp;  // a scaled sample's coefficient is coef·2^coef_exp

  void row(int64_t n, int64_t k, acc_t* dz, int64_t len) const {
    grad_z_row<scalar_t, acc_t>(o + k, g + k * gs, gs, dz, len, dot[n], coef[n]);
  }
};

// The normalisation's Jacobian needs dot(o, g) per sample; F.normalize's clamp passes the
// gradient where ‖s‖ >= l2_eps (grad_z() in the header is the scalar statement). Partial
// dots per chunk (acc type, vectorised) are combined in double, in chunk order. A scaled
// sample's ‖s·2^h‖ (stored negated) meets l2_eps·2^h, in double, and its coefficient keeps
// its exponent apart (the clamp's can pass the acc type's range).
template <typename scalar_t>
void sample_coefficients(const Problem& p, const at::opmath_type<scalar_t>* nrm,
                         const Epilogue<at::opmath_type<scalar_t>>& e, GradZ<scalar_t>& gz) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t DE = p.D * p.E, chunks = (DE + kChunk - 1) / kChunk;
  const acc_t l2_eps = static_cast<acc_t>(p.l2_eps);
  std::vector<char> passes(p.N);
  std::vector<Inverse> inverse(p.N);
  for (int64_t n = 0; n < p.N; ++n) {
    if (e.scaled[n])
      inverse[n] = inverse_denominator(-static_cast<double>(nrm[n]), p.l2_eps, e.h[n]);
    passes[n] = e.scaled[n] ? inverse[n].passes : nrm[n] >= l2_eps;
  }
  std::vector<double> partial(p.N * chunks, 0.0);
  at::parallel_for(0, p.N * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / chunks, k0 = n * DE + (task % chunks) * kChunk;
      if (passes[n])
        partial[task] =
            dot_chunk(gz.o + k0, gz.g + k0 * gz.gs, gz.gs, std::min(kChunk, (n + 1) * DE - k0));
    }
  });
  const acc_t inv_hw = acc_t(1) / static_cast<acc_t>(p.HW);
  gz.dot.resize(p.N);
  gz.coef.resize(p.N);
  gz.coef_exp.assign(p.N, 0);
  for (int64_t n = 0; n < p.N; ++n) {
    double sum = 0;
    for (int64_t k = 0; k < chunks; ++k) sum += partial[n * chunks + k];
    gz.dot[n] = static_cast<acc_t>(sum);
    if (e.scaled[n]) {  // 1 / (2·HW·denom²), as m·2^-2W·2^coef_exp: c/|o| stays finite for
                        // any normal |o| and g·c for any normal g
      constexpr int kShift = std::numeric_limits<acc_t>::max_exponent / 2;
      const Inverse& d = inverse[n];
      int ce = 0;
      const double m = std::frexp(d.m * d.m / (2.0 * p.HW), &ce);
      gz.coef[n] = static_cast<acc_t>(std::ldexp(m, -kShift));
      gz.coef_exp[n] = ce + 2 * d.e + kShift;
    } else {
      const acc_t denom = passes[n] ? nrm[n] : l2_eps;
      gz.coef[n] = inv_hw / (acc_t(2) * denom * denom);
    }
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
// here so that the GEMMs after it need no extra pass. A scaled sample's is returned
// divided by 2^e[n], e the second result.
template <typename scalar_t>
std::pair<Tensor, std::vector<int>> grad_z_kernel(const Problem& p, const Tensor& grad,
                                                  const Tensor& out, const Tensor& norm,
                                                  const Epilogue<at::opmath_type<scalar_t>>& e) {
  using acc_t = at::opmath_type<scalar_t>;
  const GradInput g_in = grad_input(grad);
  const Tensor o_c = out.contiguous();
  GradZ<scalar_t> gz{
      o_c.const_data_ptr<scalar_t>(), g_in.tensor.const_data_ptr<scalar_t>(), g_in.stride, {}, {}};
  sample_coefficients(p, norm.const_data_ptr<acc_t>(), e, gz);
  Tensor dz = cpu::empty_for_writing({p.N, p.D, p.E}, norm.options());
  if (p.self)
    grad_z_symmetric(p, gz, dz.data_ptr<acc_t>());
  else
    grad_z_general(p, gz, dz.data_ptr<acc_t>());
  return {dz, gz.coef_exp};
}

// The forward's scales again, for the samples whose norm it stored negated.
template <typename acc_t>
std::vector<SampleScale> backward_scales(const Problem& p, const Tensor& x,
                                         const std::optional<Tensor>& y, const acc_t* nrm,
                                         std::optional<std::pair<Tensor, Tensor>>& ab) {
  std::vector<SampleScale> scales(p.N);
  for (int64_t n = 0; n < p.N; ++n) {
    if (!(nrm[n] < acc_t(0))) continue;
    if (!ab) {
      const auto [a, b] = operands(p, x, y);
      ab.emplace(a, b);
    }
    const double ax = max_abs<acc_t>(ab->first[n]);
    scales[n] = sample_scale<acc_t>(ax, p.self ? ax : max_abs<acc_t>(ab->second[n]), p.sqrt_eps);
  }
  return scales;
}

// grad ← grad·2^e[n] per sample (a contiguous (N, …) gradient in the acc type).
template <typename acc_t>
void unscale(Tensor& grad, const std::vector<int>& e) {
  const int64_t N = grad.size(0), per = grad.numel() / std::max<int64_t>(N, 1);
  acc_t* g = grad.data_ptr<acc_t>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      if (e[n] != 0)
        for (int64_t k = n * per; k < (n + 1) * per; ++k) g[k] = std::ldexp(g[k], e[n]);
  });
}

std::tuple<Tensor, Tensor> backward_cpu(const Tensor& grad, const Tensor& x,
                                        const std::optional<Tensor>& y, const Tensor& out,
                                        const Tensor& norm, const c10::Scalar& sqrt_eps,
                                        const c10::Scalar& l2_eps,
                                        std::array<bool, 2> output_mask) {
  const Problem p = check_inputs(x, y, sqrt_eps, l2_eps);
  check_backward_inputs(p, grad, x, out, norm);
  Tensor dz;
  std::optional<ScaledOperands> scaled;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "bilinear_pool_backward_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const Tensor nrm = norm.contiguous();
        std::optional<std::pair<Tensor, Tensor>> ab;
        const std::vector<SampleScale> scales =
            backward_scales(p, x, y, nrm.const_data_ptr<acc_t>(), ab);
        const Epilogue<acc_t> e(p, scales);
        std::vector<int> dz_exp;
        std::tie(dz, dz_exp) = grad_z_kernel<scalar_t>(p, grad, out, nrm, e);
        if (!e.any()) return;
        const auto [sa, sb] = scaled_operands<acc_t>(p, ab->first, ab->second, scales);
        // x's gradient by 2^(2h − ey), y's by 2^(2h − ex), and both by dZ's 2^e
        std::array<std::vector<int>, 2> back;
        for (int64_t n = 0; n < p.N; ++n) {
          const SampleScale& s = scales[n];
          back[0].push_back(2 * s.h - s.ey + dz_exp[n]);
          back[1].push_back(2 * s.h - s.ex + dz_exp[n]);
        }
        scaled = ScaledOperands{sa, sb,
                                [back](Tensor& g, int input) { unscale<acc_t>(g, back[input]); }};
      });
  return input_grads(
      p, dz, x, y, output_mask,
      [](at::IntArrayRef sizes, const at::TensorOptions& options) {
        return cpu::empty_for_writing(sizes, options);
      },
      scaled ? &*scaled : nullptr);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchkit, CPU, m) {
  m.impl("bilinear_pool", &forward_cpu);
  m.impl("_bilinear_pool_backward", &backward_cpu);
}

}  // namespace torchkit::bilinear_pool
