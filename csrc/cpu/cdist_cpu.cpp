// Pairwise Euclidean distance on the CPU.
//
// Forward: the output is produced in tiles of whole rows that fit in the last-level cache:
// BLAS (multi-threaded) multiplies the tile's rows of the centred x1 by the centred x2ᵀ
// straight into the output, then the threads run the epilogue (norms, refinement, clamp,
// sqrt, zero diagonal) over the tile while it is still in cache: one pass over P×R, not four.
// (Calling BLAS single-threaded from inside parallel tasks measured 1.6× slower here: the
// library's own threading blocks the GEMM better.)
// Backward: the same tiling; G' = grad / dist is formed for a tile of rows in a scratch
// buffer; BLAS writes G'·x2 into grad_x1's rows, which one pass turns into rowsum(G')·x1 −
// G'·x2, and accumulates G'ᵀ·x1 (and G''s column sums) for grad_x2 = colsum·x2 − G'ᵀ·x1.
// G' is never materialised whole, and no output is zero-filled first.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "blas.h"
#include "cdist.h"
#include "common.h"
#include "cpu/distance.h"
#include "cpu/memory.h"

namespace torchkit::cdist {
namespace {

using at::Tensor;
using at::vec::Vectorized;
using cpu::direct_sq;

constexpr int64_t kOutputTileBytes = 16 << 20;  // an output tile that stays in the L3 cache
constexpr int64_t kColumnBlock = 64;            // backward: rows per partial column sum

int64_t tile_rows(int64_t R, int64_t elem_size) {
  return std::clamp<int64_t>(kOutputTileBytes / std::max<int64_t>(R * elem_size, 1), 16, 1024);
}

// The epilogue's test: the expansion cancelled (or is NaN), or the norms are so small that
// underflow may have struck (cpu::tiny_norms), and the entry is recomputed.
template <typename acc_t>
bool refines(acc_t d2, acc_t norms, acc_t tiny) {
  return !(d2 * acc_t(kRefineRatio) >= norms) || !(norms >= tiny);
}

// An entry's final value from its d²: clamped at 0 (NaN kept), square-rooted unless squared.
template <bool kRoot, typename acc_t>
acc_t finish(acc_t d2) {
  d2 = d2 < 0 ? acc_t(0) : d2;
  return kRoot ? std::sqrt(d2) : d2;
}

// An entry recomputed directly, Σ(a − b)², exact wherever the result is a number of the type.
template <bool kRoot, typename acc_t>
acc_t direct_value(const acc_t* a, const acc_t* b, int64_t M) {
  const auto [m, E] = cpu::direct_sq_exact(a, b, M);
  if (E == 0) return finish<kRoot>(m);
  return kRoot ? cpu::times_pow2(std::sqrt(m), E / 2) : cpu::times_pow2(m, E);
}

// One output row from its GEMM row g (−2·a·b is formed here): d² = n_a + n_b − 2g, refined
// where cancellation or underflow struck, clamped at 0, square-rooted for kRoot, and times
// 2^e (2^2e squared) for a batch element whose rows were scaled by 2^-e (cdist::Centred).
// `refine` is scratch for ⌈R / vector width⌉ lane masks.
//
// Where the output is the accumulation type (g and out may then be the same memory), full
// vectors take a branch-free pass that writes every entry and notes, in `refine`, the lanes
// whose expansion cancelled or is NaN (∞ or overflowing inputs); those, and the diagonal of
// self-distances, are recomputed afterwards. That pass is all that random data costs (a
// 256 × 256 output on one thread: 15 µs, where a test and a branch per vector took 28).
template <bool kRoot, typename scalar_t, typename acc_t>
void epilogue_row(const acc_t* g, scalar_t* out, acc_t na, const acc_t* nb, const acc_t* a,
                  const acc_t* xb, int64_t R, int64_t M, int64_t diag, int e, acc_t tiny,
                  uint8_t* refine) {
  using V = Vectorized<acc_t>;
  // fmadd with −2 rather than fnmadd, which torch before 2.9 does not have.
  const V vna(na), minus_two(-2), zero(0), ratio(static_cast<acc_t>(kRefineRatio)), vtiny(tiny);
  const int E = kRoot ? e : 2 * e;
  auto direct = [&](int64_t j) { return direct_value<kRoot>(a, xb + j * M, M); };
  int64_t j0 = 0;
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    int any = 0;
    for (; j0 + V::size() <= R; j0 += V::size()) {
      const V sum = vna + V::loadu(nb + j0);
      const V d2 = at::vec::fmadd(minus_two, V::loadu(g + j0), sum);
      // A lane whose d²·ratio ≥ |a|² + |b|² ≥ tiny fails is recomputed: cancelled, NaN or
      // underflowed.
      const int m = (V((d2 * ratio) >= sum) & V(sum >= vtiny)).zero_mask();
      refine[j0 / V::size()] = static_cast<uint8_t>(m);
      any |= m;
      const V d = at::vec::clamp_min(d2, zero);
      (kRoot ? d.sqrt() : d).store(out + j0);
    }
    if (E != 0) {
      for (int64_t j = 0; j < j0; ++j) out[j] = cpu::times_pow2(out[j], E);
    }
    if (any) {
      for (int64_t c = 0; c < j0 / V::size(); ++c) {
        for (int l = 0; refine[c] >> l; ++l) {
          const int64_t j = c * V::size() + l;
          if ((refine[c] >> l) & 1) out[j] = direct(j);
        }
      }
    }
  }
  // The rest (a partial vector, or every entry of a reduced-type output), a vector at a time.
  acc_t buf[V::size()];
  for (; j0 < R; j0 += V::size()) {
    const int64_t n = std::min<int64_t>(V::size(), R - j0);
    const V sum = vna + V::loadu(nb + j0, n);
    at::vec::fmadd(minus_two, V::loadu(g + j0, n), sum).store(buf, n);
    for (int64_t l = 0; l < n; ++l) {
      const acc_t v = refines(buf[l], na + nb[j0 + l], tiny)
                          ? direct(j0 + l)
                          : cpu::times_pow2(finish<kRoot>(buf[l]), E);
      out[j0 + l] = static_cast<scalar_t>(v);
    }
  }
  // Σ(a − a)²: 0, or NaN for a row holding NaN or ∞, as torch.cdist gives.
  if (diag >= 0) {
    out[diag] =
        static_cast<scalar_t>(finish<kRoot>(std::isfinite(na) ? acc_t(0) : direct_sq(a, a, M)));
  }
}

// The output in tiles that stay in cache between the GEMM that writes them and the epilogue
// that finishes them: row ranges of one batch element, or, where an element fits in a tile
// (P ≤ its rows), whole groups of elements, one bmm and one parallel epilogue per group
// instead of a GEMM call and a fork/join of the threads per element.
template <typename scalar_t>
void forward_kernel(const Problem& p, const Centred& c, Tensor& out) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr bool kDirect = std::is_same_v<scalar_t, acc_t>;
  const int64_t rows = tile_rows(p.R, sizeof(acc_t));
  const int64_t element_bytes = std::max<int64_t>(p.P * p.R * int64_t(sizeof(acc_t)), 1);
  const int64_t group =
      p.P <= rows ? std::clamp<int64_t>(kOutputTileBytes / element_bytes, 1, p.B) : 1;
  Tensor scratch;  // the GEMM's tile when it cannot be the output itself
  if (!kDirect) scratch = at::empty({group * std::min(rows, p.P), p.R}, c.x1.options());
  const acc_t* xa = c.raw1.const_data_ptr<acc_t>();
  const acc_t* xb = c.raw2.const_data_ptr<acc_t>();
  const acc_t* na = c.n1.const_data_ptr<acc_t>();
  const acc_t* nb = c.n2.const_data_ptr<acc_t>();
  const acc_t tiny = cpu::tiny_norms<acc_t>(p.M);
  scalar_t* o = out.data_ptr<scalar_t>();
  for (int64_t b0 = 0; b0 < p.B; b0 += group) {
    const int64_t g = std::min(group, p.B - b0);
    for (int64_t i0 = 0; i0 < p.P; i0 += rows) {
      const int64_t n = std::min(rows, p.P - i0);
      // Flat rows first … first + count − 1 (row r is element r / P's row r % P).
      const int64_t first = b0 * p.P + i0, count = g * n;
      if (g > 1) {  // whole elements (n = P)
        Tensor tile =
            kDirect ? out.narrow(0, b0, g) : scratch.narrow(0, 0, g * p.P).view({g, p.P, p.R});
        blas::bmm_out(tile, c.x1.narrow(0, b0, g), c.x2.narrow(0, b0, g).transpose(1, 2));
      } else {
        Tensor tile = kDirect ? out[b0].narrow(0, i0, n) : scratch.narrow(0, 0, n);
        blas::mm_out(tile, c.x1[b0].narrow(0, i0, n), c.x2[b0].t());
      }
      const acc_t* gm =
          kDirect ? out.const_data_ptr<acc_t>() + first * p.R : scratch.const_data_ptr<acc_t>();
      at::parallel_for(first, first + count, cpu::rows_per_task(p.R),
                       [&](int64_t begin, int64_t end) {
                         std::vector<uint8_t> refine(p.R / Vectorized<acc_t>::size() + 1);
                         for (int64_t r = begin; r < end; ++r) {
                           const int64_t b = r / p.P, i = r % p.P;
                           auto row = [&](auto root) {
                             epilogue_row<decltype(root)::value, scalar_t, acc_t>(
                                 gm + (r - first) * p.R, o + r * p.R, na[r], nb + b * p.R,
                                 xa + r * p.M, xb + b * p.R * p.M, p.R, p.M, p.self ? i : -1,
                                 c.exponent(b), tiny, refine.data());
                           };
                           p.squared ? row(std::false_type{}) : row(std::true_type{});
                         }
                       });
    }
  }
}

