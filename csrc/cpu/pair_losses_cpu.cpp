// The pair losses on the CPU (the losses: pair_losses.h), one engine for the family.
//
// Forward: anchors in blocks (pair_losses_cpu.h's rows_per_task), spread over the threads;
// per block, the similarity tiles a_blk·b_tileᵀ (one sequential BLAS call each, at most
// kRows × kCols, in a per-thread scratch) are folded into each anchor's running log-sum-exps,
// sums and counts while in cache; nothing N×M exists. NT-Xent's positive pairs, which need their
// anchor's whole negative sum first, are then taken one by one (a dot product each, never a tile).
// Totals are summed in anchor order: the same bits on any number of threads. Backward: the tiles
// again, each turned into ∂loss/∂s (a tile) and multiplied into the other side's rows. Every loss
// here has ∂loss/∂x_ij = coef_i·exp(x_ij − shift_i) for every pair, plus a correction for positive
// pairs (rare: scalar), x = s/τ; the exponentials are vectorised. Without refs the similarity is
// symmetric, so one pass over anchor blocks forms ∂/∂s_ij + ∂/∂s_ji per tile and one GEMM per tile
// gives each row's whole gradient; with refs, a second pass over ref blocks forms the refs'
// gradient (each block owns its rows: no atomics). Then the normalisation's Jacobian per row.
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "checks.h"
#include "cpu/pair_losses_cpu.h"
#include "pair_losses.h"

namespace torchkit::pair_losses {
namespace {

using at::Tensor;
using at::vec::Vectorized;
using namespace cpu;

struct Inputs {
  Side a, b;            // anchors' and refs' rows; b is a without refs
  Tensor lab, ref_lab;  // int64, contiguous
};

Inputs prepare(const Problem& p, const Tensor& embeddings, const Tensor& labels,
               const std::optional<Tensor>& ref_embeddings,
               const std::optional<Tensor>& ref_labels) {
  Inputs in;
  in.a = side(embeddings);
  in.lab = labels.to(at::kLong).contiguous();
  in.b = p.self ? in.a : side(*ref_embeddings);
  in.ref_lab = p.self ? in.lab : ref_labels->to(at::kLong).contiguous();
  return in;
}

// A backward's inputs: those of the call, or, for a shard's backward with the whole problem's
// stats (p = whole_of(call)), its refs without refs.
Inputs backward_inputs(const Problem& call, const Problem& p, const Tensor& embeddings,
                       const Tensor& labels, const std::optional<Tensor>& ref_embeddings,
                       const std::optional<Tensor>& ref_labels) {
  if (p.self && !call.self) return prepare(p, *ref_embeddings, *ref_labels, {}, {});
  return prepare(p, embeddings, labels, ref_embeddings, ref_labels);
}

// A running log-sum-exp: max and Σ exp(x − max), in double.
struct LogSumExp {
  double max = -std::numeric_limits<double>::infinity();
  double sum = 0;

  // Folds in a block of n values of x (−∞ for those left out), NaN-propagating.
  template <typename acc_t>
  void add(const acc_t* x, int64_t n) {
    using V = Vectorized<acc_t>;
    const acc_t block_max =
        at::vec::reduce_all<acc_t>([](V u, V v) { return at::vec::maximum(u, v); }, x, n);
    const double top = std::isnan(block_max) || block_max > max ? block_max : max;
    if (top == -std::numeric_limits<double>::infinity()) return;  // nothing in yet
    if (top == std::numeric_limits<double>::infinity()) return overflow();
    const acc_t shift = static_cast<acc_t>(top);
    const acc_t block_sum = at::vec::map_reduce_all<acc_t>(
        [shift](V v) { return (v - V(shift)).exp(); }, [](V u, V v) { return u + v; }, x, n);
    sum = sum * std::exp(max - top) + block_sum;
    max = top;
  }
  void add(double x) {
    const double top = std::isnan(x) || x > max ? x : max;
    if (top == -std::numeric_limits<double>::infinity()) return;
    if (top == std::numeric_limits<double>::infinity()) return overflow();
    sum = sum * std::exp(max - top) + std::exp(x - top);
    max = top;
  }
  // Folds in another running log-sum-exp (of terms after this one's), or a block's largest
  // term and Σ exp(x − it).
  void merge(double top_of, double sum_of) {
    const double top = std::isnan(top_of) || top_of > max ? top_of : max;
    if (top == -std::numeric_limits<double>::infinity()) return;
    if (top == std::numeric_limits<double>::infinity()) return overflow();
    sum = sum * std::exp(max - top) + sum_of * std::exp(top_of - top);
    max = top;
  }
  void merge(const LogSumExp& other) { merge(other.max, other.sum); }
  // A term of +∞ (a finite parameter's product past the accumulation type): the sum is +∞,
  // where the shift by the maximum would make it ∞ − ∞ = NaN.
  void overflow() {
    max = std::numeric_limits<double>::infinity();
    sum = 1;
  }
  double value() const { return sum > 0 || std::isnan(sum) ? max + std::log(sum) : max; }
};

// Per anchor, what the forwards fold their tiles into: the log-sum-exp over the pairs (over
// the negatives for NT-Xent), the positives' sum of x and the counts.
struct RowSums {
  LogSumExp lse;
  double positive = 0;
  int64_t positives = 0, pairs = 0;
};

// x = s/τ for the tile's row r (anchor i) in place, with the anchor's own row (not a pair:
// Problem::itself) set to −∞; returns its column or −1.
template <typename acc_t>
int64_t scaled_row(const Problem& p, const Inputs& in, acc_t* x, int64_t i, int64_t b0,
                   int64_t dj) {
  using V = Vectorized<acc_t>;
  const acc_t scale =
      in.a.scale.const_data_ptr<acc_t>()[i] * static_cast<acc_t>(1.0 / p.temperature);
  at::vec::map2([scale](V v, V inv) { return v * inv * V(scale); }, x, x,
                in.b.scale.const_data_ptr<acc_t>() + b0, dj);
  const int64_t own = p.offset < 0 ? -1 : p.offset + i;
  const int64_t self_col = own >= b0 && own < b0 + dj ? own - b0 : -1;
  if (self_col >= 0) x[self_col] = -std::numeric_limits<acc_t>::infinity();
  return self_col;
}

// Per anchor: the log-sum-exp over its pairs (NEGATIVES_ONLY: over its negatives), the sum of
// x over its positives and the counts.
template <typename acc_t, bool NEGATIVES_ONLY>
std::vector<RowSums> row_sums(const Problem& p, const Inputs& in) {
  std::vector<RowSums> rows(p.N);
  if (p.N == 0 || p.M == 0) return rows;
  const int64_t* lab = in.lab.const_data_ptr<int64_t>();
  const int64_t* ref_lab = in.ref_lab.const_data_ptr<int64_t>();
  for_each_tile(in.a.rows, in.b.rows, [&](Tensor& s, int64_t a0, int64_t b0) {
    const int64_t di = s.size(0), dj = s.size(1), stride = s.stride(0);
    acc_t* base = s.data_ptr<acc_t>();
    for (int64_t r = 0; r < di; ++r) {
      const int64_t i = a0 + r;
      acc_t* x = base + r * stride;
      const int64_t self_col = scaled_row<acc_t>(p, in, x, i, b0, dj);
      RowSums& row = rows[i];
      row.pairs += dj - (self_col >= 0 ? 1 : 0);
      for (int64_t c = 0; c < dj; ++c) {
        if (c != self_col && ref_lab[b0 + c] == lab[i]) {
          row.positive += x[c];
          ++row.positives;
          if (NEGATIVES_ONLY) x[c] = -std::numeric_limits<acc_t>::infinity();
        }
      }
      row.lse.add(x, dj);
    }
  });
  return rows;
}

// ---------------------------------------------------------------------------- SupCon

template <typename scalar_t>
std::tuple<Tensor, Tensor> supcon_forward(const Problem& p, const Inputs& in,
                                          const Tensor& embeddings) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int64_t kStats = kSupConStats;
  const std::vector<RowSums> rows = row_sums<acc_t, false>(p, in);
  Tensor stats = at::zeros({p.N, kStats}, in.a.rows.options());
  acc_t* st = stats.data_ptr<acc_t>();
  std::vector<double> loss(p.N, 0.0);
  int64_t positives = 0, negatives = 0, counted = 0;
  for (int64_t i = 0; i < p.N; ++i) {
    const RowSums& row = rows[i];
    const double lse = row.pairs > 0 ? row.lse.value() : 0.0;
    st[i * kStats] = static_cast<acc_t>(lse);
    positives += row.positives;
    negatives += row.pairs - row.positives;
    if (row.positives > 0) loss[i] = lse - row.positive / static_cast<double>(row.positives);
    if (loss[i] > 0 || std::isnan(loss[i])) ++counted;  // PML's AvgNonZero, keeping NaN
  }
  double total = 0;
  // PML: nothing without a positive or a negative pair, or with at most one of each (a
  // shard's caller decides that on the whole problem).
  const bool rules =
      p.shard || (positives > 0 && negatives > 0 && (positives > 1 || negatives > 1));
  if (rules && counted > 0) {
    for (int64_t i = 0; i < p.N; ++i) {
      if (!(loss[i] > 0 || std::isnan(loss[i]))) continue;
      total += loss[i];
      st[i * kStats + 1] = static_cast<acc_t>(
          1.0 / (static_cast<double>(rows[i].positives) * static_cast<double>(counted)));
    }
  }
  if (p.shard) {
    return {p.parts({total, static_cast<double>(counted), static_cast<double>(positives),
                     static_cast<double>(negatives)},
                    embeddings),
            stats};
  }
  if (counted > 0) total /= static_cast<double>(counted);
  return {scalar_of_type(total, embeddings.options()), stats};
}

// ---------------------------------------------------------------------------- NT-Xent

// Per anchor, its positive pairs' terms, from the log-sum-exp of its negatives: Σ_p loss_ip
// and log R_i (pair_losses.h). The positives are found through a map from label to ref rows
// and their similarities taken one dot product each (an anchor's positives are few; the
// negatives' sum had to be complete first).
template <typename acc_t>
void ntxent_positives(const Problem& p, const Inputs& in, const std::vector<RowSums>& rows,
                      std::vector<double>& loss, std::vector<double>& log_r) {
  using V = Vectorized<acc_t>;
  const int64_t* lab = in.lab.const_data_ptr<int64_t>();
  const int64_t* ref_lab = in.ref_lab.const_data_ptr<int64_t>();
  std::unordered_map<int64_t, std::vector<int64_t>> members;
  for (int64_t j = 0; j < p.M; ++j) members[ref_lab[j]].push_back(j);
  const acc_t* a = in.a.rows.const_data_ptr<acc_t>();
  const acc_t* b = in.b.rows.const_data_ptr<acc_t>();
  const acc_t* inv_a = in.a.scale.const_data_ptr<acc_t>();
  const acc_t* inv_b = in.b.scale.const_data_ptr<acc_t>();
  const double tiny = std::numeric_limits<acc_t>::min();
  at::parallel_for(0, p.N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (rows[i].positives == 0) continue;
      const double log_s = rows[i].lse.value();  // −∞ without negatives
      LogSumExp r;
      double total = 0;
      for (const int64_t j : members.at(lab[i])) {
        if (p.itself(i, j)) continue;
        const acc_t dot = at::vec::map2_reduce_all<acc_t>([](V u, V v) { return u * v; },
                                                          [](V u, V v) { return u + v; },
                                                          a + i * p.D, b + j * p.D, p.D);
        const double x = static_cast<double>(dot * inv_a[i] * inv_b[j]) / p.temperature;
        const double top = std::max(x, log_s);  // log(exp(x) + S_i)
        const double lse = std::isinf(log_s) ? x : top + std::log1p(std::exp(-std::abs(x - log_s)));
        const double q = std::exp(x - lse);
        total += -std::log(q + tiny);
        r.add(std::log(q / (q + tiny)) - lse);
      }
      loss[i] = total;
      log_r[i] = r.value();
    }
  });
}

