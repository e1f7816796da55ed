// The Euclidean pair losses on the CPU (contrastive_loss, triplet_margin_loss; the losses:
// pair_losses.h), on the family's engine (pair_losses_cpu.h).
//
// Distances between rows normalised as F.normalize does (PML's LpDistance), exact where
// torch.cdist's matmul form returns ~0: the normalised rows are centred on their mean (the
// clusters' common offset leaves every product) and each tile's expansion
// d² = |c_i|² + |c_j|² − 2 c_i·c_j is computed by one GEMM; where it cancelled (d² below
// (|c_i|² + |c_j|²)/kRefineRatio: near-duplicates) the entry is recomputed as Σ(e_i − e_j)² in
// float64 from the inputs and their float64 norms, and its gradient is taken the same way;
// between equal rows (equal_rows) it is 0 without a computation.
// Choices (which pairs' terms count, which triplets, the hardest pairs) are the exact
// distances' own: a tile's distance is within a bound of the exact one (Inputs::clear), and a
// choice that close to its threshold is made on the exact distance.
// Backward: per tile ∂loss/∂d_ij (from the forward's statistics) becomes w_ij = ∂loss/∂d_ij / d_ij
// and Σ_j w_ij (c_i − c_j) one GEMM; then the normalisation's Jacobian per row.
//
// distance="cosine" (pair_losses.h) runs on the same code with d = −s: the rows are not centred
// (c = e, the normalised rows), a tile's d is −c_i·c_j, within (D + 4)·u·(|c_i|² + |c_j|²)/2 of
// the exact −s (a dot product of D terms, the rows rounded once), which is computed directly
// from the inputs and their float64 1/norms where a choice is that close to its threshold; no
// entry cancels. Backward: ∂d/∂e_i = −e_j, so w_ij = ∂loss/∂d_ij and the GEMM's −Σ_j w_ij c_j
// alone.
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_map>
#include <vector>

#include "cdist.h"
#include "checks.h"
#include "cpu/pair_losses_cpu.h"
#include "pair_losses.h"

namespace torchkit::pair_losses {
namespace {

using at::Tensor;
using namespace cpu;

// One side's rows as the distance tiles take them.
template <typename acc_t>
struct Points {
  Side side;              // the rows as F.normalize leaves them (the Jacobian's)
  Tensor centred;         // (n, D): e − μ rounded once, contiguous (the GEMMs'); cosine: μ = 0
  std::vector<acc_t> sq;  // |centred_i|²
  const acc_t* raw = nullptr;
  const double* inv = nullptr;
  const acc_t* c = nullptr;
  int64_t D = 0;
  bool cosine = false;
  // Per row: all zero (F.normalize leaves it 0), and normalised to norm 1 exactly in exact
  // arithmetic (1/norm in (0, 1/eps): its norm finite and above eps). A zero row lies at distance
  // exactly 1 from a unit one, which the sum of squares below rounds to 1 ± 1e-16: a negative pair
  // there would count at contrastive_loss's neg_margin = 1, a triplet at margin 0.
  std::vector<char> zero, unit;
  std::vector<int64_t> group;  // per row: its group of equal rows over both sides (equal_rows)