Tensor forward_cpu(const Tensor& x1, const std::optional<Tensor>& x2, const c10::Scalar& squared) {
  const Problem p = check_inputs(x1, x2, squared);
  Tensor out = cpu::empty_for_writing({p.B, p.P, p.R}, x1.options());
  if (out.numel() > 0) {
    const Centred c = centre(p, x1, x2, cpu::kCentring);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x1.scalar_type(), "cdist_cpu",
                                    [&] { forward_kernel<scalar_t>(p, c, out); });
  }
  return finish_forward(p, out);
}

// A distance the forward recomputed directly (its expansion cancelled: near-duplicates far
// from the mean): its gradient G'·(a − b) is taken directly too, from the uncentred inputs,
// and left out of the GEMMs, where rowsum·a − G'·b would cancel the same way. It is formed as
// g·((a − b)/d) (g = grad, or 2·grad and d = 1 for squared): (a − b)/d is at most 1, where
// G' = grad/d overflows for a subnormal d.
template <typename acc_t>
struct Direct {
  int64_t j, i;
  acc_t g, d;

  acc_t term(acc_t a, acc_t b) const { return g * ((a - b) / d); }
};

// G' for one row: ∂L/∂d² · 2 = grad / dist (0 where dist = 0), or 2·grad for squared, with
// the directly recomputed entries moved out: their x1 half is added to d1 (this row's, zeroed
// here at the first such entry; `has_d1` says whether there was one), their x2 half queued in
// `direct`. Returns the row's sum over the entries the GEMMs take, and adds the row to
// `colsum` (column sums, for grad_x2) unless that is null. For a batch element scaled by 2^-e
// the GEMMs take the scaled rows: G' = grad / (dist·2^-e); for squared, G' = 2·grad and
// the GEMMs' results are multiplied by 2^e afterwards.
template <typename scalar_t, typename acc_t>
acc_t scaled_grad_row(const scalar_t* grad, int64_t gstride, const scalar_t* dist, acc_t na,
                      const acc_t* nb, const acc_t* a, const acc_t* xb, int64_t i, int64_t R,
                      int64_t M, bool squared, int e, acc_t tiny, acc_t* gp, acc_t* colsum,
                      acc_t* d1, bool& has_d1, std::vector<Direct<acc_t>>& direct) {
  has_d1 = false;
  auto take_direct = [&](int64_t j, acc_t gr, acc_t d) {
    if (!squared && d == 0) return;  // zero distances have zero gradient
    const Direct<acc_t> t{j, i, squared ? 2 * gr : gr, squared ? acc_t(1) : d};
    if (!has_d1) std::fill(d1, d1 + M, acc_t(0));
    has_d1 = true;
    const acc_t* b = xb + j * M;
    for (int64_t k = 0; k < M; ++k) d1[k] += t.term(a[k], b[k]);
    direct.push_back(t);
  };
  // The forward's refines() on d² in the scaled rows' units, from the output; from the rows
  // where a squared output overflowed (a d² past the type's range has a finite gradient).
  auto refined = [&](acc_t d, int64_t j) {
    acc_t ds = e == 0 ? d : cpu::times_pow2(d, squared ? -2 * e : -e);
    if (squared && std::isinf(d)) {
      const auto [m, E] = cpu::direct_sq_exact(a, xb + j * M, M);
      ds = cpu::times_pow2(m, E - 2 * e);
    }
    const acc_t d2 = squared ? ds : ds * ds;
    const acc_t norms = na + nb[j];
    return d2 * acc_t(kRefineRatio) < norms || norms < tiny;
  };
  int64_t j = 0;
  acc_t sum = 0;
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    using V = Vectorized<acc_t>;
    const V zero(0), two(2), vna(na), ratio(static_cast<acc_t>(kRefineRatio)), vtiny(tiny);
    constexpr int kAll = (1 << V::size()) - 1;
    V vsum(0);
    for (; e == 0 && j + V::size() <= R; j += V::size()) {
      const V g = gstride ? V::loadu(grad + j) : V(grad[0]), d = V::loadu(dist + j);
      V v = squared ? two * g : V::blendv(g / d, zero, d == zero);
      const V d2 = squared ? d : d * d;
      const V norms = vna + V::loadu(nb + j);
      if ((((d2 * ratio) < norms) | (norms < vtiny)).zero_mask() != kAll) {
        v.store(gp + j);
        for (int64_t l = 0; l < V::size(); ++l) {
          if (refined(dist[j + l], j + l)) {
            take_direct(j + l, grad[(j + l) * gstride], dist[j + l]);
            gp[j + l] = 0;
          }
        }
        v = V::loadu(gp + j);
      }
      v.store(gp + j);
      vsum = vsum + v;
      if (colsum) (V::loadu(colsum + j) + v).store(colsum + j);
    }
    sum = at::vec::vec_reduce_all<acc_t>([](V x, V y) { return x + y; }, vsum);
  }
  for (; j < R; ++j) {
    const acc_t gr = static_cast<acc_t>(grad[j * gstride]);
    const acc_t d = static_cast<acc_t>(dist[j]);
    acc_t v = squared ? 2 * gr : (d == 0 ? acc_t(0) : gr / d);
    if (refined(d, j)) {
      take_direct(j, gr, d);
      v = 0;
    } else if (e != 0 && !squared) {  // grad / (d·2^-e), not through grad / d
      const acc_t ds = cpu::times_pow2(d, -e);
      v = ds == 0 ? acc_t(0) : gr / ds;
    }
    gp[j] = v;
    sum += v;
    if (colsum) colsum[j] += v;
  }
  return sum;
}

