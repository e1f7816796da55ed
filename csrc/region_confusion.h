// Block permutation (RCM / jigsaw): the layout description both backends share.
//
// Any (N, C, H, W) or (C, H, W) tensor is seen as `planes` of H pixel rows, each a run of
// W · unit bytes: planes = N·C and unit = the element size for contiguous (NCHW) memory;
// planes = N and unit = C · element size for channels_last (NHWC). A block is then
// bh pixel rows × block_bytes = bw · unit bytes in every plane, and the kernels are
// byte copies: one code path for every dtype and both memory formats.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>

namespace torchkit::region_confusion {

constexpr const char* kOp = "permute_blocks";

struct Layout {
  int64_t planes = 0, planes_per_sample = 1, H = 0, n = 1;
  int64_t bh = 0;           // pixel rows per block
  int64_t row_bytes = 0;    // bytes per pixel row (W · unit)
  int64_t block_bytes = 0;  // bytes per block row segment (bw · unit)
};

// Validates the arguments and returns the input (4-D) in a layout the kernels read
// (contiguous or channels_last; other strides are copied once), the memory format the output
// must have (the backend allocates it), the permutation as contiguous int64 (N, n²), and the
// byte layout.
struct Prepared {
  at::Tensor input, permutation;
  at::MemoryFormat memory_format;
  Layout layout;
};
// num_blocks as the raw op's caller passed it (checks.h's scalar_int).
Prepared prepare(const at::Tensor& x, const at::Tensor& permutation, const c10::Scalar& num_blocks);

}  // namespace torchkit::region_confusion
