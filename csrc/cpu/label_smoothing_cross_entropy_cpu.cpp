// Label-smoothing cross-entropy on the CPU.
//
// (N, C) inputs are processed as rows of C contiguous logits. (N, C, d...) inputs with
// class-index targets are read in place, vectorised across positions (the column kernels);
// with probability targets they are transposed to (N·d..., C) rows once. Each row is cut into parts
// so that even a single row (N = 1, C = 10⁶) keeps every core busy; a part is read from memory
// once, in blocks of kBlock classes that stay in L1 while the block is read a second time.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "checks.h"
#include "common.h"
#include "cpu/memory.h"
#include "label_smoothing_cross_entropy.h"

namespace torchkit::label_smoothing_cross_entropy {
namespace {

using at::Tensor;
using at::vec::Vectorized;

constexpr int64_t kBlock = 2048;  // classes per block: 8 KiB of float32
constexpr int64_t kTasksPerThread = 4;

inline Vectorized<float> vexp(const Vectorized<float>& x) { return x.exp_u20(); }
inline Vectorized<double> vexp(const Vectorized<double>& x) { return x.map(std::exp); }

// n values starting at src as acc_t: src itself when the types agree, else a copy in buf.
template <typename scalar_t, typename acc_t>
const acc_t* as_acc(const scalar_t* src, int64_t n, acc_t* buf) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    return src;
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<acc_t>(src[i]);
    return buf;
  }
}

// Running sums over part of a row: the maximum, Σ exp(x − r) and the smoothing sums Σ w,
// Σ w·(x − r), Σ w·p, Σ w·p·(x − r), all relative to r = ref(max). Sums of the logits
// themselves would round at the logits' magnitude (ulp(10⁶) = 0.06 in float32) and lose the
// loss, which depends only on differences: relative to the maximum, the loss is
// shift-invariant, as PyTorch's log_softmax is.
template <typename acc_t>
struct RowState {
  acc_t max = -std::numeric_limits<acc_t>::infinity();
  acc_t sumexp = 0, w = 0, wx = 0, wp = 0, wpx = 0;

  acc_t ref() const { return shift_ref(max); }

  // Moves the sums to a maximum m >= max.
  void shift_to(acc_t m) {
    const acc_t d = ref() - shift_ref(m);
    sumexp *= std::exp(d);
    if (w != 0) wx += w * d;  // w = 0: nothing to move (and 0·∞ would be NaN)
    if (wp != 0) wpx += wp * d;
    max = m;
  }

  void merge(RowState o) {
    const acc_t m = std::max(max, o.max);
    shift_to(m);
    o.shift_to(m);
    sumexp += o.sumexp;
    w += o.w;
    wx += o.wx;
    wp += o.wp;
    wpx += o.wpx;
  }
};

template <typename acc_t, bool kWeight, bool kProb>
void accumulate_block(RowState<acc_t>& st, const acc_t* x, const acc_t* w, const acc_t* p,
                      int64_t n) {
  using V = Vectorized<acc_t>;
  const acc_t block_max =
      at::vec::reduce_all<acc_t>([](V a, V b) { return at::vec::maximum(a, b); }, x, n);
  if (block_max > st.max) st.shift_to(block_max);
  const acc_t r = st.ref();
  const V vr(r);
  V vs(0), vw(0), vwx(0), vwp(0), vwpx(0);
  int64_t i = 0;
  for (; i + V::size() <= n; i += V::size()) {
    const V d = V::loadu(x + i) - vr;
    vs += vexp(d);
    const V wv = kWeight ? V::loadu(w + i) : V(1);
    if constexpr (kWeight) vw += wv;
    vwx += kWeight ? wv * d : d;
    if constexpr (kProb) {
      const V wpv = wv * V::loadu(p + i);
      vwp += wpv;
      vwpx += wpv * d;
    }
  }
  auto hsum = [](const V& v) {
    return at::vec::vec_reduce_all<acc_t>([](V a, V b) { return a + b; }, v);
  };
  acc_t s = hsum(vs), ws = kWeight ? hsum(vw) : acc_t(i), wx = hsum(vwx), wp = hsum(vwp),
        wpx = hsum(vwpx);
  for (; i < n; ++i) {
    const acc_t d = x[i] - r;
    s += std::exp(d);
    const acc_t wi = kWeight ? w[i] : acc_t(1);
    ws += wi;
    wx += wi * d;
    if constexpr (kProb) {
      wp += wi * p[i];
      wpx += wi * p[i] * d;
    }
  }
  st.sumexp += s;
  st.w += ws;
  st.wx += wx;
  st.wp += wp;
  st.wpx += wpx;
}

