// Block permutation on the CPU: parallel over pixel rows; each row is assembled from
// n contiguous segment copies (one per block column) plus its unshuffled remainder.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "cpu/memory.h"
#include "region_confusion.h"

namespace torchkit::region_confusion {
namespace {

at::Tensor permute_blocks_cpu(const at::Tensor& x, const at::Tensor& permutation,
                              const c10::Scalar& num_blocks) {
  const Prepared p = prepare(x, permutation, num_blocks);
  const Layout L = p.layout;
  at::Tensor output = cpu::empty_for_writing(p.input.sizes(), p.input.options(), p.memory_format);
  const auto* src = static_cast<const char*>(p.input.const_data_ptr());
  auto* dst = static_cast<char*>(output.data_ptr());
  const int64_t* perm = p.permutation.const_data_ptr<int64_t>();
  const int64_t n = L.n, shuffled_rows = n * L.bh, shuffled_bytes = n * L.block_bytes;
  const int64_t plane_bytes = L.H * L.row_bytes;
  // Rows are cheap (a few hundred bytes to a few KiB): hand out at least ~64 KiB per task.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(L.row_bytes, 1));
  at::parallel_for(0, L.planes * L.H, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t plane = r / L.H, y = r % L.H;
      char* out_row = dst + plane * plane_bytes + y * L.row_bytes;
      const char* plane_src = src + plane * plane_bytes;
      if (y >= shuffled_rows) {  // remainder row below the blocks: unchanged
        std::memcpy(out_row, plane_src + y * L.row_bytes, L.row_bytes);
        continue;
      }
      const int64_t bi = y / L.bh, dy = y % L.bh;
      const int64_t* sample_perm = perm + (plane / L.planes_per_sample) * n * n + bi * n;
      for (int64_t bj = 0; bj < n; ++bj) {
        const int64_t s = sample_perm[bj];
        const int64_t sy = (s / n) * L.bh + dy;
        std::memcpy(out_row + bj * L.block_bytes,
                    plane_src + sy * L.row_bytes + (s % n) * L.block_bytes, L.block_bytes);
      }
      std::memcpy(out_row + shuffled_bytes, plane_src + y * L.row_bytes + shuffled_bytes,
                  L.row_bytes - shuffled_bytes);
    }
  });
  return x.dim() == 3 ? output.squeeze(0) : output;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchkit, CPU, m) { m.impl("permute_blocks", &permute_blocks_cpu); }

}  // namespace torchkit::region_confusion
