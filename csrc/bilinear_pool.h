// Bilinear pooling with signed sqrt and L2 normalisation: the problem description, the
// elementwise maths both backends share, and the device-agnostic GEMM steps.
//
//   Z = x·yᵀ / HW  (N × D × E; y = x when None)      s = sign(Z)·sqrt(|Z| + sqrt_eps)
//   out = s / max(‖s‖, l2_eps)  per sample, flattened to (N, D·E)
//
// Saved for backward: x, y, out and the per-sample ‖s‖ (N values). Backward recovers
// |s| = |out|·max(‖s‖, l2_eps), so no N×D×E intermediate outlives the forward. The CPU
// computes a sample of extreme magnitude at a power-of-two scale and stores its norm as
// −‖s·2^h‖, the sign telling its backward to recompute the scale (bilinear_pool_cpu.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>
#include <c10/macros/Macros.h>

#include <cmath>
#include <functional>

namespace torchkit::bilinear_pool {

constexpr const char* kOp = "bilinear_pool";

struct Problem {
  int64_t N = 0, D = 0, E = 0, HW = 0;
  bool self = false;           // y is None: Z = x·xᵀ is symmetric
  bool channels_last = false;  // operands are read as (N, HW, D) rather than (N, D, HW)
  double sqrt_eps = 0, l2_eps = 0;
};

// sqrt_eps and l2_eps as the raw op's caller passed them (checks.h's scalar_float).
Problem check_inputs(const at::Tensor& x, const std::optional<at::Tensor>& y,
                     const c10::Scalar& sqrt_eps, const c10::Scalar& l2_eps);

// grad and out must be (N, D·E) of x's dtype, norm (N,) of the accumulation type.
void check_backward_inputs(const Problem& p, const at::Tensor& grad, const at::Tensor& x,
                           const at::Tensor& out, const at::Tensor& norm);

// x (and y) as (N, D, HW) / (N, E, HW) in the accumulation type: views when x already is
// float32/float64 (a transposed view for channels_last memory), float32 copies otherwise.
std::tuple<at::Tensor, at::Tensor> operands(const Problem& p, const at::Tensor& x,
                                            const std::optional<at::Tensor>& y);

// Samples the CPU computed at a power-of-two scale (bilinear_pool_cpu.cpp): the operands the
// backward's GEMMs take instead of x and y, and what multiplies each gradient (acc type,
// before the cast to the input's dtype; input 0 is x, 1 is y) back into the inputs' units.
struct ScaledOperands {
  at::Tensor a, b;
  std::function<void(at::Tensor& grad, int input)> unscale;
};

// dZ/HW (N, D, E; acc type; for `self` already the symmetrised dZ + dZᵀ) → gradients of
// x and y in their shapes, dtypes and memory formats, through one GEMM each, written into
// buffers from `empty` (the CPU backend passes one that prefaults them).
using EmptyFn = at::Tensor (*)(at::IntArrayRef, const at::TensorOptions&);
std::tuple<at::Tensor, at::Tensor> input_grads(const Problem& p, const at::Tensor& dz,
                                               const at::Tensor& x,
                                               const std::optional<at::Tensor>& y,
                                               std::array<bool, 2> output_mask, EmptyFn empty,
                                               const ScaledOperands* scaled = nullptr);

// Signed square root: 0 at exactly 0 (as the reference's sign() gives), NaN stays NaN.
template <typename T>
C10_HOST_DEVICE inline T signed_sqrt(T z, T eps) {
  return z > T(0) ? std::sqrt(z + eps) : (z < T(0) ? -std::sqrt(-z + eps) : (z == z ? T(0) : z));
}

// ∂L/∂Z for one entry, from the output o, its gradient g, the per-sample dot(o, g), the
// per-sample ‖s‖ and l2_eps: through the normalisation (F.normalize's clamp passes the
// gradient where ‖s‖ >= l2_eps) and the signed sqrt (1 / (2|s|), 0 where s = 0).
template <typename T>
C10_HOST_DEVICE inline T grad_z(T o, T g, T dot, T norm, T l2_eps) {
  if (o == T(0)) return T(0);
  const bool scaled = norm >= l2_eps;
  const T denom = scaled ? norm : l2_eps;
  const T ds = scaled ? (g - o * dot) / denom : g / denom;
  return ds / (T(2) * std::abs(o) * denom);
}

}  // namespace torchkit::bilinear_pool
