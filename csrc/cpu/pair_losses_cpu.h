// The pair losses' CPU engine (the losses: pair_losses.h): what the cosine losses
// (pair_losses_cpu.cpp) and the Euclidean ones (pair_losses_euclidean_cpu.cpp) share: the
// rows as F.normalize leaves them, the tiles, and the normalisation's Jacobian.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "blas.h"
#include "common.h"
#include "pair_losses.h"

namespace torchkit::pair_losses::cpu {

using at::Tensor;
using at::vec::Vectorized;

constexpr int64_t kRows = 64;       // anchors per task (at most: rows_per_task)
constexpr int64_t kCols = 256;      // ref rows per tile
constexpr double kNormEps = 1e-12;  // F.normalize's, as PML's CosineSimilarity uses it

// Each row's L2 norm in double, without over- or underflow (scaled by the power of two of its
// largest |entry| first): F.normalize's norm, also where the accumulation type's own sum of
// squares would leave its range (float32 rows past ~1e19, where F.normalize divides by ∞).
// Each row's squares are summed in feature order (the Triton kernels' norm64_kernel sums them
// so: an exact cosine is the same bits on either), kNormRows rows at once, interleaved: one
// dependent double addition per entry of a single row made this most of a proxy-anchor
// forward's time.
constexpr int64_t kNormRows = 8;

template <typename acc_t>
std::vector<double> row_norms(const Tensor& a) {
  using V = Vectorized<acc_t>;
  const int64_t N = a.size(0), D = a.size(1);
  std::vector<double> out(N);
  const acc_t* base = a.const_data_ptr<acc_t>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i0 = begin; i0 < end; i0 += kNormRows) {
      const int64_t rows = std::min(kNormRows, end - i0);
      // Per row: its entries, the factors that scale it (0 for a row done otherwise), the
      // exponent to scale its norm back by, and its running sum.
      const acc_t* row[kNormRows];
      double f1[kNormRows] = {}, f2[kNormRows] = {}, sum[kNormRows] = {};
      int exponent[kNormRows] = {};
      bool summed[kNormRows] = {};
      for (int64_t u = 0; u < kNormRows; ++u) {
        row[u] = base + (i0 + std::min(u, rows - 1)) * D;
        if (u >= rows) continue;
        // NaN-propagating: a row holding NaN has a NaN norm.
        const double top = D == 0
                               ? 0.0
                               : static_cast<double>(at::vec::map_reduce_all<acc_t>(
                                     [](V v) { return v.abs(); },
                                     [](V x, V y) { return at::vec::maximum(x, y); }, row[u], D));
        if (!(top > 0) || std::isinf(top)) {  // 0, ∞ or NaN
          out[i0 + u] = top;
          continue;
        }
        int e = 0;
        std::frexp(top, &e);
        // row·2^-e as std::ldexp rounds it, by normal powers of two (std::ldexp per entry
        // costs more than the rest of a loss's preparation): one factor, rounding once, where
        // 2^-e is normal; two, both exact, to scale a row of tiny entries up; std::ldexp
        // itself for rows near the largest double, where 2^-e is subnormal.
        const int s = -e;
        exponent[u] = e;
        if (s >= -1022) {
          const int half = s > 1023 ? s / 2 : s;
          f1[u] = std::ldexp(1.0, half);
          f2[u] = std::ldexp(1.0, s - half);
          summed[u] = true;
          continue;
        }
        double total = 0;
        for (int64_t k = 0; k < D; ++k) {
          const double v = std::ldexp(static_cast<double>(row[u][k]), s);
          total += v * v;
        }
        out[i0 + u] = std::ldexp(std::sqrt(total), e);
      }
      for (int64_t k = 0; k < D; ++k) {
        for (int64_t u = 0; u < kNormRows; ++u) {
          const double v = static_cast<double>(row[u][k]) * f1[u] * f2[u];
          sum[u] += v * v;
        }
      }
      for (int64_t u = 0; u < rows; ++u) {
        if (summed[u]) out[i0 + u] = std::ldexp(std::sqrt(sum[u]), exponent[u]);
      }
    }
  });
  return out;
}

