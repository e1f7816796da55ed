// Bilinear pooling on CUDA: cuBLAS (batched, float32 for reduced types) for x·yᵀ, then two
// passes over the N×D·E result: signed sqrt with per-block partial sums of squares, then the
// normalisation. Backward: per-block partial dot(out, grad), one elementwise kernel for
// ∂L/∂Z, the symmetrisation for y = None, one GEMM per input. No host synchronisation.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>

#include "bilinear_pool.h"
#include "common.h"
#include "cuda/launch.h"

namespace torchkit::bilinear_pool {
namespace {

using at::Tensor;

constexpr int kThreads = 256;
constexpr int64_t kChunk = 16384;  // entries of one sample per block in the reductions

// Sum over the block's threads (kThreads, a multiple of the warp size); thread 0 gets it.
template <typename T>
__device__ T block_sum(T v) {
  __shared__ T warp_sums[kThreads / 32];
  for (int off = 16; off > 0; off /= 2) v += __shfl_down_sync(0xffffffff, v, off);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
  __syncthreads();
  T total = 0;
  if (threadIdx.x == 0)
    for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w];
  return total;
}

// z ← signed_sqrt(z / HW) in place; partial[n, chunk] = Σ z² over the block's chunk.
template <typename acc_t>
__global__ void signed_sqrt_kernel(acc_t* z, acc_t* partial, int64_t DE, acc_t inv_hw, acc_t eps) {
  const int64_t n = blockIdx.y, begin = blockIdx.x * kChunk;
  const int64_t end = min(begin + kChunk, DE);
  acc_t* zn = z + n * DE;
  acc_t sum = 0;
  for (int64_t k = begin + threadIdx.x; k < end; k += blockDim.x) {
    const acc_t v = signed_sqrt(zn[k] * inv_hw, eps);
    zn[k] = v;
    sum += v * v;
  }
  sum = block_sum(sum);
  if (threadIdx.x == 0) partial[n * gridDim.x + blockIdx.x] = sum;
}

template <typename scalar_t, typename acc_t>
__global__ void normalise_kernel(const acc_t* s, const acc_t* norm, scalar_t* out, int64_t DE,
                                 int64_t total, acc_t l2_eps) {
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < total;
       k += int64_t(gridDim.x) * blockDim.x) {
    const acc_t n = norm[k / DE];
    out[k] = static_cast<scalar_t>(s[k] / (n < l2_eps ? l2_eps : n));  // not max(): NaN stays NaN
  }
}

std::tuple<Tensor, Tensor> forward_cuda(const Tensor& x, const std::optional<Tensor>& y,
                                        const c10::Scalar& sqrt_eps, const c10::Scalar& l2_eps) {
  const Problem p = check_inputs(x, y, sqrt_eps, l2_eps);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto [a, b] = operands(p, x, y);
  const int64_t DE = p.D * p.E;
  Tensor out = at::empty({p.N, DE}, x.options());
  Tensor z = at::bmm(a, b.transpose(1, 2));  // (N, D, E), acc type
  const int64_t chunks = (DE + kChunk - 1) / kChunk;
  Tensor partial = at::empty({p.N, chunks}, z.options());
  const auto stream = at::cuda::getCurrentCUDAStream();
  Tensor norm;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "bilinear_pool_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        if (p.N > 0) {
          signed_sqrt_kernel<acc_t><<<dim3(chunks, p.N), kThreads, 0, stream>>>(
              z.data_ptr<acc_t>(), partial.data_ptr<acc_t>(), DE, acc_t(1) / acc_t(p.HW),
              static_cast<acc_t>(p.sqrt_eps));
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
        norm = partial.sum(1).sqrt_();
        const int64_t total = out.numel();
        if (total > 0) {
          normalise_kernel<scalar_t, acc_t>
              <<<cuda::grid_size(total, kThreads), kThreads, 0, stream>>>(
                  z.const_data_ptr<acc_t>(), norm.const_data_ptr<acc_t>(), out.data_ptr<scalar_t>(),
                  DE, total, static_cast<acc_t>(p.l2_eps));
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
      });
  return {out, norm};
}

