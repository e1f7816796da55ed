// SupCon on the CPU (the loss: supcon_loss.h).
//
// Forward: anchors in blocks of kRows, spread over the threads; per block, the similarity
// tiles e_blk·r_tileᵀ (one BLAS call each, kRows × kCols, in a per-thread scratch) are folded
// into each anchor's running log-sum-exp, positive sum and counts while in cache; nothing
// N×M exists. The mean over anchors is taken in anchor order (the same bits on any number
// of threads).
// Backward: the tiles again, each turned into ∂loss/∂s (a tile) and multiplied into the
// other side's rows. Without refs the similarity is symmetric, so one pass over anchor
// blocks forms ∂/∂s_ij + ∂/∂s_ji per tile and one GEMM per tile gives each row's whole
// gradient; with refs, a second pass over ref blocks forms the refs' gradient (each block
// owns its rows: no atomics). Then the normalisation's Jacobian per row.
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
#include <vector>

#include "common.h"
#include "supcon_loss.h"

namespace torchkit::supcon_loss {
namespace {

using at::Tensor;
using at::vec::Vectorized;

constexpr int64_t kRows = 64;       // anchors per task
constexpr int64_t kCols = 256;      // ref rows per tile
constexpr double kNormEps = 1e-12;  // F.normalize's, as PML's CosineSimilarity uses it

// The rows as the GEMMs take them: the inputs themselves where they are contiguous rows of the
// accumulation type (a float32 copy of float16/bfloat16 ones), with 1 / max(‖row‖, eps) per
// row: the tiles are scaled by it (s_ij = a_i·b_j·inv_i·inv_j, F.normalize's cosine), so that
// no normalised copy of the embeddings exists.
struct Inputs {
  Tensor a, b;                  // anchors' and refs' rows; b is a without refs
  Tensor inv_a, inv_b;          // (rows,) of the accumulation type
  Tensor clamped_a, clamped_b;  // (rows,) bool: ‖row‖ < eps (F.normalize's clamp holds)
  Tensor lab, ref_lab;          // int64, contiguous
};

Inputs prepare(const Problem& p, const Tensor& embeddings, const Tensor& labels,
               const std::optional<Tensor>& ref_embeddings,
               const std::optional<Tensor>& ref_labels) {
  const auto acc = acc_type(embeddings);
  auto rows = [&](const Tensor& x, Tensor& inv, Tensor& clamped) {
    const Tensor a = x.to(acc).contiguous();
    const Tensor norm = at::linalg_vector_norm(a, 2, {1});
    clamped = (norm < kNormEps).contiguous();
    inv = norm.clamp_min(kNormEps).reciprocal_();
    return a;
  };
  Inputs in;
  in.a = rows(embeddings, in.inv_a, in.clamped_a);
  in.lab = labels.to(at::kLong).contiguous();
  if (p.self) {
    in.b = in.a;
    in.inv_b = in.inv_a;
    in.clamped_b = in.clamped_a;
    in.ref_lab = in.lab;
  } else {
    in.b = rows(*ref_embeddings, in.inv_b, in.clamped_b);
    in.ref_lab = ref_labels->to(at::kLong).contiguous();
  }
  return in;
}

// Per anchor, what the forward folds its tiles into.
struct RowSums {
  double max = -std::numeric_limits<double>::infinity();  // of its pairs' x
  double sum = 0;                                         // Σ exp(x − max)
  double positive = 0;                                    // Σ x over the positives
  int64_t positives = 0, pairs = 0;
};

// Runs fn(thread scratch, tile of s = rows_a · rows_bᵀ (di × dj, acc type), a0, b0) over
// a's blocks of kRows (the tasks) and b's blocks of kCols within each, in order.
template <typename Fn>
void for_each_tile(const Tensor& a, const Tensor& b, Fn fn) {
  const int64_t A = a.size(0), B = b.size(0);
  const int64_t blocks = (A + kRows - 1) / kRows;
  // The tasks call ATen (the tile's GEMM): OpenMP's worker threads must see this thread's
  // dispatcher state (below autograd), or mm_out would refuse inputs that require grad.
  const at::ThreadLocalState state;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard guard(state);
    Tensor scratch = at::empty({kRows, kCols}, a.options());
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t a0 = blk * kRows, di = std::min(kRows, A - a0);
      for (int64_t b0 = 0; b0 < B; b0 += kCols) {
        const int64_t dj = std::min(kCols, B - b0);
        Tensor s = scratch.narrow(0, 0, di).narrow(1, 0, dj);
        at::mm_out(s, a.narrow(0, a0, di), b.narrow(0, b0, dj).t());
        fn(s, a0, b0);
      }
    }
  });
}

