// Input checks shared by every op. Each message names the op, the argument, what was
// expected and what was given, e.g.
//   "cdist: x1 must have at least 2 dimensions (*, P, M), got shape [5]"
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

// TORCH_CHECK_VALUE raises ValueError in Python, TORCH_CHECK_TYPE TypeError,
// TORCH_CHECK_INDEX IndexError: users catch what they would from PyTorch's own ops.
#define TK_CHECK_VALUE(op, cond, ...) TORCH_CHECK_VALUE(cond, op, ": ", __VA_ARGS__)
#define TK_CHECK_TYPE(op, cond, ...) TORCH_CHECK_TYPE(cond, op, ": ", __VA_ARGS__)
#define TK_CHECK_INDEX(op, cond, ...) TORCH_CHECK_INDEX(cond, op, ": ", __VA_ARGS__)

namespace torchkit {

// float32, float64, float16 or bfloat16: the types every arithmetic op takes.
inline void check_floating(const char* op, const char* name, const at::Tensor& t) {
  TK_CHECK_TYPE(op,
                at::isFloatingType(t.scalar_type()) && t.scalar_type() != at::kFloat8_e4m3fn &&
                    t.scalar_type() != at::kFloat8_e5m2,
                name, " must be float32, float64, float16 or bfloat16, got ", t.scalar_type());
}

inline void check_same_device(const char* op, const char* name_a, const at::Tensor& a,
                              const char* name_b, const at::Tensor& b) {
  TK_CHECK_VALUE(op, a.device() == b.device(), name_a, " and ", name_b,
                 " must be on the same device, got ", a.device(), " and ", b.device());
}

inline void check_same_dtype(const char* op, const char* name_a, const at::Tensor& a,
                             const char* name_b, const at::Tensor& b) {
  TK_CHECK_TYPE(op, a.scalar_type() == b.scalar_type(), name_a, " and ", name_b,
                " must have the same dtype, got ", a.scalar_type(), " and ", b.scalar_type());
}

}  // namespace torchkit