  // e_i − e_j in float64, from the inputs and their float64 1/norm: exact to float64's
  // rounding, where the rounded normalised rows would keep only float32's absolute accuracy.
  // x·(1/n) rather than x/n: a multiplication for a division, at most an ulp apart, except
  // at D = 1, where F.normalize's rows are exactly ±1 (or x/eps) and x·(1/n) is 1 − ulp for
  // many x: two rows of one sign must lie at 0 (a positive pair at 1e-16 would count at
  // contrastive_loss's pos_margin = 0, a negative there would be semi-hard) and opposite
  // ones at 2.
  struct Pair {
    const acc_t* x;
    const acc_t* y;
    double fx, fy;  // 1/n_i and 1/n_j, or n_i = max(|x_i|, eps) and n_j where D = 1
    bool divide;
    double left(int64_t k) const {
      const double a = static_cast<double>(x[k]);
      return divide ? a / fx : a * fx;
    }
    double right(int64_t k) const {
      const double b = static_cast<double>(y[k]);
      return divide ? b / fy : b * fy;
    }
    double diff(int64_t k) const { return left(k) - right(k); }
  };
  // F.normalize's divisor of a one-feature row: its norm is |x| exactly.
  static double clamp(acc_t x) {
    const double a = std::abs(static_cast<double>(x));
    return a < kNormEps ? kNormEps : a;  // NaN stays NaN
  }
  Pair pair(int64_t i, const Points& o, int64_t j) const {
    return D == 1 ? Pair{raw + i, o.raw + j, clamp(raw[i]), clamp(o.raw[j]), true}
                  : Pair{raw + i * D, o.raw + j * D, inv[i], o.inv[j], false};
  }
  // The cosine's distance −s = −e_i·e_j directly, in float64 (the same bits for (i, j) and
  // (j, i)). Between unit rows (normalised to norm 1 exactly in exact arithmetic): equal ones
  // at s = 1 exactly, and near ones (s > 1/2) at s = 1 − |e_i − e_j|²/2, whose differences
  // keep the digits of 1 − s that the products round away (a near-duplicate positive counts
  // at contrastive_loss's pos_margin = 1 as the exact term says; an equal one does not).
  double cosine_distance(int64_t i, const Points& o, int64_t j) const {
    const bool units = unit[i] && o.unit[j];
    if (units && group[i] == o.group[j]) return -1.0;
    const Pair p = pair(i, o, j);
    double s = 0;
    for (int64_t k = 0; k < D; ++k) s += p.left(k) * p.right(k);
    if (!(units && s > 0.5)) return -s;
    double d2 = 0;
    for (int64_t k = 0; k < D; ++k) {
      const double v = p.diff(k);
      d2 += v * v;
    }
    return d2 / 2 - 1;
  }
  double direct(int64_t i, const Points& o, int64_t j) const {
    if (cosine) return cosine_distance(i, o, j);
    if (group[i] == o.group[j]) return 0.0;  // equal rows: every difference is 0
    if (zero[i] != o.zero[j] && (zero[i] ? o.unit[j] : unit[i])) return 1.0;
    const Pair p = pair(i, o, j);
    double s = 0;
    for (int64_t k = 0; k < D; ++k) {
      const double v = p.diff(k);
      s += v * v;
    }
    return std::sqrt(s);
  }
};

// Both sides' points centred on one mean: that of the finite normalised rows of both (rows
// with a NaN or ∞ give NaN distances whatever the mean; cosine: not centred); without tiles,
// the direct distances' inputs only.
template <typename acc_t>
void make_points(Points<acc_t>& a, Points<acc_t>* b, const Tensor& x, const Tensor* y, bool tiles,
                 bool cosine) {
  a.side = side(x);
  if (b != nullptr) b->side = side(*y);
  const std::vector<int64_t> groups = equal_rows(a.side, b != nullptr ? &b->side : nullptr);
  a.group.assign(groups.begin(), groups.begin() + x.size(0));
  if (b != nullptr) b->group.assign(groups.begin() + x.size(0), groups.end());
  const int64_t D = x.size(1);
  std::vector<double> mean(D, 0.0);
  int64_t finite = 0;
  for (Points<acc_t>* pts : {&a, b}) {
    if (pts == nullptr) continue;
    pts->D = D;
    pts->cosine = cosine;
    pts->raw = pts->side.raw.template const_data_ptr<acc_t>();
    pts->inv = pts->side.inv64.template const_data_ptr<double>();
    const int64_t n = pts->side.raw.size(0);
    const bool* clamped = pts->side.clamped.template const_data_ptr<bool>();
    pts->zero.assign(n, 0);
    pts->unit.assign(n, 0);
    for (int64_t i = 0; i < n; ++i) {
      const double inv = pts->inv[i];
      pts->unit[i] = inv > 0 && inv < 1 / kNormEps;  // (NaN fails)
      if (!clamped[i]) continue;                     // (a zero row is clamped: its norm is 0 < eps)
      const acc_t* r = pts->raw + i * D;
      bool all_zero = true;
      for (int64_t k = 0; k < D && all_zero; ++k) all_zero = r[k] == acc_t(0);
      pts->zero[i] = all_zero;
    }
  }
  if (!tiles) return;
  for (Points<acc_t>* pts : {&a, b}) {
    if (pts == nullptr || cosine) continue;
    const int64_t n = pts->side.raw.size(0);
    for (int64_t i = 0; i < n; ++i) {
      if (!(pts->inv[i] > 0) || std::isinf(pts->inv[i])) continue;
      const acc_t* r = pts->raw + i * D;
      bool ok = true;
      for (int64_t k = 0; k < D && ok; ++k) ok = std::isfinite(r[k]);
      if (!ok) continue;
      ++finite;
      for (int64_t k = 0; k < D; ++k) mean[k] += static_cast<double>(r[k]) * pts->inv[i];
    }
  }
  if (finite > 0) {
    for (double& m : mean) m /= static_cast<double>(finite);
  }
  for (Points<acc_t>* pts : {&a, b}) {
    if (pts == nullptr) continue;
    const int64_t n = pts->side.raw.size(0);
    pts->centred = at::empty({n, D}, pts->side.raw.options());
    pts->sq.assign(n, acc_t(0));
    acc_t* c = pts->centred.template data_ptr<acc_t>();
    at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        double s = 0;
        for (int64_t k = 0; k < D; ++k) {
          const acc_t v =
              static_cast<acc_t>(static_cast<double>(pts->raw[i * D + k]) * pts->inv[i] - mean[k]);
          c[i * D + k] = v;
          s += static_cast<double>(v) * static_cast<double>(v);
        }
        pts->sq[i] = static_cast<acc_t>(s);
      }
    });
    pts->c = c;
  }
}

template <typename acc_t>
struct Inputs {
  Points<acc_t> a, b_own;            // anchors' and refs' points
  const Points<acc_t>* b = nullptr;  // &a without refs
  bool self = true;
  Tensor lab, ref_lab;  // int64, contiguous
  const int64_t* la = nullptr;
  const int64_t* lb = nullptr;

  // The distance of anchor i and ref row j computed directly, by one expression whichever
  // order a caller meets them in (without refs, (i, j) and (j, i) are one pair): every
  // decision taken on it comes out the same in every pass.
  double exact(int64_t i, int64_t j) const {
    return self && j < i ? a.direct(j, a, i) : a.direct(i, *b, j);
  }

  // Whether a tile's distance d of anchor i and ref row j lies on the same side of t as the
  // exact distance: the expansion's error is at most e = (D + 4)·u·(|c_i|² + |c_j|²) (a dot
  // product of D terms, the norms rounded once), which moves d by at most e/d (and a rounding
  // of the square root: 4u·d more), so |d − t|·d > e + 4u·d² settles it; one multiplication,
  // where an interval would take two square roots. Near 0 (d² <= e) nothing is clear.
  // (cosine: d = −c_i·c_j is within e/2 of the exact −s, whatever d.)
  bool clear(int64_t i, int64_t j, double d, double t) const {
    const double e = error_scale * (static_cast<double>(a.sq[i]) + static_cast<double>(b->sq[j]));
    if (a.cosine) return std::abs(d - t) > e / 2;
    return std::abs(d - t) * d > e + 4 * kUnit * d * d;
  }
  // How far the exact distance may be from the tile's d (clear's bound; ∞ near 0).
  double slack(int64_t i, int64_t j, double d) const {
    const double e = error_scale * (static_cast<double>(a.sq[i]) + static_cast<double>(b->sq[j]));
    if (a.cosine) return e / 2;
    return d * d > e ? e / d + 4 * kUnit * d : std::numeric_limits<double>::infinity();
  }
  static constexpr double kUnit = std::numeric_limits<acc_t>::epsilon() / 2;
  double error_scale = 0;  // (D + 4)·u
};

// tiles: whether distance tiles will be computed (not for batch_hard's backward, which takes
// its pairs directly).
template <typename acc_t>
void prepare(Inputs<acc_t>& in, const Problem& p, const Tensor& embeddings, const Tensor& labels,
             const std::optional<Tensor>& ref_embeddings, const std::optional<Tensor>& ref_labels,
             bool tiles = true) {
  make_points<acc_t>(in.a, p.self ? nullptr : &in.b_own, embeddings,
                     p.self ? nullptr : &*ref_embeddings, tiles, p.distance == Distance::Cosine);
  in.b = p.self ? &in.a : &in.b_own;
  in.self = p.self;
  in.error_scale = (static_cast<double>(p.D) + 4) * Inputs<acc_t>::kUnit;
  in.lab = labels.to(at::kLong).contiguous();
  in.ref_lab = p.self ? in.lab : ref_labels->to(at::kLong).contiguous();
  in.la = in.lab.template const_data_ptr<int64_t>();
  in.lb = in.ref_lab.template const_data_ptr<int64_t>();
}

