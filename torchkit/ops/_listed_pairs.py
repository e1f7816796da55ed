"""The pair losses over the pairs or triplets a pytorch-metric-learning miner returns
(indices_tuple=): PML's loss on that list: a short list (at most GATHER_FRACTION of the N × M
pairs) in O(list · D) time and memory, never the N × M matrix PML computes to index it, a
longer one from that matrix, exact (nor NT-Xent's positive × negative pairs matrix, ever).

The rows are normalised as F.normalize does, in float64 (every float32, float16 and bfloat16
value exactly, F.normalize's norm without over- or underflow), and each listed pair's
distance is exact, as the kernels' are (csrc/cpu/pair_losses_euclidean_cpu.cpp): taken from
its rows' difference (a short list) or from torchkit.ops.cdist of the rows (a long one);
equal rows at 0, a zero row at exactly 1 from a row of norm > eps. For distance="cosine" the
similarity is the products' sum, or 1 − d²/2 between near rows (s > 1/2) of norm > eps,
exactly 1 between equal ones. The terms, which count and the means are then PML's, in
float64, and the loss is rounded once to the inputs' dtype; autograd differentiates the whole.
SupCon and multi-similarity are PML's "matrix" losses: a pair listed twice counts once (its
mask entry), per anchor sums are scattered over the listed pairs; NT-Xent and the Euclidean
losses count every listed pair, as PML indexes them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchkit.ops._common import describe, dtype_name

_EPS = 1e-12  # F.normalize's


def check_indices_tuple(op: str, indices_tuple, N: int, M: int, device: torch.device) -> tuple[Tensor, ...]:
    """The tuple as PML's miners return it: 3 index tensors (anchors, positives, negatives:
    triplets) or 4 (anchors, positives, anchors, negatives: pairs), 1-D, of an integer dtype,
    on the embeddings' device; anchors index the N embeddings, the others the M refs (the
    embeddings themselves without refs). As int64."""
    if not isinstance(indices_tuple, (tuple, list)) or len(indices_tuple) not in (3, 4):
        raise TypeError(
            f"{op}: indices_tuple must be a tuple of 3 index tensors (anchors, positives, negatives) or 4 "
            f"(anchors, positives, anchors, negatives), as pytorch-metric-learning's miners return; got "
            f"{describe(indices_tuple)}"
            + (f" of {len(indices_tuple)}" if isinstance(indices_tuple, (tuple, list)) else "")
        )
    triplets = len(indices_tuple) == 3
    for k, t in enumerate(indices_tuple):
        name = f"indices_tuple[{k}]"
        if not torch.is_tensor(t):
            raise TypeError(f"{op}: {name} must be a Tensor of indices, got {describe(t)}")
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise TypeError(f"{op}: {name} must have an integer dtype, got {dtype_name(t.dtype)}")
        if t.dim() != 1:
            raise ValueError(f"{op}: {name} must be 1-D, got shape {list(t.shape)}")
        if t.device != device:
            raise ValueError(f"{op}: embeddings and {name} must be on the same device, got {device} and {t.device}")
    sizes = [t.shape[0] for t in indices_tuple]
    if triplets and not sizes[0] == sizes[1] == sizes[2]:
        raise ValueError(f"{op}: indices_tuple's three tensors must have one length (one triplet each), got {sizes}")
    if not triplets and (sizes[0] != sizes[1] or sizes[2] != sizes[3]):
        raise ValueError(
            f"{op}: indices_tuple's anchors and positives, and its anchors and negatives, must have one length "
            f"(one pair each), got {sizes}"
        )
    out = tuple(t.long() for t in indices_tuple)
    for k, t in enumerate(out):
        anchors = k == 0 or (k == 2 and not triplets)
        high, rows = (N, "embeddings") if anchors else (M, "ref_embeddings (or embeddings without them)")
        _check_range(op, f"indices_tuple[{k}]", t, high, rows)
    return out


def _check_range(op: str, name: str, t: Tensor, high: int, rows: str) -> None:
    """Indices in [0, high): the first bad one named where the values are read on the host
    (CPU tensors, eagerly), else a device-side assertion (no synchronisation)."""
    what = f"{op}: {name} must index the rows of {rows}, in [0, {high})"
    if t.numel() == 0:
        return
    ok = ((t >= 0) & (t < high)).all()
    if torch.compiler.is_compiling() or t.device.type != "cpu":
        torch._assert_async(ok, what)
    elif not bool(ok):
        bad = int(t[(t < 0) | (t >= high)][0])
        raise IndexError(f"{what}, got {bad}")


def _normalised(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """F.normalize's rows of x in float64, with per row whether it is all zero and whether it
    is a unit row (its norm finite and above eps: norm 1 in exact arithmetic). The norm is
    taken of the row scaled by a power of two near its largest entry (two exact factors), so
    that it neither overflows nor underflows anywhere in float64's range."""
    x = x.double()
    top = x.abs().amax(1, keepdim=True) if x.shape[1] > 0 else x.new_zeros(x.shape[0], 1)  # (D = 0: zero rows)
    finite = top.isfinite() & (top > 0)
    # (a power of two within a factor 2 of the largest entry: log2's rounding may reach the next)
    exponent = torch.where(finite, torch.log2(torch.where(finite, top, 1.0)).floor(), 0.0)
    half = (exponent / 2).floor()
    scaled = x * torch.pow(2.0, -half) * torch.pow(2.0, half - exponent)
    norm = torch.linalg.vector_norm(scaled, dim=1, keepdim=True)
    norm = norm * torch.pow(2.0, half) * torch.pow(2.0, exponent - half)
    norm = torch.where(finite, norm, top)  # 0, ∞ or NaN: the row's own
    e = x / norm.clamp_min(_EPS)
    zero = (x == 0).all(1)
    unit = (norm.squeeze(1) > _EPS) & norm.squeeze(1).isfinite()
    return e, zero, unit