template <typename scalar_t>
std::tuple<Tensor, Tensor> ntxent_forward(const Problem& p, const Inputs& in,
                                          const Tensor& embeddings) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int64_t kStats = kNTXentStats;
  const std::vector<RowSums> rows = row_sums<acc_t, true>(p, in);
  Tensor stats = at::zeros({p.N, kStats}, in.a.rows.options());
  acc_t* st = stats.data_ptr<acc_t>();
  int64_t positives = 0, negatives = 0;
  for (const RowSums& row : rows) {
    positives += row.positives;
    negatives += row.pairs - row.positives;
  }
  auto parts = [&](double total) {
    return p.parts({total, static_cast<double>(positives), static_cast<double>(negatives)},
                   embeddings);
  };
  // As PML (supcon_forward). A shard without positives or negatives has no terms; the rest is
  // its caller's to decide.
  if (positives == 0 || negatives == 0 || (!p.shard && positives <= 1 && negatives <= 1)) {
    return {p.shard ? parts(0) : at::zeros({}, embeddings.options()), stats};
  }
  std::vector<double> loss(p.N, 0.0), log_r(p.N, -std::numeric_limits<double>::infinity());
  ntxent_positives<acc_t>(p, in, rows, loss, log_r);
  double total = 0;
  for (int64_t i = 0; i < p.N; ++i) {
    total += loss[i];
    st[i * kStats] = static_cast<acc_t>(rows[i].lse.value());
    st[i * kStats + 1] = static_cast<acc_t>(log_r[i]);
    st[i * kStats + 2] = static_cast<acc_t>(1.0 / static_cast<double>(positives));
  }
  if (p.shard) return {parts(total), stats};
  return {scalar_of_type(total / static_cast<double>(positives), embeddings.options()), stats};
}

// ---------------------------------------------------------------------------- multi-similarity

// s_ij computed directly: Σ (x_i·inv_i)(x_j·inv_j) in float64 over the inputs and their
// float64 1/norms, normalised first so that no row's scale overflows (the same bits for
// (i, j) and (j, i)).
double exact_cos(const Side& a, int64_t i, const Side& b, int64_t j) {
  const int64_t D = a.raw.size(1);
  const double inv_i = a.inv64.const_data_ptr<double>()[i];
  const double inv_j = b.inv64.const_data_ptr<double>()[j];
  double dot = 0;
  AT_DISPATCH_FLOATING_TYPES(a.raw.scalar_type(), "exact_cos", [&] {
    const scalar_t* x = a.raw.const_data_ptr<scalar_t>() + i * D;
    const scalar_t* y = b.raw.const_data_ptr<scalar_t>() + j * D;
    if (D == 1) {  // F.normalize's ±1 (or x/eps), exactly: x·(1/|x|) is 1 − ulp for many x
      auto unit = [](double v) { return v / std::max(std::abs(v), kNormEps); };  // (NaN stays)
      dot = unit(static_cast<double>(x[0])) * unit(static_cast<double>(y[0]));
      return;
    }
    for (int64_t k = 0; k < D; ++k) {
      dot += (static_cast<double>(x[k]) * inv_i) * (static_cast<double>(y[k]) * inv_j);
    }
  });
  return dot;
}

// Multi-similarity's choices and terms for one problem. A tile's cosine is within `slack` of
// the exact one (a dot product of D terms of rows of norm <= 1, then the scales: (D + 4)·u);
// a choice that close to its threshold is made on the exact cosine.
template <typename acc_t>
struct MultiSimilarity {
  const Problem& p;
  const Inputs& in;
  double slack;
  std::vector<double> hard_negative, hard_positive;  // per anchor: max s_in, min s_ip (exact)

  MultiSimilarity(const Problem& p_, const Inputs& in_)
      : p(p_),
        in(in_),
        slack((static_cast<double>(p_.D) + 4) * std::numeric_limits<acc_t>::epsilon() / 2),
        hard_negative(p_.N, -std::numeric_limits<double>::infinity()),
        hard_positive(p_.N, std::numeric_limits<double>::infinity()),
        group(equal_rows(in_.a, p_.self ? nullptr : &in_.b)),
        has_equal(p_.N, 0),
        equal_cos(p_.N, 0.0) {
    for (int64_t j = 0; j < in.b.raw.size(0); ++j) {
      const int64_t g = ref_group(j);
      if (g < p.N && g != (p.self ? j : -1) && !has_equal[g]) {
        has_equal[g] = 1;
        equal_cos[g] = exact_cos(in.a, g, in.a, g);
      }
    }
  }

  // Groups of equal rows (equal_rows: anchors, then refs), and per anchor g that is the first of
  // a group holding a pair, the exact cosine of two of its rows: the same bits for every such
  // pair. (A group with an anchor and a ref starts at an anchor: refs are numbered after them.)
  std::vector<int64_t> group;
  std::vector<char> has_equal;
  std::vector<double> equal_cos;

  int64_t ref_group(int64_t j) const { return group[p.self ? j : p.N + j]; }
  double exact(int64_t i, int64_t j) const {
    const int64_t g = group[i];
    if (g == ref_group(j) && has_equal[g]) return equal_cos[g];
    return exact_cos(in.a, i, in.b, j);
  }

  // Whether the pair (anchor i, ref j) with tile cosine s is one the miner keeps (PML's
  // MultiSimilarityMiner: a positive below the anchor's hardest negative + ε, a negative
  // above its hardest positive − ε; every pair without a miner). A NaN keeps the pair.
  bool mined(int64_t i, int64_t j, double s, bool positive) const {
    if (!p.miner_epsilon) return true;
    const double eps = *p.miner_epsilon;
    const double t = positive ? hard_negative[i] : hard_positive[i];
    auto keep = [&](double v) { return positive ? v - eps < t : v + eps > t; };
    if (std::isnan(s) || std::isnan(t)) return true;
    if (std::abs((positive ? s - eps : s + eps) - t) > slack) return keep(s);
    return keep(exact(i, j));
  }
};

// x = s (the cosine) for the tile's row of anchor i, as scaled_row gives it with τ = 1.
template <typename acc_t>
int64_t cos_row(const Problem& p, const Inputs& in, acc_t* x, int64_t i, int64_t b0, int64_t dj) {
  Problem unit = p;
  unit.temperature = 1;
  return scaled_row<acc_t>(unit, in, x, i, b0, dj);
}

// A loss's ∂loss/∂s in the form the tiles take vectorised: for anchor a's pair of cosine s, a
// negative's weight·exp(neg_slope·(s − neg_shift) + neg_c[a]), a positive's
// pos_w[a]·exp(pos_slope·(s − pos_shift) + pos_c[a]) (the exponent formed in double, as the
// scalar terms form it), where the miner keeps the pair. The miner's choice is certain outside
// a band of s per anchor and kind ([neg_lo, neg_hi]: kept above, dropped below; [pos_lo,
// pos_hi]: kept below, dropped above; bands of −∞ or +∞ without a miner); within it, and for
// NaN, the pair is left to the loss's scalar terms, which decide on the exact cosine. Only
// where the exponents' parts are finite (ordinary()): elsewhere every pair takes the scalar
// terms, as they handle ±∞.
template <typename acc_t>
struct VectorTerms {
  double neg_slope = 0, neg_shift = 0, pos_slope = 0, pos_shift = 0;
  std::vector<double> neg_c, pos_c;
  std::vector<acc_t> pos_w, neg_lo, neg_hi, pos_lo, pos_hi;