// The tile's row r (row i of one side against rows b0.. of the other; anchors_own: the rows are
// anchors) turned from products into distances in place; direct[c] says which entries were
// computed directly (cancelled, or not finite; cosine: none), and exact[c] (where given) holds
// those in float64, before their rounding to acc_t.
template <typename acc_t>
void distance_row(const Inputs<acc_t>& in, bool anchors_own, acc_t* x, int64_t i, int64_t b0,
                  int64_t dj, bool* direct, double* exact = nullptr) {
  constexpr acc_t kRatio = static_cast<acc_t>(cdist::kRefineRatio);
  const Points<acc_t>& own = anchors_own ? in.a : *in.b;
  const Points<acc_t>& other = anchors_own ? *in.b : in.a;
  using V = at::vec::Vectorized<acc_t>;
  if (own.cosine) {
    at::vec::map([](V v) { return V(0) - v; }, x, x, dj);
    std::fill(direct, direct + dj, false);
    return;
  }
  const acc_t si = own.sq[i];
  const acc_t* sq = other.sq.data() + b0;
  // d² = |c_i|² + |c_j|² − 2 c_i·c_j and its square root, vectorised; then the entries to
  // recompute (cancelled, 0 = 0 included, or NaN).
  at::vec::map2([si](V v, V s) { return (V(si) + s - V(2) * v).sqrt(); }, x, x, sq, dj);
  for (int64_t c = 0; c < dj; ++c) {
    const acc_t sum = si + sq[c];
    direct[c] = !(x[c] * x[c] * kRatio > sum);
  }
  for (int64_t c = 0; c < dj; ++c) {
    if (!direct[c]) continue;
    const double d = anchors_own ? in.exact(i, b0 + c) : in.exact(b0 + c, i);
    x[c] = static_cast<acc_t>(d);
    if (exact != nullptr) exact[c] = d;
  }
}

// ∂loss/∂E for the rows of `own` against `other` (anchors or refs), times grad. coef(a, r, d,
// positive) is ∂loss/∂d for anchor a's pair with ref row r; anchors_own says which side holds
// the anchors; symmetric (no refs) adds the pair (j, i) to (i, j), both one row's gradient.
// Per tile: w = Σ coef / d (0 at d = 0, cdist's subgradient), Σ_j w_ij (c_i − c_j) by one GEMM
// and a row sum; directly computed entries outside the GEMM, in float64. extra(out) adds what
// the tiles leave out (∂loss/∂e, before the normalisation's Jacobian). Of the anchors, the rows
// p asks for (own_rows).
template <typename acc_t, typename Coef, typename Extra>
Tensor rows_grad(const Problem& p, const Inputs<acc_t>& in, bool anchors_own, acc_t grad, Coef coef,
                 Extra extra) {
  const Points<acc_t>& own = anchors_own ? in.a : *in.b;
  const Points<acc_t>& other = anchors_own ? *in.b : in.a;
  const int64_t* own_lab = anchors_own ? in.la : in.lb;
  const int64_t* other_lab = anchors_own ? in.lb : in.la;
  const bool symmetric = p.self;
  const int64_t D = own.D;
  const auto [first, rows] = own_rows(p, own.centred, anchors_own);
  const Tensor mine = own.centred.narrow(0, first, rows);
  Tensor out = at::zeros_like(mine);
  acc_t* op = out.data_ptr<acc_t>();
  const GemmRows summed = gemm_rows(other.centred);
  for_each_tile(mine, other.centred, [&](Tensor& s, int64_t a0, int64_t b0) {
    const int64_t di = s.size(0), dj = s.size(1), stride = s.stride(0);
    acc_t* base = s.data_ptr<acc_t>();
    bool direct[kCols];
    std::vector<double> acc(D);
    for (int64_t r = 0; r < di; ++r) {
      const int64_t i = first + a0 + r;
      acc_t* x = base + r * stride;
      distance_row(in, anchors_own, x, i, b0, dj, direct);
      double row_sum = 0;
      bool any_direct = false;
      for (int64_t c = 0; c < dj; ++c) {
        const int64_t j = b0 + c;
        const acc_t d = x[c];
        if (anchors_own ? p.itself(i, j) : p.itself(j, i)) {
          x[c] = 0;
          continue;
        }
        const bool positive = own_lab[i] == other_lab[j];
        double g = anchors_own ? coef(i, j, d, positive) : coef(j, i, d, positive);
        if (symmetric) g += coef(j, i, d, positive);
        const double w = own.cosine ? g : g == 0 || d == 0 ? 0.0 : g / static_cast<double>(d);
        if (direct[c] && w != 0) {
          if (!any_direct) std::fill(acc.begin(), acc.end(), 0.0);
          any_direct = true;
          const auto pr = own.pair(i, other, j);
          for (int64_t k = 0; k < D; ++k) acc[k] += w * pr.diff(k);
          x[c] = 0;
          continue;
        }
        x[c] = static_cast<acc_t>(w);
        row_sum += static_cast<double>(x[c]);
      }
      acc_t* orow = op + (i - first) * D;
      const acc_t* ci = own.c + i * D;
      if (own.cosine) continue;  // (no Σ_j w_ij·c_i term, no direct entry)
      for (int64_t k = 0; k < D; ++k) {
        orow[k] += static_cast<acc_t>(row_sum) * ci[k] +
                   (any_direct ? static_cast<acc_t>(acc[k]) : acc_t(0));
      }
    }
    Tensor dst = out.narrow(0, a0, di);
    blas::addmm_(dst, s, summed.rows.narrow(0, b0, dj), 1, -1);
    add_nonfinite<acc_t>(summed, dst, s, b0);
  });
  extra(out);
  through_normalisation<acc_t>(out, own.side, grad, first);
  return out;
}

// The gradients of both inputs from coef and extra (rows_grad's; extra(out, anchors_own)):
// without refs one symmetric pass, with refs a pass over anchor blocks and one over ref blocks
// (each block owns its rows).
template <typename acc_t, typename Coef, typename Extra>
std::tuple<Tensor, Tensor> gradients(const Problem& p, const Inputs<acc_t>& in, bool want_e,
                                     bool want_r, acc_t grad, at::ScalarType dtype, Coef coef,
                                     Extra extra) {
  Tensor ge, gr;
  auto on = [&](bool anchors_own) {
    return [&, anchors_own](Tensor& out) { extra(out, anchors_own); };
  };
  if (want_e || p.self) ge = rows_grad<acc_t>(p, in, true, grad, coef, on(true)).to(dtype);
  if (want_r && !p.self) gr = rows_grad<acc_t>(p, in, false, grad, coef, on(false)).to(dtype);
  return {ge, gr};
}

