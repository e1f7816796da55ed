// Label-smoothing cross-entropy: what the schema file shares with the CPU and CUDA kernels.
//
// Every supported form reduces to one per-position formula. With logits x (C classes),
// lse = log Σ_c exp(x_c), class weights w (all 1 when absent) and a smoothed target
// distribution q, the loss at a position is
//     ℓ = Σ_c w_c q_c (lse − x_c)
// where, for a class-index target t and a probability target p respectively,
//     q_c = a·[c = t] + b        q_c = a·p_c + b
// with (a, b) = (1 − ε, ε/C) for PyTorch's convention and (1 − ε − ε/(C−1), ε/(C−1)) for the
// cookbook's (exclude_target=True: the target gets 1 − ε, every other class ε/(C−1)).
// The gradient is ∂ℓ/∂x_c = K·softmax_c − w_c q_c with K = Σ_c w_c q_c.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>
#include <c10/macros/Macros.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <limits>

#include <tuple>
#include <type_traits>

namespace torchkit::label_smoothing_cross_entropy {

constexpr const char* kOp = "label_smoothing_cross_entropy";

enum class Reduction { None, Mean, Sum };

// The input viewed as (N, C, S): S = 1 for (N, C) and (C); S = d1·…·dk for (N, C, d1, …, dk).
struct Problem {
  int64_t N = 0, C = 0, S = 0;
  bool prob_target = false;
  Reduction reduction = Reduction::Mean;
  int64_t ignore_index = -100;
  double a = 1.0, b = 0.0;
};

// Validates the arguments (each message names the argument, the expectation and the value)
// and describes the problem. Shared by both backends; index range checks are the kernels'.
Problem check_inputs(const at::Tensor& input, const at::Tensor& target,
                     const std::optional<at::Tensor>& weight, const c10::Scalar& ignore_index,
                     c10::string_view reduction, const c10::Scalar& label_smoothing,
                     const c10::Scalar& exclude_target);

// The backward's own arguments, checked against the forward's problem: grad has the loss's
// shape (the positions for 'none', 0-d otherwise), lse the positions' shape in the
// accumulation type, total_weight is 0-d in that type; all on the input's device. The
// kernels index them by position, so a wrong size would read outside them.
void check_backward_inputs(const Problem& p, const at::Tensor& input, const at::Tensor& grad,
                           const at::Tensor& lse, const at::Tensor& total_weight);

// Per-position outputs every forward kernel fills: (lse, loss, weight of the position in a
// mean: w_t for a kept index target, 0 for an ignored one, 1 for a probability target),
// shaped as the positions ((), (N,) or (N, d1, …, dk)). lse is float64 (see split_lse); the
// others are in the accumulation type (float32, or float64 for float64 input).
std::tuple<at::Tensor, at::Tensor, at::Tensor> allocate_positions(const Problem& p,
                                                                  const at::Tensor& input);

// The op's outputs from the per-position losses: (loss in the reduction's shape and the
// input's dtype, lse, total weight). Device tensor ops only: no host synchronisation.
std::tuple<at::Tensor, at::Tensor, at::Tensor> reduce(const Problem& p, const at::Tensor& input,
                                                      const at::Tensor& lse,
                                                      const at::Tensor& losses,
                                                      const at::Tensor& position_weights);

// The per-position upstream gradient scale for the backward kernels, in the accumulation
// type: grad for 'none' (positions-shaped), grad for 'sum' and grad / total_weight for
// 'mean' (0-d, broadcast by the kernels).
at::Tensor grad_scale(const Problem& p, const at::Tensor& grad, const at::Tensor& total_weight);

// Σ_c w_c as a 0-d accumulation-type tensor on the input's device (C when weight is absent).
at::Tensor weight_sum(const Problem& p, const at::Tensor& input,
                      const std::optional<at::Tensor>& weight);

// Shift invariance, shared by both backends' kernels. The loss and its gradient depend only on
// differences of logits, and the kernels keep it so: sums run relative to the maximum, and
// the backward never subtracts a rounded absolute log-sum-exp.

C10_HOST_DEVICE inline float lowest_finite(float) { return -FLT_MAX; }
C10_HOST_DEVICE inline double lowest_finite(double) { return -DBL_MAX; }

// The reference sums are kept relative to: the maximum, or the lowest finite value while every
// logit seen is −∞, so that exp(x − r) is 0 there and no −∞ − (−∞) = NaN arises. NaN stays NaN.
template <typename acc_t>
C10_HOST_DEVICE inline acc_t shift_ref(acc_t max) {
  const acc_t lowest = lowest_finite(max);
  return max < lowest ? lowest : max;
}

// lse = hi + lo, hi in the accumulation type: the backward takes exp((x − hi) − lo), where
// x − hi is exact near the maximum. exp(x − fl(lse)) would be off by up to ulp(lse)/2 in the
// exponent: 3 % at logits of 10⁶ in float32. ±∞ and NaN are carried by hi alone.
template <typename acc_t>
struct SplitLse {
  acc_t hi, lo;
};

template <typename acc_t>
C10_HOST_DEVICE inline SplitLse<acc_t> split_lse(double lse) {
  const acc_t hi = static_cast<acc_t>(lse);
  const double rest = lse - static_cast<double>(hi);
  return {hi, rest == rest ? static_cast<acc_t>(rest) : acc_t(0)};
}

// The saved lse is one float64, max + log Σ exp(x − max) rounded: it errs by up to
// |lse|·2⁻⁵³, an error in every softmax's exponent, and past |lse| ≈ 2⁵³ it has lost log Σ
// (≤ log C) altogether: a row of equal logits of 10¹⁸ would get softmax 1 for every class
// instead of 1/C. Where |lse| reaches kCoarseLse (an error of 2⁻²⁹ in float32's exponent,
// 2⁻⁴¹ in float64's), the backward recomputes the row's max and log Σ from its logits
// instead (exact_lse on the CPU, row_split and position_split on CUDA), a pass over the row;
// ordinary logits never come near it.
template <typename acc_t>
constexpr double kCoarseLse = std::is_same_v<acc_t, float> ? 0x1p24 : 0x1p12;

template <typename acc_t>
C10_HOST_DEVICE inline bool coarse_lse(double lse) {
  return (lse < 0 ? -lse : lse) >= kCoarseLse<acc_t> && lse - lse == 0;  // finite and large
}

// hi = the maximum of n logits (`stride` apart), lo = log Σ exp(x − hi): the log-sum-exp
// split exactly, from the logits themselves. The shift is shift_ref's, as the forward's.
template <typename acc_t, typename T>
SplitLse<acc_t> exact_lse(const T* x, int64_t n, int64_t stride) {
  acc_t max = -std::numeric_limits<acc_t>::infinity();
  for (int64_t c = 0; c < n; ++c) max = std::max(max, static_cast<acc_t>(x[c * stride]));
  const acc_t ref = shift_ref(max);
  double sum = 0;  // float64: a long row's sequential sum would round in float32
  for (int64_t c = 0; c < n; ++c) sum += std::exp(static_cast<acc_t>(x[c * stride]) - ref);
  return {ref, static_cast<acc_t>(std::log(sum))};
}

// Kernel dispatch shared by both backends.

template <typename F>
void with_bool(bool value, F&& f) {
  if (value) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

template <typename T>
struct Type {
  using type = T;
};

// Calls f(Type<scalar_t>, Type<index_t>, kWeight, kProb) with the problem's types as
// compile-time arguments (C++17: torch 2.4 builds extensions without C++20's template lambdas).
template <typename F>
void dispatch(const Problem& p, const at::Tensor& input, const at::Tensor& target, bool has_weight,
              F&& f) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), kOp, [&] {
    with_bool(has_weight, [&](auto weighted) {
      if (p.prob_target) {
        f(Type<scalar_t>{}, Type<int64_t>{}, weighted, std::true_type{});
      } else if (target.scalar_type() == at::kInt) {
        f(Type<scalar_t>{}, Type<int32_t>{}, weighted, std::false_type{});
      } else {
        f(Type<scalar_t>{}, Type<int64_t>{}, weighted, std::false_type{});
      }
    });
  });
}

}  // namespace torchkit::label_smoothing_cross_entropy
