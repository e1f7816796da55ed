// Label-smoothing cross-entropy: schemas, input checks and the device-agnostic reduction.
#include "label_smoothing_ce.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include "checks.h"
#include "common.h"

namespace torchkit::lsce {

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

}  // namespace

Problem check_inputs(const at::Tensor& input, const at::Tensor& target,
                     const std::optional<at::Tensor>& weight, int64_t ignore_index,
                     c10::string_view reduction, double label_smoothing, bool exclude_target) {
  Problem p;
  p.reduction = parse_reduction(reduction);
  p.ignore_index = ignore_index;
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
  const auto positions = position_shape(input);
  if (p.prob_target) {
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
  if (weight.has_value()) {
    const auto& w = *weight;
    TK_CHECK_VALUE(kOp, w.dim() == 1 && w.size(0) == p.C, "weight must have shape (C,) = (", p.C,
                   ",), got ", w.sizes());
    check_same_dtype(kOp, "input", input, "weight", w);
    check_same_device(kOp, "input", input, "weight", w);
  }

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

TORCH_LIBRARY_FRAGMENT(torchkit, m) {
  // Returns (loss, lse, total_weight); lse (per position, float64) and total_weight (the
  // mean's denominator) are what the backward needs besides the inputs.
  m.def(
      "label_smoothing_cross_entropy(Tensor input, Tensor target, Tensor? weight, int "
      "ignore_index, str reduction, float label_smoothing, bool exclude_target) -> (Tensor, "
      "Tensor, Tensor)");
  m.def(
      "_label_smoothing_cross_entropy_backward(Tensor grad, Tensor input, Tensor target, Tensor? "
      "weight, Tensor lse, Tensor total_weight, int ignore_index, str reduction, float "
      "label_smoothing, bool exclude_target) -> Tensor");
}

}  // namespace torchkit::lsce