// ---------------------------------------------------------------------------- contrastive

// A positive pair's term relu(d − pos_margin) and a negative's relu(neg_margin − d); NaN
// counts (PML's reducer drops it: `losses > 0` is false). Cosine (d = −s): PML's
// relu(pos_margin − s) and relu(s − neg_margin) are these at the margins negated.
struct ContrastiveTerms {
  double pos_margin, neg_margin;
  explicit ContrastiveTerms(const Problem& p)
      : pos_margin(p.distance == Distance::Cosine ? -p.pos_margin : p.pos_margin),
        neg_margin(p.distance == Distance::Cosine ? -p.neg_margin : p.neg_margin) {}
  double term(double d, bool positive) const { return positive ? d - pos_margin : neg_margin - d; }
  static bool counted(double t) { return !(t <= 0); }
  // The tile's distance d of anchor i and ref row j, exact where it decides whether the term
  // counts.
  template <typename acc_t>
  double settled(const Inputs<acc_t>& in, int64_t i, int64_t j, double d, bool positive) const {
    return std::isnan(d) || in.clear(i, j, d, positive ? pos_margin : neg_margin) ? d
                                                                                  : in.exact(i, j);
  }
};

struct PairSums {
  double sum[2] = {0, 0};     // [negative, positive]
  int64_t terms[2] = {0, 0};  // terms > 0 (or NaN)
  int64_t pairs[2] = {0, 0};
};

template <typename scalar_t>
std::tuple<Tensor, Tensor> contrastive_forward(const Problem& p, const Tensor& embeddings,
                                               const Tensor& labels,
                                               const std::optional<Tensor>& ref_embeddings,
                                               const std::optional<Tensor>& ref_labels) {
  using acc_t = at::opmath_type<scalar_t>;
  Inputs<acc_t> in;
  prepare(in, p, embeddings, labels, ref_embeddings, ref_labels);
  const ContrastiveTerms t(p);
  std::vector<PairSums> rows(p.N);
  if (p.N > 0 && p.M > 0) {
    for_each_tile(in.a.centred, in.b->centred, [&](Tensor& s, int64_t a0, int64_t b0) {
      const int64_t di = s.size(0), dj = s.size(1), stride = s.stride(0);
      acc_t* base = s.data_ptr<acc_t>();
      bool direct[kCols];
      for (int64_t r = 0; r < di; ++r) {
        const int64_t i = a0 + r;
        acc_t* x = base + r * stride;
        distance_row(in, true, x, i, b0, dj, direct);
        PairSums& row = rows[i];
        for (int64_t c = 0; c < dj; ++c) {
          if (p.itself(i, b0 + c)) continue;
          const int positive = in.la[i] == in.lb[b0 + c];
          ++row.pairs[positive];
          const double d = direct[c] ? x[c] : t.settled(in, i, b0 + c, x[c], positive);
          const double v = t.term(d, positive);
          if (!ContrastiveTerms::counted(v)) continue;
          row.sum[positive] += v;
          ++row.terms[positive];
        }
      }
    });
  }
  PairSums total;
  for (const PairSums& row : rows) {  // in anchor order: the same bits on any number of threads
    for (int k = 0; k < 2; ++k) {
      total.sum[k] += row.sum[k];
      total.terms[k] += row.terms[k];
      total.pairs[k] += row.pairs[k];
    }
  }
  Tensor stats = at::zeros({p.N, kContrastiveStats}, in.a.centred.options());
  if (p.shard) {  // the stats as if the rules held; its caller rewrites them
    acc_t* st = stats.data_ptr<acc_t>();
    for (int k = 0; k < 2; ++k) {
      if (total.terms[k] == 0) continue;
      for (int64_t i = 0; i < p.N; ++i)
        st[i * kContrastiveStats + 1 - k] =
            static_cast<acc_t>(1 / static_cast<double>(total.terms[k]));
    }
    auto n = [](int64_t v) { return static_cast<double>(v); };
    return {p.parts({total.sum[1], n(total.terms[1]), total.sum[0], n(total.terms[0]),
                     n(total.pairs[1]), n(total.pairs[0])},
                    embeddings),
            stats};
  }
  double loss = 0;
  if (total.pairs[0] > 1 || total.pairs[1] > 1) {  // PML: nothing when every index list is <= 1
    acc_t* st = stats.data_ptr<acc_t>();
    for (int k = 0; k < 2; ++k) {
      if (total.terms[k] == 0) continue;
      const double n = static_cast<double>(total.terms[k]);
      loss += total.sum[k] / n;
      for (int64_t i = 0; i < p.N; ++i)
        st[i * kContrastiveStats + 1 - k] = static_cast<acc_t>(1 / n);
    }
  }
  return {scalar_of_type(loss, embeddings.options()), stats};
}

template <typename acc_t>
std::tuple<Tensor, Tensor> contrastive_backward(const Problem& p, const Inputs<acc_t>& in,
                                                const Tensor& stats, bool want_e, bool want_r,
                                                acc_t grad, at::ScalarType dtype) {
  const acc_t* st = stats.const_data_ptr<acc_t>();
  const double w_pos = st[0], w_neg = st[1];  // every row holds the same two
  const ContrastiveTerms t(p);
  return gradients<acc_t>(
      p, in, want_e, want_r, grad, dtype,
      [&](int64_t a, int64_t r, acc_t d, bool positive) {
        const double v = t.term(t.settled(in, a, r, d, positive), positive);
        if (!ContrastiveTerms::counted(v)) return 0.0;
        return positive ? w_pos : -w_neg;
      },
      [](Tensor&, bool) {});
}

// ---------------------------------------------------------------------------- triplet

// Each anchor's positives' distances, sorted: a CSR over anchors, 12 bytes per positive pair
// (the distance, and how many counted triplets the pair is in). The distances are computed
// directly, in float64 whatever the inputs' type (exact, and the same bits for (a, p) and
// (p, a), so that a pair is found again by its distance in its partner's list), and kept so:
// a triplet counts on the exact difference d_ap − d_an + margin, where a positive's distance
// rounded to float32 would count a tie (a negative row equal to the positive) or drop a
// near-tie. One at a NaN distance is only counted.
template <typename acc_t>
struct Positives {
  std::vector<int64_t> start;  // anchor a's positives: [start[a], start[a + 1])
  std::vector<double> dist;
  std::vector<int32_t> uses;  // per positive pair, its counted triplets (count_triplets)
  std::vector<int64_t> nan;   // per anchor, its positives at a NaN distance
  std::unordered_map<int64_t, std::vector<int64_t>> members;  // label -> ref rows