// The backward's scratch for one tile of rows: G' (with the recomputed entries taken out),
// each row's direct x1 half and row sum, and G''s column sums, one partial sum per block of
// kColumnBlock rows, added in block order so that the sums do not depend on the number of
// threads.
template <typename acc_t>
struct BackwardTile {
  BackwardTile(const Problem& p, int64_t rows, bool column_sums, const at::TensorOptions& options)
      : gp(at::empty({rows, p.R}, options)),
        d1(at::empty({rows, p.M}, options)),
        rowsum(rows),
        has_d1(rows),
        blocks((rows + kColumnBlock - 1) / kColumnBlock) {
    if (column_sums) {
      colsum = at::empty({p.R, 1}, options);
      partial = at::empty({blocks, p.R}, options);
    }
  }
  Tensor gp, d1, colsum, partial;
  std::vector<acc_t> rowsum;
  std::vector<char> has_d1;  // char, not bool: threads write neighbouring rows
  int64_t blocks;
};

// Step 1: G' for rows [i0, i0 + n) of batch b (scaled_grad_row), and the tile's column sums
// added to colsum.
template <typename scalar_t, typename acc_t>
void scale_tile(const Problem& p, const Centred& c, const GradInput& grad, const Tensor& dist,
                int64_t b, int64_t i0, int64_t n, BackwardTile<acc_t>& t,
                std::vector<std::vector<Direct<acc_t>>>& queued) {
  const scalar_t* grad_p = grad.tensor.const_data_ptr<scalar_t>();
  const scalar_t* dist_p = dist.const_data_ptr<scalar_t>();
  const acc_t* xa = c.raw1[b].const_data_ptr<acc_t>();
  const acc_t* xb = c.raw2[b].const_data_ptr<acc_t>();
  const acc_t* na = c.n1[b].const_data_ptr<acc_t>();
  const acc_t* nb = c.n2[b].const_data_ptr<acc_t>();
  acc_t* part = t.partial.defined() ? t.partial.template data_ptr<acc_t>() : nullptr;
  const int64_t off = (b * p.P + i0) * p.R, gs = grad.stride;
  const int e = c.exponent(b);
  const acc_t tiny = cpu::tiny_norms<acc_t>(p.M);
  const int64_t tile_blocks = (n + kColumnBlock - 1) / kColumnBlock;
  at::parallel_for(
      0, tile_blocks, cpu::rows_per_task(kColumnBlock * p.R), [&](int64_t bb, int64_t be) {
        auto& direct = queued[at::get_thread_num()];
        for (int64_t blk = bb; blk < be; ++blk) {
          acc_t* block_sum = part ? part + blk * p.R : nullptr;
          if (block_sum) std::fill(block_sum, block_sum + p.R, acc_t(0));
          for (int64_t i = blk * kColumnBlock; i < std::min(n, (blk + 1) * kColumnBlock); ++i) {
            bool touched;
            t.rowsum[i] = scaled_grad_row<scalar_t, acc_t>(
                grad_p + (off + i * p.R) * gs, gs, dist_p + off + i * p.R, na[i0 + i], nb,
                xa + (i0 + i) * p.M, xb, i0 + i, p.R, p.M, p.squared, e, tiny,
                t.gp.template data_ptr<acc_t>() + i * p.R, block_sum,
                t.d1.template data_ptr<acc_t>() + i * p.M, touched, direct);
            t.has_d1[i] = touched;
          }
        }
      });
  if (!part) return;
  acc_t* cs = t.colsum.template data_ptr<acc_t>();
  at::parallel_for(0, p.R, at::internal::GRAIN_SIZE / std::max<int64_t>(tile_blocks, 1),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t blk = 0; blk < tile_blocks; ++blk) {
                       const acc_t* src = part + blk * p.R;
                       for (int64_t j = begin; j < end; ++j) cs[j] += src[j];
                     }
                   });
}