// The rows as the GEMMs take them, with the factor each tile's entries are scaled by: where
// every row's norm lies in an ordinary window ([2^-40, 2^40] in float32, [2^-400, 2^400] in
// float64, or 0), the inputs themselves (a float32 copy of float16/bfloat16 ones) and
// 1 / max(‖row‖, eps) (s_ij = a_i·b_j·scale_i·scale_j, F.normalize's cosine), so that no
// normalised copy exists; elsewhere a copy of the rows normalised in double, scale 1.
struct Side {
  Tensor rows;     // (rows, D) of the accumulation type, contiguous
  Tensor scale;    // (rows,): what multiplies its rows in a tile's entries
  Tensor inv;      // (rows,): 1 / max(‖x‖, eps), F.normalize's factor
  Tensor clamped;  // (rows,) bool: ‖x‖ < eps (F.normalize's clamp holds)
  Tensor raw;      // (rows, D): the inputs in the accumulation type (rows itself, or its source)
  Tensor inv64;    // (rows,) float64: inv before rounding
};

inline Side side(const Tensor& x) {
  const auto acc = acc_type(x);
  Side out;
  out.rows = x.to(acc).contiguous();
  std::vector<double> norm;
  AT_DISPATCH_FLOATING_TYPES(acc, "row_norms", [&] { norm = row_norms<scalar_t>(out.rows); });
  const int64_t n = out.rows.size(0);
  const double window = acc == at::kDouble ? std::ldexp(1.0, 400) : std::ldexp(1.0, 40);
  Tensor inv = at::empty({n}, out.rows.options().dtype(at::kDouble));
  out.clamped = at::empty({n}, out.rows.options().dtype(at::kBool));
  double* ip = inv.data_ptr<double>();
  bool* cp = out.clamped.data_ptr<bool>();
  bool ordinary = true;
  for (int64_t i = 0; i < n; ++i) {
    cp[i] = norm[i] < kNormEps;
    ip[i] = 1.0 / (cp[i] ? kNormEps : norm[i]);  // NaN stays NaN
    ordinary = ordinary && (norm[i] == 0 || (norm[i] >= 1 / window && norm[i] <= window));
  }
  out.inv = inv.to(acc);
  out.raw = out.rows;
  out.inv64 = inv;
  if (ordinary) {
    out.scale = out.inv;
  } else {
    // Out of place: for float64 rows, out.rows may be the caller's tensor itself.
    out.rows = out.rows.to(at::kDouble).mul(inv.unsqueeze(1)).to(acc).contiguous();
    out.scale = at::ones({n}, out.rows.options());
  }
  return out;
}

