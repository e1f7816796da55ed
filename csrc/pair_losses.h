// The metric-learning losses over pairs of embeddings, as pytorch-metric-learning 2.x computes
// them with its defaults (rows L2-normalised as F.normalize does; cosine similarity for SupCon
// and NT-Xent, Euclidean distance for the contrastive and triplet losses), without the N×M
// matrix: the CPU kernels (cpu/pair_losses_cpu.cpp, cpu/pair_losses_euclidean_cpu.cpp) fold
// similarity or distance tiles into per-anchor statistics and recompute them in the backward.
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
// The contrastive and triplet losses take a distance: "euclidean" (PML's LpDistance, its
// default) or "cosine" (PML's CosineSimilarity, a similarity s: margins on the other side,
// relu(pos_margin − s) and relu(s − neg_margin) for the contrastive pairs, relu(s_an − s_ap +
// margin) per triplet, the hardest positive the least similar). Their kernels take d = −s as
// the cosine's distance, which orders pairs as a distance does (near first): the triplet
// terms are then the Euclidean ones, and the contrastive terms those of margins −pos_margin
// and −neg_margin.
// contrastive_loss (ContrastiveLoss + AvgNonZeroReducer), d_ij the Euclidean distance:
//   loss = mean of the positive pairs' relu(d − pos_margin) > 0 + mean of the negative pairs'
//   relu(neg_margin − d) > 0 (a mean over nothing is 0); 0 when the batch has at most one
//   positive and one negative pair (PML's check). stats (N, 2): 1/(positive terms counted),
//   1/(negative terms counted), the same in every row (0 for none).
// triplet_margin_loss (TripletMarginLoss + AvgNonZeroReducer, with the miner of `mining`):
//   per triplet (a, p, n) loss relu(d_ap − d_an + margin), the mean of those > 0 over the
//   triplets: "all" of them, "semi_hard" ones (d_ap < d_an, TripletMarginMiner's semihard),
//   "batch_hard" one per anchor with positives and negatives (its farthest positive and
//   nearest negative, BatchHardMiner). stats (N, 3) int64: the anchor's hardest positive and
//   negative (batch_hard; −1 otherwise or without), and its number of triplets in the mean.
// multi_similarity_loss (MultiSimilarityLoss + MeanReducer, with MultiSimilarityMiner(ε)
//   unless miner_epsilon is None), s the cosine similarity: with the miner, anchor i keeps the
//   positives with s − ε < its largest negative s, and the negatives with s + ε > its smallest
//   positive s (nothing if the batch has no positive or no negative pair); per anchor
//   log(1 + Σ_kept positives exp(α(base − s)))/α + log(1 + Σ_kept negatives exp(β(s − base)))/β,
//   and the loss is their mean over the N anchors; 0 when each kind keeps at most one pair.
//   stats (N, 5) float64: the anchor's largest negative and smallest positive s (exact; ∓∞
//   without), its two log terms Lp_i and Ln_i, and 1/N (0 for a zero loss).
// proxy_anchor_loss (ProxyAnchorLoss + DivisorReducer, holding the given proxies), s the
//   cosine similarity of an embedding and a proxy, proxy c's positives the embeddings of label
//   c: per proxy Lp_c = log(1 + Σ_positives exp(α(margin − s))) and
//   Ln_c = log(1 + Σ_negatives exp(α(s + margin))); the loss is Σ Lp_c over the P proxies with
//   positives (0 for none) plus Σ Ln_c over the C proxies. Problem: the proxies are the
//   anchors (N = C), the embeddings the refs (M). stats (C, 4): Lp_c, Ln_c, α/P (0 for none),
//   α/C.
//
// A shard (shard given: torchkit's losses across ranks, torchkit/ops/_pair_losses_across_ranks.py):
// the call computes one rank's anchors of a larger problem against all of its refs. shard >= 0:
// the anchors are ref rows [shard, shard + N) (the global batch without ref_embeddings), and
// anchor i with ref row shard + i is that row itself, not a pair; shard = −1: ref_embeddings
// are the pairs' other side. The loss output is then the reducer's parts (float64, below),
// which summed over the ranks give the problem's loss, and the stats are normalised by this
// call's own counts, without PML's batch rules (a rank cannot see them): the caller applies
// the rules to the summed parts and scales the backward's grad (contrastive_loss: rewrites
// its two stats columns).
// A shard's backward: supcon_loss, ntxent_loss, contrastive_loss and multi_similarity_loss with
// shard >= 0 take the whole problem's stats (M rows, every rank's anchors', normalised to the
// whole problem: whole_of) and return the anchors' whole gradient, each anchor's pairs taken as
// anchor and as every anchor's ref (rows [shard, shard + N) of the gradient the loss without
// refs over ref_embeddings has; the refs' gradient is not computed: zeros where asked). Every
// other shard's backward (triplet_margin_loss's mining would need every anchor's per-positive
// counts; shard = −1) takes the shard's stats and returns the refs' gradient from the shard's
// anchors too, which the caller sums over the ranks. own_stats (those four losses, shard >= 0):
// the backward takes the shard's own stats (N rows) and returns the gradient of the anchors'
// pairs alone, anchor i's own ref row left out: the refs are a memory that holds the anchors'
// rows (torchkit.nn.CrossBatchMemory, one process), not every anchor of the problem; the refs'
// gradient is not computed (zeros where asked).
//   supcon_loss: Σ of the loss_i in the mean, their count, positive pairs, negative pairs.
//   ntxent_loss: Σ loss_ip, positive pairs, negative pairs.
//   contrastive_loss: Σ and count of the positive terms > 0, the same of the negative ones,
//     positive pairs, negative pairs.
//   triplet_margin_loss: Σ of the triplets' losses in the mean, their count.
//   multi_similarity_loss: Σ of the anchors' losses, anchors, kept negative pairs, kept
//     positive pairs.
//   proxy_anchor_loss (shard = −1: the embeddings are one rank's, the proxies everyone's):
//     (C, 3) per proxy log Σ_positives exp(α(margin − s)) and log Σ_negatives exp(α(s +
//     margin)), without the 1 (−∞ for none), and whether it has positives; its caller merges
//     the log-sums, forms the stats and calls the backward, whose stats say everything.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>
#include <c10/util/string_view.h>