  explicit VectorTerms(int64_t anchors)
      : neg_c(anchors),
        pos_c(anchors),
        pos_w(anchors),
        neg_lo(anchors, -std::numeric_limits<acc_t>::infinity()),
        neg_hi(anchors, -std::numeric_limits<acc_t>::infinity()),
        pos_lo(anchors, std::numeric_limits<acc_t>::infinity()),
        pos_hi(anchors, std::numeric_limits<acc_t>::infinity()) {}

  bool ordinary() const {
    auto finite = [](const auto& v) {
      return std::all_of(v.begin(), v.end(), [](auto x) { return std::isfinite(x); });
    };
    return std::isfinite(neg_slope * (1 + std::abs(neg_shift))) &&
           std::isfinite(pos_slope * (1 + std::abs(pos_shift))) && finite(neg_c) && finite(pos_c) &&
           finite(pos_w);
  }
};

// The acc_t values just past a double band [lo, hi] of values formed as a sum of terms of
// magnitude up to `scale` (outward by a few units of either type's rounding at that scale, so
// that a comparison of an acc_t s with them decides as the double comparison of s, ± ε and
// the threshold would, rounding included).
template <typename acc_t>
std::pair<acc_t, acc_t> outside(double lo, double hi, double scale) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const double pad = 8 * std::numeric_limits<acc_t>::epsilon() * (1 + scale);
  auto down = [&](double v) {
    if (std::isinf(v)) return static_cast<acc_t>(v);
    const double m = v - pad;
    acc_t f = static_cast<acc_t>(m);
    return static_cast<double>(f) > m ? std::nextafter(f, static_cast<acc_t>(-kInf)) : f;
  };
  auto up = [&](double v) {
    if (std::isinf(v)) return static_cast<acc_t>(v);
    const double m = v + pad;
    acc_t f = static_cast<acc_t>(m);
    return static_cast<double>(f) < m ? std::nextafter(f, static_cast<acc_t>(kInf)) : f;
  };
  return {down(lo), up(hi)};
}

// Multi-similarity's forward: per block of anchors, its strip of cosines (for_each_strip: one
// GEMM while the strip fits) read twice, for the miner's thresholds (each anchor's hardest
// negative and positive, exact) and then for the terms. Both passes are vectorised over a
// row; a pair whose choice lies within the tile's slack of its threshold, and a row holding
// NaN, take the scalar choices (MultiSimilarity::mined, Extreme), which decide on the exact
// cosine.
template <typename scalar_t>
std::tuple<Tensor, Tensor> ms_forward(const Problem& p, const Inputs& in,
                                      const Tensor& embeddings) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vectorized<acc_t>;
  constexpr int64_t S = kMultiSimilarityStats;
  constexpr acc_t kInf = std::numeric_limits<acc_t>::infinity();
  MultiSimilarity<acc_t> ms(p, in);
  Tensor stats = at::zeros({p.N, S}, in.a.rows.options().dtype(at::kDouble));
  double* st = stats.data_ptr<double>();
  // A loss of 0 (a shard's: no terms, its anchors counted).
  auto zero = [&] {
    return std::tuple<Tensor, Tensor>{p.shard
                                          ? p.parts({0, static_cast<double>(p.N), 0, 0}, embeddings)
                                          : at::zeros({}, embeddings.options()),
                                      stats};
  };
  if (p.N == 0 || p.M == 0) return zero();
  const int64_t* lab = in.lab.const_data_ptr<int64_t>();
  const int64_t* ref_lab = in.ref_lab.const_data_ptr<int64_t>();
  const bool mining = p.miner_epsilon.has_value();
  const double eps = mining ? *p.miner_epsilon : 0.0;
  std::vector<int64_t> pairs(2 * p.N, 0);  // per anchor: [negative, positive] pairs kept
  std::vector<char> sides(2 * p.N, 0);     // per anchor: [a negative, a positive] exists
  std::vector<LogSumExp> lse(2 * p.N);     // per anchor: [negatives, positives]
  for (LogSumExp& l : lse) l.add(0.0);     // the 1
  auto prepare = [&](Tensor& s, int64_t a0, int64_t b0) {
    for (int64_t r = 0; r < s.size(0); ++r)
      cos_row<acc_t>(p, in, s.data_ptr<acc_t>() + r * s.stride(0), a0 + r, b0, s.size(1));
  };
  for_each_strip(in.a.rows, in.b.rows, prepare, [&](auto& tiles, int64_t a0, int64_t di) {
    const int64_t width = strip_width(p.N, p.M);
    std::vector<acc_t> kind(width), neg(width), pos(width), y(width), z(width);
    // The columns' kinds for anchor i (1: a positive pair), its own row's column, and the
    // row's values per kind: negatives (−∞ elsewhere), positives (+∞ elsewhere).
    auto split = [&](const acc_t* x, int64_t i, int64_t b0, int64_t dj) {
      const int64_t own = p.offset < 0 ? -1 : p.offset + i;
      const int64_t self_col = own >= b0 && own < b0 + dj ? own - b0 : -1;
      const int64_t li = lab[i];
      for (int64_t c = 0; c < dj; ++c) {
        kind[c] = ref_lab[b0 + c] == li ? 1 : 0;
        neg[c] = kind[c] != 0 ? -kInf : x[c];
        pos[c] = kind[c] != 0 ? x[c] : kInf;
      }
      if (self_col >= 0) neg[self_col] = -kInf, pos[self_col] = kInf;
      return self_col;
    };
    std::vector<Extreme<true>> negative(mining ? di : 0);
    std::vector<Extreme<false>> positive(mining ? di : 0);
    if (mining) {  // the thresholds
      tiles([&](Tensor& s, int64_t b0) {
        const int64_t dj = s.size(1);
        for (int64_t r = 0; r < di; ++r) {
          const int64_t i = a0 + r;
          const acc_t* x = s.data_ptr<acc_t>() + r * s.stride(0);
          const int64_t self_col = split(x, i, b0, dj);
          auto exact = [&](int64_t j) { return ms.exact(i, j); };
          // The tile's extremes first, then only the candidates within two slacks of them are
          // offered: the others cannot be the exact extreme. A NaN offers every pair.
          const acc_t top = at::vec::reduce_all<acc_t>(
              [](V u, V v) { return at::vec::maximum(u, v); }, neg.data(), dj);
          const acc_t bottom = at::vec::reduce_all<acc_t>(
              [](V u, V v) { return at::vec::minimum(u, v); }, pos.data(), dj);
          const bool nan = std::isnan(top) || std::isnan(bottom);
          const double near = 2 * ms.slack;  // (the vector test below it, outward)
          const V over = V(nan ? -kInf : std::nextafter(static_cast<acc_t>(top - near), -kInf));
          const V under = V(nan ? kInf : std::nextafter(static_cast<acc_t>(bottom + near), kInf));
          for (int64_t c = 0; c < dj; c += V::size()) {
            const int64_t n = std::min<int64_t>(V::size(), dj - c);
            const V offered =
                (V::loadu(neg.data() + c, n) >= over) | (V::loadu(pos.data() + c, n) <= under);
            if ((~offered.zero_mask() & ((1 << n) - 1)) == 0 && !nan) continue;
            for (int64_t k = c; k < c + n; ++k) {
              if (k == self_col) continue;
              const double v = x[k];
              if (kind[k] != 0) {
                sides[2 * i + 1] = 1;
                if (nan || v <= bottom + near) positive[r].offer(b0 + k, v, ms.slack, exact);
              } else {
                sides[2 * i] = 1;
                if (nan || v >= top - near) negative[r].offer(b0 + k, v, ms.slack, exact);
              }
            }
          }
          if (top > -kInf) sides[2 * i] = 1;
          if (bottom < kInf) sides[2 * i + 1] = 1;
        }
      });
      for (int64_t r = 0; r < di; ++r) {
        const int64_t i = a0 + r;
        if (negative[r].index >= 0)
          ms.hard_negative[i] =
              negative[r].slack == 0 ? negative[r].value : ms.exact(i, negative[r].index);
        if (positive[r].index >= 0)
          ms.hard_positive[i] =
              positive[r].slack == 0 ? positive[r].value : ms.exact(i, positive[r].index);
      }
    }
    // The terms: log(1 + Σ exp(α(base − s))) over the kept positives, log(1 + Σ exp(β(s −
    // base))) over the kept negatives. The miner's choice is certain outside a band per kind
    // (VectorTerms's), and made by MultiSimilarity::mined within it.
    tiles([&](Tensor& s, int64_t b0) {
      const int64_t dj = s.size(1);
      for (int64_t r = 0; r < di; ++r) {
        const int64_t i = a0 + r;
        const acc_t* x = s.data_ptr<acc_t>() + r * s.stride(0);
        const int64_t self_col = split(x, i, b0, dj);
        for (int64_t c = 0; c < dj; ++c) {  // (as the scalar choices form them: in double)
          const double v = x[c];
          y[c] = static_cast<acc_t>(p.beta * (v - p.base));
          z[c] = static_cast<acc_t>(p.alpha * (p.base - v));
        }
        acc_t neg_lo = -kInf, neg_hi = -kInf, pos_lo = kInf, pos_hi = kInf;
        if (mining) {
          const double tp = ms.hard_positive[i], tn = ms.hard_negative[i];
          const double slack = ms.slack;
          std::tie(neg_lo, neg_hi) =
              outside<acc_t>(tp - eps - slack, tp - eps + slack, std::abs(tp) + eps + 1);
          std::tie(pos_lo, pos_hi) =
              outside<acc_t>(tn + eps - slack, tn + eps + slack, std::abs(tn) + eps + 1);
        }
        int64_t kept_negatives = 0, kept_positives = 0;
        for (int64_t c = 0; c < dj; c += V::size()) {
          const int64_t n = std::min<int64_t>(V::size(), dj - c);
          const int lanes = (1 << n) - 1;
          const V sv = V::loadu(x + c, n), is_pos = V::loadu(kind.data() + c, n) != V(0);
          const V keep_neg = (sv > V(neg_hi)) & ~is_pos;
          const V keep_pos = (sv < V(pos_lo)) & is_pos;
          const V decided = V::blendv((sv > V(neg_hi)) | (sv < V(neg_lo)),
                                      (sv < V(pos_lo)) | (sv > V(pos_hi)), is_pos);
          V::blendv(V(-kInf), V::loadu(y.data() + c, n), keep_neg).store(y.data() + c, n);
          V::blendv(V(-kInf), V::loadu(z.data() + c, n), keep_pos).store(z.data() + c, n);
          const int open = decided.zero_mask() & lanes;
          const bool self_here = self_col >= c && self_col < c + n;
          if (open == 0 && !self_here) {
            kept_negatives += __builtin_popcount(~keep_neg.zero_mask() & lanes);
            kept_positives += __builtin_popcount(~keep_pos.zero_mask() & lanes);
            continue;
          }
          for (int64_t k = c; k < c + n; ++k) {  // the lanes one at a time
            y[k] = z[k] = -kInf;
            if (k == self_col) continue;
            const bool is_positive = kind[k] != 0;
            const double v = x[k];
            if (!ms.mined(i, b0 + k, v, is_positive)) continue;
            if (is_positive) {
              ++kept_positives;
              z[k] = static_cast<acc_t>(p.alpha * (p.base - v));
            } else {
              ++kept_negatives;
              y[k] = static_cast<acc_t>(p.beta * (v - p.base));
            }
          }
        }
        pairs[2 * i] += kept_negatives;
        pairs[2 * i + 1] += kept_positives;
        lse[2 * i].add(y.data(), dj);
        lse[2 * i + 1].add(z.data(), dj);
      }
    });
  });
  // PML's miner returns nothing without a positive or a negative pair: the loss is 0. (A
  // shard's anchors see every ref: without a negative the whole problem has none, and anchors
  // without positives keep no pair.)
  if (mining) {
    bool any[2] = {false, false};
    for (int64_t i = 0; i < p.N; ++i) {
      any[0] = any[0] || sides[2 * i];
      any[1] = any[1] || sides[2 * i + 1];
    }
    if (!any[0] || !any[1]) return zero();
  }
  int64_t kept[2] = {0, 0};
  for (int64_t i = 0; i < p.N; ++i) {
    kept[0] += pairs[2 * i];
    kept[1] += pairs[2 * i + 1];
  }
  // PML: nothing when each kind has at most one pair (a shard's caller decides that).
  if (!p.shard && kept[0] <= 1 && kept[1] <= 1) return zero();
  const double w = 1.0 / static_cast<double>(p.N);
  double total = 0;
  for (int64_t i = 0; i < p.N; ++i) {
    const double ln = lse[2 * i].value(), lp = lse[2 * i + 1].value();
    total += lp / p.alpha + ln / p.beta;
    double* row = st + i * S;
    row[0] = ms.hard_negative[i];
    row[1] = ms.hard_positive[i];
    row[2] = lp;
    row[3] = ln;
    row[4] = w;
  }
  if (p.shard) {
    return {p.parts({total, static_cast<double>(p.N), static_cast<double>(kept[0]),
                     static_cast<double>(kept[1])},
                    embeddings),
            stats};
  }
  return {scalar_of_type(total * w, embeddings.options()), stats};
}