// Step 2: grad_x1's rows [i0, i0 + n) = rowsum·x1 − G'·x2 (+ the direct entries' x1 half),
// G'·x2 by BLAS straight into them. For squared distances of a batch element scaled by 2^-e
// the GEMMs' part is multiplied by 2^e (scale_exp = e, else 0) before the direct entries'
// part, in the inputs' units, is added: no intermediate passes through 2^e·G'.
template <typename acc_t>
void grad_x1_rows(const Problem& p, const Centred& c, int64_t b, int64_t i0, int64_t n,
                  int scale_exp, const BackwardTile<acc_t>& t, Tensor& g1) {
  Tensor rows = g1[b].narrow(0, i0, n);
  blas::mm_out(rows, t.gp.narrow(0, 0, n), c.x2[b]);
  acc_t* out = rows.data_ptr<acc_t>();
  const acc_t* xc1 = c.x1[b].const_data_ptr<acc_t>();
  const acc_t* d1 = t.d1.template const_data_ptr<acc_t>();
  at::parallel_for(0, n, cpu::rows_per_task(p.M), [&](int64_t begin, int64_t end) {
    using V = Vectorized<acc_t>;
    for (int64_t i = begin; i < end; ++i) {
      const V rs(t.rowsum[i]);
      const acc_t* x = xc1 + (i0 + i) * p.M;
      const acc_t* d = d1 + i * p.M;
      acc_t* o = out + i * p.M;
      int64_t k = 0;
      for (; scale_exp == 0 && k + V::size() <= p.M; k += V::size()) {
        V v = at::vec::fmsub(rs, V::loadu(x + k), V::loadu(o + k));
        if (t.has_d1[i]) v = v + V::loadu(d + k);
        v.store(o + k);
      }
      for (; k < p.M; ++k) {
        const acc_t v = t.rowsum[i] * x[k] - o[k];
        o[k] = (scale_exp ? cpu::times_pow2(v, scale_exp) : v) + (t.has_d1[i] ? d[k] : acc_t(0));
      }
    }
  });
}

