// Small tensor helpers every op uses, on either backend.
#pragma once

#include <ATen/core/Tensor.h>

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

}  // namespace torchkit
