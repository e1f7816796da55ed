// Pairwise Euclidean distance on CUDA: cuBLAS for the product of the centred sets (float32
// for reduced types; TF32 only where the user enabled it for matmuls), then one epilogue
// kernel over the output. Backward: one kernel forms G' = grad / dist, then two batched GEMMs;
// the entries the forward recomputed directly take their gradient directly too.
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
    // Recomputed where the expansion cancelled, or is NaN (∞ or overflowing inputs); on the
    // diagonal of self-distances Σ(a − a)² is 0 for a finite row, NaN otherwise.
    const bool diag = self && i == j;
    if (d2 * acc_t(kRefineRatio) < na + nb || d2 != d2 || (diag && !isfinite(na))) {
      const acc_t* a = raw1 + row * M;
      const acc_t* c = raw2 + (b * R + j) * M;
      acc_t s = 0;
      for (int64_t k = 0; k < M; ++k) s += (a[k] - c[k]) * (a[k] - c[k]);
      d2 = s;
    } else if (diag) {
      d2 = 0;
    }
    d2 = d2 < acc_t(0) ? acc_t(0) : d2;  // NaN stays NaN
    out[idx] = static_cast<scalar_t>(squared ? d2 : sqrt(d2));
  }
}

Tensor forward_cuda(const Tensor& x1, const std::optional<Tensor>& x2, const c10::Scalar& squared) {
  const Problem p = check_inputs(x1, x2, squared);
  const c10::cuda::CUDAGuard guard(x1.device());
  Tensor out = at::empty({p.B, p.P, p.R}, x1.options());
  if (out.numel() > 0) {
    const Centred c = centre(p, x1, x2, kCentringAten);
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
__device__ acc_t scaled_grad(const scalar_t* grad, int64_t gstride, const scalar_t* dist,
                             int64_t idx, bool squared) {
  const acc_t gr = static_cast<acc_t>(grad[idx * gstride]);
  const acc_t d = static_cast<acc_t>(dist[idx]);
  return squared ? acc_t(2) * gr : (d == acc_t(0) ? acc_t(0) : gr / d);
}

// Whether the forward recomputed this distance directly (the epilogue's test, from the output).
template <typename scalar_t, typename acc_t>
__device__ bool refined(const scalar_t* dist, int64_t idx, acc_t na, acc_t nb, bool squared) {
  const acc_t d = static_cast<acc_t>(dist[idx]);
  return (squared ? d : d * d) * acc_t(kRefineRatio) < na + nb;
}

// One warp per output row (b, i): G' for the GEMMs, with the directly recomputed entries moved
// out of it; their x1 half, G'·(a − b) from the uncentred inputs, goes into d1's row (the
// warp owns it: the entries are added in order of j, reproducibly), and their columns are
// flagged for direct_columns_kernel. Reads of the row are coalesced.
template <typename scalar_t, typename acc_t>
__global__ void scaled_grad_rows_kernel(
    const scalar_t* __restrict__ grad, int64_t gstride, const scalar_t* __restrict__ dist,
    const acc_t* __restrict__ n1, const acc_t* __restrict__ n2, const acc_t* __restrict__ raw1,
    const acc_t* __restrict__ raw2, int64_t P, int64_t R, int64_t M, int64_t rows, bool squared,
    acc_t* __restrict__ gp, acc_t* __restrict__ d1, uint8_t* __restrict__ column_flags) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t row = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32; row < rows;
       row += warps) {
    const int64_t b = row / P;
    const acc_t na = n1[row];
    const acc_t* a = raw1 + row * M;
    for (int64_t j0 = 0; j0 < R; j0 += 32) {
      const int64_t j = j0 + lane, idx = row * R + j;
      acc_t v = 0;
      bool direct = false;
      if (j < R) {
        v = scaled_grad<scalar_t, acc_t>(grad, gstride, dist, idx, squared);
        direct = refined<scalar_t, acc_t>(dist, idx, na, n2[b * R + j], squared);
        gp[idx] = direct ? acc_t(0) : v;
        if (direct) column_flags[b * R + j] = 1;
      }
      for (unsigned mask = __ballot_sync(0xffffffff, direct); mask != 0; mask &= mask - 1) {
        const int src = __ffs(mask) - 1;
        const acc_t vs = __shfl_sync(0xffffffff, v, src);
        const acc_t* c = raw2 + (b * R + j0 + src) * M;
        for (int64_t k = lane; k < M; k += 32) d1[row * M + k] += vs * (a[k] - c[k]);
      }
    }
  }
}

