// Bilinear pooling: schemas, input checks and the GEMMs of the backward.
#include "bilinear_pool.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>
#include <cmath>

#include "autograd.h"
#include "blas.h"
#include "checks.h"
#include "common.h"

namespace torchkit::bilinear_pool {

namespace {

// (N, C, H, W) → (N, C, HW) without a copy where the memory allows it.
at::Tensor flat(const Problem& p, const at::Tensor& t) {
  const at::Tensor a = p.channels_last
                           ? t.permute({0, 2, 3, 1}).reshape({p.N, p.HW, t.size(1)}).transpose(1, 2)
                           : t.reshape({p.N, t.size(1), p.HW});
  return a.scalar_type() == acc_type(t) ? a : a.to(acc_type(t));
}

}  // namespace

Problem check_inputs(const at::Tensor& x, const std::optional<at::Tensor>& y,
                     const c10::Scalar& sqrt_eps_arg, const c10::Scalar& l2_eps_arg) {
  Problem p;
  const double sqrt_eps = p.sqrt_eps = scalar_float(kOp, "sqrt_eps", sqrt_eps_arg);
  const double l2_eps = p.l2_eps = scalar_float(kOp, "l2_eps", l2_eps_arg);
  check_floating(kOp, "x", x);
  TK_CHECK_VALUE(kOp, x.dim() == 4, "x must be a 4-D feature map (N, D, H, W), got shape ",
                 x.sizes());
  TK_CHECK_VALUE(kOp, std::isfinite(sqrt_eps) && sqrt_eps >= 0,
                 "sqrt_eps must be finite and >= 0, got ", sqrt_eps);
  TK_CHECK_VALUE(kOp, std::isfinite(l2_eps) && l2_eps >= 0, "l2_eps must be finite and >= 0, got ",
                 l2_eps);
  p.N = x.size(0);
  p.D = x.size(1);
  p.HW = x.size(2) * x.size(3);
  TK_CHECK_VALUE(kOp, p.HW > 0,
                 "x must have at least one spatial position (H·W > 0): the pooled product is "
                 "divided by H·W; got shape ",
                 x.sizes());
  p.self = !y.has_value();
  p.E = p.D;
  if (y.has_value()) {
    const auto& t = *y;
    check_same_device(kOp, "x", x, "y", t);
    check_same_dtype(kOp, "x", x, "y", t);
    TK_CHECK_VALUE(
        kOp, t.dim() == 4 && t.size(0) == p.N && t.size(2) == x.size(2) && t.size(3) == x.size(3),
        "y must be (N, E, H, W) with x's N, H and W, got x of shape ", x.sizes(),
        " and y of shape ", t.sizes());
    p.E = t.size(1);
  }
  // Read channels_last inputs as (N, HW, C) rows instead of copying them to (N, C, HW).
  p.channels_last =
      x.is_contiguous(at::MemoryFormat::ChannelsLast) && !x.is_contiguous() &&
      (!y.has_value() || (y->is_contiguous(at::MemoryFormat::ChannelsLast) && !y->is_contiguous()));
  return p;
}

void check_backward_inputs(const Problem& p, const at::Tensor& grad, const at::Tensor& x,
                           const at::Tensor& out, const at::Tensor& norm) {
  const std::vector<int64_t> shape{p.N, p.D * p.E};
  TK_CHECK_VALUE(kOp, grad.sizes() == c10::IntArrayRef(shape) && out.sizes() == grad.sizes(),
                 "backward: grad and out must have the output's shape ", c10::IntArrayRef(shape),
                 ", got ", grad.sizes(), " and ", out.sizes());
  TK_CHECK_VALUE(kOp, norm.dim() == 1 && norm.size(0) == p.N && norm.scalar_type() == acc_type(x),
                 "backward: norm must be (N,) = (", p.N, ",) of ", acc_type(x), ", got ",
                 norm.sizes(), " of ", norm.scalar_type());
  check_same_dtype(kOp, "x", x, "grad", grad);
  check_same_dtype(kOp, "x", x, "out", out);
  check_same_device(kOp, "x", x, "grad", grad);
  check_same_device(kOp, "x", x, "out", out);
  check_same_device(kOp, "x", x, "norm", norm);
}

std::tuple<at::Tensor, at::Tensor> operands(const Problem& p, const at::Tensor& x,
                                            const std::optional<at::Tensor>& y) {
  const at::Tensor a = flat(p, x);
  return {a, p.self ? a : flat(p, *y)};
}

std::tuple<at::Tensor, at::Tensor> input_grads(const Problem& p, const at::Tensor& dz,
                                               const at::Tensor& x,
                                               const std::optional<at::Tensor>& y,
                                               std::array<bool, 2> output_mask, EmptyFn empty,
                                               const ScaledOperands* scaled) {
  const auto [a, b] = scaled ? std::make_tuple(scaled->a, scaled->b) : operands(p, x, y);
  // Each gradient is produced in the layout its input has: (N, HW, C) rows for
  // channels_last, (N, C, HW) otherwise, so that the view back to 4-D is free.
  auto grad_of = [&](const at::Tensor& g, const at::Tensor& other, const at::Tensor& input,
                     int which) {
    const int64_t C = input.size(1);
    if (p.channels_last) {  // (g·other)ᵀ = otherᵀ·gᵀ : (N, HW, C)
      at::Tensor out = empty({p.N, p.HW, C}, g.options());
      blas::bmm_out(out, other.transpose(1, 2), g.transpose(1, 2));
      if (scaled) scaled->unscale(out, which);
      return out.view({p.N, input.size(2), input.size(3), C})
          .permute({0, 3, 1, 2})
          .to(input.scalar_type());
    }
    at::Tensor out = empty({p.N, C, p.HW}, g.options());
    blas::bmm_out(out, g, other);
    if (scaled) scaled->unscale(out, which);
    return out.view(input.sizes()).to(input.scalar_type());
  };
  const auto none = at::empty({0}, x.options());
  if (p.self) return {output_mask[0] ? grad_of(dz, a, x, 0) : none, none};
  return {output_mask[0] ? grad_of(dz, b, x, 0) : none,
          output_mask[1] ? grad_of(dz.transpose(1, 2), a, *y, 1) : none};
}

namespace {

// Autograd in C++: the formula that torchkit/ops/bilinear_pool.py gives the torch.func
// transforms, without the Python a register_autograd formula runs on every call.
class BilinearPoolFunction : public torch::autograd::Function<BilinearPoolFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& x,
                                                const std::optional<at::Tensor>& y,
                                                const c10::Scalar& sqrt_eps,
                                                const c10::Scalar& l2_eps) {
    static const auto op = op_handle<std::tuple<at::Tensor, at::Tensor>(
        const at::Tensor&, const std::optional<at::Tensor>&, const c10::Scalar&,
        const c10::Scalar&)>("torchkit::bilinear_pool");
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, norm] = op.call(x, y, sqrt_eps, l2_eps);
    // Inputs, output and N norms: nothing N×D² more.
    ctx->save_for_backward({x, y.value_or(at::Tensor()), out, norm});
    ctx->mark_non_differentiable({norm});  // what the backward needs, not a result
    ctx->saved_data["sqrt_eps"] = sqrt_eps;
    ctx->saved_data["l2_eps"] = l2_eps;
    ctx->saved_data["two_stream"] = y.has_value();
    return {out, norm};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static const auto op = op_handle<std::tuple<at::Tensor, at::Tensor>(
        const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
        const at::Tensor&, const c10::Scalar&, const c10::Scalar&, std::array<bool, 2>)>(
        "torchkit::_bilinear_pool_backward");
    const auto saved = ctx->get_saved_variables();
    const bool two_stream = ctx->saved_data["two_stream"].toBool();
    const std::optional<at::Tensor> y =
        two_stream ? std::optional<at::Tensor>(saved[1]) : std::nullopt;
    const std::array<bool, 2> mask{ctx->needs_input_grad(0),
                                   two_stream && ctx->needs_input_grad(1)};
    const BackwardOpGuard guard;
    auto [gx, gy] =
        op.call(grads[0], saved[0], y, saved[2], saved[3], ctx->saved_data["sqrt_eps"].toScalar(),
                ctx->saved_data["l2_eps"].toScalar(), mask);
    return {mask[0] ? gx : at::Tensor(), mask[1] ? gy : at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> bilinear_pool_autograd(const at::Tensor& x,
                                                          const std::optional<at::Tensor>& y,
                                                          const c10::Scalar& sqrt_eps,
                                                          const c10::Scalar& l2_eps) {
  auto out = BilinearPoolFunction::apply(x, y, sqrt_eps, l2_eps);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torchkit, m) {
  // Returns (out, norm): norm is the per-sample ‖s‖ before clamping (acc type; negative for a
  // sample the CPU scaled, see bilinear_pool.h), what the backward needs besides the inputs
  // and the output.
  m.def("bilinear_pool(Tensor x, Tensor? y, Scalar sqrt_eps, Scalar l2_eps) -> (Tensor, Tensor)");
  // Returns (grad_x, grad_y); one output_mask leaves out (and grad_y for y = None) is (0,).
  m.def(
      "_bilinear_pool_backward(Tensor grad, Tensor x, Tensor? y, Tensor out, Tensor norm, Scalar "
      "sqrt_eps, Scalar l2_eps, bool[2] output_mask) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(torchkit, Autograd, m) { m.impl("bilinear_pool", &bilinear_pool_autograd); }

}  // namespace torchkit::bilinear_pool