// How many parts to cut each of `rows` rows of C classes into: one when rows alone keep
// every thread busy, more (down to one block each) when they do not.
int64_t parts_per_row(int64_t rows, int64_t C) {
  const int64_t tasks = kTasksPerThread * at::get_num_threads();
  const int64_t blocks = (C + kBlock - 1) / kBlock;
  return std::max<int64_t>(1, std::min(blocks, (tasks + rows - 1) / std::max<int64_t>(rows, 1)));
}

template <typename index_t>
void check_target(const Problem& p, index_t t) {
  TK_CHECK_INDEX(kOp, t >= 0 && t < p.C, "target must hold class indices in [0, ", p.C,
                 ") or ignore_index=", p.ignore_index, ", got ", static_cast<int64_t>(t));
}

template <typename scalar_t, typename index_t, bool kWeight, bool kProb>
void forward_rows(const Problem& pr, const Tensor& x_rows, const Tensor& target_rows,
                  const Tensor& w_acc, Tensor& lse, Tensor& losses, Tensor& position_weights) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t rows = x_rows.size(0), C = pr.C;
  const int64_t parts = parts_per_row(rows, C);
  const int64_t part_len = (C + parts - 1) / parts;
  const scalar_t* x = x_rows.const_data_ptr<scalar_t>();
  const scalar_t* p = kProb ? target_rows.const_data_ptr<scalar_t>() : nullptr;
  const index_t* t = kProb ? nullptr : target_rows.const_data_ptr<index_t>();
  const acc_t* w = kWeight ? w_acc.const_data_ptr<acc_t>() : nullptr;

  std::vector<RowState<acc_t>> states(rows * parts);
  at::parallel_for(0, rows * parts, 1, [&](int64_t begin, int64_t end) {
    acc_t xbuf[kBlock], pbuf[kBlock];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / parts, c0 = (task % parts) * part_len;
      const int64_t c1 = std::min(C, c0 + part_len);
      RowState<acc_t>& st = states[task];
      for (int64_t b = c0; b < c1; b += kBlock) {
        const int64_t n = std::min(kBlock, c1 - b);
        const acc_t* xa = as_acc(x + r * C + b, n, xbuf);
        const acc_t* pa = kProb ? as_acc(p + r * C + b, n, pbuf) : nullptr;
        accumulate_block<acc_t, kWeight, kProb>(st, xa, kWeight ? w + b : nullptr, pa, n);
      }
    }
  });

  const acc_t a = pr.a, bb = pr.b;
  double* lse_out = lse.mutable_data_ptr<double>();
  acc_t* loss_out = losses.mutable_data_ptr<acc_t>();
  acc_t* pw_out = position_weights.mutable_data_ptr<acc_t>();
  at::parallel_for(0, rows, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      RowState<acc_t> st = states[r * parts];
      for (int64_t k = 1; k < parts; ++k) st.merge(states[r * parts + k]);
      // lse − x_c = (ref − x_c) + log_s: no term carries the logits' magnitude.
      const acc_t ref = st.ref(), log_s = std::log(st.sumexp);
      lse_out[r] = static_cast<double>(ref) + static_cast<double>(log_s);
      // ε = 0 skips the smoothing sum, so that −∞ logits (masking) stay finite as in PyTorch.
      const acc_t smooth = bb != 0 ? bb * (st.w * log_s - st.wx) : acc_t(0);
      if constexpr (kProb) {
        loss_out[r] = a * (st.wp * log_s - st.wpx) + smooth;
        pw_out[r] = 1;
      } else {
        const index_t ti = t[r];
        if (ti == pr.ignore_index) {
          loss_out[r] = 0;
          pw_out[r] = 0;
          continue;
        }
        check_target(pr, ti);
        const acc_t wt = kWeight ? w[ti] : acc_t(1);
        loss_out[r] = a * wt * ((ref - static_cast<acc_t>(x[r * C + ti])) + log_s) + smooth;
        pw_out[r] = wt;
      }
    }
  });
}

