// Pairwise Euclidean distance: schemas, input checks, broadcasting and centring.
#include "cdist.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "autograd.h"
#include "checks.h"
#include "common.h"

namespace torchkit::cdist {

namespace {

std::vector<int64_t> expanded_shape(const Problem& p, int64_t rows) {
  std::vector<int64_t> shape = p.batch;
  shape.push_back(rows);
  shape.push_back(p.M);
  return shape;
}

// (*B_i, rows, M) → contiguous (B, rows, M) in the accumulation type.
at::Tensor batched(const Problem& p, const at::Tensor& x) {
  const int64_t rows = x.size(-2);
  // The common case, a contiguous (rows, M) or (B, rows, M) input in its accumulation type,
  // is a view: four ATen calls cost more than a small problem's arithmetic.
  if (x.scalar_type() == acc_type(x) && x.is_contiguous() &&
      ((x.dim() == 2 && p.B == 1) || (x.dim() == 3 && x.size(0) == p.B))) {
    return x.dim() == 2 ? x.view({1, rows, p.M}) : x;
  }
  return x.expand(expanded_shape(p, rows)).reshape({p.B, rows, p.M}).to(acc_type(x)).contiguous();
}

// The sum (B, 1, M) of x's finite rows and their count (B, 1, 1), in x's type, from one
// finiteness mask.
std::pair<at::Tensor, at::Tensor> finite_row_sum(const at::Tensor& x) {
  const at::Tensor finite = x.isfinite().all(-1, /*keepdim=*/true);
  return {x.masked_fill(finite.logical_not(), 0).sum(1, true),
          finite.sum(1, true, x.scalar_type())};
}

}  // namespace

Problem check_inputs(const at::Tensor& x1, const std::optional<at::Tensor>& x2, bool squared,
                     const Names& names) {
  const char* op = names.op;
  Problem p;
  p.squared = squared;
  p.self = !x2.has_value();
  check_floating(op, names.x1, x1);
  TK_CHECK_VALUE(op, x1.dim() >= 2, names.x1,
                 " must have at least 2 dimensions (*, P, M), got shape ", x1.sizes());
  p.P = x1.size(-2);
  p.M = x1.size(-1);
  p.R = p.P;
  std::vector<int64_t> b1(x1.sizes().begin(), x1.sizes().end() - 2);
  p.batch = b1;
  if (x2.has_value()) {
    const auto& y = *x2;
    check_same_device(op, names.x1, x1, names.x2, y);
    check_same_dtype(op, names.x1, x1, names.x2, y);
    TK_CHECK_VALUE(op, y.dim() >= 2, names.x2,
                   " must have at least 2 dimensions (*, R, M), got shape ", y.sizes());
    TK_CHECK_VALUE(op, y.size(-1) == p.M, names.x1, " and ", names.x2,
                   " must have the same number of features M (their last dimension), got ",
                   names.x1, " of shape ", x1.sizes(), " and ", names.x2, " of shape ", y.sizes());
    p.R = y.size(-2);
    std::vector<int64_t> b2(y.sizes().begin(), y.sizes().end() - 2);
    // Broadcast as torch.cdist does: align from the right, sizes equal or one of them 1.
    const size_t n = std::max(b1.size(), b2.size());
    p.batch.assign(n, 1);
    for (size_t k = 0; k < n; ++k) {
      const int64_t s1 = k < b1.size() ? b1[b1.size() - 1 - k] : 1;
      const int64_t s2 = k < b2.size() ? b2[b2.size() - 1 - k] : 1;
      TK_CHECK_VALUE(op, s1 == s2 || s1 == 1 || s2 == 1, "the batch dimensions of ", names.x1,
                     " and ", names.x2, " must broadcast, got ", names.x1, " of shape ", x1.sizes(),
                     " and ", names.x2, " of shape ", y.sizes());
      p.batch[n - 1 - k] = s1 == 1 ? s2 : s1;
    }
  }
  p.B = 1;
  for (int64_t s : p.batch) p.B *= s;
  return p;
}

Problem check_inputs(const at::Tensor& x1, const std::optional<at::Tensor>& x2,
                     const c10::Scalar& squared) {
  return check_inputs(x1, x2, scalar_bool(kOp, "squared", squared));
}

std::pair<at::Tensor, at::Tensor> centre_rows_aten(const at::Tensor& raw, const at::Tensor& mean) {
  at::Tensor x = mean.defined() ? raw - mean : raw;
  // Σ x² over M, a slice of rows at a time, so that the squares are never a temporary as
  // large as x (205 MB for knn's 100,000 × 512 gallery).
  constexpr int64_t kRows = 4096;
  at::Tensor n = at::empty({x.size(0), x.size(1)}, x.options());
  for (int64_t r = 0; r < x.size(1); r += kRows) {
    const int64_t len = std::min(kRows, x.size(1) - r);
    at::Tensor slice = n.narrow(1, r, len);
    at::sum_out(slice, x.narrow(1, r, len).square(), -1);
  }
  return {x, n};
}

Shift finite_mean_aten(const at::Tensor& raw1, const at::Tensor& raw2) {
  auto [sum, count] = finite_row_sum(raw1);
  if (raw2.defined()) {
    const auto [sum2, count2] = finite_row_sum(raw2);
    sum.add_(sum2);
    count.add_(count2);
  }
  return {sum.div_(count.clamp_min_(1)), {}};
}

Centred centre(const Problem& p, const at::Tensor& x1, const std::optional<at::Tensor>& x2,
               Centring centring) {
  Centred c;
  c.raw1 = batched(p, x1);
  c.raw2 = p.self ? c.raw1 : batched(p, *x2);
  Shift shift = centring.mean(c.raw1, p.self ? at::Tensor() : c.raw2);
  at::Tensor in1 = c.raw1, in2 = c.raw2;
  if (!shift.exponents.empty()) {  // rows divided by 2^e (exact), a copy: extreme data only
    c.exponents = std::move(shift.exponents);
    std::vector<double> factors(c.exponents.size());
    for (size_t b = 0; b < factors.size(); ++b) factors[b] = std::ldexp(1.0, -c.exponents[b]);
    const at::Tensor f = at::tensor(factors, at::kDouble)
                             .view({p.B, 1, 1})
                             .to(c.raw1.options().dtype(c.raw1.scalar_type()));
    in1 = c.raw1 * f;
    in2 = p.self ? in1 : c.raw2 * f;
    shift = centring.mean(in1, p.self ? at::Tensor() : in2);
  }
  std::tie(c.x1, c.n1) = centring.rows(in1, shift.mean);
  if (p.self) {
    c.x2 = c.x1;
    c.n2 = c.n1;
  } else {
    std::tie(c.x2, c.n2) = centring.rows(in2, shift.mean);
  }
  return c;
}

void check_backward_inputs(const Problem& p, const at::Tensor& grad, const at::Tensor& x1,
                           const at::Tensor& dist) {
  std::vector<int64_t> shape = p.batch;
  shape.push_back(p.P);
  shape.push_back(p.R);
  const c10::IntArrayRef expected(shape);
  TK_CHECK_VALUE(kOp, dist.sizes() == expected && grad.sizes() == expected,
                 "backward: grad and dist must have the output's shape ", expected, ", got ",
                 grad.sizes(), " and ", dist.sizes());
  check_same_dtype(kOp, "x1", x1, "grad", grad);
  check_same_dtype(kOp, "x1", x1, "dist", dist);
  check_same_device(kOp, "x1", x1, "grad", grad);
  check_same_device(kOp, "x1", x1, "dist", dist);
}

at::Tensor finish_forward(const Problem& p, const at::Tensor& dist) {
  std::vector<int64_t> shape = p.batch;
  shape.push_back(p.P);
  shape.push_back(p.R);
  return dist.view(shape);
}

std::tuple<at::Tensor, at::Tensor> finish_backward(const Problem& p, at::Tensor g1, at::Tensor g2,
                                                   const at::Tensor& x1,
                                                   const std::optional<at::Tensor>& x2) {
  auto to_input = [&](const at::Tensor& g, const at::Tensor& x) {
    return g.view(expanded_shape(p, x.size(-2))).sum_to_size(x.sizes()).to(x.scalar_type());
  };
  if (p.self) {
    at::Tensor g = g1.defined() && g2.defined() ? g1.add_(g2) : (g1.defined() ? g1 : g2);
    return {g.defined() ? to_input(g, x1) : at::empty({0}, x1.options()),
            at::empty({0}, x1.options())};
  }
  return {g1.defined() ? to_input(g1, x1) : at::empty({0}, x1.options()),
          g2.defined() ? to_input(g2, *x2) : at::empty({0}, x1.options())};
}

namespace {

// Autograd in C++: the formula that torchkit/ops/cdist.py gives the torch.func transforms,
// without the Python a register_autograd formula runs on every call (~200 µs per forward and
// backward, more than the whole product of a 64-point batch).
class CdistFunction : public torch::autograd::Function<CdistFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x1,
                            const std::optional<at::Tensor>& x2, const c10::Scalar& squared) {
    static const auto op = op_handle<at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&,
                                                const c10::Scalar&)>("torchkit::cdist");
    at::AutoDispatchBelowADInplaceOrView guard;
    at::Tensor dist = op.call(x1, x2, squared);
    ctx->save_for_backward({x1, x2.value_or(at::Tensor()), dist});  // no O(P·R·M) state
    ctx->saved_data["squared"] = squared;
    ctx->saved_data["self"] = !x2.has_value();
    return dist;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static const auto op = op_handle<std::tuple<at::Tensor, at::Tensor>(
        const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
        const c10::Scalar&, std::array<bool, 2>)>("torchkit::_cdist_backward");
    const auto saved = ctx->get_saved_variables();
    const bool self = ctx->saved_data["self"].toBool();
    const std::optional<at::Tensor> x2 = self ? std::nullopt : std::optional<at::Tensor>(saved[1]);
    const std::array<bool, 2> mask{ctx->needs_input_grad(0), !self && ctx->needs_input_grad(1)};
    const BackwardOpGuard guard;
    auto [g1, g2] =
        op.call(grads[0], saved[0], x2, saved[2], ctx->saved_data["squared"].toScalar(), mask);
    return {mask[0] ? g1 : at::Tensor(), mask[1] ? g2 : at::Tensor(), at::Tensor()};
  }
};

at::Tensor cdist_autograd(const at::Tensor& x1, const std::optional<at::Tensor>& x2,
                          const c10::Scalar& squared) {
  return CdistFunction::apply(x1, x2, squared);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torchkit, m) {
  // Number and flag arguments are Scalar so that the kernels see what the caller passed
  // (checks.h's scalar_bool), as in every torchkit op.
  m.def("cdist(Tensor x1, Tensor? x2, Scalar squared) -> Tensor");
  // Returns (grad_x1, grad_x2); an output that output_mask does not ask for (and grad_x2 when
  // x2 is None) is an empty tensor of shape (0,).
  m.def(
      "_cdist_backward(Tensor grad, Tensor x1, Tensor? x2, Tensor dist, Scalar squared, bool[2] "
      "output_mask) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(torchkit, Autograd, m) { m.impl("cdist", &cdist_autograd); }

}  // namespace torchkit::cdist