  Positives(const Problem& p, const Inputs<acc_t>& in) : start(p.N + 1, 0), nan(p.N, 0) {
    for (int64_t j = 0; j < p.M; ++j) members[in.lb[j]].push_back(j);
    for (int64_t a = 0; a < p.N; ++a) {
      const auto* m = of(in.la[a]);
      // (less the anchor's own row, a ref row of its label)
      const int64_t n =
          m == nullptr ? 0 : static_cast<int64_t>(m->size()) - (p.offset >= 0 ? 1 : 0);
      start[a + 1] = start[a] + n;
    }
    dist.resize(start[p.N]);
    uses.assign(start[p.N], 0);
    at::parallel_for(0, p.N, 16, [&](int64_t begin, int64_t end) {
      for (int64_t a = begin; a < end; ++a) {
        double* row = dist.data() + start[a];
        int64_t n = 0;
        for_each(p, in, a, [&](int64_t, double d) {
          if (std::isnan(d)) {
            ++nan[a];
          } else {
            row[n++] = d;
          }
        });
        std::sort(row, row + n);
      }
    });
  }

  const std::vector<int64_t>* of(int64_t label) const {
    const auto it = members.find(label);
    return it == members.end() ? nullptr : &it->second;
  }

  // fn(j, d) for each positive j of anchor a with its exact distance.
  template <typename Fn>
  void for_each(const Problem& p, const Inputs<acc_t>& in, int64_t a, Fn fn) const {
    const auto* m = of(in.la[a]);
    if (m == nullptr) return;
    for (const int64_t j : *m) {
      if (p.itself(a, j)) continue;
      fn(j, in.exact(a, j));
    }
  }

  // The sorted (non-NaN) positives of anchor a.
  int64_t begin(int64_t a) const { return start[a]; }
  int64_t end(int64_t a) const { return start[a + 1] - nan[a]; }

  // The positives p of anchor a whose triplet (a, p, n) with a negative at distance dn is in
  // the loss (relu(d_ap − dn + margin) > 0; semi_hard: also d_ap < dn): [lo, hi) in its list.
  // A NaN dn: all of them.
  std::pair<int64_t, int64_t> violating(int64_t a, double dn, double margin, bool semi) const {
    const double* first = dist.data() + begin(a);
    const double* last = dist.data() + end(a);
    if (std::isnan(dn)) return {begin(a), end(a)};
    auto outside = [&](double d) { return !(d - dn + margin > 0); };
    auto nearer = [&](double d) { return d < dn; };
    if (last - first <= 32) {  // a count without branches: a binary search mispredicts
      int64_t lo = 0, hi = 0;
      for (const double* d = first; d != last; ++d) {
        lo += outside(*d);
        hi += nearer(*d);
      }
      return {begin(a) + lo, semi ? begin(a) + std::max(lo, hi) : end(a)};
    }
    const double* lo = std::partition_point(first, last, outside);
    const double* hi = semi ? std::partition_point(lo, last, nearer) : last;
    return {lo - dist.data(), hi - dist.data()};
  }

  // violating() for the tile's distance dn of anchor a and negative n, from the exact distance
  // where the range could differ (Inputs::clear of the thresholds at its ends).
  std::pair<int64_t, int64_t> settled(const Inputs<acc_t>& in, int64_t a, int64_t n, double dn,
                                      double margin, bool semi) const {
    const auto range = violating(a, dn, margin, semi);
    if (std::isnan(dn)) return range;
    const auto [first, last] = range;
    // The thresholds next to the range's ends: d_ap + margin around its first, d_ap around its
    // last (semi_hard).
    auto clear = [&](int64_t k, double shift) { return in.clear(a, n, dn, dist[k] + shift); };
    bool stable = (first == begin(a) || clear(first - 1, margin)) &&
                  (first == end(a) || clear(first, margin));
    if (semi) {
      stable =
          stable && (last == begin(a) || clear(last - 1, 0)) && (last == end(a) || clear(last, 0));
    }
    return stable ? range : violating(a, in.exact(a, n), margin, semi);
  }

  // Where in anchor a's list a positive at distance d is (any of equal distance: they have
  // the same counts), or −1 (NaN).
  int64_t find(int64_t a, double d) const {
    const double* at = std::lower_bound(dist.data() + begin(a), dist.data() + end(a), d);
    return at != dist.data() + end(a) && *at == d ? at - dist.data() : -1;
  }
};

// Per anchor: its triplets in the mean, and Σ d_an over them.
struct TripletSums {
  int64_t count = 0;
  double negative = 0;
};

// all / semi_hard: one pass over the tiles, where each negative forms counted triplets with a
// range of its anchor's sorted positives: it adds their number (and as many times its
// distance) to its anchor's sums, and 1 to each of them (as differences, then summed):
// pos.uses. The loss's sum is then Σ uses·(d_ap + margin) − Σ negative.
template <typename acc_t>
std::vector<TripletSums> count_triplets(const Problem& p, const Inputs<acc_t>& in,
                                        Positives<acc_t>& pos) {
  const bool semi = p.mining == Mining::SemiHard;
  std::vector<TripletSums> rows(p.N);
  for_each_tile(in.a.centred, in.b->centred, [&](Tensor& s, int64_t a0, int64_t b0) {
    const int64_t di = s.size(0), dj = s.size(1), stride = s.stride(0);
    acc_t* base = s.data_ptr<acc_t>();
    bool direct[kCols];
    double exact[kCols];
    for (int64_t r = 0; r < di; ++r) {
      const int64_t a = a0 + r;
      if (pos.start[a + 1] == pos.start[a]) continue;
      acc_t* x = base + r * stride;
      distance_row(in, true, x, a, b0, dj, direct, exact);
      TripletSums& row = rows[a];
      for (int64_t c = 0; c < dj; ++c) {
        if (in.la[a] == in.lb[b0 + c]) continue;  // a positive (or itself)
        // (a direct distance exact: compared with the positives' exact ones, not rounded)
        const double dn = direct[c] ? exact[c] : static_cast<double>(x[c]);
        const auto [lo, hi] = direct[c] ? pos.violating(a, dn, p.margin, semi)
                                        : pos.settled(in, a, b0 + c, dn, p.margin, semi);
        const int64_t k = std::max<int64_t>(hi - lo, 0) + pos.nan[a];
        row.count += k;
        if (k > 0) row.negative += static_cast<double>(k) * dn;
        if (hi <= lo) continue;
        ++pos.uses[lo];
        if (hi < pos.end(a)) --pos.uses[hi];  // (the slot past the list is the next anchor's)
      }
    }
  });
  at::parallel_for(0, p.N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t a = begin; a < end; ++a) {
      int32_t run = 0;
      for (int64_t k = pos.begin(a); k < pos.end(a); ++k) run = pos.uses[k] += run;
    }
  });
  return rows;
}