// One warp per flagged column (b, j): the x2 half of the direct entries, −G'·(a − b), into
// d2's row j, in order of i. Columns without a direct entry return at once; the strided
// reads of a flagged column are the price of exactness there.
template <typename scalar_t, typename acc_t>
__global__ void direct_columns_kernel(
    const scalar_t* __restrict__ grad, int64_t gstride, const scalar_t* __restrict__ dist,
    const acc_t* __restrict__ n1, const acc_t* __restrict__ n2, const acc_t* __restrict__ raw1,
    const acc_t* __restrict__ raw2, int64_t P, int64_t R, int64_t M, int64_t columns, bool squared,
    const uint8_t* __restrict__ column_flags, acc_t* __restrict__ d2) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t col = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32; col < columns;
       col += warps) {
    if (!column_flags[col]) continue;
    const int64_t b = col / R, j = col % R;
    const acc_t nb = n2[col];
    const acc_t* c = raw2 + col * M;
    for (int64_t i0 = 0; i0 < P; i0 += 32) {
      const int64_t i = i0 + lane, idx = ((b * P) + i) * R + j;
      acc_t v = 0;
      bool direct = false;
      if (i < P) {
        direct = refined<scalar_t, acc_t>(dist, idx, n1[b * P + i], nb, squared);
        if (direct) v = scaled_grad<scalar_t, acc_t>(grad, gstride, dist, idx, squared);
      }
      for (unsigned mask = __ballot_sync(0xffffffff, direct); mask != 0; mask &= mask - 1) {
        const int src = __ffs(mask) - 1;
        const acc_t vs = __shfl_sync(0xffffffff, v, src);
        const acc_t* a = raw1 + (b * P + i0 + src) * M;
        for (int64_t k = lane; k < M; k += 32) d2[col * M + k] -= vs * (a[k] - c[k]);
      }
    }
  }
}

std::tuple<Tensor, Tensor> backward_cuda(const Tensor& grad, const Tensor& x1,
                                         const std::optional<Tensor>& x2, const Tensor& dist,
                                         const c10::Scalar& squared,
                                         std::array<bool, 2> output_mask) {
  const Problem p = check_inputs(x1, x2, squared);
  check_backward_inputs(p, grad, x1, dist);
  const c10::cuda::CUDAGuard guard(x1.device());
  const bool want1 = output_mask[0], want2 = p.self ? output_mask[0] : output_mask[1];
  const auto acc = acc_type(x1);
  Tensor g1, g2;
  if (want1) g1 = at::zeros({p.B, p.P, p.M}, x1.options().dtype(acc));
  if (want2) g2 = at::zeros({p.B, p.R, p.M}, x1.options().dtype(acc));
  if ((want1 || want2) && p.B * p.P * p.R * p.M > 0) {
    const Centred c = centre(p, x1, x2, kCentringAten);
    const GradInput grad_c = grad_input(grad);
    const Tensor dist_c = dist.contiguous();
    Tensor gp = at::empty({p.B, p.P, p.R}, x1.options().dtype(acc));
    Tensor d1 = at::zeros({p.B, p.P, p.M}, x1.options().dtype(acc));
    Tensor d2 = at::zeros({p.B, p.R, p.M}, x1.options().dtype(acc));
    Tensor flags = at::zeros({p.B, p.R}, x1.options().dtype(at::kByte));
    constexpr int kWarpsPerBlock = kThreads / 32;
    auto stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, x1.scalar_type(), "cdist_backward_cuda", [&] {
          using acc_t = at::opmath_type<scalar_t>;
          const int64_t rows = p.B * p.P, columns = p.B * p.R;
          scaled_grad_rows_kernel<scalar_t, acc_t>
              <<<cuda::grid_size(rows, kWarpsPerBlock), kThreads, 0, stream>>>(
                  grad_c.tensor.const_data_ptr<scalar_t>(), grad_c.stride,
                  dist_c.const_data_ptr<scalar_t>(), c.n1.const_data_ptr<acc_t>(),
                  c.n2.const_data_ptr<acc_t>(), c.raw1.const_data_ptr<acc_t>(),
                  c.raw2.const_data_ptr<acc_t>(), p.P, p.R, p.M, rows, p.squared,
                  gp.data_ptr<acc_t>(), d1.data_ptr<acc_t>(), flags.data_ptr<uint8_t>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
          if (want2) {
            direct_columns_kernel<scalar_t, acc_t>
                <<<cuda::grid_size(columns, kWarpsPerBlock), kThreads, 0, stream>>>(
                    grad_c.tensor.const_data_ptr<scalar_t>(), grad_c.stride,
                    dist_c.const_data_ptr<scalar_t>(), c.n1.const_data_ptr<acc_t>(),
                    c.n2.const_data_ptr<acc_t>(), c.raw1.const_data_ptr<acc_t>(),
                    c.raw2.const_data_ptr<acc_t>(), p.P, p.R, p.M, columns, p.squared,
                    flags.const_data_ptr<uint8_t>(), d2.data_ptr<acc_t>());
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          }
        });
    // grad_x1 = rowsum(G')·x1 − G'·x2, grad_x2 = colsum(G')·x2 − G'ᵀ·x1 (centred x1, x2),
    // plus the direct entries.
    if (want1) at::baddbmm_out(g1, c.x1 * gp.sum(2, true), gp, c.x2, 1, -1).add_(d1);
    if (want2) {
      at::baddbmm_out(g2, c.x2 * gp.sum(1).unsqueeze(-1), gp.transpose(1, 2), c.x1, 1, -1).add_(d2);
    }
  }
  return finish_backward(p, g1, g2, x1, x2);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchkit, CUDA, m) {
  m.impl("cdist", &forward_cuda);
  m.impl("_cdist_backward", &backward_cuda);
}

}  // namespace torchkit::cdist
