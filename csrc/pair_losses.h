// The metric-learning losses over pairs of embeddings, as pytorch-metric-learning 2.x computes
// them with its defaults (cosine similarity of rows L2-normalised as F.normalize does), without
// the N×M similarity matrix: the CPU kernels (cpu/pair_losses_cpu.cpp) fold similarity tiles
// into per-anchor statistics and recompute them in the backward.
//
// Pairs: anchor i (a row of embeddings) with every row j of ref_embeddings, or, without refs,
// with every other row of embeddings; positives have equal labels, negatives different ones.
//
// supcon_loss (SupConLoss + AvgNonZeroReducer), x_ij = s_ij / temperature:
//   L_i = log Σ_pairs exp(x_ij),  loss_i = L_i − mean over i's positives of x_ij (0 without),
//   loss = mean of the loss_i > 0 (NaN ones kept), 0 if the batch has no positive or no
//   negative pair. stats (N, 2): L_i, and w_i = 1/(n_i·K) for the K anchors in the mean (0 for
//   the others).
// ntxent_loss (NTXentLoss + MeanReducer), per positive pair (i, p):
//   S_i = Σ_{i's negatives} exp(x_in),  q_ip = exp(x_ip) / (exp(x_ip) + S_i),
//   loss_ip = −log(q_ip + tiny) (tiny: the accumulation type's smallest normal, PML's small_val),
//   loss = mean over every positive pair, 0 if the batch has no positive or no negative pair.
//   stats (N, 3): log S_i, log R_i = log Σ_p (q_ip / (q_ip + tiny)) / (exp(x_ip) + S_i), and
//   1/(number of positive pairs) (0 for a zero loss).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>

#include <optional>

namespace torchkit::pair_losses {

constexpr int64_t kSupConStats = 2;
constexpr int64_t kNTXentStats = 3;

struct Problem {
  const char* op = nullptr;
  int64_t N = 0, M = 0, D = 0;  // anchors, ref rows (M = N without refs), features
  bool self = true;             // ref_embeddings = None: the pairs of the batch itself
  double temperature = 0;
};

Problem check_inputs(const char* op, const at::Tensor& embeddings, const at::Tensor& labels,
                     const std::optional<at::Tensor>& ref_embeddings,
                     const std::optional<at::Tensor>& ref_labels, const c10::Scalar& temperature);

// grad is the loss's gradient (a scalar of embeddings' dtype), stats the forward's, with
// `columns` per anchor.
void check_backward_inputs(const Problem& p, const at::Tensor& grad, const at::Tensor& embeddings,
                           const at::Tensor& stats, int64_t columns);

}  // namespace torchkit::pair_losses