// K = Σ_c w_c q_c per row (0 for an ignored one): a·w_t + b·W for an index target;
// a·Σ w·p + b·W needs a pass over p.
template <typename scalar_t, typename index_t, bool kWeight, bool kProb>
std::vector<at::opmath_type<scalar_t>> target_weights(const Problem& pr, int64_t rows,
                                                      const scalar_t* p, const index_t* t,
                                                      const at::opmath_type<scalar_t>* w,
                                                      double weight_total) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t C = pr.C;
  const acc_t a = pr.a, bb = pr.b, W = weight_total;
  std::vector<acc_t> K(rows);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    acc_t pbuf[kBlock];
    for (int64_t r = begin; r < end; ++r) {
      if constexpr (kProb) {
        acc_t wp = 0;
        for (int64_t b = 0; b < C; b += kBlock) {
          const int64_t n = std::min(kBlock, C - b);
          const acc_t* pa = as_acc(p + r * C + b, n, pbuf);
          for (int64_t i = 0; i < n; ++i) wp += (kWeight ? w[b + i] : acc_t(1)) * pa[i];
        }
        K[r] = a * wp + bb * W;
      } else {
        const index_t ti = t[r];
        if (ti == pr.ignore_index) {
          K[r] = 0;
          continue;
        }
        check_target(pr, ti);
        K[r] = a * (kWeight ? w[ti] : acc_t(1)) + bb * W;
      }
    }
  });
  return K;
}

// What a row's gradient needs besides its logits: the incoming gradient g, K, and the
// log-sum-exp as hi + lo.
template <typename acc_t>
struct RowGradient {
  acc_t g, K, hi, lo;
};

// gout[i] = g·(softmax(x)ᵢ·K − wᵢ·qᵢ) over n classes, q = a·p + b (b alone for an index
// target, whose own term the caller adds).
template <typename acc_t, bool kWeight, bool kProb>
void gradient_block(const Problem& pr, const RowGradient<acc_t>& rg, const acc_t* xa,
                    const acc_t* pa, const acc_t* wb, int64_t n, acc_t* gout) {
  using V = Vectorized<acc_t>;
  const acc_t a = pr.a, bb = pr.b;
  const V vg(rg.g), vK(rg.K), vhi(rg.hi), vlo(rg.lo), va(a), vb(bb);
  int64_t i = 0;
  for (; i + V::size() <= n; i += V::size()) {
    const V wv = kWeight ? V::loadu(wb + i) : V(1);
    const V q = kProb ? va * V::loadu(pa + i) + vb : vb;
    (vg * (vexp((V::loadu(xa + i) - vhi) - vlo) * vK - wv * q)).store(gout + i);
  }
  for (; i < n; ++i) {
    const acc_t q = kProb ? a * pa[i] + bb : bb;
    gout[i] = rg.g * (std::exp((xa[i] - rg.hi) - rg.lo) * rg.K - (kWeight ? wb[i] : acc_t(1)) * q);
  }
}