// Groups of equal rows (entry by entry, ±0 alike) over the rows of a and b (b's numbered after
// a's; b may be null): per row, its group, the lowest number of a row equal to it; a row
// holding NaN or ±∞ is alone. Two rows of one group have one exact distance (0) and one exact
// cosine, which the losses then take without a computation: a collapsed batch (early in
// training, a model that maps every input to one point, or to 0) has every pair cancel in the
// tiles' expansion and tie in every choice, so that each of its N² pairs would otherwise be
// recomputed in float64. Rows are hashed, sorted by hash, and only rows of one hash compared.
inline std::vector<int64_t> equal_rows(const Side& a, const Side* b) {
  const int64_t na = a.raw.size(0), nb = b != nullptr ? b->raw.size(0) : 0, D = a.raw.size(1);
  const int64_t n = na + nb;
  std::vector<uint64_t> hash(n);
  std::vector<char> finite(n);
  std::vector<int64_t> group(n);
  AT_DISPATCH_FLOATING_TYPES(a.raw.scalar_type(), "equal_rows", [&] {
    using bits_t = std::conditional_t<sizeof(scalar_t) == 8, uint64_t, uint32_t>;
    auto row = [&](int64_t g) {
      return g < na ? a.raw.const_data_ptr<scalar_t>() + g * D
                    : b->raw.const_data_ptr<scalar_t>() + (g - na) * D;
    };
    at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const scalar_t* r = row(g);
        uint64_t h = 0xcbf29ce484222325ULL;  // FNV-1a over the entries' bits (−0 as +0)
        bool ok = true;
        for (int64_t k = 0; k < D; ++k) {
          const scalar_t v = r[k] == scalar_t(0) ? scalar_t(0) : r[k];
          ok = ok && std::isfinite(v);
          bits_t bits;
          std::memcpy(&bits, &v, sizeof bits);
          h = (h ^ static_cast<uint64_t>(bits)) * 0x100000001b3ULL;
        }
        hash[g] = h;
        finite[g] = ok;
      }
    });
    std::vector<int64_t> order;
    order.reserve(n);
    for (int64_t g = 0; g < n; ++g) {
      group[g] = g;
      if (finite[g]) order.push_back(g);
    }
    std::sort(order.begin(), order.end(),
              [&](int64_t x, int64_t y) { return hash[x] != hash[y] ? hash[x] < hash[y] : x < y; });
    std::vector<int64_t> firsts;  // a run of one hash: the first row of each group met in it
    for (size_t s = 0, e = 0; s < order.size(); s = e) {
      for (e = s; e < order.size() && hash[order[e]] == hash[order[s]]; ++e) {
      }
      firsts.clear();
      for (size_t t = s; t < e; ++t) {
        const scalar_t* r = row(order[t]);
        auto same = [&](int64_t f) { return std::equal(r, r + D, row(f)); };
        const auto it = std::find_if(firsts.begin(), firsts.end(), same);
        if (it != firsts.end()) {
          group[order[t]] = *it;
        } else {
          firsts.push_back(order[t]);
        }
      }
    }
  });
  return group;
}

// The rows of a per task: kRows, or fewer for small a (at least 8 tasks while blocks of 8 rows
// allow): a function of a's size alone, never of the number of threads, so that the tiles, and
// the GEMMs' rounding with them, are the same on any number.
inline int64_t rows_per_task(int64_t A) {
  constexpr int64_t kTasks = 8, kMinRows = 8;
  const int64_t rows = ((A + kTasks - 1) / kTasks + kMinRows - 1) / kMinRows * kMinRows;
  return std::min(kRows, std::max(kMinRows, rows));
}

// Runs fn(s, a0, b0) for each tile s = a[a0:a0+di] · b[b0:b0+dj]ᵀ (di × dj, in a per-thread
// scratch): a's blocks of rows_per_task are the tasks, b's blocks of kCols are taken in order.
// Each task's GEMMs (the tiles' and fn's) are sequential (blas::Sequential): a task alone on its
// thread would otherwise let MKL use every thread and round by their number.
template <typename Fn>
void for_each_tile(const Tensor& a, const Tensor& b, Fn fn) {
  const int64_t A = a.size(0), B = b.size(0);
  const int64_t rows = rows_per_task(A);
  const int64_t blocks = (A + rows - 1) / rows;
  // The tasks call ATen (the tile's GEMM): OpenMP's worker threads must see this thread's
  // dispatcher state (below autograd), or mm_out would refuse inputs that require grad.
  const at::ThreadLocalState state;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard guard(state);
    const blas::Sequential sequential;
    Tensor scratch = at::empty({rows, kCols}, a.options());
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t a0 = blk * rows, di = std::min(rows, A - a0);
      for (int64_t b0 = 0; b0 < B; b0 += kCols) {
        const int64_t dj = std::min(kCols, B - b0);
        Tensor s = scratch.narrow(0, 0, di).narrow(1, 0, dj);
        blas::mm_out(s, a.narrow(0, a0, di), b.narrow(0, b0, dj).t());
        fn(s, a0, b0);
      }
    }
  });
}

// The most entries (rows × columns) of a block's strip that for_each_strip keeps whole:
// 4 MiB of float32 per thread.
constexpr int64_t kStripEntries = int64_t{1} << 20;