// partial[n, chunk] = Σ out·grad over the block's chunk of sample n.
template <typename scalar_t, typename acc_t>
__global__ void dot_kernel(const scalar_t* o, const scalar_t* g, int64_t gstride, acc_t* partial,
                           int64_t DE) {
  const int64_t n = blockIdx.y, begin = blockIdx.x * kChunk;
  const int64_t end = min(begin + kChunk, DE);
  acc_t sum = 0;
  for (int64_t k = begin + threadIdx.x; k < end; k += blockDim.x)
    sum += static_cast<acc_t>(o[n * DE + k]) * static_cast<acc_t>(g[(n * DE + k) * gstride]);
  sum = block_sum(sum);
  if (threadIdx.x == 0) partial[n * gridDim.x + blockIdx.x] = sum;
}

// ∂L/∂Z · 1/HW per entry (grad_z() in the header).
template <typename scalar_t, typename acc_t>
__global__ void grad_z_kernel(const scalar_t* o, const scalar_t* g, int64_t gstride,
                              const acc_t* dot, const acc_t* norm, acc_t* dz, int64_t DE,
                              int64_t total, acc_t l2_eps, acc_t inv_hw) {
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < total;
       k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = k / DE;
    dz[k] = grad_z<acc_t>(static_cast<acc_t>(o[k]), static_cast<acc_t>(g[k * gstride]), dot[n],
                          norm[n], l2_eps) *
            inv_hw;
  }
}

std::tuple<Tensor, Tensor> backward_cuda(const Tensor& grad, const Tensor& x,
                                         const std::optional<Tensor>& y, const Tensor& out,
                                         const Tensor& norm, const c10::Scalar& sqrt_eps,
                                         const c10::Scalar& l2_eps,
                                         std::array<bool, 2> output_mask) {
  const Problem p = check_inputs(x, y, sqrt_eps, l2_eps);
  check_backward_inputs(p, grad, x, out, norm);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t DE = p.D * p.E, total = p.N * DE;
  const GradInput g_c = grad_input(grad);  // a broadcast d.sum() gradient is read in place
  const Tensor o_c = out.contiguous();
  const Tensor norm_c = norm.contiguous();  // read by sample index
  Tensor dz = at::empty({p.N, p.D, p.E}, norm.options());
  const int64_t chunks = (DE + kChunk - 1) / kChunk;
  Tensor partial = at::empty({p.N, chunks}, norm.options());
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "bilinear_pool_backward_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        if (total == 0) return;
        dot_kernel<scalar_t, acc_t><<<dim3(chunks, p.N), kThreads, 0, stream>>>(
            o_c.const_data_ptr<scalar_t>(), g_c.tensor.const_data_ptr<scalar_t>(), g_c.stride,
            partial.data_ptr<acc_t>(), DE);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        const Tensor dot = partial.sum(1);
        grad_z_kernel<scalar_t, acc_t><<<cuda::grid_size(total, kThreads), kThreads, 0, stream>>>(
            o_c.const_data_ptr<scalar_t>(), g_c.tensor.const_data_ptr<scalar_t>(), g_c.stride,
            dot.const_data_ptr<acc_t>(), norm_c.const_data_ptr<acc_t>(), dz.data_ptr<acc_t>(), DE,
            total, static_cast<acc_t>(p.l2_eps), acc_t(1) / acc_t(p.HW));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  if (p.self) dz = dz + dz.transpose(1, 2);  // Z = x·xᵀ: (i, j) and (j, i) are one sum
  return input_grads(p, dz, x, y, output_mask,
                     [](at::IntArrayRef sizes, const at::TensorOptions& options) {
                       return at::empty(sizes, options);
                     });
}

}  // namespace

TORCH_LIBRARY_IMPL(torchkit, CUDA, m) {
  m.impl("bilinear_pool", &forward_cuda);
  m.impl("_bilinear_pool_backward", &backward_cuda);
}

}  // namespace torchkit::bilinear_pool