// batch_hard: per anchor its farthest positive and nearest negative from the tiles (ties to
// the lower index, a NaN distance wins), where the tiles' error could change a comparison
// by the exact distances of both.
template <typename acc_t>
void batch_hard(const Problem& p, const Inputs<acc_t>& in, int64_t* hardest) {
  constexpr int64_t S = kTripletStats;
  std::vector<Extreme<true>> farthest(p.N);  // positive
  std::vector<Extreme<false>> nearest(p.N);  // negative
  for_each_tile(in.a.centred, in.b->centred, [&](Tensor& s, int64_t a0, int64_t b0) {
    const int64_t di = s.size(0), dj = s.size(1), stride = s.stride(0);
    acc_t* base = s.data_ptr<acc_t>();
    bool direct[kCols];
    for (int64_t r = 0; r < di; ++r) {
      const int64_t a = a0 + r;
      acc_t* x = base + r * stride;
      distance_row(in, true, x, a, b0, dj, direct);
      auto exact = [&](int64_t j) { return in.exact(a, j); };
      for (int64_t c = 0; c < dj; ++c) {
        const int64_t j = b0 + c;
        if (p.itself(a, j)) continue;
        const double d = x[c];
        const double slack = direct[c] || std::isnan(d) ? 0.0 : in.slack(a, j, d);
        if (in.la[a] == in.lb[j]) {
          farthest[a].offer(j, d, slack, exact);
        } else {
          nearest[a].offer(j, d, slack, exact);
        }
      }
    }
  });
  for (int64_t a = 0; a < p.N; ++a) {
    hardest[a * S] = farthest[a].index;
    hardest[a * S + 1] = nearest[a].index;
  }
}

template <typename scalar_t>
std::tuple<Tensor, Tensor> triplet_forward(const Problem& p, const Tensor& embeddings,
                                           const Tensor& labels,
                                           const std::optional<Tensor>& ref_embeddings,
                                           const std::optional<Tensor>& ref_labels) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int64_t S = kTripletStats;
  Tensor stats = at::full({p.N, S}, -1, labels.options().dtype(at::kLong));
  int64_t* st = stats.data_ptr<int64_t>();
  for (int64_t a = 0; a < p.N; ++a) st[a * S + 2] = 0;
  if (p.N == 0 || p.M == 0) {
    return {p.shard ? p.parts({0, 0}, embeddings) : at::zeros({}, embeddings.options()), stats};
  }
  Inputs<acc_t> in;
  prepare(in, p, embeddings, labels, ref_embeddings, ref_labels);
  double total = 0;
  int64_t count = 0;
  if (p.mining == Mining::BatchHard) {
    batch_hard(p, in, st);
    std::vector<double> loss(p.N, 0.0);
    at::parallel_for(0, p.N, 16, [&](int64_t begin, int64_t end) {
      for (int64_t a = begin; a < end; ++a) {
        if (st[a * S] < 0 || st[a * S + 1] < 0) continue;
        loss[a] = in.exact(a, st[a * S]) - in.exact(a, st[a * S + 1]) + p.margin;
        st[a * S + 2] = !(loss[a] <= 0);  // > 0, or NaN
      }
    });
    for (int64_t a = 0; a < p.N; ++a) {
      if (st[a * S + 2] == 0) continue;
      total += loss[a];
      ++count;
    }
  } else {
    Positives<acc_t> pos(p, in);
    const std::vector<TripletSums> rows = count_triplets(p, in, pos);
    for (int64_t a = 0; a < p.N; ++a) {
      double sum = -rows[a].negative;
      for (int64_t k = pos.begin(a); k < pos.end(a); ++k) {
        sum += static_cast<double>(pos.uses[k]) * (pos.dist[k] + p.margin);
      }
      // A NaN distance in a counted triplet: the loss is NaN.
      if (rows[a].count > 0 && pos.nan[a] > 0) sum = std::numeric_limits<double>::quiet_NaN();
      st[a * S + 2] = rows[a].count;
      total += sum;
      count += rows[a].count;
    }
  }
  if (p.shard) return {p.parts({total, static_cast<double>(count)}, embeddings), stats};
  const double loss = count > 0 ? total / static_cast<double>(count) : 0.0;
  return {scalar_of_type(loss, embeddings.options()), stats};
}

// ∂/∂e of the pair (i, j)'s distance times g, into row i of out (float64 differences; cosine:
// ∂(−e_i·e_j)/∂e_i = −e_j).
template <typename acc_t>
void add_pair(acc_t* out_row, const Points<acc_t>& own, int64_t i, const Points<acc_t>& other,
              int64_t j, double d, double g) {
  const auto pr = own.pair(i, other, j);
  if (own.cosine) {
    if (g == 0) return;
    for (int64_t k = 0; k < own.D; ++k) out_row[k] -= static_cast<acc_t>(g * pr.right(k));
    return;
  }
  if (g == 0 || d == 0) return;
  const double w = g / d;
  for (int64_t k = 0; k < own.D; ++k) out_row[k] += static_cast<acc_t>(w * pr.diff(k));
}