// ∂loss/∂E for the rows of `own` against `other` (rows_grad's roles) of a loss whose
// ∂loss/∂s is, for anchor i's negative j, weight·exp(terms.negative(i, j, s)) (an exponent,
// −∞ where the pair does not count), and for its positive j terms.positive(i, j, s): per
// tile (both anchors' terms without refs: s is symmetric), vectorised over a row by the
// terms' vector_form() (the pairs in a miner's band and NaN one at a time, by the scalar
// terms), times other's scale into one GEMM; then the normalisation's Jacobian. Of the
// anchors, the rows p asks for (own_rows).
template <typename acc_t, typename Terms>
Tensor cos_rows_grad(const Problem& p, const Inputs& in, const Terms& terms, acc_t weight,
                     bool anchors_own, acc_t grad) {
  using V = Vectorized<acc_t>;
  const Side& own = anchors_own ? in.a : in.b;
  const Side& other = anchors_own ? in.b : in.a;
  const int64_t* la = in.lab.const_data_ptr<int64_t>();
  const int64_t* lb = in.ref_lab.const_data_ptr<int64_t>();
  const acc_t* io = own.scale.const_data_ptr<acc_t>();
  const acc_t* ib = other.scale.const_data_ptr<acc_t>();
  const auto [first, rows] = own_rows(p, own.rows, anchors_own);
  const Tensor mine = own.rows.narrow(0, first, rows);
  Tensor out = at::zeros_like(mine);
  const GemmRows summed = gemm_rows(other.rows);
  // The terms of the anchors of the tile's rows (anchors_own) and of its columns (the other
  // side's rows: without refs, the same anchors' other direction).
  const bool row_terms = anchors_own, column_terms = !anchors_own || p.self;
  const std::optional<VectorTerms<acc_t>> vt = terms.vector_form();
  // Anchor i's term for its pair j of cosine s, scalar (the band's pairs, NaN, and every pair
  // where the terms are not ordinary).
  auto scalar_term = [&](int64_t i, int64_t j, double s_ij) -> double {
    if (la[i] == lb[j]) return terms.positive(i, j, s_ij);
    return weight * std::exp(static_cast<acc_t>(terms.negative(i, j, s_ij)));
  };
  auto pair_grad = [&](int64_t i, int64_t j, double s_ij) -> acc_t {
    if (anchors_own ? p.itself(i, j) : p.itself(j, i)) return 0;
    double g = anchors_own ? scalar_term(i, j, s_ij) : scalar_term(j, i, s_ij);
    if (p.self) g += scalar_term(j, i, s_ij);
    return static_cast<acc_t>(g);
  };
  for_each_tile(mine, other.rows, [&](Tensor& s, int64_t a0, int64_t b0) {
    const int64_t di = s.size(0), dj = s.size(1), stride = s.stride(0);
    acc_t positive[kCols];  // 1 where the pair is positive, else 0
    acc_t e_row[kCols], e_column[kCols];
    for (int64_t r = 0; r < di; ++r) {
      const int64_t i = first + a0 + r;
      acc_t* x = s.data_ptr<acc_t>() + r * stride;
      const acc_t scale = io[i];
      at::vec::map2([scale](V v, V inv) { return v * inv * V(scale); }, x, x, ib + b0, dj);
      if (!vt) {
        for (int64_t c = 0; c < dj; ++c) x[c] = pair_grad(i, b0 + c, x[c]) * ib[b0 + c];
        continue;
      }
      const int64_t own_label = anchors_own ? la[i] : lb[i];
      const int64_t* other_labels = (anchors_own ? lb : la) + b0;
      for (int64_t c = 0; c < dj; ++c) positive[c] = other_labels[c] == own_label ? 1 : 0;
      // The exponents, in double as the scalar terms form them: of the row's anchor (e_row)
      // and of the columns' (e_column).
      if (row_terms) {
        const double nc = vt->neg_c[i], pc = vt->pos_c[i];
        for (int64_t c = 0; c < dj; ++c) {
          const double sc = x[c];
          e_row[c] =
              static_cast<acc_t>(positive[c] != 0 ? vt->pos_slope * (sc - vt->pos_shift) + pc
                                                  : vt->neg_slope * (sc - vt->neg_shift) + nc);
        }
      }
      if (column_terms) {
        const double *nc = vt->neg_c.data() + b0, *pc = vt->pos_c.data() + b0;
        for (int64_t c = 0; c < dj; ++c) {
          const double sc = x[c];
          e_column[c] =
              static_cast<acc_t>(positive[c] != 0 ? vt->pos_slope * (sc - vt->pos_shift) + pc[c]
                                                  : vt->neg_slope * (sc - vt->neg_shift) + nc[c]);
        }
      }
      // One direction's terms from its exponents e: its anchors' values by at (V loads of
      // per-column arrays, or the row's broadcast); decided: the lanes whose choice is certain.
      auto direction = [&](const V& sv, const V& pos, const V& e, auto at, V& decided) {
        const V keep = V::blendv((sv > at(vt->neg_hi)), (sv < at(vt->pos_lo)), pos);
        const V drop = V::blendv((sv < at(vt->neg_lo)), (sv > at(vt->pos_hi)), pos);
        decided = decided & (keep | drop);
        const V coef = V::blendv(V(weight), at(vt->pos_w), pos);
        return V::blendv(V(0), coef * e.exp(), keep);
      };
      for (int64_t c = 0; c < dj; c += V::size()) {
        const int64_t n = std::min<int64_t>(V::size(), dj - c);
        const V sv = V::loadu(x + c, n), pos = V::loadu(positive + c, n) != V(0);
        // (every bit set: the comparisons' true)
        V decided = V(0) == V(0);
        V g(0);
        if (row_terms) {
          g = g + direction(
                      sv, pos, V::loadu(e_row + c, n),
                      [&](const std::vector<acc_t>& v) { return V(v[i]); }, decided);
        }
        if (column_terms) {
          g = g + direction(
                      sv, pos, V::loadu(e_column + c, n),
                      [&](const std::vector<acc_t>& v) { return V::loadu(v.data() + b0 + c, n); },
                      decided);
        }
        g = g * V::loadu(ib + b0 + c, n);
        const int open = decided.zero_mask() & ((1 << n) - 1);  // the band's lanes and NaN
        if (open == 0) {
          g.store(x + c, n);
          continue;
        }
        acc_t cosine[V::size()];
        sv.store(cosine, n);
        g.store(x + c, n);
        for (int64_t k = 0; k < n; ++k) {
          if (open & (1 << k)) x[c + k] = pair_grad(i, b0 + c + k, cosine[k]) * ib[b0 + c + k];
        }
      }
      // The batch's pair of a row with itself: none.
      const int64_t me = p.offset < 0 ? -1 : (anchors_own ? p.offset + i : i - p.offset);
      if (me >= b0 && me < b0 + dj && (anchors_own ? p.itself(i, me) : p.itself(me, i)))
        x[me - b0] = 0;
    }
    Tensor dst = out.narrow(0, a0, di);
    blas::addmm_(dst, s, summed.rows.narrow(0, b0, dj));
    add_nonfinite<acc_t>(summed, dst, s, b0);
  });
  through_normalisation<acc_t>(out, own, grad, first);
  return out;
}