template <typename scalar_t, typename index_t, bool kWeight, bool kProb>
void backward_rows(const Problem& pr, const Tensor& scale, const Tensor& x_rows,
                   const Tensor& target_rows, const Tensor& w_acc, double weight_total,
                   const Tensor& lse, Tensor& grad_rows) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t rows = x_rows.size(0), C = pr.C;
  const int64_t parts = parts_per_row(rows, C);
  const int64_t part_len = (C + parts - 1) / parts;
  const scalar_t* x = x_rows.const_data_ptr<scalar_t>();
  const scalar_t* p = kProb ? target_rows.const_data_ptr<scalar_t>() : nullptr;
  const index_t* t = kProb ? nullptr : target_rows.const_data_ptr<index_t>();
  const acc_t* w = kWeight ? w_acc.const_data_ptr<acc_t>() : nullptr;
  const acc_t* g = scale.const_data_ptr<acc_t>();
  const int64_t g_stride = scale.dim() == 0 ? 0 : 1;
  const double* lse_in = lse.const_data_ptr<double>();
  scalar_t* out = grad_rows.mutable_data_ptr<scalar_t>();
  const std::vector<acc_t> K =
      target_weights<scalar_t, index_t, kWeight, kProb>(pr, rows, p, t, w, weight_total);
  // Each row's log-sum-exp as hi + lo, recomputed from the row where the saved one is coarse.
  std::vector<SplitLse<acc_t>> split(rows);
  at::parallel_for(0, rows, std::max<int64_t>(1, at::internal::GRAIN_SIZE / C),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t r = begin; r < end; ++r) {
                       split[r] = coarse_lse<acc_t>(lse_in[r]) ? exact_lse<acc_t>(x + r * C, C, 1)
                                                               : split_lse<acc_t>(lse_in[r]);
                     }
                   });

  at::parallel_for(0, rows * parts, 1, [&](int64_t begin, int64_t end) {
    acc_t xbuf[kBlock], pbuf[kBlock], gbuf[kBlock];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / parts, c0 = (task % parts) * part_len;
      const int64_t c1 = std::min(C, c0 + part_len);
      const bool ignored = !kProb && t[r] == pr.ignore_index;
      const auto [hi, lo] = split[r];
      const RowGradient<acc_t> rg{g[r * g_stride], K[r], hi, lo};
      for (int64_t b = c0; b < c1; b += kBlock) {
        const int64_t n = std::min(kBlock, c1 - b);
        scalar_t* dst = out + r * C + b;
        acc_t* gout = std::is_same_v<scalar_t, acc_t> ? reinterpret_cast<acc_t*>(dst) : gbuf;
        if (ignored) {
          std::fill(gout, gout + n, acc_t(0));
        } else {
          const acc_t* xa = as_acc(x + r * C + b, n, xbuf);
          const acc_t* pa = kProb ? as_acc(p + r * C + b, n, pbuf) : nullptr;
          gradient_block<acc_t, kWeight, kProb>(pr, rg, xa, pa, kWeight ? w + b : nullptr, n, gout);
          if constexpr (!kProb) {
            // The target's own term, in acc_t before rounding (bf16 would lose it otherwise).
            const int64_t ti = t[r];
            if (ti >= b && ti < b + n) {
              const acc_t wt = kWeight ? w[ti] : acc_t(1);
              const acc_t q = static_cast<acc_t>(pr.a) + static_cast<acc_t>(pr.b);
              gout[ti - b] = rg.g * (std::exp((xa[ti - b] - hi) - lo) * rg.K - wt * q);
            }
          }
        }
        if constexpr (!std::is_same_v<scalar_t, acc_t>) {
          for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<scalar_t>(gout[i]);
        }
      }
    }
  });
}

// N-D inputs with class-index targets: (N, C, S) read in place, vectorised across positions.
// A task takes `span` consecutive positions of one sample and copies their C class rows
// (span contiguous values each) into a local buffer first: the rows are S apart in memory,
// and for power-of-two S (images) reading them in place makes every class collide in the
// same cache sets. The passes (max; Σexp and Σw·x; the gradient) then run on the buffer.
// No transposed copy: the gradient is written in the input's (N, C, S) layout.
template <typename acc_t>
int64_t column_span(int64_t C) {
  constexpr int64_t kBufferBytes = 32 << 10, kWidth = Vectorized<acc_t>::size();
  const int64_t fit = kBufferBytes / static_cast<int64_t>(sizeof(acc_t)) / std::max<int64_t>(C, 1);
  return std::clamp<int64_t>(fit / kWidth * kWidth, kWidth, 32 * kWidth);
}