#include <initializer_list>
#include <optional>

namespace torchkit::pair_losses {

constexpr int64_t kSupConStats = 2;
constexpr int64_t kNTXentStats = 3;
constexpr int64_t kContrastiveStats = 2;
constexpr int64_t kTripletStats = 3;
constexpr int64_t kMultiSimilarityStats = 5;
constexpr int64_t kProxyAnchorStats = 4;
constexpr int64_t kSupConParts = 4;
constexpr int64_t kNTXentParts = 3;
constexpr int64_t kContrastiveParts = 6;
constexpr int64_t kTripletParts = 2;
constexpr int64_t kMultiSimilarityParts = 4;

enum class Mining { All, BatchHard, SemiHard };
enum class Distance { Euclidean, Cosine };

struct Problem {
  const char* op = nullptr;
  int64_t N = 0, M = 0, D = 0;              // anchors, ref rows (M = N without refs), features
  bool self = true;                         // ref_embeddings = None: the pairs of the batch itself
  int64_t offset = -1;                      // anchor i is ref row offset + i (0 for self; -1: none)
  bool shard = false;                       // a shard of a larger problem (above)
  bool own_stats = false;                   // a shard's backward with its own stats (above)
  int64_t grad_first = 0, grad_rows = -1;   // the anchors' gradient rows computed (< 0: all N)
  double temperature = 0;                   // supcon_loss, ntxent_loss
  double pos_margin = 0, neg_margin = 0;    // contrastive_loss
  double margin = 0;                        // triplet_margin_loss
  Mining mining = Mining::All;              // triplet_margin_loss
  Distance distance = Distance::Euclidean;  // contrastive_loss, triplet_margin_loss
  double alpha = 0, beta = 0, base = 0;     // multi_similarity_loss
  std::optional<double> miner_epsilon;      // multi_similarity_loss; none: no miner

  // Whether anchor i and ref row j are one row (not a pair).
  bool itself(int64_t i, int64_t j) const { return offset >= 0 && j == offset + i; }
  // A shard's loss output: its parts, float64 on like's device.
  at::Tensor parts(std::initializer_list<double> values, const at::Tensor& like) const;
  // Whether a shard's backward of the losses that take the whole problem's stats (above) does.
  bool takes_whole_stats() const { return shard && offset >= 0 && !own_stats; }
  // The anchors' gradient rows a backward computes: [grad_first, grad_end()).
  int64_t grad_end() const { return grad_rows < 0 ? N : grad_first + grad_rows; }
};

// The problem a shard's backward with the whole problem's stats solves: p's refs without refs
// (every rank's rows, N = M), of whose anchors' gradient it computes p's rows.
Problem whole_of(const Problem& p);

// The tensors' checks, common to the family; then each loss checks its own parameters.
Problem check_inputs(const char* op, const at::Tensor& embeddings, const at::Tensor& labels,
                     const std::optional<at::Tensor>& ref_embeddings,
                     const std::optional<at::Tensor>& ref_labels, std::optional<int64_t> shard);
// own_stats of a backward that takes the whole problem's stats with shard >= 0 (above): only
// there; sets p.own_stats.
void check_own_stats(Problem& p, bool own_stats);
double check_temperature(const char* op, const c10::Scalar& temperature);
// A margin (or the miner's ε): finite, of either sign, as PML takes them.
double check_margin(const char* op, const char* name, const c10::Scalar& margin);
// Finite and > 0; finite.
double check_positive(const char* op, const char* name, const c10::Scalar& value);
double check_finite(const char* op, const char* name, const c10::Scalar& value);
Mining check_mining(const char* op, c10::string_view mining);
Distance check_distance(const char* op, c10::string_view distance);
// proxy_anchor_loss's inputs: labels in [0, C) (read: CPU tensors), margin finite, alpha > 0.
Problem check_proxy_inputs(const at::Tensor& embeddings, const at::Tensor& labels,
                           const at::Tensor& proxies, const c10::Scalar& margin,
                           const c10::Scalar& alpha);

// grad is the loss's gradient (a scalar of embeddings' dtype, or float64 for a shard), stats the
// forward's, with `columns` per anchor, of stats_type (the accumulation type if undefined).
void check_backward_inputs(const Problem& p, const at::Tensor& grad, const at::Tensor& embeddings,
                           const at::Tensor& stats, int64_t columns,
                           std::optional<at::ScalarType> stats_type = std::nullopt);

// A backward's outputs from the gradients it computed (undefined: zero, allocated only here,
// so that a backward never holds a gradient twice): zeros where wanted but not computed, (0,)
// where output_mask leaves them out.
std::tuple<at::Tensor, at::Tensor> backward_outputs(
    const at::Tensor& ge, const at::Tensor& gr, bool want_e, bool want_r,
    const at::Tensor& embeddings, const std::optional<at::Tensor>& ref_embeddings);

}  // namespace torchkit::pair_losses