// Multi-similarity's ∂loss/∂s from its stats: w·exp(β(s − base) − Ln_i) for a kept negative,
// −w·exp(α(base − s) − Lp_i) for a kept positive.
template <typename acc_t>
struct MultiSimilarityTerms {
  const Problem& p;
  const MultiSimilarity<acc_t>& ms;
  const double* st;
  static constexpr int64_t S = kMultiSimilarityStats;
  double negative(int64_t i, int64_t j, double s) const {
    return ms.mined(i, j, s, false) ? p.beta * (s - p.base) - st[i * S + 3]
                                    : -std::numeric_limits<double>::infinity();
  }
  double positive(int64_t i, int64_t j, double s) const {
    if (!ms.mined(i, j, s, true)) return 0.0;
    return -st[i * S + 4] * std::exp(p.alpha * (p.base - s) - st[i * S + 2]);
  }
  // The miner's bands: a negative is kept where s + ε > its anchor's hardest positive, a
  // positive where s − ε < its hardest negative, certain beyond the tiles' slack.
  std::optional<VectorTerms<acc_t>> vector_form() const {
    VectorTerms<acc_t> v(p.N);
    v.neg_slope = p.beta;
    v.neg_shift = v.pos_shift = p.base;
    v.pos_slope = -p.alpha;
    for (int64_t a = 0; a < p.N; ++a) {
      v.neg_c[a] = -st[a * S + 3];
      v.pos_c[a] = -st[a * S + 2];
      v.pos_w[a] = static_cast<acc_t>(-st[a * S + 4]);
      if (!p.miner_epsilon) continue;
      const double eps = *p.miner_epsilon, slack = ms.slack;
      const double tp = ms.hard_positive[a], tn = ms.hard_negative[a];
      std::tie(v.neg_lo[a], v.neg_hi[a]) =
          outside<acc_t>(tp - eps - slack, tp - eps + slack, std::abs(tp) + eps + 1);
      std::tie(v.pos_lo[a], v.pos_hi[a]) =
          outside<acc_t>(tn + eps - slack, tn + eps + slack, std::abs(tn) + eps + 1);
    }
    if (!v.ordinary()) return std::nullopt;
    return v;
  }
};

// ---------------------------------------------------------------------------- proxy anchor

// The proxies are the anchors (label c for proxy c) and the embeddings the refs, but the
// tiles' rows are the embeddings: proxies are few (a few hundred classes, often fewer than a
// task's rows would need to keep every thread busy), and a tile whose rows were proxies would
// pack its block of embeddings again for every few proxies. The embeddings' blocks
// (rows_per_task) are grouped into at most kSlots contiguous slots, spread over the threads; a
// slot's blocks are taken in order against the proxies kCols at a time, and fn(s, slot, e0, c0)
// gets each tile s = e[e0:e0+de] · proxies[c0:c0+dc]ᵀ. The slots are a function of the sizes
// alone: what a slot sums is the same on any number of threads.
constexpr int64_t kSlots = 16;

inline int64_t proxy_slots(int64_t N) {
  const int64_t rows = rows_per_task(N);
  return std::min(kSlots, (N + rows - 1) / rows);
}

template <typename Fn>
void for_each_proxy_tile(const Tensor& e, const Tensor& proxies, Fn fn, int64_t slots = 0) {
  const int64_t N = e.size(0), C = proxies.size(0);
  const int64_t rows = rows_per_task(N), blocks = (N + rows - 1) / rows;
  slots = slots > 0 ? slots : proxy_slots(N);
  const at::ThreadLocalState state;  // (for_each_tile's reason)
  at::parallel_for(0, slots, 1, [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard guard(state);
    const blas::Sequential sequential;
    Tensor scratch = at::empty({rows, kCols}, e.options());
    for (int64_t slot = begin; slot < end; ++slot) {
      for (int64_t blk = slot * blocks / slots; blk < (slot + 1) * blocks / slots; ++blk) {
        const int64_t e0 = blk * rows, de = std::min(rows, N - e0);
        for (int64_t c0 = 0; c0 < C; c0 += kCols) {
          const int64_t dc = std::min(kCols, C - c0);
          Tensor s = scratch.narrow(0, 0, de).narrow(1, 0, dc);
          blas::mm_out(s, e.narrow(0, e0, de), proxies.narrow(0, c0, dc).t());
          fn(s, slot, e0, c0);
        }
      }
    }
  });
}

// Per proxy, log(1 + Σ_its positives exp(α(margin − s))) and log(1 + Σ_its negatives
// exp(α(s + margin))): each tile's columns folded over its rows (vectorised across the
// proxies; an embedding's one positive, its label's column, one at a time) into its slot's
// running sums, the slots then merged in order.
template <typename scalar_t>
std::tuple<Tensor, Tensor> proxy_anchor_forward(const Problem& p, const Inputs& in,
                                                const Tensor& embeddings) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vectorized<acc_t>;
  constexpr int64_t S = kProxyAnchorStats;
  constexpr acc_t kInf = std::numeric_limits<acc_t>::infinity();
  const int64_t C = p.N, N = p.M;
  Tensor stats = at::zeros({C, S}, in.a.rows.options());
  acc_t* st = stats.data_ptr<acc_t>();
  std::vector<LogSumExp> lse(2 * C);  // per proxy: [negatives, positives]
  if (!p.shard)
    for (LogSumExp& l : lse) l.add(0.0);  // the 1 (a shard's caller adds it to the sums)
  std::vector<char> with_positives(C, 0);
  const int64_t* ref_lab = in.ref_lab.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < N; ++r) with_positives[ref_lab[r]] = 1;  // (labels in [0, C))
  if (C > 0 && N > 0) {
    const int64_t slots = proxy_slots(N);
    std::vector<LogSumExp> partial(slots * 2 * C);  // per slot and proxy: [negatives, positives]
    const acc_t* inv_p = in.a.scale.const_data_ptr<acc_t>();
    const acc_t* inv_e = in.b.scale.const_data_ptr<acc_t>();
    for_each_proxy_tile(in.b.rows, in.a.rows, [&](Tensor& s, int64_t slot, int64_t e0, int64_t c0) {
      const int64_t de = s.size(0), dc = s.size(1), stride = s.stride(0);
      LogSumExp* fold = partial.data() + slot * 2 * C;
      acc_t top[kCols], sum[kCols];  // per column: the negatives' largest term, Σ exp(· − it)
      std::fill(top, top + dc, -kInf);
      std::fill(sum, sum + dc, acc_t(0));
      for (int64_t r = 0; r < de; ++r) {
        acc_t* x = s.data_ptr<acc_t>() + r * stride;
        const acc_t scale = inv_e[e0 + r];
        at::vec::map2([scale](V v, V inv) { return v * inv * V(scale); }, x, x, inv_p + c0, dc);
        const int64_t own = ref_lab[e0 + r] - c0;  // the embedding's positive: its label's column
        if (own >= 0 && own < dc) {
          fold[2 * (c0 + own) + 1].add(p.alpha * (p.margin - static_cast<double>(x[own])));
        }
        for (int64_t c = 0; c < dc; ++c)  // (in double, as the scalar terms form them)
          x[c] = static_cast<acc_t>(p.alpha * (static_cast<double>(x[c]) + p.margin));
        if (own >= 0 && own < dc) x[own] = -kInf;
        for (int64_t c = 0; c < dc; c += V::size()) {
          const int64_t n = std::min<int64_t>(V::size(), dc - c);
          at::vec::maximum(V::loadu(top + c, n), V::loadu(x + c, n)).store(top + c, n);
        }
      }
      // (a column of −∞ alone sums 0: shifted by 0, not by −∞)
      acc_t shift[kCols];
      for (int64_t c = 0; c < dc; ++c) shift[c] = top[c] == -kInf ? acc_t(0) : top[c];
      for (int64_t r = 0; r < de; ++r) {
        const acc_t* x = s.data_ptr<acc_t>() + r * stride;
        for (int64_t c = 0; c < dc; c += V::size()) {
          const int64_t n = std::min<int64_t>(V::size(), dc - c);
          const V term = (V::loadu(x + c, n) - V::loadu(shift + c, n)).exp();
          (V::loadu(sum + c, n) + term).store(sum + c, n);
        }
      }
      for (int64_t c = 0; c < dc; ++c) fold[2 * (c0 + c)].merge(top[c], sum[c]);
    });
    for (int64_t slot = 0; slot < slots; ++slot) {
      for (int64_t k = 0; k < 2 * C; ++k) lse[k].merge(partial[slot * 2 * C + k]);
    }
  }
  if (p.shard) {  // per proxy: log Σ over its positives, over its negatives, whether any
    Tensor parts = at::empty({C, 3}, stats.options().dtype(at::kDouble));
    double* out = parts.data_ptr<double>();
    for (int64_t c = 0; c < C; ++c) {
      out[3 * c] = lse[2 * c + 1].value();
      out[3 * c + 1] = lse[2 * c].value();
      out[3 * c + 2] = with_positives[c];
    }
    return {parts, stats};
  }
  int64_t P = 0;
  for (int64_t c = 0; c < C; ++c) P += with_positives[c];
  double pos = 0, neg = 0;
  for (int64_t c = 0; c < C; ++c) {
    const double lp = lse[2 * c + 1].value(), ln = lse[2 * c].value();
    pos += lp;
    neg += ln;
    acc_t* row = st + c * S;
    row[0] = static_cast<acc_t>(lp);
    row[1] = static_cast<acc_t>(ln);
    row[2] = static_cast<acc_t>(P > 0 ? p.alpha / static_cast<double>(P) : 0.0);
    row[3] = static_cast<acc_t>(p.alpha / static_cast<double>(C));
  }
  // PML's DivisorReducer: the positive terms over the proxies with positives (0 without
  // any), the negative ones over all proxies.
  const double loss =
      (P > 0 ? pos / static_cast<double>(P) : 0.0) + (C > 0 ? neg / static_cast<double>(C) : 0.0);
  return {scalar_of_type(loss, embeddings.options()), stats};
}