// Runs fn(tiles, a0, di) for each block of a's rows (for_each_tile's tasks), where
// tiles(visit) calls visit(s, b0) for the block's tiles s = a[a0:a0+di] · b[b0:b0+dj]ᵀ in
// increasing b0, each given to prepare(s, a0, b0) (in place) first, as often as fn calls it.
// A block's whole strip (di × B) is one tile where it holds at most kStripEntries entries:
// formed and prepared once however often fn visits it (a loss that reads its pairs twice, a
// miner's extremes and then the terms, at the cost of one GEMM); past that, kCols-wide tiles
// are formed and prepared again on each visit. (Whole or not is a function of the sizes alone:
// the same tiles on any number of threads.)
inline int64_t strip_width(int64_t A, int64_t B) {  // (for_each_strip's tiles' most columns)
  return rows_per_task(A) * B <= kStripEntries ? B : kCols;
}

template <typename Prepare, typename Fn>
void for_each_strip(const Tensor& a, const Tensor& b, Prepare prepare, Fn fn) {
  const int64_t A = a.size(0), B = b.size(0);
  const int64_t rows = rows_per_task(A);
  const int64_t blocks = (A + rows - 1) / rows;
  const int64_t width = strip_width(A, B);
  const bool whole = width == B;
  const at::ThreadLocalState state;  // (for_each_tile's reason)
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard guard(state);
    const blas::Sequential sequential;
    Tensor scratch = at::empty({rows, width}, a.options());
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t a0 = blk * rows, di = std::min(rows, A - a0);
      const Tensor block = a.narrow(0, a0, di);
      bool formed = false;
      auto tiles = [&](auto&& visit) {
        for (int64_t b0 = 0; b0 < B; b0 += width) {
          const int64_t dj = std::min(width, B - b0);
          Tensor s = scratch.narrow(0, 0, di).narrow(1, 0, dj);
          if (!(whole && formed)) {
            blas::mm_out(s, block, b.narrow(0, b0, dj).t());
            prepare(s, a0, b0);
          }
          visit(s, b0);
        }
        formed = true;
      };
      fn(tiles, a0, di);
    }
  });
}

// The rows of one side a backward's pass computes (first, count): of the anchors, those the
// problem asks for (Problem::grad_first); of the refs, all.
inline std::pair<int64_t, int64_t> own_rows(const Problem& p, const Tensor& rows,
                                            bool anchors_own) {
  if (!anchors_own) return {0, rows.size(0)};
  return {p.grad_first, p.grad_end() - p.grad_first};
}

// g ← grad·∂/∂x of g·e for e = x / max(‖x‖, eps), in place, per row, from the side's rows r
// (x, or e itself) and their tile scale (e = r·scale): inv·(g − e·(e·g)) where ‖x‖ > eps,
// inv·g where the clamp holds (its constant). g holds the side's rows [first, first + rows).
template <typename acc_t>
void through_normalisation(Tensor& g, const Side& own, acc_t grad, int64_t first = 0) {
  using V = Vectorized<acc_t>;
  const int64_t rows = g.size(0), D = g.size(1);
  acc_t* gp = g.data_ptr<acc_t>();
  const acc_t* rp = own.rows.const_data_ptr<acc_t>() + first * D;
  const acc_t* sp = own.scale.const_data_ptr<acc_t>() + first;
  const acc_t* ip = own.inv.const_data_ptr<acc_t>() + first;
  const bool* cp = own.clamped.const_data_ptr<bool>() + first;
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      acc_t* gi = gp + i * D;
      const acc_t* ri = rp + i * D;
      const acc_t dot = at::vec::map2_reduce_all<acc_t>([](V u, V v) { return u * v; },
                                                        [](V u, V v) { return u + v; }, ri, gi, D);
      const acc_t factor = grad * ip[i];
      const acc_t along = cp[i] ? acc_t(0) : sp[i] * sp[i] * dot;
      at::vec::map2([factor, along](V gv, V rv) { return (gv - rv * V(along)) * V(factor); }, gi,
                    gi, ri, D);
    }
  });
}

