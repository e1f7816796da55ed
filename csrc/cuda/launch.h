// Launch geometry shared by the CUDA kernels.
#pragma once

#include <ATen/cuda/CUDAContext.h>

#include <algorithm>
#include <cstdint>

namespace torchkit::cuda {

// Blocks for a grid-stride kernel over `work` items: enough to fill the GPU (blocks_per_sm
// on every multiprocessor), never more than the work needs, at least one.
inline int grid_size(int64_t work, int threads, int blocks_per_sm = 32) {
  const int64_t max_blocks =
      int64_t(blocks_per_sm) * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return static_cast<int>(
      std::max<int64_t>(1, std::min((work + threads - 1) / threads, max_blocks)));
}

}  // namespace torchkit::cuda