// Proxy anchor's ∂loss/∂s from its stats: α/C·exp(α(s + margin) − Ln_c) for a negative,
// −α/P·exp(α(margin − s) − Lp_c) for a positive.
template <typename acc_t>
struct ProxyAnchorTerms {
  const Problem& p;
  const acc_t* st;
  static constexpr int64_t S = kProxyAnchorStats;
  double negative(int64_t c, int64_t, double s) const {
    return p.alpha * (s + p.margin) - static_cast<double>(st[c * S + 1]);
  }
  double positive(int64_t c, int64_t, double s) const {
    return -static_cast<double>(st[c * S + 2]) *
           std::exp(p.alpha * (p.margin - s) - static_cast<double>(st[c * S]));
  }
  std::optional<VectorTerms<acc_t>> vector_form() const {
    VectorTerms<acc_t> v(p.N);
    v.neg_slope = p.alpha;
    v.neg_shift = -p.margin;
    v.pos_slope = -p.alpha;
    v.pos_shift = p.margin;
    for (int64_t c = 0; c < p.N; ++c) {
      v.neg_c[c] = -static_cast<double>(st[c * S + 1]);
      v.pos_c[c] = -static_cast<double>(st[c * S]);
      v.pos_w[c] = -st[c * S + 2];
    }
    if (!v.ordinary()) return std::nullopt;
    return v;
  }
};

// The most entries (slots × rows × D) of the slots' partial gradients that proxy_anchor_grads
// keeps (16 MiB of float32), and the fewest slots it takes (past that, the two gradients are
// formed apart: each slot's share of the threads would be too coarse).
constexpr int64_t kSlotEntries = int64_t{1} << 22;
constexpr int64_t kFewestSlots = 8;

// proxy_anchor_grads' slots with one side's rows (tile_rows of them) as the tiles' rows: as
// many as for_each_proxy_tile takes, fewer where their partial gradients of the other side
// would pass kSlotEntries; 0 where that leaves fewer than kFewestSlots (and than its blocks).
inline int64_t grad_slots(int64_t tile_rows, int64_t other_rows, int64_t D) {
  const int64_t rows = rows_per_task(tile_rows), blocks = (tile_rows + rows - 1) / rows;
  const int64_t slots =
      std::min(proxy_slots(tile_rows), kSlotEntries / std::max<int64_t>(other_rows * D, 1));
  return slots > 0 && slots >= std::min(kFewestSlots, blocks) ? slots : 0;
}

// Both gradients of proxy anchor's loss in one pass over the tiles (for_each_proxy_tile, the
// embeddings or the proxies as the tiles' rows, whichever side's partial gradients are the
// smaller): per tile, ∂loss/∂s once (vectorised by the terms' vector_form, where it is
// ordinary), into the block's rows' gradient (the tile times the other side's rows) and into
// its slot's partial gradient of the other side (the tile's transpose times the block's
// rows); the slots' partials summed in order. One GEMM of the tile where the two gradients
// apart (cos_rows_grad, each side's rows as anchors) form it twice. Returns {∂/∂proxies,
// ∂/∂embeddings}.
template <typename acc_t>
std::pair<Tensor, Tensor> proxy_anchor_grads(const Problem& p, const Inputs& in,
                                             const ProxyAnchorTerms<acc_t>& terms, acc_t weight,
                                             acc_t grad, bool embedding_rows, int64_t slots) {
  using V = Vectorized<acc_t>;
  const Side &proxies = in.a, &embeddings = in.b;
  const Side& mine = embedding_rows ? embeddings : proxies;  // the tiles' rows
  const Side& other = embedding_rows ? proxies : embeddings;
  const int64_t n = mine.rows.size(0), m = other.rows.size(0), D = p.D;
  const int64_t* labels = in.ref_lab.const_data_ptr<int64_t>();
  const acc_t* inv_mine = mine.scale.const_data_ptr<acc_t>();
  const acc_t* inv_other = other.scale.const_data_ptr<acc_t>();
  const GemmRows mine_rows = gemm_rows(mine.rows), other_rows = gemm_rows(other.rows);
  Tensor owned = at::zeros_like(mine.rows);
  // (each slot's first block writes its partial: nothing to zero first)
  Tensor partial = at::empty({slots, m, D}, mine.rows.options());
  const int64_t rows = rows_per_task(n), blocks = (n + rows - 1) / rows;
  const std::optional<VectorTerms<acc_t>> vt = terms.vector_form();
  auto tile = [&](Tensor& s, int64_t slot, int64_t r0, int64_t q0) {
    const int64_t dr = s.size(0), dq = s.size(1), stride = s.stride(0);
    // ∂loss/∂s times the other side's scale (for the rows' gradient) in s, times the row's
    // (for the other side's) in t.
    Tensor t = at::empty({dr, dq}, s.options());
    acc_t* tp = t.data_ptr<acc_t>();
    acc_t cosine[kCols], e[kCols];
    for (int64_t r = 0; r < dr; ++r) {
      const int64_t i = r0 + r;
      acc_t* x = s.data_ptr<acc_t>() + r * stride;
      const acc_t scale = inv_mine[i];
      at::vec::map2([scale](V v, V inv) { return v * inv * V(scale); }, cosine, x, inv_other + q0,
                    dq);
      if (vt) {  // (the exponent in double, as the scalar terms form it)
        const double* nc = vt->neg_c.data() + (embedding_rows ? q0 : i);
        const int64_t step = embedding_rows ? 1 : 0;
        for (int64_t c = 0; c < dq; ++c)
          e[c] = static_cast<acc_t>(
              vt->neg_slope * (static_cast<double>(cosine[c]) - vt->neg_shift) + nc[c * step]);
        at::vec::map([weight](V v) { return V(weight) * v.exp(); }, x, e, dq);
      } else {
        for (int64_t c = 0; c < dq; ++c) {
          const double term = embedding_rows ? terms.negative(q0 + c, i, cosine[c])
                                             : terms.negative(i, q0 + c, cosine[c]);
          x[c] = weight * std::exp(static_cast<acc_t>(term));
        }
      }
      // The positive pairs: an embedding's label's column, or a proxy's embeddings of its class.
      if (embedding_rows) {
        const int64_t c = labels[i] - q0;
        if (c >= 0 && c < dq) x[c] = static_cast<acc_t>(terms.positive(q0 + c, i, cosine[c]));
      } else {
        for (int64_t c = 0; c < dq; ++c) {
          if (labels[q0 + c] == i) x[c] = static_cast<acc_t>(terms.positive(i, q0 + c, cosine[c]));
        }
      }
      at::vec::map([scale](V v) { return v * V(scale); }, tp + r * dq, x, dq);
      at::vec::map2([](V v, V inv) { return v * inv; }, x, x, inv_other + q0, dq);
    }
    Tensor dst = owned.narrow(0, r0, dr);
    blas::addmm_(dst, s, other_rows.rows.narrow(0, q0, dq));
    add_nonfinite<acc_t>(other_rows, dst, s, q0);
    Tensor theirs = partial[slot].narrow(0, q0, dq);
    const bool first = r0 == slot * blocks / slots * rows;  // (the slot's first block)
    blas::addmm_(theirs, t.t(), mine_rows.rows.narrow(0, r0, dr), first ? 0.0 : 1.0);
    // (add_nonfinite's rule, the tile transposed: a row of the other side NaN where it weighs
    // a row of the block that is not finite)
    for (auto it = std::lower_bound(mine_rows.nonfinite.begin(), mine_rows.nonfinite.end(), r0);
         it != mine_rows.nonfinite.end() && *it < r0 + dr; ++it) {
      for (int64_t c = 0; c < dq; ++c) {
        if (tp[(*it - r0) * dq + c] != acc_t(0)) theirs[c].fill_(NAN);
      }
    }
  };
  for_each_proxy_tile(mine.rows, other.rows, tile, slots);
  // The slots' partials summed in slot order, element by element.
  Tensor summed = at::empty({m, D}, mine.rows.options());
  const acc_t* from = partial.const_data_ptr<acc_t>();
  acc_t* to = summed.data_ptr<acc_t>();
  at::parallel_for(0, m * D, 4096, [&](int64_t begin, int64_t end) {
    std::copy(from + begin, from + end, to + begin);
    for (int64_t slot = 1; slot < slots; ++slot) {
      const acc_t* add = from + slot * m * D;
      for (int64_t k = begin; k < end; ++k) to[k] += add[k];
    }
  });
  through_normalisation<acc_t>(summed, other, grad);
  through_normalisation<acc_t>(owned, mine, grad);
  if (embedding_rows) return {summed, owned};
  return {owned, summed};
}