// Step 4: the direct entries' x2 half, −G'·(a − b) into row j of grad_x2, in (j, i) order on
// any number of threads (bitwise reproducible), each j on one thread.
template <typename acc_t>
void add_direct_to_grad_x2(const Problem& p, const Centred& c, int64_t b,
                           std::vector<std::vector<Direct<acc_t>>>& queued, Tensor& g2) {
  std::vector<Direct<acc_t>> direct;
  for (auto& q : queued) {
    direct.insert(direct.end(), q.begin(), q.end());
    q.clear();
  }
  if (!g2.defined() || direct.empty()) return;
  std::sort(direct.begin(), direct.end(), [](const Direct<acc_t>& l, const Direct<acc_t>& r) {
    return l.j != r.j ? l.j < r.j : l.i < r.i;
  });
  const acc_t* xa = c.raw1[b].const_data_ptr<acc_t>();
  const acc_t* xb = c.raw2[b].const_data_ptr<acc_t>();
  acc_t* g2b = g2[b].data_ptr<acc_t>();
  const int64_t count = static_cast<int64_t>(direct.size());
  at::parallel_for(0, count, 64, [&](int64_t begin, int64_t end) {
    // A task starts at the first entry of a column: a column is never split between tasks.
    int64_t e = begin;
    while (e > 0 && e < end && direct[e].j == direct[e - 1].j) ++e;
    if (e == end) return;  // all of the previous task's column
    for (; e < count && (e < end || direct[e].j == direct[e - 1].j); ++e) {
      const Direct<acc_t>& d = direct[e];
      const acc_t* a = xa + d.i * p.M;
      const acc_t* bj = xb + d.j * p.M;
      acc_t* out = g2b + d.j * p.M;
      for (int64_t k = 0; k < p.M; ++k) out[k] -= d.term(a[k], bj[k]);
    }
  });
}