template <typename acc_t>
std::vector<RowSums> row_sums(const Problem& p, const Inputs& in) {
  using V = Vectorized<acc_t>;
  std::vector<RowSums> rows(p.N);
  const int64_t* lab = in.lab.const_data_ptr<int64_t>();
  const int64_t* ref_lab = in.ref_lab.const_data_ptr<int64_t>();
  const acc_t inv_tau = static_cast<acc_t>(1.0 / p.temperature);
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  const acc_t* inv_a = in.inv_a.const_data_ptr<acc_t>();
  const acc_t* inv_b = in.inv_b.const_data_ptr<acc_t>();
  for_each_tile(in.a, in.b, [&](Tensor& s, int64_t a0, int64_t b0) {
    const int64_t di = s.size(0), dj = s.size(1), stride = s.stride(0);
    acc_t* base = s.data_ptr<acc_t>();
    for (int64_t r = 0; r < di; ++r) {
      const int64_t i = a0 + r;
      acc_t* x = base + r * stride;
      const acc_t row_scale = inv_a[i] * inv_tau;  // x = s_ij / τ
      at::vec::map2([row_scale](V v, V inv) { return v * inv * V(row_scale); }, x, x, inv_b + b0,
                    dj);
      const int64_t self_col = p.self && i >= b0 && i < b0 + dj ? i - b0 : -1;
      if (self_col >= 0) x[self_col] = neg_inf;  // not a pair
      RowSums& row = rows[i];
      row.pairs += dj - (self_col >= 0 ? 1 : 0);
      for (int64_t c = 0; c < dj; ++c) {
        if (c != self_col && ref_lab[b0 + c] == lab[i]) {
          row.positive += x[c];
          ++row.positives;
        }
      }
      const acc_t tile_max = at::vec::reduce_all<acc_t>(
          [](V u, V v) { return at::vec::maximum(u, v); }, x, dj);  // NaN-propagating
      const double top = std::isnan(tile_max) || tile_max > row.max ? tile_max : row.max;
      if (top == -std::numeric_limits<double>::infinity()) continue;  // no pair in the tile yet
      const acc_t shift = static_cast<acc_t>(top);
      const acc_t tile_sum = at::vec::map_reduce_all<acc_t>(
          [shift](V v) { return (v - V(shift)).exp(); }, [](V u, V v) { return u + v; }, x, dj);
      row.sum = row.sum * std::exp(row.max - top) + tile_sum;
      row.max = top;
    }
  });
  return rows;
}

template <typename scalar_t>
std::tuple<Tensor, Tensor> forward_kernel(const Problem& p, const Tensor& embeddings,
                                          const Tensor& labels,
                                          const std::optional<Tensor>& ref_embeddings,
                                          const std::optional<Tensor>& ref_labels) {
  using acc_t = at::opmath_type<scalar_t>;
  const Inputs in = prepare(p, embeddings, labels, ref_embeddings, ref_labels);
  const std::vector<RowSums> rows =
      p.N > 0 && p.M > 0 ? row_sums<acc_t>(p, in) : std::vector<RowSums>(p.N);
  Tensor stats = at::zeros({p.N, kStats}, in.a.options());
  acc_t* st = stats.data_ptr<acc_t>();
  std::vector<double> loss(p.N, 0.0);
  int64_t positives = 0, negatives = 0, counted = 0;
  for (int64_t i = 0; i < p.N; ++i) {
    const RowSums& row = rows[i];
    const double lse = row.pairs > 0 ? row.max + std::log(row.sum) : 0.0;
    st[i * kStats] = static_cast<acc_t>(lse);
    positives += row.positives;
    negatives += row.pairs - row.positives;
    if (row.positives > 0) loss[i] = lse - row.positive / static_cast<double>(row.positives);
    if (loss[i] > 0 || std::isnan(loss[i])) ++counted;  // PML's AvgNonZero, keeping NaN
  }
  double total = 0;
  if (positives > 0 && negatives > 0 && counted > 0) {
    for (int64_t i = 0; i < p.N; ++i) {
      if (!(loss[i] > 0 || std::isnan(loss[i]))) continue;
      total += loss[i];
      st[i * kStats + 1] = static_cast<acc_t>(1.0 / (static_cast<double>(rows[i].positives) *
                                                     static_cast<double>(counted) * p.temperature));
    }
    total /= static_cast<double>(counted);
  }
  return {at::scalar_tensor(total, embeddings.options()), stats};
}

