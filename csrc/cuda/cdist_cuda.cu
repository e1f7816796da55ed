// Pairwise Euclidean distance on CUDA: cuBLAS for the product of the centred sets (float32
// for reduced types; TF32 only where the user enabled it for matmuls), then one epilogue
// kernel over the output. Backward: one kernel forms G' = grad / dist, then two batched GEMMs.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>

#include "cdist.h"
#include "common.h"
#include "cuda/launch.h"

namespace torchkit::cdist {
namespace {

using at::Tensor;

constexpr int kThreads = 256;

// d² = n_a + n_b − 2g per entry (g the GEMM's a·b), refined where cancellation struck,
// clamped, square-rooted unless squared; 0 on the diagonal for self-distances.
template <typename scalar_t, typename acc_t>
__global__ void epilogue_kernel(const acc_t* g, scalar_t* out,  // may alias
                                const acc_t* __restrict__ n1, const acc_t* __restrict__ n2,
                                const acc_t* __restrict__ raw1, const acc_t* __restrict__ raw2,
                                int64_t P, int64_t R, int64_t M, int64_t total, bool squared,
                                bool self) {
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = idx % R, row = idx / R;  // row = b·P + i
    const int64_t b = row / P, i = row % P;
    const acc_t na = n1[row], nb = n2[b * R + j];
    acc_t d2 = na + nb - acc_t(2) * g[idx];
    if (d2 * acc_t(kRefineRatio) < na + nb) {
      const acc_t* a = raw1 + row * M;
      const acc_t* c = raw2 + (b * R + j) * M;
      acc_t s = 0;
      for (int64_t k = 0; k < M; ++k) s += (a[k] - c[k]) * (a[k] - c[k]);
      d2 = s;
    }
    if (self && i == j) d2 = 0;
    d2 = d2 > acc_t(0) ? d2 : acc_t(0);
    out[idx] = static_cast<scalar_t>(squared ? d2 : sqrt(d2));
  }
}

Tensor forward_cuda(const Tensor& x1, const std::optional<Tensor>& x2, bool squared) {
  const Problem p = check_inputs(x1, x2, squared);
  const c10::cuda::CUDAGuard guard(x1.device());
  Tensor out = at::empty({p.B, p.P, p.R}, x1.options());
  if (out.numel() > 0) {
    const Centred c = centre(p, x1, x2);
    // The GEMM writes into the output when the types agree; the epilogue then runs in place.
    Tensor g = c.x1.scalar_type() == x1.scalar_type() ? out : at::empty_like(out, c.x1.options());
    at::bmm_out(g, c.x1, c.x2.transpose(1, 2));
    const int64_t total = out.numel();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x1.scalar_type(), "cdist_cuda", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      epilogue_kernel<scalar_t, acc_t>
          <<<cuda::grid_size(total, kThreads), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
              g.const_data_ptr<acc_t>(), out.data_ptr<scalar_t>(), c.n1.const_data_ptr<acc_t>(),
              c.n2.const_data_ptr<acc_t>(), c.raw1.const_data_ptr<acc_t>(),
              c.raw2.const_data_ptr<acc_t>(), p.P, p.R, p.M, total, p.squared, p.self);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  return finish_forward(p, out);
}

// G' = grad / dist (0 where dist = 0), or 2·grad for squared distances.
template <typename scalar_t, typename acc_t>
__global__ void scaled_grad_kernel(const scalar_t* __restrict__ grad, int64_t gstride,
                                   const scalar_t* __restrict__ dist, acc_t* __restrict__ gp,
                                   int64_t total, bool squared) {
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const acc_t gr = static_cast<acc_t>(grad[idx * gstride]);
    const acc_t d = static_cast<acc_t>(dist[idx]);
    gp[idx] = squared ? acc_t(2) * gr : (d == acc_t(0) ? acc_t(0) : gr / d);
  }
}

std::tuple<Tensor, Tensor> backward_cuda(const Tensor& grad, const Tensor& x1,
                                         const std::optional<Tensor>& x2, const Tensor& dist,
                                         bool squared, std::array<bool, 2> output_mask) {
  const Problem p = check_inputs(x1, x2, squared);
  check_backward_inputs(p, grad, x1, dist);
  const c10::cuda::CUDAGuard guard(x1.device());
  const bool want1 = output_mask[0], want2 = p.self ? output_mask[0] : output_mask[1];
  const auto acc = acc_type(x1);
  Tensor g1, g2;
  if (want1) g1 = at::zeros({p.B, p.P, p.M}, x1.options().dtype(acc));
  if (want2) g2 = at::zeros({p.B, p.R, p.M}, x1.options().dtype(acc));
  if ((want1 || want2) && p.B * p.P * p.R * p.M > 0) {
    const Centred c = centre(p, x1, x2);
    const GradInput grad_c = grad_input(grad);
    const Tensor dist_c = dist.contiguous();
    Tensor gp = at::empty({p.B, p.P, p.R}, x1.options().dtype(acc));
    const int64_t total = gp.numel();
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, x1.scalar_type(), "cdist_backward_cuda", [&] {
          using acc_t = at::opmath_type<scalar_t>;
          scaled_grad_kernel<scalar_t, acc_t>
              <<<cuda::grid_size(total, kThreads), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
                  grad_c.tensor.const_data_ptr<scalar_t>(), grad_c.stride,
                  dist_c.const_data_ptr<scalar_t>(), gp.data_ptr<acc_t>(), total, p.squared);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
    // grad_x1 = rowsum(G')·x1 − G'·x2, grad_x2 = colsum(G')·x2 − G'ᵀ·x1 (centred x1, x2).
    if (want1) at::baddbmm_out(g1, c.x1 * gp.sum(2, true), gp, c.x2, 1, -1);
    if (want2) at::baddbmm_out(g2, c.x2 * gp.sum(1).unsqueeze(-1), gp.transpose(1, 2), c.x1, 1, -1);
  }
  return finish_backward(p, g1, g2, x1, x2);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchkit, CUDA, m) {
  m.impl("cdist", &forward_cuda);
  m.impl("_cdist_backward", &backward_cuda);
}

}  // namespace torchkit::cdist