// buf[c · span + j] = x[c · S + j] as acc_t, for j < count (zero beyond, up to span).
template <typename scalar_t, typename acc_t>
void load_block(const scalar_t* x, int64_t C, int64_t S, int64_t count, int64_t span, acc_t* buf) {
  for (int64_t c = 0; c < C; ++c) {
    const scalar_t* src = x + c * S;
    acc_t* dst = buf + c * span;
    for (int64_t j = 0; j < count; ++j) dst[j] = static_cast<acc_t>(src[j]);
    std::fill(dst + count, dst + span, acc_t(0));
  }
}

template <typename scalar_t, typename index_t, bool kWeight, bool kProb>
void forward_columns(const Problem& pr, const Tensor& input, const Tensor& target,
                     const Tensor& w_acc, double weight_total, Tensor& lse, Tensor& losses,
                     Tensor& position_weights) {
  if constexpr (kProb) {
    TORCH_INTERNAL_ASSERT(false, "forward_columns: class-index targets only");
  } else {
    using acc_t = at::opmath_type<scalar_t>;
    using V = Vectorized<acc_t>;
    const int64_t C = pr.C, S = pr.S, span = column_span<acc_t>(C);
    const int64_t tasks_per_sample = (S + span - 1) / span;
    const scalar_t* x = input.const_data_ptr<scalar_t>();
    const index_t* t = target.const_data_ptr<index_t>();
    const acc_t* w = kWeight ? w_acc.const_data_ptr<acc_t>() : nullptr;
    double* lse_out = lse.mutable_data_ptr<double>();
    acc_t* loss_out = losses.mutable_data_ptr<acc_t>();
    acc_t* pw_out = position_weights.mutable_data_ptr<acc_t>();
    const acc_t a = pr.a, bb = pr.b, W = weight_total;
    at::parallel_for(0, pr.N * tasks_per_sample, 1, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> buf(C * span);
      acc_t mx[V::size()], log_sum[V::size()], wx[V::size()];
      for (int64_t task = begin; task < end; ++task) {
        const int64_t n = task / tasks_per_sample, s0 = (task % tasks_per_sample) * span;
        const int64_t count = std::min(span, S - s0);
        load_block(x + n * C * S + s0, C, S, count, span, buf.data());
        for (int64_t j0 = 0; j0 < count; j0 += V::size()) {
          const acc_t* col = buf.data() + j0;
          V vmax(-std::numeric_limits<acc_t>::infinity());
          for (int64_t c = 0; c < C; ++c) vmax = at::vec::maximum(vmax, V::loadu(col + c * span));
          const V vref = at::vec::maximum(vmax, V(lowest_finite(acc_t(0))));  // shift_ref
          V vsum(0), vwx(0);  // Σ exp(x − ref), Σ w·(x − ref)
          for (int64_t c = 0; c < C; ++c) {
            const V d = V::loadu(col + c * span) - vref;
            vsum += vexp(d);
            vwx += kWeight ? V(w[c]) * d : d;
          }
          vref.store(mx);
          vsum.log().store(log_sum);  // one vector log, not a scalar log per position
          vwx.store(wx);
          for (int64_t l = 0; l < std::min<int64_t>(V::size(), count - j0); ++l) {
            const int64_t pos = n * S + s0 + j0 + l;
            const acc_t log_s = log_sum[l];
            lse_out[pos] = static_cast<double>(mx[l]) + static_cast<double>(log_s);
            const index_t ti = t[pos];
            if (ti == pr.ignore_index) {
              loss_out[pos] = 0;
              pw_out[pos] = 0;
              continue;
            }
            check_target(pr, ti);
            // ε = 0 skips the smoothing sum, so that −∞ logits (masking) stay finite.
            const acc_t smooth = bb != 0 ? bb * (W * log_s - wx[l]) : acc_t(0);
            const acc_t wt = kWeight ? w[ti] : acc_t(1);
            loss_out[pos] = a * wt * ((mx[l] - col[ti * span + l]) + log_s) + smooth;
            pw_out[pos] = wt;
          }
        }
      }
    });
  }
}