// ---------------------------------------------------------------------------- the ops

template <bool NTXENT>
std::tuple<Tensor, Tensor> forward_cpu(const Tensor& embeddings, const Tensor& labels,
                                       const std::optional<Tensor>& ref_embeddings,
                                       const std::optional<Tensor>& ref_labels,
                                       const c10::Scalar& temperature,
                                       std::optional<int64_t> shard) {
  Problem p = check_inputs(NTXENT ? "ntxent_loss" : "supcon_loss", embeddings, labels,
                           ref_embeddings, ref_labels, shard);
  p.temperature = check_temperature(p.op, temperature);
  const Inputs in = prepare(p, embeddings, labels, ref_embeddings, ref_labels);
  std::tuple<Tensor, Tensor> result;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, embeddings.scalar_type(),
                                  "pair_loss_cpu", [&] {
                                    result = NTXENT ? ntxent_forward<scalar_t>(p, in, embeddings)
                                                    : supcon_forward<scalar_t>(p, in, embeddings);
                                  });
  return result;
}

// ∂loss/∂x_ij for anchor i and pair j, x = s/τ, from the forward's per-anchor stats: for a
// negative pair coef_i·exp(x − shift_i) (vectorised over tiles; shift_i = +∞ where coef_i = 0,
// so that the term is exactly 0), for a positive pair positive(i, x).
// SupCon: coef_i = 1/K (w_i·n_i) for the K anchors in the mean, shift_i = L_i, and a positive
//   pair's term has −w_i more.
// NT-Xent: coef_i = 1/P (P positive pairs), shift_i = −log R_i; a positive pair's term is
//   −q(1 − q)/(q + tiny)/P, q from x and log S_i.
template <typename acc_t>
struct PairGrad {
  bool ntxent = false;
  std::vector<acc_t> coef, shift, w, log_s;
  double tiny = 0;

  PairGrad(bool ntxent_, const acc_t* stats, int64_t N)
      : ntxent(ntxent_), coef(N), shift(N, std::numeric_limits<acc_t>::infinity()), w(N, 0) {
    if (ntxent) {
      log_s.resize(N);
      tiny = std::numeric_limits<acc_t>::min();
      for (int64_t i = 0; i < N; ++i) {
        const acc_t* row = stats + i * kNTXentStats;
        log_s[i] = row[0];
        coef[i] = std::isinf(row[1]) && row[1] < 0 ? acc_t(0) : row[2];  // no positives: R_i = 0
        if (coef[i] != acc_t(0)) shift[i] = -row[1];
      }
      return;
    }
    int64_t counted = 0;
    for (int64_t i = 0; i < N; ++i) counted += stats[i * kSupConStats + 1] != acc_t(0);
    const acc_t c = counted ? static_cast<acc_t>(1.0 / static_cast<double>(counted)) : acc_t(0);
    for (int64_t i = 0; i < N; ++i) {
      w[i] = stats[i * kSupConStats + 1];
      if (w[i] == acc_t(0)) continue;
      coef[i] = c;
      shift[i] = stats[i * kSupConStats];
    }
  }

  bool any() const {
    return std::any_of(coef.begin(), coef.end(), [](acc_t v) { return v != acc_t(0); });
  }

  acc_t positive(int64_t i, acc_t x) const {
    if (!ntxent) return coef[i] == acc_t(0) ? acc_t(0) : coef[i] * std::exp(x - shift[i]) - w[i];
    if (coef[i] == acc_t(0)) return acc_t(0);
    const double xd = x, ls = log_s[i];
    const double lse =
        std::isinf(ls) ? xd : std::max(xd, ls) + std::log1p(std::exp(-std::abs(xd - ls)));
    const double q = std::exp(xd - lse);
    return static_cast<acc_t>(-q * (1 - q) / (q + tiny)) * coef[i];
  }
};

// ∂loss/∂E for the rows of `own` (anchors or refs) against `other`, times grad: per tile,
// ∂loss/∂s_ij from the recomputed cosine, times inv_j (the GEMM takes other's raw rows), into
// Σ_j ·other_j; then through own's normalisation. anchors_own says which side holds the
// anchors (their stats); symmetric adds ∂/∂s_ji (no refs: s is symmetric, and both
// directions are one row's gradient). Of the anchors, the rows p asks for (own_rows).
template <typename acc_t>
Tensor rows_grad(const Problem& p, const Side& own, const Side& other, const Tensor& own_lab,
                 const Tensor& other_lab, const PairGrad<acc_t>& pg, bool anchors_own,
                 bool symmetric, acc_t grad) {
  using V = Vectorized<acc_t>;
  const auto [first, rows] = own_rows(p, own.rows, anchors_own);
  const Tensor mine = own.rows.narrow(0, first, rows);
  Tensor out = at::zeros_like(mine);
  const int64_t* la = own_lab.const_data_ptr<int64_t>();
  const int64_t* lb = other_lab.const_data_ptr<int64_t>();
  const acc_t* io = own.scale.const_data_ptr<acc_t>();
  const acc_t* ib = other.scale.const_data_ptr<acc_t>();
  const acc_t* coef = pg.coef.data();
  const acc_t* shift = pg.shift.data();
  const acc_t inv_tau = static_cast<acc_t>(1.0 / p.temperature);
  const bool columns = !anchors_own || symmetric;  // terms of the anchors in the columns
  const GemmRows summed = gemm_rows(other.rows);
  for_each_tile(mine, other.rows, [&](Tensor& s, int64_t a0, int64_t b0) {
    const int64_t di = s.size(0), dj = s.size(1), stride = s.stride(0);
    acc_t* base = s.data_ptr<acc_t>();
    acc_t x[kCols];
    for (int64_t r = 0; r < di; ++r) {
      const int64_t i = first + a0 + r;
      acc_t* row = base + r * stride;
      const acc_t scale = io[i] * inv_tau;
      at::vec::map2([scale](V v, V inv) { return v * inv * V(scale); }, x, row, ib + b0, dj);
      const bool row_terms = anchors_own && coef[i] != acc_t(0);
      int64_t c = 0;
      for (; c + V::size() <= dj; c += V::size()) {
        const V xv = V::loadu(x + c);
        V g(0);
        if (row_terms) g = V(coef[i]) * (xv - V(shift[i])).exp();
        if (columns) {
          const V cv = V::loadu(coef + b0 + c);
          g = g + V::blendv(cv * (xv - V::loadu(shift + b0 + c)).exp(), V(0), cv == V(0));
        }
        g.store(row + c);
      }
      for (; c < dj; ++c) {
        const int64_t j = b0 + c;
        acc_t g = row_terms ? coef[i] * std::exp(x[c] - shift[i]) : acc_t(0);
        if (columns && coef[j] != acc_t(0)) g += coef[j] * std::exp(x[c] - shift[j]);
        row[c] = g;
      }
      // The positive pairs' own terms, the batch's pair of a row with itself (none), and inv_j
      // with τ's 1/τ (∂x/∂s).
      for (c = 0; c < dj; ++c) {
        const int64_t j = b0 + c;
        if (anchors_own ? p.itself(i, j) : p.itself(j, i)) {
          row[c] = 0;
          continue;
        }
        if (la[i] == lb[j]) {
          acc_t g = anchors_own ? pg.positive(i, x[c]) : acc_t(0);
          if (columns) g += pg.positive(j, x[c]);
          row[c] = g;
        }
        row[c] *= ib[j] * inv_tau;
      }
    }
    Tensor dst = out.narrow(0, a0, di);
    blas::addmm_(dst, s, summed.rows.narrow(0, b0, dj));
    add_nonfinite<acc_t>(summed, dst, s, b0);
  });
  through_normalisation<acc_t>(out, own, grad, first);
  return out;
}

template <bool NTXENT>
std::tuple<Tensor, Tensor> backward_cpu(const Tensor& grad, const Tensor& embeddings,
                                        const Tensor& labels,
                                        const std::optional<Tensor>& ref_embeddings,
                                        const std::optional<Tensor>& ref_labels,
                                        const Tensor& stats, const c10::Scalar& temperature,
                                        std::array<bool, 2> output_mask,
                                        std::optional<int64_t> shard, bool own_stats) {
  Problem call = check_inputs(NTXENT ? "ntxent_loss" : "supcon_loss", embeddings, labels,
                              ref_embeddings, ref_labels, shard);
  call.temperature = check_temperature(call.op, temperature);
  check_own_stats(call, own_stats);
  const Problem p = call.takes_whole_stats() ? whole_of(call) : call;
  check_backward_inputs(p, grad, embeddings, stats, NTXENT ? kNTXentStats : kSupConStats);
  const bool want_e = output_mask[0], want_r = !call.self && output_mask[1];
  Tensor ge, gr;
  auto outputs = [&] {
    return backward_outputs(ge, gr, want_e, want_r, embeddings, ref_embeddings);
  };
  if ((!want_e && !want_r) || call.N == 0 || call.M == 0 || call.D == 0) return outputs();
  const Inputs in = backward_inputs(call, p, embeddings, labels, ref_embeddings, ref_labels);
  const Tensor st = stats.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, embeddings.scalar_type(), "pair_loss_backward_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const PairGrad<acc_t> pg(NTXENT, st.const_data_ptr<acc_t>(), p.N);
        if (!pg.any()) return;
        const double g = grad.item<double>();
        const acc_t gv = static_cast<acc_t>(g);
        const auto dtype = embeddings.scalar_type();
        if (p.self) {
          if (want_e)
            ge = rows_grad<acc_t>(p, in.a, in.a, in.lab, in.lab, pg, true, true, gv).to(dtype);
          return;
        }
        if (want_e)
          ge = rows_grad<acc_t>(p, in.a, in.b, in.lab, in.ref_lab, pg, true, false, gv).to(dtype);
        if (want_r && !p.own_stats)
          gr = rows_grad<acc_t>(p, in.b, in.a, in.ref_lab, in.lab, pg, false, false, gv).to(dtype);
      });
  return outputs();
}