// The rows a backward's GEMM sums with per-pair weights, Σ_j w_ij·row_j. A row holding NaN
// (normalised or centred rows of inputs that are not finite) would make 0·row_j NaN, so that a
// row with no term in the loss (an anchor without positives among the refs) would spoil every
// gradient it meets: such rows are zero in `rows`, and add_nonfinite makes NaN the gradient
// rows that give one a weight other than 0 (a pair whose term is NaN: the loss is NaN), as the
// Triton kernels do (_weighted_rows).
struct GemmRows {
  Tensor rows;                     // the rows, those not finite zeroed (the input if none)
  std::vector<int64_t> nonfinite;  // the rows not finite, in increasing order
};

// rows: (n, D), contiguous.
inline GemmRows gemm_rows(const Tensor& rows) {
  GemmRows out{rows, {}};
  const int64_t n = rows.size(0), D = rows.size(1);
  std::vector<char> bad(n, 0);  // (scanned in place: at::isfinite would allocate rows' size twice)
  AT_DISPATCH_FLOATING_TYPES(rows.scalar_type(), "gemm_rows", [&] {
    const scalar_t* base = rows.const_data_ptr<scalar_t>();
    using V = Vectorized<scalar_t>;
    at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {  // (x − x is 0 for finite x, NaN for ±∞ and NaN)
        const scalar_t zero = D == 0 ? scalar_t(0)
                                     : at::vec::map_reduce_all<scalar_t>(
                                           [](V v) { return v - v; },
                                           [](V x, V y) { return x + y; }, base + i * D, D);
        bad[i] = zero != scalar_t(0);
      }
    });
  });
  for (int64_t i = 0; i < n; ++i) {
    if (bad[i]) out.nonfinite.push_back(i);
  }
  if (out.nonfinite.empty()) return out;
  const Tensor index = at::tensor(out.nonfinite, rows.options().dtype(at::kLong));
  out.rows = rows.index_fill(0, index, 0);
  return out;
}

// dst's rows r (a tile's) NaN where the weight w[r, c] of a non-finite row b0 + c of the tile's
// columns [b0, b0 + dj) is not 0. w: (di, dj).
template <typename acc_t>
void add_nonfinite(const GemmRows& g, Tensor& dst, const Tensor& w, int64_t b0) {
  const int64_t dj = w.size(1);
  const acc_t* wp = w.const_data_ptr<acc_t>();
  for (auto it = std::lower_bound(g.nonfinite.begin(), g.nonfinite.end(), b0);
       it != g.nonfinite.end() && *it < b0 + dj; ++it) {
    for (int64_t r = 0; r < w.size(0); ++r) {
      if (wp[r * w.stride(0) + (*it - b0)] != acc_t(0)) dst[r].fill_(NAN);
    }
  }
}

// The running extreme (MAX: the largest) of values each known to within a slack, and its
// index, offered in increasing index order: ties keep the lower index, the first NaN wins, and
// where the slacks leave a comparison open the exact values decide (exact(j): row j's exact
// value), so that the extreme is the exact values' own.
template <bool MAX>
struct Extreme {
  int64_t index = -1;
  double value = 0, slack = 0;

  template <typename Exact>
  void offer(int64_t j, double v, double s, Exact exact) {
    if (std::isnan(v) && !std::isnan(value)) return set(j, v, 0);
    if (index < 0) return set(j, v, s);
    if (std::isnan(value) || std::isnan(v)) return;
    const double gap = MAX ? v - value : value - v;  // > 0: v is better
    if (gap > s + slack) return set(j, v, s);
    if (gap <= -(s + slack)) return;
    if (slack != 0) set(index, exact(index), 0);
    const double e = s == 0 ? v : exact(j);
    if (MAX ? e > value : e < value) set(j, e, 0);
  }
  void set(int64_t j, double v, double s) {
    index = j;
    value = v;
    slack = s;
  }
};

}  // namespace torchkit::pair_losses::cpu
