// Covariance pooling on CUDA: cuBLAS batched GEMMs throughout (the ½(3I − ·) updates in
// their alpha/beta), the backward through the Newton–Schulz adjoint chain: on the GPU its
// GEMMs cost less than one batched eigendecomposition. No host synchronisation.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "covariance_pool.h"

namespace torchkit::covariance_pool {
namespace {

using at::Tensor;

const Backend kBackend{centre_aten, symmetric_product_bmm, sqrtm_backward_chain};

std::tuple<Tensor, Tensor, Tensor> covariance_pool_cuda(const Tensor& x,
                                                        const c10::Scalar& iterations,
                                                        const c10::Scalar& sqrt,
                                                        const c10::Scalar& triu) {
  const Problem p = check_inputs(x, iterations, sqrt, triu);
  const c10::cuda::CUDAGuard guard(x.device());
  return forward(p, x, kBackend);
}

Tensor covariance_pool_backward_cuda(const Tensor& grad, const Tensor& x, const Tensor& sigma,
                                     const Tensor& scale, const c10::Scalar& iterations,
                                     const c10::Scalar& sqrt, const c10::Scalar& triu) {
  const Problem p = check_inputs(x, iterations, sqrt, triu);
  check_backward_inputs(p, grad, x, sigma, scale);
  const c10::cuda::CUDAGuard guard(x.device());
  return backward(p, grad, x, sigma, scale, kBackend);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchkit, CUDA, m) {
  m.impl("covariance_pool", &covariance_pool_cuda);
  m.impl("_covariance_pool_backward", &covariance_pool_backward_cuda);
}

}  // namespace torchkit::covariance_pool