def _exactly(v: Tensor, value: float, where: Tensor) -> Tensor:
    """v with `value` where `where` holds, keeping v's gradient there (v is within an ulp of
    value there, so that value − v is exact and v + (value − v) rounds to value)."""
    return torch.where(where, v + (value - v).detach(), v)


# A list of at most this fraction of the N × M pairs gathers its pairs' rows (O(list · D));
# a longer one (a triplet miner's lists reach N·M·(M/classes)) takes the pairs' values from the
# N × M matrix, as PML does, but exact (torchkit.ops.cdist on the float64 rows).
GATHER_FRACTION = 0.25


def _rows(x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """_normalised's rows of x, with per row whether it holds NaN or ∞: such a row is
    normalised as zeros and its pairs' values made NaN after, so that a row in no listed pair
    takes no part (its gradient 0, not 0 · NaN), as in the kernels."""
    bad = ~x.isfinite().all(1)
    return (*_normalised(torch.where(bad[:, None], 0.0, x)), bad)


def _value_matrix(embeddings: Tensor, refs: Tensor, distance: str, same_rows: bool) -> Tensor:
    """pair_values of every (embeddings row, refs row) pair, N × M: exact distances from
    torchkit.ops.cdist of the float64 rows (as PML computes its matrix, but exact)."""
    from torchkit.ops.cdist import cdist

    e, ze, ue, bad_e = _rows(embeddings)
    r, zr, ur, bad_r = (e, ze, ue, bad_e) if same_rows else _rows(refs)
    d = cdist(e, None if same_rows else r)  # (exact: equal rows at 0)
    s = e @ r.T if distance == "cosine" else None
    return _values(d, s, ze[:, None], ue[:, None], zr[None, :], ur[None, :], bad_e[:, None] | bad_r[None, :], distance)


def _values(d, s, zx, ux, zy, uy, bad, distance: str) -> Tensor:
    """The pairs' values from their float64 distances d (and cosines s) and their rows' flags."""
    if distance == "euclidean":
        values = _exactly(d, 1.0, (zx & uy) | (ux & zy))
    else:
        units = ux & uy
        s = torch.where(units & (s > 0.5), 1 - d * d / 2, s)
        values = _exactly(s, 1.0, units & (d == 0))  # (equal rows: at distance exactly 0)
    return torch.where(bad, float("nan"), values)


def pair_values(embeddings: Tensor, refs: Tensor, pairs: list, distance: str, same_rows: bool) -> list[Tensor]:
    """Per list of pairs (rows, cols) (row rows[k] of embeddings, row cols[k] of refs), its
    values, float64: the Euclidean distance of the normalised rows, or their cosine similarity
    (module docstring). The rows are normalised once, and the lists taken together."""
    sizes = [rows.shape[0] for rows, _ in pairs]
    rows, cols = torch.cat([r for r, _ in pairs]), torch.cat([c for _, c in pairs])
    if not _short(rows.shape[0], embeddings, refs):
        return list(_value_matrix(embeddings, refs, distance, same_rows)[rows, cols].split(sizes))
    e, ze, ue, bad_e = _rows(embeddings)
    r, zr, ur, bad_r = (e, ze, ue, bad_e) if same_rows else _rows(refs)
    x, y = e.index_select(0, rows), r.index_select(0, cols)
    d = torch.linalg.vector_norm(x - y, dim=1)  # (its gradient at 0 is 0, cdist's)
    s = (x * y).sum(1) if distance == "cosine" else None
    values = _values(d, s, ze[rows], ue[rows], zr[cols], ur[cols], bad_e[rows] | bad_r[cols], distance)
    return list(values.split(sizes))


def _short(pairs: int, embeddings: Tensor, refs: Tensor) -> bool:
    """Whether a list of this many pairs is taken pair by pair (GATHER_FRACTION)."""
    return pairs <= GATHER_FRACTION * embeddings.shape[0] * refs.shape[0]


def _masked_logsumexp(x: Tensor, keep: Tensor) -> Tensor:
    """Per row, log Σ exp(x) over the entries where keep; −∞ for none (shift detached, dropped
    entries exp(−∞) = 0: no gradient, no NaN)."""
    masked = torch.where(keep, x, float("-inf"))
    top = masked.detach().amax(1, keepdim=True)
    shift = torch.where(top.isfinite(), top, 0.0)
    return (shift + torch.log(torch.exp(masked - shift).sum(1, keepdim=True))).squeeze(1)


def _dense_matrix_loss(op: str, embeddings, refs, same, a1, p, a2, n, params) -> Tensor:
    """SupCon or multi-similarity on a long list: PML's own masks (N × M) and sums over the
    exact N × M cosine matrix."""
    s = _value_matrix(embeddings, refs, "cosine", same)
    pos = torch.zeros_like(s, dtype=torch.bool).index_put((a1, p), torch.ones_like(a1, dtype=torch.bool))
    neg = torch.zeros_like(s, dtype=torch.bool).index_put((a2, n), torch.ones_like(a2, dtype=torch.bool))
    _check_disjoint(op, (pos & neg).any())
    if op == "supcon_loss":
        x = s / params[0]
        lse = _masked_logsumexp(x, pos | neg)
        count = pos.sum(1)
        summed = torch.where(pos, x - lse[:, None], 0.0).sum(1)
        return _mean_above_zero(-torch.where(count > 0, summed / count.clamp_min(1), 0.0))
    alpha, beta, base, _ = params
    zero = torch.zeros(s.shape[0], dtype=s.dtype, device=s.device)
    lp = torch.logaddexp(zero, _masked_logsumexp(alpha * (base - s), pos))
    ln = torch.logaddexp(zero, _masked_logsumexp(beta * (s - base), neg))
    return (lp / alpha + ln / beta).mean()


def _mean_above_zero(terms: Tensor, counted: Tensor | None = None) -> Tensor:
    """PML's AvgNonZeroReducer over the terms where `counted` (all), NaN terms kept (the loss
    is then NaN, where PML drops them); 0 for none."""
    kept = ~(terms <= 0)
    if counted is not None:
        kept = kept & counted
    total = torch.where(kept, terms, 0.0).sum()
    return total / kept.sum().clamp_min(1)


def _zero(embeddings: Tensor, refs: Tensor | None) -> Tensor:
    """A loss of 0 that carries zero gradients to the inputs (NaN inputs included)."""
    out = embeddings.flatten()[:0].sum()
    return out if refs is None else out + refs.flatten()[:0].sum()


def _first_of_each(keys: Tensor) -> Tensor:
    """Per entry, whether it is the first of its value in keys (a mask's entry set once),
    without a data-dependent size (torch.unique's)."""
    order = torch.sort(keys, stable=True)
    first = torch.ones_like(keys, dtype=torch.bool)
    first[1:] = order.values[1:] != order.values[:-1]
    return torch.zeros_like(first).scatter(0, order.indices, first)


def _segment_logsumexp(x: Tensor, index: Tensor, n: int, keep: Tensor) -> Tensor:
    """Per segment k < n: log Σ exp(x) over its entries (index = k) where keep; −∞ for none.
    The shift is detached (as PML's max), and dropped entries give exp(−∞) = 0, no gradient."""
    masked = torch.where(keep, x, float("-inf"))
    top = torch.full((n,), float("-inf"), dtype=x.dtype, device=x.device)
    top = top.scatter_reduce(0, index, masked.detach(), "amax").detach()
    shift = torch.where(top.isfinite(), top, 0.0)  # (none: −∞; NaN stays in the sum below)
    total = torch.zeros(n, dtype=x.dtype, device=x.device).index_add(0, index, torch.exp(masked - shift[index]))
    return shift + torch.log(total)


def _pair_masks(op: str, a1, p, a2, n, M: int) -> tuple[Tensor, Tensor]:
    """PML's masks of a "matrix" loss as weights of the listed pairs: each (anchor, ref) entry
    once; refused as PML's assertion refuses it, a pair listed both positive and negative."""
    pos_keys, neg_keys = a1 * M + p, a2 * M + n
    _check_disjoint(op, torch.isin(pos_keys, neg_keys).any())
    return _first_of_each(pos_keys), _first_of_each(neg_keys)


def _check_disjoint(op: str, both: Tensor) -> None:
    what = f"{op}: indices_tuple lists a pair both as a positive and as a negative (PML asserts each is either)"
    if torch.compiler.is_compiling() or both.device.type != "cpu":
        torch._assert_async(~both, what)
    elif bool(both):
        raise ValueError(what)


def listed_loss(op: str, embeddings, refs, indices, params) -> Tensor:
    """The pair loss op with params (as its spec lists them) on the checked indices: PML's
    loss on the pairs or triplets they list."""
    rows = embeddings if refs is None else refs
    same = refs is None
    if op != "triplet_margin_loss":
        a1, p, a2, n = indices if len(indices) == 4 else (indices[0], indices[1], indices[0], indices[2])
        if all(t.shape[0] <= 1 for t in (a1, p, a2, n)):  # PML: every index list of at most one
            return _zero(embeddings, refs)
    if op in ("supcon_loss", "ntxent_loss", "multi_similarity_loss"):
        if op != "multi_similarity_loss" and (a1.shape[0] == 0 or a2.shape[0] == 0):  # (PML's rule for them)
            return _zero(embeddings, refs)
        if op != "ntxent_loss" and not _short(a1.shape[0] + a2.shape[0], embeddings, rows):
            return _dense_matrix_loss(op, embeddings, rows, same, a1, p, a2, n, params).to(embeddings.dtype)
        pos, neg = pair_values(embeddings, rows, [(a1, p), (a2, n)], "cosine", same)
        N = embeddings.shape[0]
        if op == "ntxent_loss":  # per positive pair, against its anchor's listed negatives
            x, y = pos / params[0], neg / params[0]
            negatives = _segment_logsumexp(y, a2, N, torch.ones_like(a2, dtype=torch.bool))
            q = torch.exp(x - torch.logaddexp(x, negatives[a1]))
            tiny = torch.finfo(torch.float64 if embeddings.dtype == torch.float64 else torch.float32).tiny
            return (-torch.log(q + tiny)).mean().to(embeddings.dtype)
        w_pos, w_neg = _pair_masks(op, a1, p, a2, n, rows.shape[0])
        positives = torch.zeros(N, dtype=torch.float64, device=pos.device).index_add(0, a1, w_pos.double())
        if op == "supcon_loss":
            x, y = pos / params[0], neg / params[0]
            lse = _segment_logsumexp(torch.cat([x, y]), torch.cat([a1, a2]), N, torch.cat([w_pos, w_neg]))
            summed = torch.zeros(N, dtype=torch.float64, device=pos.device)
            summed = summed.index_add(0, a1, torch.where(w_pos, x - lse[a1], 0.0))
            per_anchor = -torch.where(positives > 0, summed / positives.clamp_min(1), 0.0)
            return _mean_above_zero(per_anchor).to(embeddings.dtype)
        alpha, beta, base, _ = params
        zero = torch.zeros(N, dtype=torch.float64, device=pos.device)
        lp = torch.logaddexp(zero, _segment_logsumexp(alpha * (base - pos), a1, N, w_pos))
        ln = torch.logaddexp(zero, _segment_logsumexp(beta * (neg - base), a2, N, w_neg))
        return (lp / alpha + ln / beta).mean().to(embeddings.dtype)
    if op == "contrastive_loss":
        pos_margin, neg_margin, distance = params
        pos, neg = pair_values(embeddings, rows, [(a1, p), (a2, n)], distance, same)
        if distance == "cosine":  # similarities: the margins on the other side
            loss = _mean_above_zero(pos_margin - pos) + _mean_above_zero(neg - neg_margin)
        else:
            loss = _mean_above_zero(pos - pos_margin) + _mean_above_zero(neg_margin - neg)
        return loss.to(embeddings.dtype)
    margin, _, distance = params
    sign = -1.0 if distance == "cosine" else 1.0  # s_an − s_ap is −(d_ap − d_an) with d = −s
    if len(indices) == 3:
        a, p, n = indices
        if a.shape[0] == 0:
            return _zero(embeddings, refs)
        ap, an = pair_values(embeddings, rows, [(a, p), (a, n)], distance, same)
        return _mean_above_zero(sign * (ap - an) + margin).to(embeddings.dtype)
    # Pairs: PML's triplets of each positive pair with each negative pair of its anchor.
    a1, p, a2, n = indices
    match = a1[:, None] == a2[None, :]
    ap, an = pair_values(embeddings, rows, [(a1, p), (a2, n)], distance, same)
    terms = sign * (ap[:, None] - an[None, :]) + margin
    return _mean_above_zero(terms, match).to(embeddings.dtype)