template <typename acc_t>
std::tuple<Tensor, Tensor> triplet_backward(const Problem& p, const Inputs<acc_t>& in,
                                            const int64_t* st, bool want_e, bool want_r, acc_t grad,
                                            at::ScalarType dtype) {
  constexpr int64_t S = kTripletStats;
  int64_t count = 0;
  for (int64_t a = 0; a < p.N; ++a) count += st[a * S + 2];
  const double inv_count = 1.0 / static_cast<double>(count);
  if (p.mining == Mining::BatchHard) {
    // Two pairs per counted anchor, directly: +1/C on (a, p), −1/C on (a, n). Each row sums
    // its terms in anchor order (as an anchor its own two pairs, as a chosen ref row those
    // that chose it: a CSR of the pairs by ref row, filled in anchor order), so that the rows
    // are independent tasks and the bits do not depend on the number of threads.
    Tensor ge = at::zeros_like(in.a.side.raw), gr;
    Tensor& gref = p.self ? ge : (gr = at::zeros_like(in.b->side.raw));
    acc_t* e = ge.data_ptr<acc_t>();
    acc_t* r = gref.data_ptr<acc_t>();
    const int64_t D = p.D;
    std::vector<double> dist(2 * p.N, 0.0);  // per pair (a, k): its exact distance
    at::parallel_for(0, p.N, 16, [&](int64_t begin, int64_t end) {
      for (int64_t a = begin; a < end; ++a) {
        if (st[a * S + 2] == 0) continue;
        for (int k = 0; k < 2; ++k) dist[2 * a + k] = in.exact(a, st[a * S + k]);
      }
    });
    std::vector<int64_t> start(p.M + 1, 0), chosen;  // ref row j: its pairs 2a + k
    for (int64_t a = 0; a < p.N; ++a) {
      if (st[a * S + 2] == 0) continue;
      for (int k = 0; k < 2; ++k) ++start[st[a * S + k] + 1];
    }
    for (int64_t j = 0; j < p.M; ++j) start[j + 1] += start[j];
    chosen.resize(start[p.M]);
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t a = 0; a < p.N; ++a) {
      if (st[a * S + 2] == 0) continue;
      for (int k = 0; k < 2; ++k) chosen[fill[st[a * S + k]]++] = 2 * a + k;
    }
    auto weight = [&](int64_t pair) { return pair % 2 == 0 ? inv_count : -inv_count; };
    auto own_pairs = [&](int64_t a) {  // anchor a's terms, into its row of e
      for (int k = 0; k < 2; ++k)
        add_pair(e + a * D, in.a, a, *in.b, st[a * S + k], dist[2 * a + k], weight(2 * a + k));
    };
    // Ref row j's terms from the anchors that chose it, those before `until` (an anchor index).
    auto chosen_pairs = [&](int64_t j, int64_t& next, int64_t until) {
      for (; next < start[j + 1] && chosen[next] / 2 < until; ++next) {
        const int64_t pair = chosen[next];
        add_pair(r + j * D, *in.b, j, in.a, pair / 2, dist[pair], weight(pair));
      }
    };
    at::parallel_for(0, p.self ? p.N : std::max(p.N, p.M), 16, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        const bool anchor = m < p.N && st[m * S + 2] != 0;
        int64_t next = m < p.M ? start[m] : 0;
        if (p.self) {  // one row: the pairs that chose it before m, its own, the rest
          chosen_pairs(m, next, m);
          if (anchor) own_pairs(m);
          chosen_pairs(m, next, p.N);
          continue;
        }
        if (anchor) own_pairs(m);
        if (m < p.M) chosen_pairs(m, next, p.N);
      }
    });
    through_normalisation<acc_t>(ge, in.a.side, grad);
    if (!p.self && want_r) through_normalisation<acc_t>(gr, in.b->side, grad);
    return {want_e ? ge.to(dtype) : Tensor(), want_r ? gr.to(dtype) : Tensor()};
  }
  // all / semi_hard: each positive's number of counted triplets first (count_triplets), then
  // the gradient: a negative's coefficient is −(its range's size)/C, from its anchor's list, in
  // the tiles; a positive's (its count)/C, directly.
  const bool semi = p.mining == Mining::SemiHard;
  Positives<acc_t> pos(p, in);
  count_triplets(p, in, pos);
  auto negative = [&](int64_t a, int64_t n, double dn) {
    const auto [lo, hi] = pos.settled(in, a, n, dn, p.margin, semi);
    return hi > lo ? -static_cast<double>(hi - lo) * inv_count : 0.0;
  };
  auto coef = [&](int64_t a, int64_t n, acc_t d, bool positive) {
    return positive || pos.begin(a) == pos.end(a) ? 0.0 : negative(a, n, d);
  };
  // The positive pairs, per row of out: as an anchor's (found in its list by distance) and,
  // without refs, also as its positive's (in that one's list); with refs, the refs' rows
  // from the anchors of their label.
  std::unordered_map<int64_t, std::vector<int64_t>> anchors;  // label -> anchors, for refs
  if (!p.self && want_r)
    for (int64_t a = 0; a < p.N; ++a) anchors[in.la[a]].push_back(a);
  auto uses = [&](int64_t a, double d) {
    const int64_t k = pos.find(a, d);
    return k < 0 ? 0.0 : static_cast<double>(pos.uses[k]);
  };
  auto extra = [&](Tensor& out, bool anchors_own) {
    acc_t* o = out.data_ptr<acc_t>();
    const int64_t D = p.D;
    if (anchors_own) {
      at::parallel_for(0, p.N, 16, [&](int64_t begin, int64_t end) {
        for (int64_t a = begin; a < end; ++a) {
          pos.for_each(p, in, a, [&](int64_t j, double d) {
            const double g = uses(a, d) + (p.self ? uses(j, d) : 0.0);
            add_pair(o + a * D, in.a, a, *in.b, j, d, g * inv_count);
          });
        }
      });
      return;
    }
    at::parallel_for(0, p.M, 16, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) {
        const auto it = anchors.find(in.lb[j]);
        if (it == anchors.end()) continue;
        for (const int64_t a : it->second) {
          if (p.itself(a, j)) continue;
          const double d = in.exact(a, j);
          add_pair(o + j * D, *in.b, j, in.a, a, d, uses(a, d) * inv_count);
        }
      }
    });
  };
  auto [ge, gr] = gradients<acc_t>(p, in, want_e, want_r, grad, dtype, coef, extra);
  return {ge, gr};
}

// ---------------------------------------------------------------------------- the ops

std::tuple<Tensor, Tensor> contrastive_cpu(const Tensor& embeddings, const Tensor& labels,
                                           const std::optional<Tensor>& ref_embeddings,
                                           const std::optional<Tensor>& ref_labels,
                                           const c10::Scalar& pos_margin,
                                           const c10::Scalar& neg_margin, c10::string_view distance,
                                           std::optional<int64_t> shard) {
  Problem p =
      check_inputs("contrastive_loss", embeddings, labels, ref_embeddings, ref_labels, shard);
  p.pos_margin = check_margin(p.op, "pos_margin", pos_margin);
  p.neg_margin = check_margin(p.op, "neg_margin", neg_margin);
  p.distance = check_distance(p.op, distance);
  std::tuple<Tensor, Tensor> result;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, embeddings.scalar_type(), "contrastive_loss_cpu", [&] {
        result = contrastive_forward<scalar_t>(p, embeddings, labels, ref_embeddings, ref_labels);
      });
  return result;
}