// Per position of a column block: the upstream scale (0 where ignored), K = Σ_c w_c q_c and
// the log-sum-exp as hi + lo. Sized to the block's span, zero past its count.
template <typename acc_t>
struct ColumnTerms {
  std::vector<acc_t> g, K, hi, lo;
  explicit ColumnTerms(int64_t span) : g(span), K(span), hi(span), lo(span) {}

  // buf: the block's logits (class c of position j at c · span + j), for a coarse lse.
  template <typename index_t, bool kWeight>
  void fill(const Problem& pr, const index_t* t, const acc_t* grad, int64_t g_stride,
            const double* lse, const acc_t* w, acc_t W, int64_t pos0, int64_t count,
            const acc_t* buf, int64_t span) {
    std::fill(g.begin(), g.end(), acc_t(0));
    std::fill(K.begin(), K.end(), acc_t(0));
    std::fill(hi.begin(), hi.end(), acc_t(0));
    std::fill(lo.begin(), lo.end(), acc_t(0));
    for (int64_t j = 0; j < count; ++j) {
      const int64_t pos = pos0 + j;
      const index_t ti = t[pos];
      const auto split = coarse_lse<acc_t>(lse[pos]) ? exact_lse<acc_t>(buf + j, pr.C, span)
                                                     : split_lse<acc_t>(lse[pos]);
      hi[j] = split.hi;
      lo[j] = split.lo;
      if (ti == pr.ignore_index) continue;
      check_target(pr, ti);
      g[j] = grad[pos * g_stride];
      K[j] = static_cast<acc_t>(pr.a) * (kWeight ? w[ti] : acc_t(1)) + static_cast<acc_t>(pr.b) * W;
    }
  }
};

// The gradient of a block (C class rows of `span` positions in buf) in place: every class as
// g·(softmax·K − w·b), then the targets' own terms from the logits xs (S apart per class),
// in acc_t before rounding (bf16 would lose them otherwise).
template <typename scalar_t, typename index_t, bool kWeight>
void column_gradient(const Problem& pr, const ColumnTerms<at::opmath_type<scalar_t>>& ct,
                     const at::opmath_type<scalar_t>* w, const index_t* t, const scalar_t* xs,
                     int64_t count, int64_t span, at::opmath_type<scalar_t>* buf) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vectorized<acc_t>;
  const acc_t a = pr.a, bb = pr.b;
  const V vb(bb);
  for (int64_t c = 0; c < pr.C; ++c) {
    acc_t* row = buf + c * span;
    const V wq = kWeight ? V(w[c]) * vb : vb;
    for (int64_t j = 0; j < span; j += V::size()) {
      const V e =
          vexp((V::loadu(row + j) - V::loadu(ct.hi.data() + j)) - V::loadu(ct.lo.data() + j));
      (V::loadu(ct.g.data() + j) * (e * V::loadu(ct.K.data() + j) - wq)).store(row + j);
    }
  }
  for (int64_t j = 0; j < count; ++j) {
    const index_t ti = t[j];
    if (ti == pr.ignore_index) continue;
    const acc_t wt = kWeight ? w[ti] : acc_t(1);
    const acc_t xt = static_cast<acc_t>(xs[ti * pr.S + j]);
    buf[ti * span + j] = ct.g[j] * (std::exp((xt - ct.hi[j]) - ct.lo[j]) * ct.K[j] - wt * (a + bb));
  }
}

