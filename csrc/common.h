// Small tensor helpers every op uses, on either backend.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/scalar_tensor.h>

#include <cmath>
#include <limits>

namespace torchkit {

// The type kernels accumulate in: float64 for float64 inputs, float32 for the others.
inline at::ScalarType acc_type(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// An upstream gradient as a backward kernel reads it: contiguous, or one value broadcast to
// every element. Losses such as d.sum() or d.mean() hand backward an expanded tensor (every
// stride 0); making that contiguous would write a full-size copy (measured on the CPU: 25 ms
// for a 4096² float32 cdist gradient) only to read it back, so the kernels read the one
// value. `stride` is the element stride to use: 1, or 0 for a broadcast value.
struct GradInput {
  at::Tensor tensor;
  int64_t stride;
};

inline GradInput grad_input(const at::Tensor& grad) {
  bool broadcast = grad.numel() > 1;
  for (int64_t s : grad.strides()) broadcast = broadcast && s == 0;
  if (broadcast) return {grad, 0};
  return {grad.contiguous(), 1};
}

// A 0-d tensor of `options`' dtype holding `value` as a cast to it rounds: past the dtype's
// range, ±inf, as a tensor cast gives and PyTorch's own sum of finite losses does
// (at::scalar_tensor refuses a finite double its type cannot hold).
inline at::Tensor scalar_of_type(double value, const at::TensorOptions& options) {
  // The largest finite value, and the magnitude from which round to nearest gives inf.
  double max = 0, overflow = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, options.dtype().toScalarType(), "scalar_of_type", [&] {
        using limits = std::numeric_limits<scalar_t>;
        max = static_cast<double>(limits::max());
        overflow = std::ldexp(2.0 - std::ldexp(1.0, -limits::digits), limits::max_exponent - 1);
      });
  const double magnitude = std::abs(value);
  if (magnitude > max) value = std::copysign(magnitude >= overflow ? INFINITY : max, value);
  return at::scalar_tensor(value, options);
}

}  // namespace torchkit