template <typename scalar_t>
void backward_kernel(const Problem& p, const Centred& c, const GradInput& grad, const Tensor& dist,
                     Tensor& g1, Tensor& g2) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t rows = tile_rows(p.R, sizeof(acc_t));
  BackwardTile<acc_t> t(p, std::min(rows, p.P), g2.defined(), c.x1.options());
  std::vector<std::vector<Direct<acc_t>>> queued(at::get_num_threads());
  for (int64_t b = 0; b < p.B; ++b) {
    const int e = c.exponent(b);
    if (g2.defined()) t.colsum.zero_();
    for (int64_t i0 = 0; i0 < p.P; i0 += rows) {
      const int64_t n = std::min(rows, p.P - i0);
      scale_tile<scalar_t, acc_t>(p, c, grad, dist, b, i0, n, t, queued);
      if (g1.defined()) grad_x1_rows<acc_t>(p, c, b, i0, n, p.squared ? e : 0, t, g1);
      if (g2.defined()) {  // Step 3: G'ᵀ·x1, accumulated over the tiles
        Tensor g2b = g2[b];
        const Tensor G = t.gp.narrow(0, 0, n), xc = c.x1[b].narrow(0, i0, n);
        if (i0 == 0) {
          blas::mm_out(g2b, G.t(), xc);
        } else {
          blas::addmm_(g2b, G.t(), xc);
        }
      }
    }
    if (g2.defined()) {
      g2[b].neg_().addcmul_(t.colsum, c.x2[b]);  // colsum·x2 − G'ᵀ·x1
      if (p.squared && e != 0) {
        acc_t* g = g2[b].data_ptr<acc_t>();
        for (int64_t q = 0; q < p.R * p.M; ++q) g[q] = cpu::times_pow2(g[q], e);
      }
    }
    add_direct_to_grad_x2<acc_t>(p, c, b, queued, g2);
  }
}

std::tuple<Tensor, Tensor> backward_cpu(const Tensor& grad, const Tensor& x1,
                                        const std::optional<Tensor>& x2, const Tensor& dist,
                                        const c10::Scalar& squared,
                                        std::array<bool, 2> output_mask) {
  const Problem p = check_inputs(x1, x2, squared);
  check_backward_inputs(p, grad, x1, dist);
  // For x2 = None both halves of the gradient belong to x1.
  const bool want1 = output_mask[0], want2 = p.self ? output_mask[0] : output_mask[1];
  const auto acc = acc_type(x1);
  Tensor g1, g2;
  // The kernel writes every element; without work (an empty dimension) they are zeros.
  const bool work = p.B * p.P * p.R * p.M > 0;
  const auto options = x1.options().dtype(acc);
  if (want1) g1 = work ? at::empty({p.B, p.P, p.M}, options) : at::zeros({p.B, p.P, p.M}, options);
  if (want2) g2 = work ? at::empty({p.B, p.R, p.M}, options) : at::zeros({p.B, p.R, p.M}, options);
  if ((want1 || want2) && work) {
    const Centred c = centre(p, x1, x2, cpu::kCentring);
    const GradInput grad_c = grad_input(grad);
    const Tensor dist_c = dist.contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, x1.scalar_type(), "cdist_backward_cpu",
        [&] { backward_kernel<scalar_t>(p, c, grad_c, dist_c, g1, g2); });
  }
  return finish_backward(p, g1, g2, x1, x2);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchkit, CPU, m) {
  m.impl("cdist", &forward_cpu);
  m.impl("_cdist_backward", &backward_cpu);
}

}  // namespace torchkit::cdist
