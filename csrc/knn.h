// Exact k-nearest neighbours: what the schema file shares with the CPU and CUDA kernels.
//
// The distances are cdist's (csrc/cdist.h): both sets centred on their common mean, one GEMM
// per tile, d² = |a|² + |b|² − 2a·b recomputed directly where it cancels. The P×R matrix is
// never formed: each (query tile × gallery chunk) block of d² is reduced to per-row
// candidates while it is in cache, and only the k best (d², j) per row survive. The order is
// total: ascending d², NaN after every number, ties to the lower gallery index; self-pairs
// are never candidates in leave-one-out mode. The k survivors' d² are recomputed directly
// from the uncentred inputs (exact for the outputs) and re-sorted by that value.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>

#include <limits>
#include <optional>

#include "cdist.h"

namespace torchkit::knn {

constexpr const char* kOp = "knn";

// query (*B1, P, M), gallery (*B2, R, M) or None (leave-one-out within query), 1 <= k <= R
// (R − 1 without a gallery). Messages name query and gallery.
// The raw op's arguments validated (k and squared as the caller passed them: checks.h).
struct Problem : cdist::Problem {
  int64_t k = 0;
};
Problem check_inputs(const at::Tensor& query, const std::optional<at::Tensor>& gallery,
                     const c10::Scalar& k, const c10::Scalar& squared);

// How far above the k-th best (exact) d² an expanded d² may lie and still belong to a smaller
// distance: a bound on the expansion's rounding where it did not cancel (d² >= (|a|² + |b|²)
// / kRefineRatio), about (M + 2)·ε·2(|a|² + |b|²) ≤ 2·kRefineRatio·(M + 2)·ε·d²; twice that.
// Entries within it are recomputed directly and compared exactly, so exact ties go to the
// lower index whatever the expansion's rounding.
template <typename acc_t>
double expansion_margin(int64_t M) {
  return 1.0 + 4.0 * cdist::kRefineRatio * double(M + 2) * std::numeric_limits<acc_t>::epsilon();
}

}  // namespace torchkit::knn