template <typename scalar_t, typename index_t, bool kWeight, bool kProb>
void backward_columns(const Problem& pr, const Tensor& scale, const Tensor& input,
                      const Tensor& target, const Tensor& w_acc, double weight_total,
                      const Tensor& lse, Tensor& grad) {
  if constexpr (kProb) {
    TORCH_INTERNAL_ASSERT(false, "backward_columns: class-index targets only");
  } else {
    using acc_t = at::opmath_type<scalar_t>;
    const int64_t C = pr.C, S = pr.S, span = column_span<acc_t>(C);
    const int64_t tasks_per_sample = (S + span - 1) / span;
    const scalar_t* x = input.const_data_ptr<scalar_t>();
    const index_t* t = target.const_data_ptr<index_t>();
    const acc_t* w = kWeight ? w_acc.const_data_ptr<acc_t>() : nullptr;
    const acc_t* g = scale.const_data_ptr<acc_t>();
    const int64_t g_stride = scale.dim() == 0 ? 0 : 1;
    const double* lse_in = lse.const_data_ptr<double>();
    scalar_t* out = grad.mutable_data_ptr<scalar_t>();
    const acc_t W = weight_total;
    at::parallel_for(0, pr.N * tasks_per_sample, 1, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> buf(C * span);
      ColumnTerms<acc_t> ct(span);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t n = task / tasks_per_sample, s0 = (task % tasks_per_sample) * span;
        const int64_t count = std::min(span, S - s0), pos0 = n * S + s0;
        const scalar_t* xs = x + n * C * S + s0;
        load_block(xs, C, S, count, span, buf.data());
        ct.template fill<index_t, kWeight>(pr, t, g, g_stride, lse_in, w, W, pos0, count,
                                           buf.data(), span);
        column_gradient<scalar_t, index_t, kWeight>(pr, ct, w, t + pos0, xs, count, span,
                                                    buf.data());
        // Each class row out in one piece.
        scalar_t* dst = out + n * C * S + s0;
        for (int64_t c = 0; c < C; ++c) {
          const acc_t* row = buf.data() + c * span;
          for (int64_t j = 0; j < count; ++j) dst[c * S + j] = static_cast<scalar_t>(row[j]);
        }
      }
    });
  }
}

#define TK_DISPATCHED(fn)                                                         \
  fn<typename decltype(s)::type, typename decltype(i)::type, decltype(kW)::value, \
     decltype(kP)::value>

// N-D inputs with class-index targets take the column kernels (no transposition).
bool use_columns(const Problem& p) { return p.S > 1 && !p.prob_target; }

// (N, C, S) → (N·S, C) rows of contiguous classes; a view when S = 1 and input is contiguous.
Tensor as_rows(const Problem& p, const Tensor& t) {
  return t.reshape({p.N, p.C, p.S}).transpose(1, 2).reshape({p.N * p.S, p.C}).contiguous();
}

// reduce() for the CPU: for up to kSerialReduce positions, the sums are taken here and the
// two scalars made directly, instead of by four small tensor ops whose fixed cost is a
// quarter of the whole call at N = 256, C = 1000. The sums run in float64: a sequential
// float32 sum of 16,384 losses errs by 7e-4 where one loss dwarfs the rest.
constexpr int64_t kSerialReduce = 1 << 14;

std::tuple<Tensor, Tensor, Tensor> reduce_cpu(const Problem& p, const Tensor& input,
                                              const Tensor& lse, const Tensor& losses,
                                              const Tensor& position_weights) {
  const int64_t n = losses.numel();
  if (p.reduction == Reduction::None || n > kSerialReduce) {
    return reduce(p, input, lse, losses, position_weights);
  }
  double loss_sum = 0, weight_total = 0;
  AT_DISPATCH_FLOATING_TYPES(losses.scalar_type(), "reduce_cpu", [&] {
    const scalar_t* l = losses.const_data_ptr<scalar_t>();
    const scalar_t* w = position_weights.const_data_ptr<scalar_t>();
    double ls = 0, ws = 0;  // float64, as reduce() sums
    for (int64_t k = 0; k < n; ++k) {
      ls += l[k];
      ws += w[k];
    }
    loss_sum = ls;
    weight_total = ws;
  });
  // 0 / 0 = NaN when every position is ignored, as in PyTorch.
  const double value = p.reduction == Reduction::Mean ? loss_sum / weight_total : loss_sum;
  return {scalar_of_type(value, input.options()), lse,
          scalar_of_type(weight_total, losses.options())};
}

