// Pairwise Euclidean distance: the problem description and the device-agnostic steps that
// both backends share (input checks, broadcasting, centring, the final reshape).
//
// Algorithm. d²(a, b) = |a|² + |b|² − 2·a·b puts the work in one GEMM, but loses every digit
// when |a|², |b|² ≫ d² (points far from the origin: PyTorch #42479). Two cures together:
//  1. Both sets are centred on their common mean (per batch) before the product; distances
//     do not change, and the norms become as small as the data's spread allows. (The CPU
//     skips it where the mean is negligible beside the rows' norms: see cpu/cdist_cpu.cpp.)
//  2. Where cancellation remains (d² < (|a|² + |b|²) / kRefineRatio: near-duplicate points
//     inside a cluster), the epilogue recomputes that entry as Σ(a − b)² from the inputs.
// The GEMM and the epilogue run in float32 for reduced types (float64 for float64).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>

#include <optional>
#include <utility>
#include <vector>

namespace torchkit::cdist {

constexpr const char* kOp = "cdist";

// An entry whose expansion cancelled more than log2(kRefineRatio) bits is recomputed
// directly. The expansion's error is a few float32 ulps of |a|² + |b|², so what is kept has
// a relative error of about kRefineRatio ulps of d² (tests/test_cdist.py holds it to 2e-5
// on far-from-origin, clustered and random data); random data (d² ≈ |a|² + |b|² after
// centring) never takes the slow path.
constexpr double kRefineRatio = 16.0;

struct Problem {
  std::vector<int64_t> batch;  // broadcast batch shape
  int64_t B = 1, P = 0, R = 0, M = 0;
  bool self = false;  // x2 is None: distances within x1
  bool squared = false;
};

// How messages name the op and its two point sets: cdist's x1 and x2, knn's query and gallery.
struct Names {
  const char* op = kOp;
  const char* x1 = "x1";
  const char* x2 = "x2";
};

// Validates x1 (*B1, P, M) and x2 (*B2, R, M) (or None) and broadcasts the batch shapes.
Problem check_inputs(const at::Tensor& x1, const std::optional<at::Tensor>& x2, bool squared,
                     const Names& names = Names{});
// The same for the raw op's arguments: `squared` as the caller passed it (checks.h).
Problem check_inputs(const at::Tensor& x1, const std::optional<at::Tensor>& x2,
                     const c10::Scalar& squared);

// x1, x2 as contiguous (B, P, M) and (B, R, M) in the accumulation type, centred on their
// common per-batch mean (or, where the backend's Centring skips it, the raw rows themselves),
// with their squared row norms (B, P), (B, R), and uncentred (raw1,
// raw2: views of the inputs where they already are contiguous acc-typed). Refinement reads
// the uncentred values: centring rounds each coordinate to the spread's precision, and
// would erase differences between near-duplicates far from the mean. For `self` the second
// of each pair aliases the first.
//
// A backend may also scale (the CPU does): for a batch element whose largest finite magnitude
// lies outside [2^-H, 2^H] (H = a quarter of the type's exponent range: 2^±32 in float32),
// where |x|² and the product would under- or overflow, x1 and x2 (and n1, n2) are of the
// rows divided by 2^e, e = exponents[b], so that its largest magnitude lies in [1/2, 1):
// distances and their squares come back multiplied by 2^e and 2^2e, exactly. exponents is
// empty where no element needed it (always, for a backend that does not scale).
struct Centred {
  at::Tensor x1, x2, n1, n2, raw1, raw2;
  std::vector<int> exponents;

  int exponent(int64_t b) const { return exponents.empty() ? 0 : exponents[b]; }
};

// The centring's two passes, each backend its own (the _aten forms are portable ATen ops;
// the CPU's, in cpu/distance.h, are fused loops):
//  - mean: the (B, 1, M) mean of the finite rows of raw1 (B, P, M) and raw2 (B, R, M), raw2
//    undefined for self. One NaN or ∞ row would make a plain mean, and so every distance of
//    the batch, non-finite: such rows are left out of it. A backend may instead return an
//    undefined mean where centring would not pay: the rows are then used as they are. A
//    backend that scales returns instead, where an element needs it, the exponents (see
//    Centred) and no mean: centre() calls it again on the scaled rows.
//  - rows: raw (B, rows, M) − mean (raw itself for an undefined mean), and the result's
//    squared row norms (B, rows).
struct Shift {
  at::Tensor mean;
  std::vector<int> exponents;
};
struct Centring {
  Shift (*mean)(const at::Tensor& raw1, const at::Tensor& raw2);
  std::pair<at::Tensor, at::Tensor> (*rows)(const at::Tensor& raw, const at::Tensor& mean);
};
Shift finite_mean_aten(const at::Tensor& raw1, const at::Tensor& raw2);
std::pair<at::Tensor, at::Tensor> centre_rows_aten(const at::Tensor& raw, const at::Tensor& mean);
inline constexpr Centring kCentringAten{finite_mean_aten, centre_rows_aten};

Centred centre(const Problem& p, const at::Tensor& x1, const std::optional<at::Tensor>& x2,
               Centring centring);

// grad and dist must be (*batch, P, R) of x1's dtype: what the forward returned.
void check_backward_inputs(const Problem& p, const at::Tensor& grad, const at::Tensor& x1,
                           const at::Tensor& dist);

// (B, P, R) → (*batch, P, R).
at::Tensor finish_forward(const Problem& p, const at::Tensor& dist);

// Gradients (B, P, M), (B, R, M) in the accumulation type (either may be undefined) → the
// inputs' shapes and dtype, summed over broadcast batch dimensions. For `self`, both halves
// are x1's and are added.
std::tuple<at::Tensor, at::Tensor> finish_backward(const Problem& p, at::Tensor g1, at::Tensor g2,
                                                   const at::Tensor& x1,
                                                   const std::optional<at::Tensor>& x2);

}  // namespace torchkit::cdist