std::tuple<Tensor, Tensor> forward_cpu(const Tensor& embeddings, const Tensor& labels,
                                       const std::optional<Tensor>& ref_embeddings,
                                       const std::optional<Tensor>& ref_labels,
                                       const c10::Scalar& temperature) {
  const Problem p = check_inputs(embeddings, labels, ref_embeddings, ref_labels, temperature);
  std::tuple<Tensor, Tensor> result;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, embeddings.scalar_type(), "supcon_loss_cpu", [&] {
        result = forward_kernel<scalar_t>(p, embeddings, labels, ref_embeddings, ref_labels);
      });
  return result;
}

// ∂loss/∂s for anchor i and pair j from x = s/τ: w_i·(n_i·exp(x − L_i) − [positive]), with
// w_i·n_i = c = 1/(K·τ) for every counted anchor and 0 for the others (w_i = 0): per anchor,
// cw_i = c or 0, w_i, and L_i (+∞ where cw_i = 0, so that the exponential is 0 there).
template <typename acc_t>
struct PairGrad {
  std::vector<acc_t> lse, w, cw;
  acc_t inv_tau;

  PairGrad(const acc_t* stats, int64_t N, double temperature) : lse(N), w(N), cw(N) {
    int64_t counted = 0;
    for (int64_t i = 0; i < N; ++i) counted += stats[i * kStats + 1] != acc_t(0);
    const acc_t c =
        counted ? static_cast<acc_t>(1.0 / (static_cast<double>(counted) * temperature)) : acc_t(0);
    for (int64_t i = 0; i < N; ++i) {
      w[i] = stats[i * kStats + 1];
      cw[i] = w[i] != acc_t(0) ? c : acc_t(0);
      lse[i] = w[i] != acc_t(0) ? stats[i * kStats] : std::numeric_limits<acc_t>::infinity();
    }
    inv_tau = static_cast<acc_t>(1.0 / temperature);
  }
  bool any() const {
    return std::any_of(w.begin(), w.end(), [](acc_t v) { return v != acc_t(0); });
  }
};

// g ← grad·∂/∂x of g·e for e = x / max(‖x‖, eps), in place, per row: with inv = 1/max(‖x‖,
// eps), inv·(g − inv²·(x·g)·x) where ‖x‖ > eps, inv·g elsewhere (the clamp's constant).
template <typename acc_t>
void through_normalisation(Tensor& g, const Tensor& x, const Tensor& inv, const Tensor& clamped,
                           acc_t grad) {
  using V = Vectorized<acc_t>;
  const int64_t rows = g.size(0), D = g.size(1);
  acc_t* gp = g.data_ptr<acc_t>();
  const acc_t* xp = x.const_data_ptr<acc_t>();
  const acc_t* ip = inv.const_data_ptr<acc_t>();
  const bool* cp = clamped.const_data_ptr<bool>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      acc_t* gi = gp + i * D;
      const acc_t* xi = xp + i * D;
      const acc_t dot = at::vec::map2_reduce_all<acc_t>([](V u, V v) { return u * v; },
                                                        [](V u, V v) { return u + v; }, xi, gi, D);
      const acc_t scale = grad * ip[i];
      const acc_t along = cp[i] ? acc_t(0) : ip[i] * ip[i] * dot;
      at::vec::map2([scale, along](V gv, V xv) { return (gv - xv * V(along)) * V(scale); }, gi, gi,
                    xi, D);
    }
  });
}

