// Covariance pooling: schemas, input checks, and the device-agnostic steps (centring and
// scaling, the Newton–Schulz chain and its adjoint, the trace's terms, the triangle).
#include "covariance_pool.h"

#include <ATen/ATen.h>
#include <c10/util/safe_numerics.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <vector>

#include "autograd.h"
#include "blas.h"
#include "checks.h"
#include "common.h"

namespace torchkit::covariance_pool {

namespace {

using at::Tensor;

Tensor per_sample(const Tensor& v) { return v.view({v.size(0), 1, 1}); }

Tensor batch_trace(const Tensor& m) { return m.diagonal(0, 1, 2).sum(-1); }

// 1 / tr, and 0 for a zero trace (all features constant: Σ = 0, whose square root is 0).
Tensor inverse_trace(const Tensor& tr) {
  return at::where(tr == 0, at::zeros_like(tr), tr.reciprocal());
}

// alpha·m + beta·I.
Tensor shifted(const Tensor& m, double alpha, double beta) {
  Tensor t = m.mul(alpha);
  t.diagonal(0, 1, 2).add_(beta);
  return t;
}

// The Newton–Schulz polynomial F(A). With `keep`, also what the adjoint chain reads:
// Y₀ … Y_{n−2}, Z₀ … Z_{n−2}, T₁ … T_{n−2} and W = Z·Y (the final product's factor).
struct Iterates {
  std::vector<Tensor> Y, Z, T;
  Tensor W;
};

Tensor newton_schulz(const Tensor& A, int64_t n, const SymmetricProduct& product, Iterates* keep) {
  // T₀ = ½(3I − A), Y₀ = A·T₀ = 1.5·A − 0.5·A·A.
  Tensor Y = product(A, A, -0.5, A, 1.5, 0.0);
  if (n == 1) return Y;
  Tensor Z = shifted(A, -0.5, 1.5);
  if (keep) keep->Y = {Y}, keep->Z = {Z};
  for (int64_t i = 1; i <= n - 2; ++i) {
    const Tensor T = product(Z, Y, -0.5, Tensor(), 0.0, 1.5);
    Y = product(Y, T, 1.0, Tensor(), 0.0, 0.0);
    Z = product(T, Z, 1.0, Tensor(), 0.0, 0.0);
    if (keep) keep->T.push_back(T), keep->Y.push_back(Y), keep->Z.push_back(Z);
  }
  const Tensor W = product(Z, Y, 1.0, Tensor(), 0.0, 0.0);
  if (keep) keep->W = W;
  return product(Y, W, -0.5, Y, 1.5, 0.0);  // ½·Y(3I − Z·Y)
}

// The gradient (N, D, D) in the layout of the output: zeros below the diagonal for triu.
Tensor full_grad(const Problem& p, const Tensor& grad, at::ScalarType acc) {
  const Tensor g = grad.to(acc);
  if (!p.triu) return g.reshape({p.N, p.D, p.D});
  Tensor full = at::zeros({p.N, p.D * p.D}, g.options());
  const Tensor rc = at::triu_indices(p.D, p.D, 0, g.options().dtype(at::kLong));
  full.index_copy_(1, rc[0] * p.D + rc[1], g);
  return full.view({p.N, p.D, p.D});
}

Tensor pack(const Problem& p, const Tensor& m) {
  if (!p.triu) return m;
  const Tensor rc = at::triu_indices(p.D, p.D, 0, m.options().dtype(at::kLong));
  return m.reshape({p.N, p.D * p.D}).index_select(1, rc[0] * p.D + rc[1]);
}

}  // namespace

Problem check_inputs(const at::Tensor& x, const c10::Scalar& iterations_arg,
                     const c10::Scalar& sqrt, const c10::Scalar& triu) {
  Problem p;
  const int64_t iterations = p.iterations = scalar_int(kOp, "iterations", iterations_arg);
  p.sqrt = scalar_bool(kOp, "sqrt", sqrt);
  p.triu = scalar_bool(kOp, "triu", triu);
  check_floating(kOp, "x", x);
  TK_CHECK_VALUE(kOp, x.dim() == 3 || x.dim() == 4,
                 "x must be a feature map (N, D, H, W) or (N, D, M), got shape ", x.sizes());
  TK_CHECK_VALUE(kOp, iterations >= 1 && iterations <= kMaxIterations,
                 "iterations must be between 1 and ", kMaxIterations, ", got ", iterations);
  p.N = x.size(0);
  p.D = x.size(1);
  p.M = x.size(2);
  TK_CHECK_VALUE(kOp, x.dim() == 3 || !c10::mul_overflows(x.size(2), x.size(3), &p.M),
                 "x's H·W overflows int64, got shape ", x.sizes());
  TK_CHECK_VALUE(kOp, p.M > 0,
                 "x must have at least one spatial position (H·W > 0): the covariance is an "
                 "average over them; got shape ",
                 x.sizes());
  int64_t dd = 0, ndd = 0;
  TK_CHECK_VALUE(kOp, !c10::mul_overflows(p.D, p.D, &dd) && !c10::mul_overflows(p.N, dd, &ndd),
                 "N·D·D (the covariances' size) must fit int64 indexing, got N = ", p.N,
                 ", D = ", p.D);
  p.channels_last =
      x.dim() == 4 && x.is_contiguous(at::MemoryFormat::ChannelsLast) && !x.is_contiguous();
  return p;
}

void check_backward_inputs(const Problem& p, const at::Tensor& grad, const at::Tensor& x,
                           const at::Tensor& sigma, const at::Tensor& scale) {
  const std::vector<int64_t> out_shape =
      p.triu ? std::vector<int64_t>{p.N, p.D * (p.D + 1) / 2} : std::vector<int64_t>{p.N, p.D, p.D};
  TK_CHECK_VALUE(kOp, grad.sizes() == c10::IntArrayRef(out_shape),
                 "backward: grad must have the output's shape ", c10::IntArrayRef(out_shape),
                 ", got ", grad.sizes());
  const auto acc = acc_type(x);
  TK_CHECK_VALUE(kOp,
                 sigma.dim() == 3 && sigma.size(0) == p.N && sigma.size(1) == p.D &&
                     sigma.size(2) == p.D && sigma.scalar_type() == acc,
                 "backward: sigma must be (N, D, D) = (", p.N, ", ", p.D, ", ", p.D, ") of ", acc,
                 ", got ", sigma.sizes(), " of ", sigma.scalar_type());
  TK_CHECK_VALUE(kOp, scale.dim() == 1 && scale.size(0) == p.N && scale.scalar_type() == acc,
                 "backward: scale must be (N,) = (", p.N, ",) of ", acc, ", got ", scale.sizes(),
                 " of ", scale.scalar_type());
  check_same_dtype(kOp, "x", x, "grad", grad);
  check_same_device(kOp, "x", x, "grad", grad);
  check_same_device(kOp, "x", x, "sigma", sigma);
  check_same_device(kOp, "x", x, "scale", scale);
}

at::Tensor positions(const Problem& p, const at::Tensor& x) {
  if (x.dim() == 3) return x;
  if (p.channels_last) return x.permute({0, 2, 3, 1}).reshape({p.N, p.M, p.D}).transpose(1, 2);
  return x.reshape({p.N, p.D, p.M});
}

std::tuple<at::Tensor, at::Tensor> centre_aten(const Problem& p, const at::Tensor& x,
                                               const std::optional<at::Tensor>& scale) {
  const Tensor a = positions(p, x).to(acc_type(x));
  // The mean summed and subtracted in float64, so that each centred value is rounded once
  // (cpu/covariance_pool_cpu.cpp's ChannelStats says why); M·max|x| may overflow float32.
  // A constant channel's mean must be exact: float32's float64 sum is (below 2^29
  // positions); float64's is formed as the first position plus the mean of the differences
  // from it, as the CPU's is.
  Tensor mean;
  if (a.scalar_type() == at::kDouble) {
    const Tensor x0 = a.narrow(2, 0, 1);
    mean = x0 + (a - x0).mean({2}, /*keepdim=*/true);
  } else {
    mean = a.mean({2}, /*keepdim=*/true, at::kDouble);
  }
  Tensor xc = (a - mean).to(a.scalar_type());
  Tensor s;
  if (scale.has_value()) {
    s = *scale;
  } else {
    // Dividing by a power of two is exact; 0 (constant features) keeps s = 1. NaN and ±∞
    // have no say in the scale of the sample's other channels.
    const Tensor m = xc.abs().nan_to_num_(0, 0, 0).amax({1, 2});
    const auto [mantissa, exponent] = at::frexp(m);
    s = at::where(at::isfinite(m) & (m > 0), at::ldexp(at::ones_like(m), exponent - 1),
                  at::ones_like(m));
  }
  xc.div_(per_sample(s));
  return {xc, s};
}

at::Tensor symmetric_product_bmm(const at::Tensor& A, const at::Tensor& B, double alpha,
                                 const at::Tensor& S, double beta, double gamma) {
  Tensor C = S.defined() ? blas::baddbmm(S, A, B, beta, alpha) : blas::bmm(A, B);
  if (!S.defined() && alpha != 1.0) C.mul_(alpha);
  if (gamma != 0.0) C.diagonal(0, 1, 2).add_(gamma);
  return C;
}

std::tuple<at::Tensor, at::Tensor> sqrtm_backward_chain(const at::Tensor& A, const at::Tensor& Gf,
                                                        int64_t n) {
  Iterates it;
  const Tensor F = newton_schulz(A, n, symmetric_product_bmm, n > 1 ? &it : nullptr);
  // Reverse through F = ½·Y(3I − W), W = Z·Y; then each Yᵢ = Yᵢ₋₁Tᵢ, Zᵢ = TᵢZᵢ₋₁,
  // Tᵢ = ½(3I − Zᵢ₋₁Yᵢ₋₁); then Y₀ = A·T₀, Z₀ = T₀, T₀ = ½(3I − A). Every forward matrix is
  // symmetric, so the adjoints need no transposes.
  Tensor gY = Gf, gZ = at::zeros_like(Gf);
  if (n > 1) {
    const Tensor& Y = it.Y.back();
    const Tensor gW = blas::bmm(Y, Gf).mul_(-0.5);
    gY = blas::baddbmm_(blas::baddbmm(Gf, Gf, it.W, 1.5, -0.5), it.Z.back(), gW);
    gZ = blas::bmm(gW, Y);
    for (int64_t i = n - 2; i >= 1; --i) {
      const Tensor &T = it.T[i - 1], &Yp = it.Y[i - 1], &Zp = it.Z[i - 1];
      const Tensor gT = blas::baddbmm_(blas::bmm(Yp, gY), gZ, Zp);
      Tensor gYp = blas::baddbmm_(blas::bmm(gY, T), Zp, gT, 1.0, -0.5);
      gZ = blas::baddbmm_(blas::bmm(T, gZ), gT, Yp, 1.0, -0.5);
      gY = std::move(gYp);
    }
  }
  const Tensor T0 = shifted(A, -0.5, 1.5);
  const Tensor gT0 = blas::baddbmm(gZ, A, gY);
  Tensor gA = blas::bmm(gY, T0).add_(gT0, -0.5);
  return {gA, (Gf * F).sum({1, 2})};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(const Problem& p, const at::Tensor& x,
                                                       const Backend& backend) {
  const SymmetricProduct& product = backend.product;
  const auto acc = acc_type(x);
  const auto opts = x.options().dtype(acc);
  const std::vector<int64_t> out_shape =
      p.triu ? std::vector<int64_t>{p.N, p.D * (p.D + 1) / 2} : std::vector<int64_t>{p.N, p.D, p.D};
  if (p.N == 0 || p.D == 0) {
    return {at::zeros(out_shape, x.options()), at::zeros({p.N, p.D, p.D}, opts),
            at::ones({p.N}, opts)};
  }
  auto [xc, s] = backend.centre(p, x, std::nullopt);
  const Tensor sigma =
      product(xc, xc.transpose(1, 2), 1.0 / static_cast<double>(p.M), Tensor(), 0.0, 0.0);
  xc = Tensor();  // the largest temporary: gone before the iteration's buffers
  if (!p.sqrt) {
    // Σ = s·(s·Σ̃), one power of two at a time (each exact): s² alone overflows (float32
    // features past ~1.8e19) where Σ is representable, and 0·inf would make the zero
    // covariances NaN. The triangle is packed first, so both passes read half the matrix.
    const Tensor f = p.triu ? s.view({p.N, 1}) : per_sample(s);
    Tensor out = p.triu ? pack(p, sigma).mul_(f) : sigma * f;
    return {out.mul_(f).to(x.scalar_type()), sigma, s};
  }
  const Tensor tr = batch_trace(sigma);
  const Tensor A = sigma * per_sample(inverse_trace(tr));
  const Tensor out =
      newton_schulz(A, p.iterations, product, nullptr).mul_(per_sample(s * tr.sqrt()));
  return {pack(p, out).to(x.scalar_type()), sigma, s};
}

at::Tensor backward(const Problem& p, const at::Tensor& grad, const at::Tensor& x,
                    const at::Tensor& sigma, const at::Tensor& scale, const Backend& backend) {
  if (p.N == 0 || p.D == 0) return at::zeros_like(x);
  const auto acc = acc_type(x);
  const Tensor G = full_grad(p, grad, acc);
  // gsigma = ∂L/∂Σ̃ / s, so that ∂L/∂Xc = (gsigma + gsigmaᵀ)·X̃c / M with X̃c = Xc / s.
  Tensor gsigma;
  if (!p.sqrt) {
    gsigma = G * per_sample(scale);  // out = s²·Σ̃: ∂L/∂Σ̃ = s²·G
  } else {
    // out = s·r·F(A), r = √tr Σ̃, A = Σ̃ / tr Σ̃: ∂L/∂Σ̃ is s times the gradient through
    // r·F(A) of G.
    const Tensor tr = batch_trace(sigma);
    const Tensor inv = inverse_trace(tr);
    const Tensor A = sigma * per_sample(inv);
    const auto [gA, dot] = backend.sqrtm_backward(A, G * per_sample(tr.sqrt()), p.iterations);
    // d√tr / dΣ̃ = I / (2√tr); d(Σ̃ / tr) / dΣ̃ gives gA / tr − <gA, A> / tr · I.
    const Tensor diag = (0.5 * dot - (gA * A).sum({1, 2})) * inv;
    gsigma = gA * per_sample(inv);
    gsigma.diagonal(0, 1, 2).add_(diag.unsqueeze(1));
  }
  const Tensor gsym = (gsigma + gsigma.transpose(1, 2)).div_(static_cast<double>(p.M));
  const Tensor xc = std::get<0>(backend.centre(p, x, scale));
  // Xc's rows sum to zero, so (gsym·Xc)'s do too: the gradient through the mean is zero.
  if (p.channels_last) {  // (gsym·X̃c)ᵀ = X̃cᵀ·gsym: (N, M, D) rows, as x is laid out
    return blas::bmm(xc.transpose(1, 2), gsym)
        .view({p.N, x.size(2), x.size(3), p.D})
        .permute({0, 3, 1, 2})
        .to(x.scalar_type());
  }
  return blas::bmm(gsym, xc).view(x.sizes()).to(x.scalar_type());
}

namespace {

// Autograd in C++: the formula that torchkit/ops/covariance_pool.py gives the torch.func
// transforms, without the Python a register_autograd formula runs on every call.
class CovariancePoolFunction : public torch::autograd::Function<CovariancePoolFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& x, const c10::Scalar& iterations,
                                                const c10::Scalar& sqrt, const c10::Scalar& triu) {
    static const auto op = op_handle<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
        const at::Tensor&, const c10::Scalar&, const c10::Scalar&, const c10::Scalar&)>(
        "torchkit::covariance_pool");
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, sigma, scale] = op.call(x, iterations, sqrt, triu);
    ctx->save_for_backward({x, sigma, scale});     // x, one D×D matrix and one scale per sample
    ctx->mark_non_differentiable({sigma, scale});  // what the backward needs, not results
    ctx->saved_data["iterations"] = iterations;
    ctx->saved_data["sqrt"] = sqrt;
    ctx->saved_data["triu"] = triu;
    return {out, sigma, scale};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static const auto op =
        op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const c10::Scalar&, const c10::Scalar&,
                             const c10::Scalar&)>("torchkit::_covariance_pool_backward");
    const auto saved = ctx->get_saved_variables();
    const BackwardOpGuard guard;
    at::Tensor gx =
        op.call(grads[0], saved[0], saved[1], saved[2], ctx->saved_data["iterations"].toScalar(),
                ctx->saved_data["sqrt"].toScalar(), ctx->saved_data["triu"].toScalar());
    return {gx, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> covariance_pool_autograd(
    const at::Tensor& x, const c10::Scalar& iterations, const c10::Scalar& sqrt,
    const c10::Scalar& triu) {
  auto out = CovariancePoolFunction::apply(x, iterations, sqrt, triu);
  return {out[0], out[1], out[2]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torchkit, m) {
  // Returns (out, sigma, scale): the pooled feature in x's dtype, then what the backward
  // needs besides x, in the accumulation type: Σ̃ = Σ / s² (N, D, D) and s (N,).
  m.def(
      "covariance_pool(Tensor x, Scalar iterations, Scalar sqrt, Scalar triu) -> (Tensor, "
      "Tensor, Tensor)");
  m.def(
      "_covariance_pool_backward(Tensor grad, Tensor x, Tensor sigma, Tensor scale, Scalar "
      "iterations, Scalar sqrt, Scalar triu) -> Tensor");
}

TORCH_LIBRARY_IMPL(torchkit, Autograd, m) { m.impl("covariance_pool", &covariance_pool_autograd); }

}  // namespace torchkit::covariance_pool