Problem ms_problem(const Tensor& embeddings, const Tensor& labels,
                   const std::optional<Tensor>& ref_embeddings,
                   const std::optional<Tensor>& ref_labels, const c10::Scalar& alpha,
                   const c10::Scalar& beta, const c10::Scalar& base,
                   const std::optional<c10::Scalar>& miner_epsilon, std::optional<int64_t> shard) {
  Problem p =
      check_inputs("multi_similarity_loss", embeddings, labels, ref_embeddings, ref_labels, shard);
  p.alpha = check_positive(p.op, "alpha", alpha);
  p.beta = check_positive(p.op, "beta", beta);
  p.base = check_finite(p.op, "base", base);
  if (miner_epsilon.has_value())
    p.miner_epsilon = check_margin(p.op, "miner_epsilon", *miner_epsilon);
  return p;
}

std::tuple<Tensor, Tensor> ms_forward_cpu(const Tensor& embeddings, const Tensor& labels,
                                          const std::optional<Tensor>& ref_embeddings,
                                          const std::optional<Tensor>& ref_labels,
                                          const c10::Scalar& alpha, const c10::Scalar& beta,
                                          const c10::Scalar& base,
                                          const std::optional<c10::Scalar>& miner_epsilon,
                                          std::optional<int64_t> shard) {
  const Problem p = ms_problem(embeddings, labels, ref_embeddings, ref_labels, alpha, beta, base,
                               miner_epsilon, shard);
  const Inputs in = prepare(p, embeddings, labels, ref_embeddings, ref_labels);
  std::tuple<Tensor, Tensor> result;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, embeddings.scalar_type(),
                                  "multi_similarity_loss_cpu",
                                  [&] { result = ms_forward<scalar_t>(p, in, embeddings); });
  return result;
}

std::tuple<Tensor, Tensor> ms_backward_cpu(
    const Tensor& grad, const Tensor& embeddings, const Tensor& labels,
    const std::optional<Tensor>& ref_embeddings, const std::optional<Tensor>& ref_labels,
    const Tensor& stats, const c10::Scalar& alpha, const c10::Scalar& beta, const c10::Scalar& base,
    const std::optional<c10::Scalar>& miner_epsilon, std::array<bool, 2> output_mask,
    std::optional<int64_t> shard, bool own_stats) {
  Problem call = ms_problem(embeddings, labels, ref_embeddings, ref_labels, alpha, beta, base,
                            miner_epsilon, shard);
  check_own_stats(call, own_stats);
  const Problem p = call.takes_whole_stats() ? whole_of(call) : call;
  check_backward_inputs(p, grad, embeddings, stats, kMultiSimilarityStats, at::kDouble);
  const bool want_e = output_mask[0], want_r = !call.self && output_mask[1];
  Tensor ge, gr;
  auto outputs = [&] {
    return backward_outputs(ge, gr, want_e, want_r, embeddings, ref_embeddings);
  };
  if ((!want_e && !want_r) || call.N == 0 || call.M == 0 || call.D == 0) return outputs();
  const Tensor st = stats.contiguous();
  const double* sp = st.const_data_ptr<double>();
  if (sp[kMultiSimilarityStats - 1] == 0) return outputs();  // a loss of 0 by PML's rules
  const Inputs in = backward_inputs(call, p, embeddings, labels, ref_embeddings, ref_labels);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, embeddings.scalar_type(), "multi_similarity_loss_backward_cpu",
      [&] {
        using acc_t = at::opmath_type<scalar_t>;
        MultiSimilarity<acc_t> ms(p, in);
        for (int64_t i = 0; i < p.N; ++i) {
          ms.hard_negative[i] = sp[i * kMultiSimilarityStats];
          ms.hard_positive[i] = sp[i * kMultiSimilarityStats + 1];
        }
        const acc_t g = static_cast<acc_t>(grad.item<double>());
        const auto dtype = embeddings.scalar_type();
        const MultiSimilarityTerms<acc_t> terms{p, ms, sp};
        const acc_t w = static_cast<acc_t>(sp[kMultiSimilarityStats - 1]);  // 1/N in every row
        if (want_e) ge = cos_rows_grad<acc_t>(p, in, terms, w, true, g).to(dtype);
        if (want_r && !p.self && !p.own_stats)
          gr = cos_rows_grad<acc_t>(p, in, terms, w, false, g).to(dtype);
      });
  return outputs();
}

// The proxies as the anchors (labels 0..C−1), the embeddings as the refs.
Inputs proxy_inputs(const Problem& p, const Tensor& embeddings, const Tensor& labels,
                    const Tensor& proxies) {
  Inputs in;
  in.a = side(proxies);
  in.b = side(embeddings);
  in.lab = at::arange(p.N, labels.options().dtype(at::kLong));
  in.ref_lab = labels.to(at::kLong).contiguous();
  return in;
}

std::tuple<Tensor, Tensor> proxy_anchor_cpu(const Tensor& embeddings, const Tensor& labels,
                                            const Tensor& proxies, const c10::Scalar& margin,
                                            const c10::Scalar& alpha,
                                            std::optional<int64_t> shard) {
  Problem p = check_proxy_inputs(embeddings, labels, proxies, margin, alpha);
  if (shard.has_value()) {
    TK_CHECK_VALUE(p.op, *shard == -1,
                   "shard must be -1 (the embeddings are a shard of the refs, the proxies the "
                   "anchors), got ",
                   *shard);
    p.shard = true;
  }
  const Inputs in = proxy_inputs(p, embeddings, labels, proxies);
  std::tuple<Tensor, Tensor> result;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, embeddings.scalar_type(), "proxy_anchor_loss_cpu",
      [&] { result = proxy_anchor_forward<scalar_t>(p, in, embeddings); });
  return result;
}

std::tuple<Tensor, Tensor> proxy_anchor_backward_cpu(const Tensor& grad, const Tensor& embeddings,
                                                     const Tensor& labels, const Tensor& proxies,
                                                     const Tensor& stats, const c10::Scalar& margin,
                                                     const c10::Scalar& alpha,
                                                     std::array<bool, 2> output_mask) {
  const Problem p = check_proxy_inputs(embeddings, labels, proxies, margin, alpha);
  check_backward_inputs(p, grad, embeddings, stats, kProxyAnchorStats);
  const bool want_e = output_mask[0], want_p = output_mask[1];
  Tensor ge, gp;
  auto outputs = [&] { return backward_outputs(ge, gp, want_e, want_p, embeddings, proxies); };
  if ((!want_e && !want_p) || p.N == 0 || p.M == 0 || p.D == 0) return outputs();
  const Inputs in = proxy_inputs(p, embeddings, labels, proxies);
  const Tensor st = stats.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, embeddings.scalar_type(), "proxy_anchor_loss_backward_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const acc_t* sp = st.const_data_ptr<acc_t>();
        const ProxyAnchorTerms<acc_t> terms{p, sp};
        const acc_t w = sp[3];  // α/C in every row
        const acc_t g = static_cast<acc_t>(grad.item<double>());
        const auto dtype = embeddings.scalar_type();
        // Both gradients in one pass where one side's partial gradients fit (the smaller).
        const int64_t by_embeddings = grad_slots(p.M, p.N, p.D);
        const int64_t by_proxies = grad_slots(p.N, p.M, p.D);
        const bool embedding_rows = by_embeddings > 0 && (by_proxies == 0 || p.N <= p.M);
        if (want_p && want_e && (by_embeddings > 0 || by_proxies > 0)) {
          const auto [proxies_grad, embeddings_grad] = proxy_anchor_grads<acc_t>(
              p, in, terms, w, g, embedding_rows, embedding_rows ? by_embeddings : by_proxies);
          gp = proxies_grad.to(dtype);
          ge = embeddings_grad.to(dtype);
          return;
        }
        if (want_p) gp = cos_rows_grad<acc_t>(p, in, terms, w, true, g).to(dtype);
        if (want_e) ge = cos_rows_grad<acc_t>(p, in, terms, w, false, g).to(dtype);
      });
  return outputs();
}

}  // namespace

TORCH_LIBRARY_IMPL(torchkit, CPU, m) {
  m.impl("supcon_loss", &forward_cpu<false>);
  m.impl("_supcon_loss_backward", &backward_cpu<false>);
  m.impl("ntxent_loss", &forward_cpu<true>);
  m.impl("_ntxent_loss_backward", &backward_cpu<true>);
  m.impl("multi_similarity_loss", &ms_forward_cpu);
  m.impl("_multi_similarity_loss_backward", &ms_backward_cpu);
  m.impl("proxy_anchor_loss", &proxy_anchor_cpu);
  m.impl("_proxy_anchor_loss_backward", &proxy_anchor_backward_cpu);
}

}  // namespace torchkit::pair_losses
