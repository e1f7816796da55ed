"""Pure-PyTorch reference implementations: the cookbook formulations, short and obvious.

Same signatures as ``torchkit.ops``; tests use them as oracles and benchmarks as peers.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "bilinear_pool",
    "cdist",
    "contrastive_loss",
    "covariance_pool",
    "knn",
    "label_smoothing_cross_entropy",
    "multi_similarity_loss",
    "ntxent_loss",
    "permute_blocks",
    "proxy_anchor_loss",
    "region_confusion",
    "supcon_loss",
    "triplet_margin_loss",
]


def label_smoothing_cross_entropy(
    input: Tensor,
    target: Tensor,
    weight: Optional[Tensor] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.1,
    *,
    exclude_target: bool = False,
) -> Tensor:
    """The cookbook's smoothed-target cross-entropy (see ``torchkit.ops`` for the semantics):
    build the smoothed distribution q explicitly, then ``-Σ w·q·log_softmax``."""
    class_dim = 0 if input.dim() == 1 else 1
    C = input.shape[class_dim]
    eps = label_smoothing
    logp = F.log_softmax(input, dim=class_dim)
    if target.is_floating_point():
        y, keep = target, None
    else:
        keep = target != ignore_index
        y = F.one_hot(torch.where(keep, target, 0), C).movedim(-1, class_dim).to(input.dtype)
    q = (1 - eps) * y + (eps * (1 - y) / max(C - 1, 1) if exclude_target else eps / C)
    shape = [1] * input.dim()
    shape[class_dim] = C
    w = torch.ones(C, dtype=input.dtype, device=input.device) if weight is None else weight
    loss = -(w.view(shape) * q * logp).sum(class_dim)
    if keep is None:
        denominator = loss.new_tensor(loss.numel())
    else:
        loss = torch.where(keep, loss, 0)
        denominator = torch.where(keep, w[torch.where(keep, target, 0)], 0).sum()
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / denominator


def cdist(x1: Tensor, x2: Optional[Tensor] = None, *, squared: bool = False) -> Tensor:
    """The cookbook's broadcasting formula ``sqrt(Σ (x1[:, None] - x2)²)``: exact, but
    O(P·R·M) memory. Zero distances get a zero gradient (``torch.cdist``'s convention)."""
    x2 = x1 if x2 is None else x2
    d2 = ((x1.unsqueeze(-2) - x2.unsqueeze(-3)) ** 2).sum(-1)
    if squared:
        return d2
    # sqrt'(0) is infinite; route zeros around it so that their gradient is 0, not NaN.
    zero = d2 == 0
    return torch.where(zero, 0.0, torch.where(zero, 1.0, d2).sqrt())


def knn(query: Tensor, gallery: Optional[Tensor] = None, k: int = 1, *, squared: bool = False) -> tuple[Tensor, Tensor]:
    """The whole distance matrix (``cdist`` above), then a stable sort: ascending, NaN last,
    ties to the lower index; without a gallery each row's own column sorts after all others."""
    d = cdist(query, gallery, squared=squared)
    order = d.sort(dim=-1, stable=True).indices
    if gallery is None:
        rows = torch.arange(d.shape[-2], device=d.device).unsqueeze(-1)
        own = order == rows  # the diagonal, wherever the sort put it
        order = order.gather(-1, own.to(torch.uint8).sort(dim=-1, stable=True).indices)
    indices = order[..., :k]
    return d.gather(-1, indices), indices


def permute_blocks(x: Tensor, permutation: Tensor, num_blocks: int) -> Tensor:
    """Block gather by slicing: output block b is input block permutation[..., b]; pixels
    beyond the last full block row/column stay in place."""
    n = num_blocks
    bh, bw = x.shape[-2] // n, x.shape[-1] // n
    batch = x if x.dim() == 4 else x.unsqueeze(0)
    out = batch.clone()
    for k, perm in enumerate(permutation.reshape(-1, n * n).tolist()):
        for b, src in enumerate(perm):
            (i, j), (si, sj) = divmod(b, n), divmod(src, n)
            out[k, :, i * bh : (i + 1) * bh, j * bw : (j + 1) * bw] = batch[
                k, :, si * bh : (si + 1) * bh, sj * bw : (sj + 1) * bw
            ]
    return out if x.dim() == 4 else out[0]


def region_confusion(
    x: Tensor, num_blocks: int = 7, neighbourhood: int = 2, *, generator: Optional[torch.Generator] = None
) -> tuple[Tensor, Tensor]:
    """The cookbook's RCM snippet, image by image (stable argsort; the region of full blocks
    is shuffled and the remainder rows/columns are left in place). Returns
    ``(shuffled, permutation)`` like ``torchkit.ops.region_confusion``."""
    n, k = num_blocks, neighbourhood
    draw_device = generator.device if generator is not None else torch.device("cpu")
    batch = x if x.dim() == 4 else x.unsqueeze(0)
    bh, bw = batch.shape[-2] // n, batch.shape[-1] // n
    outs, perms = [], []
    for img in batch:
        X = img[:, : n * bh, : n * bw]
        # Shuffle rows: for each block column j, rows are reordered by argsort(i + r).
        Q = (
            torch.arange(n).unsqueeze(1) * torch.ones(1, n).long()
            + torch.randint(low=-k, high=k, size=(n, n), generator=generator, device=draw_device).cpu()
        )
        Q = torch.argsort(Q, dim=0, stable=True)
        X = [torch.chunk(row, chunks=n, dim=2) for row in torch.chunk(X, chunks=n, dim=1)]
        X = [[X[Q[i, j].item()][j] for j in range(n)] for i in range(n)]
        # Shuffle columns: for each block row i, columns are reordered by argsort(j + r).
        Q2 = (
            torch.ones(n, 1).long() * torch.arange(n).unsqueeze(0)
            + torch.randint(low=-k, high=k, size=(n, n), generator=generator, device=draw_device).cpu()
        )
        Q2 = torch.argsort(Q2, dim=1, stable=True)
        X = [[X[i][Q2[i, j].item()] for j in range(n)] for i in range(n)]
        Y = torch.cat([torch.cat(row, dim=2) for row in X], dim=1)
        out = img.clone()
        out[:, : n * bh, : n * bw] = Y
        outs.append(out)
        # Output block (i, j) came from input block (Q[i, Q2[i, j]], Q2[i, j]).
        perms.append(torch.stack([Q[i, Q2[i]] * n + Q2[i] for i in range(n)]).view(n * n))
    perm = torch.stack(perms).to(x.device)
    if x.dim() == 3:
        return outs[0], perm[0]
    return torch.stack(outs), perm


def bilinear_pool(x: Tensor, y: Optional[Tensor] = None, *, sqrt_eps: float = 1e-5, l2_eps: float = 1e-12) -> Tensor:
    """The cookbook's composition: bmm / HW, signed sqrt, F.normalize (two-stream with y)."""
    N, D, H, W = x.shape
    X = x.reshape(N, D, H * W)
    Y = X if y is None else y.reshape(N, y.shape[1], H * W)
    Z = torch.bmm(X, Y.transpose(1, 2)) / (H * W)
    Z = Z.reshape(N, Z.shape[1] * Z.shape[2])
    Z = torch.sign(Z) * torch.sqrt(torch.abs(Z) + sqrt_eps)
    return F.normalize(Z, eps=l2_eps)


def covariance_pool(x: Tensor, *, iterations: int = 5, sqrt: bool = True, triu: bool = True) -> Tensor:
    """fast-MPN-COV's ``Covpool`` → ``Sqrtm`` → ``Triuvec`` as plain tensor ops, autograd
    through every Newton–Schulz step. Reduced types compute in float32. A zero-trace sample
    (constant features) gives 0, with a finite gradient."""
    X = x.flatten(2)
    X = X.float() if X.dtype in (torch.float16, torch.bfloat16) else X
    Xc = X - X.mean(2, keepdim=True)
    out = Xc @ Xc.mT / X.shape[2]
    if sqrt:
        tr = out.diagonal(dim1=-2, dim2=-1).sum(-1).view(-1, 1, 1)
        tr = torch.where(tr == 0, 1.0, tr)  # Σ = 0: A = 0 and F(A) = 0, whatever tr stands for
        A = out / tr
        I3 = 3 * torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
        T = 0.5 * (I3 - A)
        Y = A @ T
        if iterations >= 2:
            Z = T
            for _ in range(iterations - 2):
                T = 0.5 * (I3 - Z @ Y)
                Y, Z = Y @ T, T @ Z
            Y = 0.5 * Y @ (I3 - Z @ Y)
        out = Y * tr.sqrt()
    if triu:
        rows, cols = torch.triu_indices(out.shape[-1], out.shape[-1], device=out.device)
        out = out[:, rows, cols]
    return out.to(x.dtype)


def _rows(embeddings, labels, ref_embeddings, ref_labels):
    """The pair losses' rows as PML takes them (F.normalize'd) and which (anchor, ref) entries
    are pairs (every ref row; every other row without refs), positives and negatives."""
    e = F.normalize(embeddings, dim=1)
    if ref_embeddings is None:
        r, ref_labels = e, labels
        pairs = ~torch.eye(len(e), dtype=torch.bool, device=e.device)
    else:
        r = F.normalize(ref_embeddings, dim=1)
        pairs = torch.ones(len(e), len(r), dtype=torch.bool, device=e.device)
    same = labels[:, None] == ref_labels[None, :]
    return e, r, pairs, same & pairs, ~same & pairs


def _pairs(embeddings, labels, temperature, ref_embeddings, ref_labels):
    """x = cos/τ and the pair masks (_rows)."""
    e, r, pairs, positive, negative = _rows(embeddings, labels, ref_embeddings, ref_labels)
    return e @ r.T / temperature, pairs, positive, negative


def _distances(embeddings, labels, ref_embeddings, ref_labels, distance="euclidean"):
    """Euclidean distances of the normalised rows, computed from their differences (PML's
    torch.cdist takes the matmul form, which returns ~0 for near-duplicates), and the masks.
    distance="cosine": −s, the cosine similarity negated, which orders pairs as a distance;
    between unit rows (F.normalize's of a norm above its eps) with s > 1/2, s = 1 − d²/2: the
    distance keeps the digits of 1 − s of near-duplicates (and is 0 between equal rows) where
    the rounded products give 1 ± ulp."""
    e, r, _, positive, negative = _rows(embeddings, labels, ref_embeddings, ref_labels)
    d = torch.cdist(e, r, compute_mode="donot_use_mm_for_euclid_dist")
    if distance == "cosine":
        x, y = embeddings, embeddings if ref_embeddings is None else ref_embeddings
        unit = [(v.norm(dim=1) > 1e-12) & v.isfinite().all(1) for v in (x, y)]
        s = e @ r.T
        s = torch.where(unit[0][:, None] & unit[1][None, :] & (s > 0.5), 1 - d * d / 2, s)
        return -s, positive, negative
    return d, positive, negative


def _no_loss(positive: Tensor, negative: Tensor) -> bool:
    """PML's pair losses give 0 without a positive or a negative pair, and (its check that
    every index list has at most one entry) with at most one of each."""
    p, n = int(positive.sum()), int(negative.sum())
    return p == 0 or n == 0 or (p <= 1 and n <= 1)


def _mean_non_zero(losses: Tensor) -> Tensor:
    """PML's AvgNonZeroReducer, keeping NaN terms (it drops them: NaN > 0 is false)."""
    kept = (losses > 0) | losses.isnan()
    return losses[kept].mean() if kept.any() else losses.sum() * 0


def supcon_loss(
    embeddings: Tensor,
    labels: Tensor,
    temperature: float = 0.1,
    *,
    ref_embeddings: Optional[Tensor] = None,
    ref_labels: Optional[Tensor] = None,
) -> Tensor:
    """pytorch-metric-learning's SupConLoss with its defaults, on the full N×M matrix."""
    x, pairs, positive, negative = _pairs(embeddings, labels, temperature, ref_embeddings, ref_labels)
    zero = (embeddings * 0).sum()
    if _no_loss(positive, negative):
        return zero
    lse = torch.logsumexp(x.masked_fill(~pairs, float("-inf")), dim=1)
    count = positive.sum(1)
    loss = torch.where(count > 0, lse - (x * positive).sum(1) / count.clamp_min(1), 0.0)
    counted = (loss > 0) | loss.isnan()
    return loss[counted].mean() if counted.any() else zero


def ntxent_loss(
    embeddings: Tensor,
    labels: Tensor,
    temperature: float = 0.07,
    *,
    ref_embeddings: Optional[Tensor] = None,
    ref_labels: Optional[Tensor] = None,
) -> Tensor:
    """pytorch-metric-learning's NTXentLoss with its defaults, on the full N×M matrix."""
    x, _, positive, negative = _pairs(embeddings, labels, temperature, ref_embeddings, ref_labels)
    if _no_loss(positive, negative):
        return (embeddings * 0).sum()
    log_s = torch.logsumexp(x.masked_fill(~negative, float("-inf")), dim=1, keepdim=True)
    q = torch.exp(x - torch.logaddexp(x, log_s))  # per pair: its softmax against i's negatives
    pair_loss = -torch.log(q + torch.finfo(x.dtype).tiny)
    return pair_loss[positive].mean()


def contrastive_loss(
    embeddings: Tensor,
    labels: Tensor,
    pos_margin: float = 0.0,
    neg_margin: float = 1.0,
    *,
    distance: str = "euclidean",
    indices_tuple: Optional[tuple] = None,
    ref_embeddings: Optional[Tensor] = None,
    ref_labels: Optional[Tensor] = None,
) -> Tensor:
    """pytorch-metric-learning's ContrastiveLoss with its defaults (distance="cosine": with
    CosineSimilarity()), on the full N×M matrix; indices_tuple: on the pairs it lists (a
    miner's; triplets (a, p, n) as the pairs (a, p) and (a, n))."""
    d, positive, negative = _distances(embeddings, labels, ref_embeddings, ref_labels, distance)
    if indices_tuple is None:
        a1, p = positive.nonzero(as_tuple=True)
        a2, n = negative.nonzero(as_tuple=True)
    else:
        a1, p, a2, n = indices_tuple if len(indices_tuple) == 4 else (*indices_tuple[:2], *indices_tuple[::2])
    if all(len(t) <= 1 for t in (a1, p, a2, n)):  # PML: every index list of length <= 1
        return (embeddings * 0).sum()
    if distance == "cosine":  # similarities: the margins on the other side
        s = -d
        return _mean_non_zero(F.relu(pos_margin - s[a1, p])) + _mean_non_zero(F.relu(s[a2, n] - neg_margin))
    return _mean_non_zero(F.relu(d[a1, p] - pos_margin)) + _mean_non_zero(F.relu(neg_margin - d[a2, n]))


def triplet_margin_loss(
    embeddings: Tensor,
    labels: Tensor,
    margin: float = 0.05,
    *,
    mining: str = "all",
    distance: str = "euclidean",
    indices_tuple: Optional[tuple] = None,
    ref_embeddings: Optional[Tensor] = None,
    ref_labels: Optional[Tensor] = None,
) -> Tensor:
    """pytorch-metric-learning's TripletMarginLoss with its defaults (distance="cosine": loss
    and miner with CosineSimilarity()), on the triplets of all of them, TripletMarginMiner's
    semihard ones or BatchHardMiner's, from the full N×M matrix (and, but for batch_hard, an
    N×M×M mask). With cosine, d = −s: s_an − s_ap + margin is d_ap − d_an + margin, and the
    hardest positive and negative are the same rows. indices_tuple (mining="all"): on the
    triplets it lists (a miner's; pairs as PML converts them: each positive pair with each
    negative pair of its anchor)."""
    d, positive, negative = _distances(embeddings, labels, ref_embeddings, ref_labels, distance)
    if indices_tuple is not None:
        if len(indices_tuple) == 3:
            a, p, n = indices_tuple
        else:
            a1, p1, a2, n2 = indices_tuple
            i, j = torch.where(a1[:, None] == a2[None, :])
            a, p, n = a1[i], p1[i], n2[j]
        return _mean_non_zero(F.relu(d[a, p] - d[a, n] + margin))
    if mining == "batch_hard":
        far = d.masked_fill(~positive, float("-inf")).max(1)  # ties: the first index
        near = d.masked_fill(~negative, float("inf")).min(1)
        anchors = positive.any(1) & negative.any(1)
        rows = torch.arange(len(d), device=d.device)[anchors]
        ap, an = d[rows, far.indices[anchors]], d[rows, near.indices[anchors]]
    else:
        a, p, n = torch.where(positive[:, :, None] & negative[:, None, :])
        ap, an = d[a, p], d[a, n]
        if mining == "semi_hard":
            keep = (ap < an) | ap.isnan() | an.isnan()  # (PML's miner drops NaN triplets)
            ap, an = ap[keep], an[keep]
    return _mean_non_zero(F.relu(ap - an + margin))


def multi_similarity_loss(
    embeddings: Tensor,
    labels: Tensor,
    alpha: float = 2.0,
    beta: float = 50.0,
    base: float = 0.5,
    *,
    miner_epsilon: Optional[float] = 0.1,
    ref_embeddings: Optional[Tensor] = None,
    ref_labels: Optional[Tensor] = None,
) -> Tensor:
    """pytorch-metric-learning's MultiSimilarityLoss with its defaults, on the pairs of its
    MultiSimilarityMiner(epsilon=miner_epsilon) (every pair for None), on the full N×M matrix;
    a NaN similarity keeps its pair (PML's miner drops it)."""
    e, r, _, positive, negative = _rows(embeddings, labels, ref_embeddings, ref_labels)
    s = e @ r.T
    zero = (embeddings * 0).sum()
    if miner_epsilon is not None:
        if not positive.any() or not negative.any():
            return zero
        hardest_negative = s.masked_fill(~negative, float("-inf")).amax(1, keepdim=True)
        hardest_positive = s.masked_fill(~positive, float("inf")).amin(1, keepdim=True)
        nan = s.isnan() | hardest_negative.isnan() | hardest_positive.isnan()
        positive = positive & ((s - miner_epsilon < hardest_negative) | nan)
        negative = negative & ((s + miner_epsilon > hardest_positive) | nan)
    if positive.sum() <= 1 and negative.sum() <= 1:
        return zero
    one = torch.zeros(len(s), 1, dtype=s.dtype, device=s.device)  # log(1 + Σ)
    lp = torch.logsumexp(torch.cat([(alpha * (base - s)).masked_fill(~positive, float("-inf")), one], 1), 1)
    ln = torch.logsumexp(torch.cat([(beta * (s - base)).masked_fill(~negative, float("-inf")), one], 1), 1)
    return (lp / alpha + ln / beta).mean()


def proxy_anchor_loss(
    embeddings: Tensor, labels: Tensor, proxies: Tensor, margin: float = 0.1, alpha: float = 32.0
) -> Tensor:
    """pytorch-metric-learning's ProxyAnchorLoss holding ``proxies``, with its defaults, on the
    full N×C matrix."""
    s = F.normalize(embeddings, dim=1) @ F.normalize(proxies, dim=1).T
    positive = F.one_hot(labels.long(), len(proxies)).bool()
    one = torch.zeros(1, len(proxies), dtype=s.dtype, device=s.device)  # log(1 + Σ)
    lp = torch.logsumexp(torch.cat([(alpha * (margin - s)).masked_fill(~positive, float("-inf")), one]), 0)
    ln = torch.logsumexp(torch.cat([(alpha * (s + margin)).masked_fill(positive, float("-inf")), one]), 0)
    with_positives = positive.any(0)
    pos = lp.sum() / with_positives.sum() if with_positives.any() else (s * 0).sum()
    return pos + ln.sum() / len(proxies)
