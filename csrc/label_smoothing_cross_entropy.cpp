// Label-smoothing cross-entropy: schemas, input checks and the device-agnostic reduction.
#include "label_smoothing_cross_entropy.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "autograd.h"
#include "checks.h"
#include "common.h"

namespace torchkit::label_smoothing_cross_entropy {

namespace {

Reduction parse_reduction(c10::string_view reduction) {
  if (reduction == "mean") return Reduction::Mean;
  if (reduction == "sum") return Reduction::Sum;
  TK_CHECK_VALUE(kOp, reduction == "none", "reduction must be 'none', 'mean' or 'sum', got '",
                 reduction, "'");
  return Reduction::None;
}

std::vector<int64_t> position_shape(const at::Tensor& input) {
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.erase(shape.begin() + (input.dim() == 1 ? 0 : 1));  // drop the class dimension
  return shape;
}

// A target of class probabilities (the input's shape and dtype) or of class indices (the
// input's shape without the class dimension).
void check_target_tensor(const at::Tensor& input, const at::Tensor& target, bool prob_target,
                         int64_t ignore_index) {
  const auto positions = position_shape(input);
  if (prob_target) {
    TK_CHECK_VALUE(kOp, target.sizes() == input.sizes(),
                   "a floating target holds class probabilities and must have the input's shape ",
                   input.sizes(), ", got ", target.sizes());
    check_same_dtype(kOp, "input", input, "a probability target", target);
    TK_CHECK_VALUE(
        kOp, ignore_index < 0,
        "ignore_index is not supported with probability targets, got ignore_index=", ignore_index);
  } else {
    TK_CHECK_TYPE(kOp, target.scalar_type() == at::kLong || target.scalar_type() == at::kInt,
                  "target must hold class indices (int64 or int32) or class probabilities (the "
                  "input's floating dtype), got ",
                  target.scalar_type());
    TK_CHECK_VALUE(kOp, target.sizes() == c10::IntArrayRef(positions),
                   "a class-index target must have shape ", c10::IntArrayRef(positions),
                   " (the input's shape ", input.sizes(), " without the class dimension), got ",
                   target.sizes());
  }
}

// The target distribution q = a·onehot + b: ε spread over all C classes, or over the C − 1
// others with exclude_target.
void set_coefficients(Problem& p, double label_smoothing, bool exclude_target) {
  const double eps = label_smoothing;
  const double C = static_cast<double>(p.C);
  if (exclude_target) {
    TK_CHECK_VALUE(kOp, p.C >= 2 || eps == 0.0,
                   "exclude_target=True spreads label_smoothing over the C - 1 other classes and "
                   "needs C >= 2, got C = ",
                   p.C);
    p.b = p.C >= 2 ? eps / (C - 1.0) : 0.0;
    p.a = 1.0 - eps - p.b;
  } else {
    p.a = 1.0 - eps;
    p.b = eps / C;
  }
}

}  // namespace

Problem check_inputs(const at::Tensor& input, const at::Tensor& target,
                     const std::optional<at::Tensor>& weight, const c10::Scalar& ignore_index_arg,
                     c10::string_view reduction, const c10::Scalar& label_smoothing_arg,
                     const c10::Scalar& exclude_target_arg) {
  Problem p;
  const int64_t ignore_index = p.ignore_index = scalar_int(kOp, "ignore_index", ignore_index_arg);
  const double label_smoothing = scalar_float(kOp, "label_smoothing", label_smoothing_arg);
  const bool exclude_target = scalar_bool(kOp, "exclude_target", exclude_target_arg);
  p.reduction = parse_reduction(reduction);
  check_floating(kOp, "input", input);
  TK_CHECK_VALUE(kOp, input.dim() >= 1,
                 "input must have shape (C), (N, C) or (N, C, d1, ..., dk), got a 0-d tensor");
  check_same_device(kOp, "input", input, "target", target);
  TK_CHECK_VALUE(kOp, label_smoothing >= 0.0 && label_smoothing <= 1.0,
                 "label_smoothing must be in [0, 1], got ", label_smoothing);

  const int64_t class_dim = input.dim() == 1 ? 0 : 1;
  p.C = input.size(class_dim);
  p.N = input.dim() == 1 ? 1 : input.size(0);
  p.S = 1;
  for (int64_t d = 2; d < input.dim(); ++d) p.S *= input.size(d);
  TK_CHECK_VALUE(kOp, p.C > 0, "input must have at least one class (C > 0), got input of shape ",
                 input.sizes());

  p.prob_target = at::isFloatingType(target.scalar_type());
  check_target_tensor(input, target, p.prob_target, ignore_index);
  if (weight.has_value()) {
    const auto& w = *weight;
    TK_CHECK_VALUE(kOp, w.dim() == 1 && w.size(0) == p.C, "weight must have shape (C,) = (", p.C,
                   ",), got ", w.sizes());
    check_same_dtype(kOp, "input", input, "weight", w);
    check_same_device(kOp, "input", input, "weight", w);
  }

  set_coefficients(p, label_smoothing, exclude_target);
  return p;
}

void check_backward_inputs(const Problem& p, const at::Tensor& input, const at::Tensor& grad,
                           const at::Tensor& lse, const at::Tensor& total_weight) {
  const auto positions = position_shape(input);
  const c10::IntArrayRef loss_shape =
      p.reduction == Reduction::None ? c10::IntArrayRef(positions) : c10::IntArrayRef();
  check_floating(kOp, "grad", grad);
  TK_CHECK_VALUE(kOp, grad.sizes() == loss_shape, "backward: grad must have the loss's shape ",
                 loss_shape, ", got ", grad.sizes());
  const auto acc = acc_type(input);
  TK_CHECK_VALUE(kOp,
                 lse.sizes() == c10::IntArrayRef(positions) && lse.scalar_type() == at::kDouble,
                 "backward: lse must be ", c10::IntArrayRef(positions), " of ", at::kDouble,
                 ", got ", lse.sizes(), " of ", lse.scalar_type());
  TK_CHECK_VALUE(kOp, total_weight.dim() == 0 && total_weight.scalar_type() == acc,
                 "backward: total_weight must be 0-d of ", acc, ", got ", total_weight.sizes(),
                 " of ", total_weight.scalar_type());
  check_same_device(kOp, "input", input, "grad", grad);
  check_same_device(kOp, "input", input, "lse", lse);
  check_same_device(kOp, "input", input, "total_weight", total_weight);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> allocate_positions(const Problem& p,
                                                                  const at::Tensor& input) {
  const auto opts = input.options().dtype(acc_type(input));
  const auto shape = position_shape(input);
  return {at::empty(shape, opts.dtype(at::kDouble)), at::empty(shape, opts),
          at::empty(shape, opts)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> reduce(const Problem& p, const at::Tensor& input,
                                                      const at::Tensor& lse,
                                                      const at::Tensor& losses,
                                                      const at::Tensor& position_weights) {
  // Sums in float64: one large loss beside many small ones must not swallow them.
  const at::Tensor weight_sum = position_weights.sum(at::kDouble);
  at::Tensor loss;
  switch (p.reduction) {
    case Reduction::None:
      loss = losses.to(input.scalar_type());
      break;
    case Reduction::Sum:
      loss = losses.sum(at::kDouble).to(input.scalar_type());
      break;
    case Reduction::Mean:
      // 0 / 0 = NaN when every position is ignored, as in PyTorch.
      loss = losses.sum(at::kDouble).div(weight_sum).to(input.scalar_type());
      break;
  }
  return {loss, lse, weight_sum.to(position_weights.scalar_type())};
}

at::Tensor grad_scale(const Problem& p, const at::Tensor& grad, const at::Tensor& total_weight) {
  const auto acc = total_weight.scalar_type();
  switch (p.reduction) {
    case Reduction::None:
      return grad.to(acc).contiguous();
    case Reduction::Sum:
      return grad.to(acc);
    case Reduction::Mean:
      break;
  }
  return grad.to(acc).div(total_weight);
}

at::Tensor weight_sum(const Problem& p, const at::Tensor& input,
                      const std::optional<at::Tensor>& weight) {
  const auto acc = acc_type(input);
  if (weight.has_value()) return weight->sum(acc);
  return at::full({}, static_cast<double>(p.C), input.options().dtype(acc));
}

namespace {

// Autograd in C++: the formula that torchkit/ops/label_smoothing_cross_entropy.py gives the
// torch.func transforms and forward-mode AD, without the Python a register_autograd formula runs on
// every call (~150 µs per forward and backward, a third of a 256 × 1000 batch's).
class LsceFunction : public torch::autograd::Function<LsceFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& input, const at::Tensor& target,
                                                const std::optional<at::Tensor>& weight,
                                                const c10::Scalar& ignore_index,
                                                c10::string_view reduction,
                                                const c10::Scalar& label_smoothing,
                                                const c10::Scalar& exclude_target) {
    static const auto op = op_handle<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
        const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const c10::Scalar&,
        c10::string_view, const c10::Scalar&, const c10::Scalar&)>(
        "torchkit::label_smoothing_cross_entropy");
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [loss, lse, total_weight] =
        op.call(input, target, weight, ignore_index, reduction, label_smoothing, exclude_target);
    // Only the inputs (no copies), per-position lse and the mean's denominator.
    ctx->save_for_backward({input, target, weight.value_or(at::Tensor()), lse, total_weight});
    ctx->mark_non_differentiable({lse, total_weight});  // what the backward needs
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["reduction"] = std::string(reduction);
    ctx->saved_data["label_smoothing"] = label_smoothing;
    ctx->saved_data["exclude_target"] = exclude_target;
    return {loss, lse, total_weight};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static const auto op = op_handle<at::Tensor(
        const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
        const at::Tensor&, const at::Tensor&, const c10::Scalar&, c10::string_view,
        const c10::Scalar&, const c10::Scalar&)>(
        "torchkit::_label_smoothing_cross_entropy_backward");
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &input = saved[0], &target = saved[1], &lse = saved[3], &tw = saved[4];
    const std::optional<at::Tensor> weight =
        saved[2].defined() ? std::optional<at::Tensor>(saved[2]) : std::nullopt;
    const std::string reduction = ctx->saved_data["reduction"].toStringRef();
    const c10::Scalar eps_arg = ctx->saved_data["label_smoothing"].toScalar();
    const c10::Scalar exclude_target_arg = ctx->saved_data["exclude_target"].toScalar();
    const double eps = eps_arg.toDouble();  // the forward's kernel checked their types
    const bool exclude_target = exclude_target_arg.toBool();
    const at::Tensor& grad = grads[0];  // materialised: zeros where the loss got none
    at::Tensor grad_input, grad_target;
    if (ctx->needs_input_grad(0)) {
      const BackwardOpGuard guard;
      grad_input =
          op.call(grad, input, target, weight, lse, tw, ctx->saved_data["ignore_index"].toScalar(),
                  reduction, eps_arg, exclude_target_arg);
    }
    if (ctx->needs_input_grad(1)) {
      // Probability targets only: ∂ℓ/∂p_c = a·w_c·(lse − x_c), a the target coefficient, times
      // the upstream gradient. lse − x_c = −log_softmax in float64, exact at any magnitude of
      // the logits (the saved lse minus x_c would round at it, and lose log Σ past 2⁵³).
      const int64_t class_dim = input.dim() == 1 ? 0 : 1;
      const int64_t C = input.size(class_dim);
      const double a = 1 - eps - (exclude_target && C > 1 ? eps / double(C - 1) : 0.0);
      at::Tensor scale = (reduction == "mean" ? grad / tw : grad).to(at::kDouble);
      if (reduction == "none") scale = scale.unsqueeze(class_dim);
      at::Tensor g = scale * a * at::log_softmax(input.to(at::kDouble), class_dim).neg_();
      if (weight.has_value()) {
        std::vector<int64_t> view(input.dim(), 1);
        view[class_dim] = C;
        g = g * weight->to(at::kDouble).view(view);
      }
      grad_target = g.to(target.scalar_type());
    }
    return {grad_input,   grad_target,  at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> label_smoothing_cross_entropy_autograd(
    const at::Tensor& input, const at::Tensor& target, const std::optional<at::Tensor>& weight,
    const c10::Scalar& ignore_index, c10::string_view reduction, const c10::Scalar& label_smoothing,
    const c10::Scalar& exclude_target) {
  // The backward gives weight no gradient; one that asks for it would silently get none.
  // Checked where a gradient is recorded (under no_grad nothing is asked).
  TK_CHECK_VALUE(kOp,
                 !(at::GradMode::is_enabled() && weight.has_value() && weight->requires_grad()),
                 "weight must not require grad (class weights are constants here), got a "
                 "weight with requires_grad=True; pass weight.detach()");
  auto out = LsceFunction::apply(input, target, weight, ignore_index, reduction, label_smoothing,
                                 exclude_target);
  return {out[0], out[1], out[2]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torchkit, m) {
  // Returns (loss, lse, total_weight); lse (per position, float64) and total_weight (the
  // mean's denominator) are what the backward needs besides the inputs.
  m.def(
      "label_smoothing_cross_entropy(Tensor input, Tensor target, Tensor? weight, Scalar "
      "ignore_index, str reduction, Scalar label_smoothing, Scalar exclude_target) -> (Tensor, "
      "Tensor, Tensor)");
  m.def(
      "_label_smoothing_cross_entropy_backward(Tensor grad, Tensor input, Tensor target, Tensor? "
      "weight, Tensor lse, Tensor total_weight, Scalar ignore_index, str reduction, Scalar "
      "label_smoothing, Scalar exclude_target) -> Tensor");
}

TORCH_LIBRARY_IMPL(torchkit, Autograd, m) {
  m.impl("label_smoothing_cross_entropy", &label_smoothing_cross_entropy_autograd);
}

}  // namespace torchkit::label_smoothing_cross_entropy
