// The pair losses: schemas and input checks. Their autograd formulas call the backward ops
// (torchkit/ops/pair_losses.py).
#include "pair_losses.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <string>

#include "checks.h"

namespace torchkit::pair_losses {

namespace {

// The integer type of a floating type's width, to compare values by their bits.
at::ScalarType bits_type(const at::Tensor& t) {
  switch (t.element_size()) {
    case 2:
      return at::kShort;
    case 4:
      return at::kInt;
    default:
      return at::kLong;
  }
}

void check_labels(const char* op, const char* name, const at::Tensor& labels, const char* of,
                  const at::Tensor& e) {
  TK_CHECK_TYPE(op, at::isIntegralType(labels.scalar_type(), /*includeBool=*/false), name,
                " must have an integer dtype, got ", labels.scalar_type());
  TK_CHECK_VALUE(op, labels.dim() == 1 && labels.size(0) == e.size(0), name,
                 " must be 1-D with one label per row of ", of, " (", e.size(0), "), got shape ",
                 labels.sizes());
}

}  // namespace

Problem check_inputs(const char* op, const at::Tensor& embeddings, const at::Tensor& labels,
                     const std::optional<at::Tensor>& ref_embeddings,
                     const std::optional<at::Tensor>& ref_labels, std::optional<int64_t> shard) {
  Problem p;
  p.op = op;
  check_floating(op, "embeddings", embeddings);
  TK_CHECK_VALUE(op, embeddings.dim() == 2, "embeddings must be 2-D (N, D), got shape ",
                 embeddings.sizes());
  check_same_device(op, "embeddings", embeddings, "labels", labels);
  check_labels(op, "labels", labels, "embeddings", embeddings);
  TK_CHECK_VALUE(op, ref_embeddings.has_value() == ref_labels.has_value(),
                 "ref_embeddings and ref_labels must be given together, got ",
                 ref_embeddings.has_value() ? "ref_embeddings alone" : "ref_labels alone");
  p.N = embeddings.size(0);
  p.D = embeddings.size(1);
  p.M = p.N;
  p.self = !ref_embeddings.has_value();
  if (!p.self) {
    const at::Tensor& r = *ref_embeddings;
    check_same_device(op, "embeddings", embeddings, "ref_embeddings", r);
    check_same_dtype(op, "embeddings", embeddings, "ref_embeddings", r);
    TK_CHECK_VALUE(op, r.dim() == 2 && r.size(1) == p.D,
                   "ref_embeddings must be 2-D (M, D) with embeddings' D, got embeddings of shape ",
                   embeddings.sizes(), " and ref_embeddings of shape ", r.sizes());
    check_same_device(op, "embeddings", embeddings, "ref_labels", *ref_labels);
    check_labels(op, "ref_labels", *ref_labels, "ref_embeddings", r);
    p.M = r.size(0);
  }
  p.offset = p.self ? 0 : -1;
  if (shard.has_value()) {
    TK_CHECK_VALUE(op, !p.self,
                   "shard needs ref_embeddings (every rank's rows, of which the anchors are a "
                   "shard), got ref_embeddings=None");
    // -1 takes any refs; an offset needs the N anchors among the M refs.
    TK_CHECK_VALUE(op, *shard == -1 || (*shard >= 0 && *shard <= p.M - p.N),
                   "shard must be -1 (refs apart from the anchors) or the anchors' first row in "
                   "ref_embeddings, in [0, M - N] = [0, ",
                   p.M - p.N, "], got ", *shard);
    p.shard = true;
    p.offset = *shard;
    // The anchors are those ref rows: their labels must be too (the kernels count an anchor's
    // positives less itself).
    if (p.offset >= 0 && p.N > 0 && labels.device().is_cpu()) {
      const at::Tensor mine = labels.to(at::kLong);
      const at::Tensor theirs = ref_labels->narrow(0, p.offset, p.N).to(at::kLong);
      const at::Tensor differ = mine.ne(theirs).nonzero();
      TK_CHECK_VALUE(op, differ.numel() == 0, "with shard = ", p.offset,
                     ", labels must equal ref_labels[shard:shard + N] (the anchors are those ref "
                     "rows), got a different label at anchor ",
                     differ.numel() ? differ[0].item<int64_t>() : 0);
      // And their rows, compared by their bits (a NaN row is that row too).
      const at::Tensor rows = embeddings.view(bits_type(embeddings));
      const at::Tensor refs = ref_embeddings->narrow(0, p.offset, p.N);
      const at::Tensor unequal = rows.ne(refs.view(bits_type(refs))).any(1).nonzero();
      TK_CHECK_VALUE(op, unequal.numel() == 0, "with shard = ", p.offset,
                     ", embeddings must equal ref_embeddings[shard:shard + N] (the anchors are "
                     "those ref rows), got a different row at anchor ",
                     unequal.numel() ? unequal[0].item<int64_t>() : 0);
    }
  }
  return p;
}

void check_own_stats(Problem& p, bool own_stats) {
  TK_CHECK_VALUE(p.op, !own_stats || (p.shard && p.offset >= 0),
                 "backward: own_stats needs shard >= 0 (the anchors' rows among the refs: "
                 "otherwise the stats are the call's own anyway), got shard = ",
                 p.shard ? std::to_string(p.offset) : std::string("None"));
  p.own_stats = own_stats;
}

Problem whole_of(const Problem& p) {
  Problem q = p;
  q.self = true;
  q.N = p.M;
  q.offset = 0;
  q.grad_first = p.offset;
  q.grad_rows = p.N;
  return q;
}

at::Tensor Problem::parts(std::initializer_list<double> values, const at::Tensor& like) const {
  at::Tensor out = at::empty({static_cast<int64_t>(values.size())},
                             like.options().dtype(at::kDouble).device(at::kCPU));
  std::copy(values.begin(), values.end(), out.data_ptr<double>());
  return out.to(like.device());
}

double check_temperature(const char* op, const c10::Scalar& temperature) {
  return check_positive(op, "temperature", temperature);
}

double check_margin(const char* op, const char* name, const c10::Scalar& margin) {
  const double m = scalar_float(op, name, margin);
  TK_CHECK_VALUE(op, std::isfinite(m), name, " must be finite, got ", m);
  return m;
}

double check_positive(const char* op, const char* name, const c10::Scalar& value) {
  const double v = scalar_float(op, name, value);
  TK_CHECK_VALUE(op, std::isfinite(v) && v > 0, name, " must be finite and > 0, got ", v);
  return v;
}

double check_finite(const char* op, const char* name, const c10::Scalar& value) {
  const double v = scalar_float(op, name, value);
  TK_CHECK_VALUE(op, std::isfinite(v), name, " must be finite, got ", v);
  return v;
}

Mining check_mining(const char* op, c10::string_view mining) {
  if (mining == "all") return Mining::All;
  if (mining == "batch_hard") return Mining::BatchHard;
  TK_CHECK_VALUE(op, mining == "semi_hard",
                 "mining must be 'all', 'batch_hard' or 'semi_hard', got '", mining, "'");
  return Mining::SemiHard;
}

Distance check_distance(const char* op, c10::string_view distance) {
  if (distance == "euclidean") return Distance::Euclidean;
  TK_CHECK_VALUE(op, distance == "cosine", "distance must be 'euclidean' or 'cosine', got '",
                 distance, "'");
  return Distance::Cosine;
}

Problem check_proxy_inputs(const at::Tensor& embeddings, const at::Tensor& labels,
                           const at::Tensor& proxies, const c10::Scalar& margin,
                           const c10::Scalar& alpha) {
  const char* op = "proxy_anchor_loss";
  check_floating(op, "embeddings", embeddings);
  TK_CHECK_VALUE(op, embeddings.dim() == 2, "embeddings must be 2-D (N, D), got shape ",
                 embeddings.sizes());
  check_same_device(op, "embeddings", embeddings, "labels", labels);
  check_labels(op, "labels", labels, "embeddings", embeddings);
  check_same_device(op, "embeddings", embeddings, "proxies", proxies);
  check_same_dtype(op, "embeddings", embeddings, "proxies", proxies);
  TK_CHECK_VALUE(op, proxies.dim() == 2 && proxies.size(1) == embeddings.size(1),
                 "proxies must be 2-D (C, D) with embeddings' D, got embeddings of shape ",
                 embeddings.sizes(), " and proxies of shape ", proxies.sizes());
  Problem p;
  p.op = op;
  p.N = proxies.size(0);
  p.M = embeddings.size(0);
  p.D = embeddings.size(1);
  p.self = false;
  p.margin = check_margin(op, "margin", margin);
  p.alpha = check_positive(op, "alpha", alpha);
  if (labels.numel() > 0 && labels.device().is_cpu()) {
    const at::Tensor l = labels.to(at::kLong);
    const int64_t low = l.min().item<int64_t>(), high = l.max().item<int64_t>();
    TK_CHECK_INDEX(op, low >= 0 && high < p.N, "labels must lie in [0, C) = [0, ", p.N,
                   ") (a row of proxies each), got ", low < 0 ? low : high);
  }
  return p;
}

void check_backward_inputs(const Problem& p, const at::Tensor& grad, const at::Tensor& embeddings,
                           const at::Tensor& stats, int64_t columns,
                           std::optional<at::ScalarType> stats_type) {
  const char* op = p.op;
  TK_CHECK_VALUE(op, grad.dim() == 0, "backward: grad must be a scalar (the loss's), got shape ",
                 grad.sizes());
  // A shard's grad is its caller's scale of the whole loss's, which a reduced dtype would round.
  if (!(p.shard && grad.scalar_type() == at::kDouble))
    check_same_dtype(op, "embeddings", embeddings, "grad", grad);
  check_same_device(op, "embeddings", embeddings, "grad", grad);
  const auto acc =
      stats_type.value_or(embeddings.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  // (a shard's backward with the whole problem's stats: p is whole_of's, N every rank's rows)
  const bool whole = p.grad_rows >= 0;
  TK_CHECK_VALUE(op,
                 stats.dim() == 2 && stats.size(0) == p.N && stats.size(1) == columns &&
                     stats.scalar_type() == acc,
                 "backward: stats must be (", whole ? "M" : "N", ", ", columns, ") = (", p.N, ", ",
                 columns, ") of ", acc, whole ? " (with shard >= 0: the whole problem's)" : "",
                 ", got ", stats.sizes(), " of ", stats.scalar_type());
  check_same_device(op, "embeddings", embeddings, "stats", stats);
}

std::tuple<at::Tensor, at::Tensor> backward_outputs(
    const at::Tensor& ge, const at::Tensor& gr, bool want_e, bool want_r,
    const at::Tensor& embeddings, const std::optional<at::Tensor>& ref_embeddings) {
  auto out = [&](const at::Tensor& g, bool want, const at::Tensor& like) {
    if (!want) return at::empty({0}, embeddings.options());
    return g.defined() ? g : at::zeros_like(like, at::MemoryFormat::Contiguous);
  };
  return {out(ge, want_e, embeddings), out(gr, want_r, want_r ? *ref_embeddings : embeddings)};
}

TORCH_LIBRARY_FRAGMENT(torchkit, m) {
  // Each loss returns (loss, stats): the loss (a scalar of embeddings' dtype; a shard's parts)
  // and per anchor what the backward needs, of the accumulation type (pair_losses.h). Each
  // backward returns (grad_embeddings, grad_ref_embeddings); one output_mask leaves out (and
  // the second for ref_embeddings = None) is (0,). shard: one rank's part of a larger problem
  // (pair_losses.h); proxy_anchor_loss's backward has none (its stats say all).
  m.def(
      "supcon_loss(Tensor embeddings, Tensor labels, Tensor? ref_embeddings, Tensor? ref_labels, "
      "Scalar temperature, int? shard=None) -> (Tensor, Tensor)");
  m.def(
      "_supcon_loss_backward(Tensor grad, Tensor embeddings, Tensor labels, Tensor? "
      "ref_embeddings, Tensor? ref_labels, Tensor stats, Scalar temperature, bool[2] "
      "output_mask, int? shard=None, bool own_stats=False) -> (Tensor, Tensor)");
  m.def(
      "ntxent_loss(Tensor embeddings, Tensor labels, Tensor? ref_embeddings, Tensor? ref_labels, "
      "Scalar temperature, int? shard=None) -> (Tensor, Tensor)");
  m.def(
      "_ntxent_loss_backward(Tensor grad, Tensor embeddings, Tensor labels, Tensor? "
      "ref_embeddings, Tensor? ref_labels, Tensor stats, Scalar temperature, bool[2] "
      "output_mask, int? shard=None, bool own_stats=False) -> (Tensor, Tensor)");
  m.def(
      "contrastive_loss(Tensor embeddings, Tensor labels, Tensor? ref_embeddings, Tensor? "
      "ref_labels, Scalar pos_margin, Scalar neg_margin, str distance=\"euclidean\", int? "
      "shard=None) -> (Tensor, Tensor)");
  m.def(
      "_contrastive_loss_backward(Tensor grad, Tensor embeddings, Tensor labels, Tensor? "
      "ref_embeddings, Tensor? ref_labels, Tensor stats, Scalar pos_margin, Scalar neg_margin, "
      "str distance, bool[2] output_mask, int? shard=None, bool own_stats=False) -> (Tensor, "
      "Tensor)");
  m.def(
      "triplet_margin_loss(Tensor embeddings, Tensor labels, Tensor? ref_embeddings, Tensor? "
      "ref_labels, Scalar margin, str mining, str distance=\"euclidean\", int? shard=None) -> "
      "(Tensor, Tensor)");
  m.def(
      "_triplet_margin_loss_backward(Tensor grad, Tensor embeddings, Tensor labels, Tensor? "
      "ref_embeddings, Tensor? ref_labels, Tensor stats, Scalar margin, str mining, str "
      "distance, bool[2] output_mask, int? shard=None) -> (Tensor, Tensor)");
  m.def(
      "multi_similarity_loss(Tensor embeddings, Tensor labels, Tensor? ref_embeddings, Tensor? "
      "ref_labels, Scalar alpha, Scalar beta, Scalar base, Scalar? miner_epsilon, int? "
      "shard=None) -> (Tensor, Tensor)");
  m.def(
      "_multi_similarity_loss_backward(Tensor grad, Tensor embeddings, Tensor labels, Tensor? "
      "ref_embeddings, Tensor? ref_labels, Tensor stats, Scalar alpha, Scalar beta, Scalar base, "
      "Scalar? miner_epsilon, bool[2] output_mask, int? shard=None, bool own_stats=False) -> "
      "(Tensor, Tensor)");
  m.def(
      "proxy_anchor_loss(Tensor embeddings, Tensor labels, Tensor proxies, Scalar margin, Scalar "
      "alpha, int? shard=None) -> (Tensor, Tensor)");
  m.def(
      "_proxy_anchor_loss_backward(Tensor grad, Tensor embeddings, Tensor labels, Tensor "
      "proxies, Tensor stats, Scalar margin, Scalar alpha, bool[2] output_mask) -> (Tensor, "
      "Tensor)");
}

}  // namespace torchkit::pair_losses
