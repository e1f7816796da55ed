// Exact k-nearest neighbours: the schema and the input checks.
#include "knn.h"

#include <torch/library.h>

#include "checks.h"

namespace torchkit::knn {

Problem check_inputs(const at::Tensor& query, const std::optional<at::Tensor>& gallery,
                     const c10::Scalar& k_arg, const c10::Scalar& squared) {
  Problem p;
  const int64_t k = p.k = scalar_int(kOp, "k", k_arg);
  static_cast<cdist::Problem&>(p) = cdist::check_inputs(
      query, gallery, scalar_bool(kOp, "squared", squared), cdist::Names{kOp, "query", "gallery"});
  TK_CHECK_VALUE(kOp, k >= 1, "k must be >= 1, got ", k);
  if (p.self) {
    TK_CHECK_VALUE(kOp, k <= p.P - 1, "k must be <= P - 1 = ", p.P - 1,
                   " without a gallery (each row's neighbours are the other rows of query), got ",
                   k);
  } else {
    TK_CHECK_VALUE(kOp, k <= p.R, "k must be <= the gallery's size R = ", p.R, ", got ", k);
  }
  return p;
}

TORCH_LIBRARY_FRAGMENT(torchkit, m) {
  // Returns (distances, indices), each (*batch, P, k): distances ascending in the inputs'
  // dtype, indices int64 into the gallery. The gradient is a composition of PyTorch ops
  // (torchkit/ops/knn.py): no backward op.
  m.def("knn(Tensor query, Tensor? gallery, Scalar k, Scalar squared) -> (Tensor, Tensor)");
}

}  // namespace torchkit::knn
