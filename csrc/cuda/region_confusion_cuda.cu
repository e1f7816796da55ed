// Block permutation on CUDA: one thread per vector of the output (16 bytes where the block
// width, the row length and both pointers allow it, down to single bytes), reading the one
// source vector it needs. Out-of-range permutation values trip a device-side assertion
// rather than read outside the input (the host cannot check without a synchronisation).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/macros/Macros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "cuda/launch.h"
#include "region_confusion.h"

namespace torchkit::region_confusion {
namespace {

constexpr int kThreads = 256;

template <typename vec_t>
__global__ void permute_blocks_kernel(const vec_t* __restrict__ src, vec_t* __restrict__ dst,
                                      const int64_t* __restrict__ perm, Layout L, int64_t total) {
  // All byte extents below are in units of vec_t.
  const int64_t row = L.row_bytes / sizeof(vec_t), block = L.block_bytes / sizeof(vec_t);
  const int64_t n = L.n, shuffled_rows = n * L.bh, shuffled = n * block;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t x = idx % row, r = idx / row;  // r = plane · H + y
    const int64_t plane = r / L.H, y = r % L.H;
    int64_t sy = y, sx = x;
    if (y < shuffled_rows && x < shuffled) {
      const int64_t s = perm[(plane / L.planes_per_sample) * n * n + (y / L.bh) * n + x / block];
      CUDA_KERNEL_ASSERT(s >= 0 && s < n * n && "permute_blocks: permutation value out of range");
      sy = (s / n) * L.bh + y % L.bh;
      sx = (s % n) * block + x % block;
    }
    dst[idx] = src[(plane * L.H + sy) * row + sx];
  }
}

template <typename vec_t>
void launch(const Prepared& p, at::Tensor& output, int64_t total_bytes) {
  const int64_t total = total_bytes / sizeof(vec_t);
  const int blocks = cuda::grid_size(total, kThreads);
  permute_blocks_kernel<vec_t><<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<const vec_t*>(p.input.const_data_ptr()), static_cast<vec_t*>(output.data_ptr()),
      p.permutation.const_data_ptr<int64_t>(), p.layout, total);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor permute_blocks_cuda(const at::Tensor& x, const at::Tensor& permutation,
                               const c10::Scalar& num_blocks) {
  const c10::cuda::CUDAGuard guard(x.device());
  const Prepared p = prepare(x, permutation, num_blocks);
  at::Tensor output = at::empty(p.input.sizes(), p.input.options(), p.memory_format);
  const int64_t total_bytes = p.layout.planes * p.layout.H * p.layout.row_bytes;
  if (total_bytes > 0) {
    // The widest vector that divides every extent and both addresses.
    const auto fits = [&](int64_t v) {
      return p.layout.row_bytes % v == 0 && p.layout.block_bytes % v == 0 &&
             reinterpret_cast<uintptr_t>(p.input.const_data_ptr()) % v == 0 &&
             reinterpret_cast<uintptr_t>(output.data_ptr()) % v == 0;
    };
    if (fits(16)) {
      launch<uint4>(p, output, total_bytes);
    } else if (fits(8)) {
      launch<uint2>(p, output, total_bytes);
    } else if (fits(4)) {
      launch<uint32_t>(p, output, total_bytes);
    } else if (fits(2)) {
      launch<uint16_t>(p, output, total_bytes);
    } else {
      launch<uint8_t>(p, output, total_bytes);
    }
  }
  return x.dim() == 3 ? output.squeeze(0) : output;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchkit, CUDA, m) { m.impl("permute_blocks", &permute_blocks_cuda); }

}  // namespace torchkit::region_confusion
