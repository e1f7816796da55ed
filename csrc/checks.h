// Input checks shared by every op. Each message names the op, the argument, what was
// expected and what was given, e.g.
//   "cdist: x1 must have at least 2 dimensions (*, P, M), got shape [5]"
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>
#include <c10/util/Exception.h>

#include <charconv>
#include <string>

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

// A raw op declares its number and flag arguments `Scalar`, so that its kernel sees the type
// the caller passed: for a declared `float`, `int` or `bool` the dispatcher would convert a
// bool, a one-element tensor or None without a word (torch.ops.torchkit.bilinear_pool(x,
// None, 1e-5, True) would run with l2_eps = 1). It refuses tensors and None itself, naming
// the argument; these read the rest as the public functions take them (ops/_common.py's
// as_float, as_int and check_bool, with their messages): a float from any real number but a
// bool, an int from an integer, a flag from a bool only.
// A value as the Python side's describe() prints it: "bool True", "int 3", "float 5.0".
inline std::string describe(const c10::Scalar& s) {
  if (s.isBoolean()) return s.toBool() ? "bool True" : "bool False";
  if (s.isComplex()) return "complex " + c10::str(s.toComplexDouble());
  if (s.isIntegral(false)) return "int " + std::to_string(s.toLong());
  char text[32];  // the shortest digits that read back as the double, as Python's repr
  const auto written = std::to_chars(text, text + sizeof(text), s.toDouble());
  std::string digits(text, written.ptr);
  if (digits.find_first_of(".en") == std::string::npos) digits += ".0";  // 5 → 5.0; not inf, 1e+16
  return "float " + digits;
}

inline double scalar_float(const char* op, const char* name, const c10::Scalar& s) {
  TK_CHECK_TYPE(op, s.isFloatingPoint() || s.isIntegral(false), name, " must be a float, got ",
                describe(s));
  return s.toDouble();
}

inline int64_t scalar_int(const char* op, const char* name, const c10::Scalar& s) {
  TK_CHECK_TYPE(op, s.isIntegral(false), name, " must be an int, got ", describe(s));
  return s.toLong();
}

inline bool scalar_bool(const char* op, const char* name, const c10::Scalar& s) {
  TK_CHECK_TYPE(op, s.isBoolean(), name, " must be a bool, got ", describe(s));
  return s.toBool();
}

}  // namespace torchkit
