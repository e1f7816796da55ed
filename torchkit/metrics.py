"""Retrieval metrics of metric learning, on exact k-nearest neighbours (``torchkit.ops.knn``).

Without a gallery both are leave-one-out over ``embeddings`` (each query ranks every other
row; the CUB-200, Cars-196 and SOP protocol); with one they rank queries against the gallery
(the In-Shop protocol). Neither materialises the query x gallery distance matrix.

With ``group`` (a ``torch.distributed`` process group, e.g. ``torch.distributed.group.WORLD``)
every rank passes its own shard of the embeddings, labels and gallery, and every rank gets
the values one process computes on the concatenation of the shards in rank order. The
neighbours come from ``torchkit.distributed.knn``'s ring, with the labels travelling beside
their rows: nobody gathers the embeddings.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch
from torch import Tensor

from torchkit import distributed
from torchkit.distributed import _Shards
from torchkit.ops._common import as_int, check_tensor, describe

__all__ = ["map_at_r", "recall_at_k"]


def _check_labels(op: str, name: str, labels: Any, rows: Tensor, rows_name: str) -> None:
    check_tensor(op, name, labels)
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"{op}: {name} must have an integer dtype, got {labels.dtype}")
    if labels.shape != rows.shape[:1]:
        raise ValueError(
            f"{op}: {name} must be (N,) = ({rows.shape[0]},), one per row of {rows_name}, "
            f"got shape {tuple(labels.shape)}"
        )
    if labels.device != rows.device:
        raise ValueError(
            f"{op}: {rows_name} and {name} must be on the same device, got {rows.device} and {labels.device}"
        )


def _check(op: str, embeddings: Any, labels: Any, gallery: Any, gallery_labels: Any) -> None:
    distributed._check_embeddings(op, "embeddings", embeddings, "gallery", gallery)
    _check_labels(op, "labels", labels, embeddings, "embeddings")
    if (gallery is None) != (gallery_labels is None):
        raise ValueError(f"{op}: gallery and gallery_labels go together; got only one of them")
    if gallery is not None:
        _check_labels(op, "gallery_labels", gallery_labels, gallery, "gallery")


def _check_ks(op: str, ks: Any) -> tuple[int, ...]:
    not_iterable = isinstance(ks, (str, bytes)) or not isinstance(ks, Iterable)
    if not_iterable or (torch.is_tensor(ks) and ks.dim() != 1):
        raise TypeError(f"{op}: ks must be an iterable of ints such as (1, 2, 4, 8), got {describe(ks)}")
    ks = [as_int(op, "every K in ks", k) for k in ks]
    if not ks:
        raise ValueError(f"{op}: ks must hold at least one K")
    return tuple(sorted(set(ks)))


_NO_KS = object()  # map_at_r takes no ks


def _setup(op: str, embeddings, labels, gallery, gallery_labels, group, ks=_NO_KS):
    """The arguments checked (with a group, on every rank together: one rank's error is
    raised on all of them); returns the process group (None for one process), how the gallery
    is split over its ranks, and ``ks`` as sorted distinct ints (if given)."""
    checked: dict = {}

    def check() -> None:
        _check(op, embeddings, labels, gallery, gallery_labels)
        if ks is not _NO_KS:
            checked["ks"] = _check_ks(op, ks)

    if group is None:
        check()
        rows = (embeddings if gallery is None else gallery).shape[0]
        return None, _Shards((rows,), 0, leave_one_out=gallery is None), checked.get("ks")
    group = distributed._resolve_group(op, group)
    error = distributed._capture(check)
    return group, distributed._agree(op, group, error, query=embeddings, gallery=gallery, **checked), checked.get("ks")


def _sum_over_ranks(values: list, group) -> list:
    """``values`` summed elementwise over the group's ranks in rank order (the same on every
    rank); unchanged for one process."""
    if group is None:
        return values
    return [sum(column) for column in zip(*distributed._all_gather(values, group), strict=False)]


@torch.no_grad()
def recall_at_k(
    embeddings: Tensor,
    labels: Tensor,
    ks: Iterable[int] = (1, 2, 4, 8),
    *,
    gallery: Optional[Tensor] = None,
    gallery_labels: Optional[Tensor] = None,
    group=None,
) -> dict[int, float]:
    """Recall@K: the fraction of queries whose ``K`` nearest neighbours include one of the
    same label, for each ``K`` in ``ks`` (Recall@1 is precision@1).

    Args:
        embeddings (Tensor[N, M]): the queries (and, without a gallery, the gallery too):
            float32, float64, float16 or bfloat16.
        labels (Tensor[N]): their class labels: any integer dtype, on the embeddings' device.
        ks: an iterable of ints, each in ``[1, R]`` (``R`` the gallery's rows, ``N - 1``
            without a gallery).
        gallery (Tensor[R, M], optional), gallery_labels (Tensor[R], optional): rank against
            these instead of leave-one-out.
        group (optional): a ``torch.distributed`` process group: each rank passes its shard
            and gets the recall over the union (see the module's docstring).

    Returns:
        ``{K: recall}`` with Python floats (the count of hits over the number of queries).
    """
    op = "recall_at_k"
    group, shards, ks = _setup(op, embeddings, labels, gallery, gallery_labels, group, ks)
    limit = shards.union_size
    if ks[0] < 1 or ks[-1] > limit:
        rows = "the other rows of embeddings: leave-one-out" if gallery is None else "the gallery's rows"
        everywhere = ", over every rank" if group is not None else ""
        bad = ks[0] if ks[0] < 1 else ks[-1]
        raise ValueError(f"{op}: every K in ks must be in [1, R], R = {limit} ({rows}{everywhere}), got {bad}")
    reference = (labels if gallery is None else gallery_labels).long()
    _, _, neighbour_labels = distributed._ring_knn(embeddings, gallery, ks[-1], group, shards, labels=reference)
    hits = neighbour_labels == labels.unsqueeze(1)
    first_hit = torch.where(hits.any(1), hits.int().argmax(1), hits.shape[1])  # rank of the first match
    *found, queries = _sum_over_ranks([int((first_hit < k).sum()) for k in ks] + [embeddings.shape[0]], group)
    if queries == 0:
        raise ValueError(f"{op}: embeddings holds no query{' on any rank' if group is not None else ''}")
    return {k: n / queries for k, n in zip(ks, found, strict=False)}


@torch.no_grad()
def map_at_r(
    embeddings: Tensor,
    labels: Tensor,
    *,
    gallery: Optional[Tensor] = None,
    gallery_labels: Optional[Tensor] = None,
    group=None,
) -> float:
    """MAP@R ("A Metric Learning Reality Check", Musgrave et al., 2020): for a query with R
    relevant gallery items (same label; itself excluded without a gallery), the mean over
    its R nearest neighbours of precision@i at each rank i that is relevant, divided by R;
    averaged over the queries. Queries with no relevant item are left out (they have no
    R-precision to measure).

    Args: as :func:`recall_at_k`, without ``ks``. With ``group``, each query's R counts the
    relevant items over every rank's gallery (one exchange of per-label counts).

    Returns:
        MAP@R as a Python float (per-query values summed in float64).
    """
    op = "map_at_r"
    group, shards, _ = _setup(op, embeddings, labels, gallery, gallery_labels, group)
    reference = (labels if gallery is None else gallery_labels).long()
    relevant = _relevant_counts(reference, labels, group) - int(shards.leave_one_out)
    keep = relevant > 0
    (r_max,) = _max_over_ranks([int(relevant.max()) if relevant.numel() else 0], group)
    if r_max == 0:
        raise ValueError(f"{op}: no query has a relevant item (every label is unique to its query)")
    _, _, neighbour_labels = distributed._ring_knn(embeddings, gallery, r_max, group, shards, labels=reference)
    R = relevant[keep].unsqueeze(1)
    ranks = torch.arange(1, r_max + 1, device=embeddings.device)
    hits = (neighbour_labels[keep] == labels[keep].unsqueeze(1)) & (ranks <= R)
    precision = hits.cumsum(1).double() / ranks
    ap = ((precision * hits).sum(1) / R.squeeze(1)).sum().item()
    total, queries = _sum_over_ranks([ap, int(keep.sum())], group)
    return total / queries


def _relevant_counts(reference: Tensor, labels: Tensor, group) -> Tensor:
    """For each of ``labels``, how many rows of the gallery (every rank's, with a group)
    carry it."""
    classes, counts = reference.unique(return_counts=True)
    if group is not None:  # every rank's (class, count) pairs, merged: O(classes) per rank
        everyone = distributed._all_gather((classes.cpu(), counts.cpu()), group)
        classes, where = torch.cat([c for c, _ in everyone]).unique(return_inverse=True)
        counts = torch.zeros(classes.numel(), dtype=torch.long).index_add_(
            0, where, torch.cat([n for _, n in everyone])
        )
        classes, counts = classes.to(labels.device), counts.to(labels.device)
    if classes.numel() == 0:
        return torch.zeros_like(labels, dtype=torch.long)
    position = torch.searchsorted(classes, labels.long()).clamp(max=classes.numel() - 1)
    return torch.where(classes[position] == labels, counts[position], 0)


def _max_over_ranks(values: list, group) -> list:
    if group is None:
        return values
    return [max(column) for column in zip(*distributed._all_gather(values, group), strict=False)]