std::tuple<Tensor, Tensor, Tensor> forward_cpu(const Tensor& input, const Tensor& target,
                                               const std::optional<Tensor>& weight,
                                               const c10::Scalar& ignore_index,
                                               c10::string_view reduction,
                                               const c10::Scalar& label_smoothing,
                                               const c10::Scalar& exclude_target) {
  const Problem p =
      check_inputs(input, target, weight, ignore_index, reduction, label_smoothing, exclude_target);
  auto [lse, losses, position_weights] = allocate_positions(p, input);
  if (lse.numel() > 0) {
    const Tensor w_sum = weight_sum(p, input, weight);
    const Tensor w_acc = weight ? weight->to(w_sum.scalar_type()).contiguous() : Tensor();
    const double W = w_sum.item<double>();  // a CPU scalar: no device synchronisation
    const Tensor t_flat = p.prob_target ? Tensor() : target.reshape({-1}).contiguous();
    if (use_columns(p)) {
      const Tensor x = input.contiguous();
      dispatch(p, input, target, weight.has_value(), [&](auto s, auto i, auto kW, auto kP) {
        TK_DISPATCHED(forward_columns)(p, x, t_flat, w_acc, W, lse, losses, position_weights);
      });
    } else {
      const Tensor x_rows = as_rows(p, input);
      const Tensor t_rows = p.prob_target ? as_rows(p, target) : t_flat;
      dispatch(p, input, target, weight.has_value(), [&](auto s, auto i, auto kW, auto kP) {
        TK_DISPATCHED(forward_rows)(p, x_rows, t_rows, w_acc, lse, losses, position_weights);
      });
    }
  }
  return reduce_cpu(p, input, lse, losses, position_weights);
}

Tensor backward_cpu(const Tensor& grad, const Tensor& input, const Tensor& target,
                    const std::optional<Tensor>& weight, const Tensor& lse,
                    const Tensor& total_weight, const c10::Scalar& ignore_index,
                    c10::string_view reduction, const c10::Scalar& label_smoothing,
                    const c10::Scalar& exclude_target) {
  const Problem p =
      check_inputs(input, target, weight, ignore_index, reduction, label_smoothing, exclude_target);
  check_backward_inputs(p, input, grad, lse, total_weight);
  if (input.numel() == 0) return at::zeros_like(input, at::MemoryFormat::Contiguous);
  const Tensor w_sum = weight_sum(p, input, weight);
  const Tensor w_acc = weight ? weight->to(w_sum.scalar_type()).contiguous() : Tensor();
  const double W = w_sum.item<double>();
  const Tensor scale = grad_scale(p, grad, total_weight);
  const Tensor t_flat = p.prob_target ? Tensor() : target.reshape({-1}).contiguous();
  if (use_columns(p)) {
    const Tensor x = input.contiguous();
    Tensor grad_input = cpu::empty_for_writing(input.sizes(), input.options());
    dispatch(p, input, target, weight.has_value(), [&](auto s, auto i, auto kW, auto kP) {
      TK_DISPATCHED(backward_columns)(p, scale, x, t_flat, w_acc, W, lse.contiguous(), grad_input);
    });
    return grad_input;
  }
  const Tensor x_rows = as_rows(p, input);
  const Tensor t_rows = p.prob_target ? as_rows(p, target) : t_flat;
  Tensor grad_rows = cpu::empty_for_writing({p.N * p.S, p.C}, input.options());
  dispatch(p, input, target, weight.has_value(), [&](auto s, auto i, auto kW, auto kP) {
    TK_DISPATCHED(backward_rows)(p, scale, x_rows, t_rows, w_acc, W, lse.contiguous(), grad_rows);
  });
  if (p.S == 1) return grad_rows.view(input.sizes());
  return grad_rows.view({p.N, p.S, p.C}).transpose(1, 2).contiguous().view(input.sizes());
}

}  // namespace

TORCH_LIBRARY_IMPL(torchkit, CPU, m) {
  m.impl("label_smoothing_cross_entropy", &forward_cpu);
  m.impl("_label_smoothing_cross_entropy_backward", &backward_cpu);
}

}  // namespace torchkit::label_smoothing_cross_entropy