// ∂loss/∂E for the rows of `own` (anchors or refs) against `other`, times grad: per tile,
// ∂loss/∂s_ij from the recomputed cosine, times inv_j (the GEMM takes other's raw rows), into
// Σ_j ·other_j; then through own's normalisation. anchors_own says which side holds the
// anchors (their stats); symmetric adds ∂/∂s_ji (no refs: s is symmetric, and both
// directions are one row's gradient).
template <typename acc_t>
Tensor rows_grad(const Problem& p, const Tensor& own, const Tensor& other, const Tensor& inv_own,
                 const Tensor& clamped_own, const Tensor& inv_other, const Tensor& own_lab,
                 const Tensor& other_lab, const PairGrad<acc_t>& pg, bool anchors_own,
                 bool symmetric, acc_t grad) {
  Tensor out = at::zeros_like(own);
  const int64_t* la = own_lab.const_data_ptr<int64_t>();
  const int64_t* lb = other_lab.const_data_ptr<int64_t>();
  const acc_t* io = inv_own.const_data_ptr<acc_t>();
  const acc_t* ib = inv_other.const_data_ptr<acc_t>();
  using V = Vectorized<acc_t>;
  const acc_t* lse = pg.lse.data();
  const acc_t* cw = pg.cw.data();
  const acc_t* w = pg.w.data();
  for_each_tile(own, other, [&](Tensor& s, int64_t a0, int64_t b0) {
    const int64_t di = s.size(0), dj = s.size(1), stride = s.stride(0);
    acc_t* base = s.data_ptr<acc_t>();
    // The exponential terms, vectorised: per column (the anchors there: lse, cw at b0) and, for
    // the row's own anchor, one factor per row.
    auto column_term = [&](V x, int64_t c) {
      const V cwv = V::loadu(cw + b0 + c);
      return V::blendv(cwv * (x - V::loadu(lse + b0 + c)).exp(), V(0), cwv == V(0));
    };
    for (int64_t r = 0; r < di; ++r) {
      const int64_t i = a0 + r;
      acc_t* row = base + r * stride;
      const acc_t scale = io[i] * pg.inv_tau;
      const bool row_anchor = anchors_own && cw[i] != acc_t(0);
      int64_t c = 0;
      for (; c + V::size() <= dj; c += V::size()) {
        const V x = V::loadu(row + c) * V::loadu(ib + b0 + c) * V(scale);  // s_ij / τ
        V g(0);
        if (row_anchor) g = V(cw[i]) * (x - V(lse[i])).exp();
        if (!anchors_own || symmetric) g = g + column_term(x, c);
        g.store(row + c);
      }
      for (; c < dj; ++c) {
        const int64_t j = b0 + c;
        const acc_t x = row[c] * ib[j] * scale;
        acc_t g = row_anchor ? cw[i] * std::exp(x - lse[i]) : acc_t(0);
        if ((!anchors_own || symmetric) && cw[j] != acc_t(0)) g += cw[j] * std::exp(x - lse[j]);
        row[c] = g;
      }
      // The positives' −w terms, the diagonal of the batch with itself, and inv_j (the GEMM
      // takes other's raw rows).
      for (c = 0; c < dj; ++c) {
        const int64_t j = b0 + c;
        if (p.self && i == j) {
          row[c] = 0;
          continue;
        }
        if (la[i] == lb[j]) row[c] -= (anchors_own ? w[i] : w[j]) + (symmetric ? w[j] : acc_t(0));
        row[c] *= ib[j];
      }
    }
    Tensor dst = out.narrow(0, a0, di);
    dst.addmm_(s, other.narrow(0, b0, dj));
  });
  through_normalisation<acc_t>(out, own, inv_own, clamped_own, grad);
  return out;
}

std::tuple<Tensor, Tensor> backward_cpu(const Tensor& grad, const Tensor& embeddings,
                                        const Tensor& labels,
                                        const std::optional<Tensor>& ref_embeddings,
                                        const std::optional<Tensor>& ref_labels,
                                        const Tensor& stats, const c10::Scalar& temperature,
                                        std::array<bool, 2> output_mask) {
  const Problem p = check_inputs(embeddings, labels, ref_embeddings, ref_labels, temperature);
  check_backward_inputs(p, grad, embeddings, stats);
  const bool want_e = output_mask[0], want_r = !p.self && output_mask[1];
  Tensor ge = want_e ? at::zeros_like(embeddings, at::MemoryFormat::Contiguous)
                     : at::empty({0}, embeddings.options());
  Tensor gr = want_r ? at::zeros_like(*ref_embeddings, at::MemoryFormat::Contiguous)
                     : at::empty({0}, embeddings.options());
  if ((!want_e && !want_r) || p.N == 0 || p.M == 0 || p.D == 0) return {ge, gr};
  const Inputs in = prepare(p, embeddings, labels, ref_embeddings, ref_labels);
  const Tensor st = stats.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, embeddings.scalar_type(), "supcon_loss_backward_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const PairGrad<acc_t> pg(st.const_data_ptr<acc_t>(), p.N, p.temperature);
        if (!pg.any()) return;
        const double g = grad.item<double>();
        const acc_t gv = static_cast<acc_t>(g);
        const auto dtype = embeddings.scalar_type();
        if (p.self) {
          ge = rows_grad<acc_t>(p, in.a, in.a, in.inv_a, in.clamped_a, in.inv_a, in.lab, in.lab, pg,
                                true, true, gv)
                   .to(dtype);
          return;
        }
        if (want_e)
          ge = rows_grad<acc_t>(p, in.a, in.b, in.inv_a, in.clamped_a, in.inv_b, in.lab, in.ref_lab,
                                pg, true, false, gv)
                   .to(dtype);
        if (want_r)
          gr = rows_grad<acc_t>(p, in.b, in.a, in.inv_b, in.clamped_b, in.inv_a, in.ref_lab, in.lab,
                                pg, false, false, gv)
                   .to(dtype);
      });
  return {ge, gr};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchkit, CPU, m) {
  m.impl("supcon_loss", &forward_cpu);
  m.impl("_supcon_loss_backward", &backward_cpu);
}

}  // namespace torchkit::supcon_loss
