// Block permutation: schema, checks and the byte layout shared by the CPU and CUDA kernels.
#include "region_confusion.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include "checks.h"

namespace torchkit::region_confusion {

Prepared prepare(const at::Tensor& x, const at::Tensor& permutation,
                 const c10::Scalar& num_blocks) {
  const int64_t n = scalar_int(kOp, "num_blocks", num_blocks);
  TK_CHECK_VALUE(kOp, x.dim() == 3 || x.dim() == 4,
                 "x must be an image (C, H, W) or a batch (N, C, H, W), got shape ", x.sizes());
  const bool batched = x.dim() == 4;
  const int64_t N = batched ? x.size(0) : 1, C = x.size(-3), H = x.size(-2), W = x.size(-1);
  TK_CHECK_VALUE(kOp, n >= 1 && n <= H && n <= W, "num_blocks must be in [1, min(H, W)] = [1, ",
                 std::min(H, W), "] for x of shape ", x.sizes(), ", got ", n);
  TK_CHECK_TYPE(
      kOp, permutation.scalar_type() == at::kLong || permutation.scalar_type() == at::kInt,
      "permutation must hold block indices (int64 or int32), got ", permutation.scalar_type());
  check_same_device(kOp, "x", x, "permutation", permutation);
  const std::vector<int64_t> expected =
      batched ? std::vector<int64_t>{N, n * n} : std::vector<int64_t>{n * n};
  TK_CHECK_VALUE(kOp, permutation.sizes() == c10::IntArrayRef(expected),
                 "permutation must have shape ", c10::IntArrayRef(expected),
                 " (one index per block, num_blocks² per sample), got ", permutation.sizes());

  Prepared p;
  p.permutation = permutation.to(at::kLong).contiguous().view({N, n * n});
  if (x.device().is_cpu() && p.permutation.numel() > 0) {
    // On the CPU the check is free: refuse indices that would read outside the input.
    const auto [lo, hi] = at::aminmax(p.permutation);
    const int64_t min = lo.item<int64_t>(), max = hi.item<int64_t>();
    TK_CHECK_INDEX(kOp, min >= 0 && max < n * n, "permutation values must be in [0, ", n * n,
                   ") (block indices for num_blocks = ", n, "), got values in [", min, ", ", max,
                   "]");
  }

  const at::Tensor x4 = batched ? x : x.unsqueeze(0);
  const bool channels_last =
      C > 1 && x4.is_contiguous(at::MemoryFormat::ChannelsLast) && !x4.is_contiguous();
  p.input = channels_last ? x4 : x4.contiguous();
  p.memory_format = channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
  const int64_t unit = (channels_last ? C : 1) * x.element_size();
  p.layout.planes = channels_last ? N : N * C;
  p.layout.planes_per_sample = channels_last ? 1 : C;
  p.layout.H = H;
  p.layout.n = n;
  p.layout.bh = H / n;
  p.layout.row_bytes = W * unit;
  p.layout.block_bytes = (W / n) * unit;
  return p;
}

TORCH_LIBRARY_FRAGMENT(torchkit, m) {
  // Output block b is input block permutation[..., b] (row-major block numbering); pixels
  // beyond the last full block row/column stay in place. Its gradient is the same op with
  // the inverse permutation.
  m.def("permute_blocks(Tensor x, Tensor permutation, Scalar num_blocks) -> Tensor");
}

}  // namespace torchkit::region_confusion
