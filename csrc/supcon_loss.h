// Supervised contrastive loss (Khosla et al., 2020) as pytorch-metric-learning 2.x's
// SupConLoss computes it with its defaults (cosine similarity of L2-normalised embeddings,
// AvgNonZeroReducer), without the N×M similarity matrix:
//
//   e = embeddings / max(‖·‖, 1e-12) per row, r likewise (r = e for ref_embeddings = None)
//   x_ij = e_i·r_j / temperature over anchor i's pairs j (every ref row; j ≠ i without refs)
//   L_i = log Σ_pairs exp(x_ij),  P_i = the pairs of i's label (positives), n_i = |P_i|
//   loss_i = L_i − (1/n_i)·Σ_{P_i} x_ij  (0 for an anchor without positives)
//   loss = mean of the loss_i > 0 (NaN ones included: NaN stays NaN), 0 if none is, and 0 if
//          the batch has no positive pair or no negative pair.
//
// Saved for backward, per anchor (stats, (N, 2) of the accumulation type): L_i and
// w_i = 1/(n_i·K·temperature) for an anchor counted in the mean (K of them), 0 otherwise.
// The backward recomputes the similarity tiles: ∂loss/∂x_ij = w_i·τ·(n_i·exp(x_ij − L_i) −
// [j ∈ P_i]).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>

#include <optional>

namespace torchkit::supcon_loss {

constexpr const char* kOp = "supcon_loss";
constexpr int64_t kStats = 2;  // L_i, w_i

struct Problem {
  int64_t N = 0, M = 0, D = 0;  // anchors, ref rows (M = N without refs), features
  bool self = true;             // ref_embeddings = None: the pairs of the batch itself
  double temperature = 0;
};

Problem check_inputs(const at::Tensor& embeddings, const at::Tensor& labels,
                     const std::optional<at::Tensor>& ref_embeddings,
                     const std::optional<at::Tensor>& ref_labels, const c10::Scalar& temperature);

// grad is the loss's gradient (a scalar of embeddings' dtype), stats the forward's.
void check_backward_inputs(const Problem& p, const at::Tensor& grad, const at::Tensor& embeddings,
                           const at::Tensor& stats);

}  // namespace torchkit::supcon_loss
