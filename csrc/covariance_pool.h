// Covariance pooling with iterative matrix square-root normalisation (iSQRT-COV, Li et al.,
// CVPR 2018; fast-MPN-COV's Covpool → Sqrtm → Triuvec), fused.
//
//   Σ = (1/M)·Xc·Xcᵀ, Xc = X − mean over the M = H·W positions        (N × D × D)
//   sqrt: A = Σ / tr Σ;  T₀ = ½(3I − A), Y₀ = A·T₀, Z₀ = T₀;
//         Tᵢ = ½(3I − Zᵢ₋₁Yᵢ₋₁), Yᵢ = Yᵢ₋₁Tᵢ, Zᵢ = TᵢZᵢ₋₁   (i = 1 … n − 2);
//         F = ½·Y(3I − Z·Y) with the last Y, Z (n = 1: F = A·T₀);  out = √tr Σ · F
//   triu: the upper triangle with the diagonal, row-major, (N, D(D+1)/2)
//
// Scaling: each sample's Xc is divided by a power of two s near its largest |entry| before
// the GEMM, so Σ̃ = Σ / s² neither overflows nor underflows for any finite input (float32's
// Σ overflows for features past ~1e19) and is otherwise bitwise what the unscaled product
// gives. The square root is homogeneous: out = s·√tr Σ̃·F(Σ̃ / tr Σ̃) (s² · Σ̃ without sqrt).
//
// Saved for backward: x, Σ̃ (D² per sample) and s. The backward recomputes what it needs
// from Σ̃: the Newton–Schulz iterates for the adjoint chain (CUDA, and small problems on the
// CPU), or A's eigendecomposition for the spectral form of the same gradient (CPU).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>

#include <functional>
#include <optional>

namespace torchkit::covariance_pool {

constexpr const char* kOp = "covariance_pool";

// The most Newton–Schulz steps a call may ask for. 51 take the smallest eigenvalue float64
// resolves (1e-16 of the trace) to its square root; a bound turns a mistyped count (2**40)
// into an error instead of a call that never returns.
constexpr int64_t kMaxIterations = 100;

struct Problem {
  int64_t N = 0, D = 0, M = 0;
  int64_t iterations = 0;
  bool sqrt = true, triu = true;
  bool channels_last = false;  // a 4-D input read as (N, M, D) rows rather than (N, D, M)
};

Problem check_inputs(const at::Tensor& x, const c10::Scalar& iterations, const c10::Scalar& sqrt,
                     const c10::Scalar& triu);

void check_backward_inputs(const Problem& p, const at::Tensor& grad, const at::Tensor& x,
                           const at::Tensor& sigma, const at::Tensor& scale);

// C = alpha·A·B + beta·S + gamma·I over the batch, for A·B known to be symmetric (A and B are
// polynomials in the same symmetric matrix): a backend may compute half of it and mirror.
// S may be undefined (then beta is ignored).
using SymmetricProduct =
    std::function<at::Tensor(const at::Tensor& A, const at::Tensor& B, double alpha,
                             const at::Tensor& S, double beta, double gamma)>;

// For the Newton–Schulz polynomial F of n iterations (A symmetric, Gf any N × D × D): the
// gradient of <Gf, F(A)> with respect to A, and <Gf, F(A)> per sample (N,).
using SqrtmBackward = std::function<std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor& A, const at::Tensor& Gf, int64_t iterations)>;

// X̃c = (X − mean over the positions) / s as (N, D, M) in the accumulation type (a view of
// (N, M, D) memory for channels_last inputs), and s (N,): a power of two per sample with
// max|Xc| / s in [1, 2), the max over the channels free of NaN and ±∞ (1 where it is 0), or
// `scale` where it is given (the backward's recomputation of the forward's X̃c).
using Centre = std::function<std::tuple<at::Tensor, at::Tensor>(
    const Problem& p, const at::Tensor& x, const std::optional<at::Tensor>& scale)>;

struct Backend {
  Centre centre;
  SymmetricProduct product;
  SqrtmBackward sqrtm_backward;
};

// Returns (out, Σ̃, s): out of x's dtype, Σ̃ (N, D, D) and s (N,) of the accumulation type.
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(const Problem& p, const at::Tensor& x,
                                                       const Backend& backend);

// The gradient of x, in x's shape, dtype and memory format.
at::Tensor backward(const Problem& p, const at::Tensor& grad, const at::Tensor& x,
                    const at::Tensor& sigma, const at::Tensor& scale, const Backend& backend);

// x as (N, D, M), without a copy where the memory allows it ((N, M, D) memory for
// channels_last inputs).
at::Tensor positions(const Problem& p, const at::Tensor& x);

// The portable pieces, in ATen ops.
std::tuple<at::Tensor, at::Tensor> centre_aten(const Problem& p, const at::Tensor& x,
                                               const std::optional<at::Tensor>& scale);
at::Tensor symmetric_product_bmm(const at::Tensor& A, const at::Tensor& B, double alpha,
                                 const at::Tensor& S, double beta, double gamma);
// The adjoint chain through the recomputed iterates: 6 GEMMs per iteration.
std::tuple<at::Tensor, at::Tensor> sqrtm_backward_chain(const at::Tensor& A, const at::Tensor& Gf,
                                                        int64_t iterations);

}  // namespace torchkit::covariance_pool