std::tuple<Tensor, Tensor> contrastive_backward_cpu(
    const Tensor& grad, const Tensor& embeddings, const Tensor& labels,
    const std::optional<Tensor>& ref_embeddings, const std::optional<Tensor>& ref_labels,
    const Tensor& stats, const c10::Scalar& pos_margin, const c10::Scalar& neg_margin,
    c10::string_view distance, std::array<bool, 2> output_mask, std::optional<int64_t> shard,
    bool own_stats) {
  Problem call =
      check_inputs("contrastive_loss", embeddings, labels, ref_embeddings, ref_labels, shard);
  call.pos_margin = check_margin(call.op, "pos_margin", pos_margin);
  call.neg_margin = check_margin(call.op, "neg_margin", neg_margin);
  call.distance = check_distance(call.op, distance);
  check_own_stats(call, own_stats);
  const bool whole = call.takes_whole_stats();
  const Problem p = whole ? whole_of(call) : call;
  check_backward_inputs(p, grad, embeddings, stats, kContrastiveStats);
  const bool want_e = output_mask[0], want_r = !call.self && output_mask[1];
  Tensor ge, gr;
  auto outputs = [&] {
    return backward_outputs(ge, gr, want_e, want_r, embeddings, ref_embeddings);
  };
  if ((!want_e && !want_r) || (whole && !want_e) || call.N == 0 || call.M == 0 || call.D == 0)
    return outputs();
  const Tensor st = stats.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, embeddings.scalar_type(), "contrastive_loss_backward_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        if (st.const_data_ptr<acc_t>()[0] == 0 && st.const_data_ptr<acc_t>()[1] == 0) return;
        Inputs<acc_t> in;
        if (whole) {  // the refs without refs
          prepare(in, p, *ref_embeddings, *ref_labels, std::nullopt, std::nullopt);
        } else {
          prepare(in, p, embeddings, labels, ref_embeddings, ref_labels);
        }
        auto [e, r] = contrastive_backward<acc_t>(p, in, st, want_e, want_r && !p.own_stats,
                                                  static_cast<acc_t>(grad.item<double>()),
                                                  embeddings.scalar_type());
        ge = e;
        gr = r;
      });
  return outputs();
}

std::tuple<Tensor, Tensor> triplet_cpu(const Tensor& embeddings, const Tensor& labels,
                                       const std::optional<Tensor>& ref_embeddings,
                                       const std::optional<Tensor>& ref_labels,
                                       const c10::Scalar& margin, c10::string_view mining,
                                       c10::string_view distance, std::optional<int64_t> shard) {
  Problem p =
      check_inputs("triplet_margin_loss", embeddings, labels, ref_embeddings, ref_labels, shard);
  p.margin = check_margin(p.op, "margin", margin);
  p.mining = check_mining(p.op, mining);
  p.distance = check_distance(p.op, distance);
  // A positive pair counts its triplets in an int32 (at most M).
  TK_CHECK_VALUE(p.op, p.M <= std::numeric_limits<int32_t>::max(),
                 "at most 2^31 - 1 rows of ref_embeddings (or embeddings) are supported, got ",
                 p.M);
  std::tuple<Tensor, Tensor> result;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, embeddings.scalar_type(), "triplet_margin_loss_cpu", [&] {
        result = triplet_forward<scalar_t>(p, embeddings, labels, ref_embeddings, ref_labels);
      });
  return result;
}

std::tuple<Tensor, Tensor> triplet_backward_cpu(
    const Tensor& grad, const Tensor& embeddings, const Tensor& labels,
    const std::optional<Tensor>& ref_embeddings, const std::optional<Tensor>& ref_labels,
    const Tensor& stats, const c10::Scalar& margin, c10::string_view mining,
    c10::string_view distance, std::array<bool, 2> output_mask, std::optional<int64_t> shard) {
  Problem p =
      check_inputs("triplet_margin_loss", embeddings, labels, ref_embeddings, ref_labels, shard);
  p.margin = check_margin(p.op, "margin", margin);
  p.mining = check_mining(p.op, mining);
  p.distance = check_distance(p.op, distance);
  check_backward_inputs(p, grad, embeddings, stats, kTripletStats, at::kLong);
  const bool want_e = output_mask[0], want_r = !p.self && output_mask[1];
  Tensor ge, gr;
  auto outputs = [&] {
    return backward_outputs(ge, gr, want_e, want_r, embeddings, ref_embeddings);
  };
  if ((!want_e && !want_r) || p.N == 0 || p.M == 0 || p.D == 0) return outputs();
  const Tensor st = stats.contiguous();
  const int64_t* sp = st.const_data_ptr<int64_t>();
  int64_t count = 0;
  for (int64_t a = 0; a < p.N; ++a) {
    const int64_t* row = sp + a * kTripletStats;
    TK_CHECK_VALUE(p.op,
                   row[2] >= 0 && row[0] >= -1 && row[0] < p.M && row[1] >= -1 && row[1] < p.M &&
                       (p.mining != Mining::BatchHard || row[2] == 0 ||
                        (row[2] == 1 && row[0] >= 0 && row[1] >= 0)),
                   "backward: stats row ", a,
                   " is not the forward's (hardest positive and "
                   "negative in [-1, ",
                   p.M, "), a count >= 0), got [", row[0], ", ", row[1], ", ", row[2], "]");
    count += row[2];
  }
  if (count == 0) return outputs();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, embeddings.scalar_type(), "triplet_margin_loss_backward_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        Inputs<acc_t> in;
        prepare(in, p, embeddings, labels, ref_embeddings, ref_labels,
                p.mining != Mining::BatchHard);
        auto [e, r] = triplet_backward<acc_t>(p, in, sp, want_e, want_r,
                                              static_cast<acc_t>(grad.item<double>()),
                                              embeddings.scalar_type());
        ge = e;
        gr = r;
      });
  return outputs();
}

}  // namespace

TORCH_LIBRARY_IMPL(torchkit, CPU, m) {
  m.impl("contrastive_loss", &contrastive_cpu);
  m.impl("_contrastive_loss_backward", &contrastive_backward_cpu);
  m.impl("triplet_margin_loss", &triplet_cpu);
  m.impl("_triplet_margin_loss_backward", &triplet_backward_cpu);
}

}  // namespace torchkit::pair_losses
