"""Retrieval metrics of metric learning, on exact k-nearest neighbours (``torchkit.ops.knn``).

Without a gallery both are leave-one-out over ``embeddings`` (each query ranks every other
row; the CUB-200, Cars-196 and SOP protocol); with one they rank queries against the gallery
(the In-Shop protocol). Neither materialises the query × gallery distance matrix.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import torch
from torch import Tensor

from torchkit.ops import knn

__all__ = ["map_at_r", "recall_at_k"]


def _check(name: str, embeddings: Tensor, labels: Tensor, gallery: Optional[Tensor], gallery_labels: Optional[Tensor]):
    if embeddings.dim() != 2:
        raise ValueError(f"{name}: embeddings must be (N, M), got shape {tuple(embeddings.shape)}")
    if labels.shape != embeddings.shape[:1]:
        raise ValueError(
            f"{name}: labels must be (N,) = ({embeddings.shape[0]},), one per embedding, "
            f"got shape {tuple(labels.shape)}"
        )
    if (gallery is None) != (gallery_labels is None):
        raise ValueError(f"{name}: gallery and gallery_labels go together; got only one of them")
    if gallery is not None:
        if gallery.dim() != 2:
            raise ValueError(f"{name}: gallery must be (R, M), got shape {tuple(gallery.shape)}")
        if gallery_labels.shape != gallery.shape[:1]:
            raise ValueError(
                f"{name}: gallery_labels must be (R,) = ({gallery.shape[0]},), got shape {tuple(gallery_labels.shape)}"
            )
    reference_labels = labels if gallery_labels is None else gallery_labels
    return reference_labels.to(labels.device)


@torch.no_grad()
def recall_at_k(
    embeddings: Tensor,
    labels: Tensor,
    ks: Iterable[int] = (1, 2, 4, 8),
    *,
    gallery: Optional[Tensor] = None,
    gallery_labels: Optional[Tensor] = None,
) -> dict[int, float]:
    """Recall@K: the fraction of queries whose ``K`` nearest neighbours include one of the
    same label, for each ``K`` in ``ks`` (Recall@1 is precision@1).

    Args:
        embeddings (Tensor[N, M]): the queries (and, without a gallery, the gallery too).
        labels (Tensor[N]): their class labels (any integer dtype).
        ks: the K values, each in ``[1, R]`` (``R = N − 1`` without a gallery).
        gallery (Tensor[R, M], optional), gallery_labels (Tensor[R], optional): rank against
            these instead of leave-one-out.

    Returns:
        ``{K: recall}`` with Python floats.
    """
    reference_labels = _check("recall_at_k", embeddings, labels, gallery, gallery_labels)
    ks = sorted({int(k) for k in ks})
    if not ks:
        raise ValueError("recall_at_k: ks must hold at least one K")
    _, neighbours = knn(embeddings, gallery, ks[-1])
    hits = reference_labels[neighbours] == labels.unsqueeze(1)
    first_hit = torch.where(hits.any(1), hits.float().argmax(1), hits.shape[1])  # rank of the first match
    return {k: (first_hit < k).float().mean().item() for k in ks}


@torch.no_grad()
def map_at_r(
    embeddings: Tensor,
    labels: Tensor,
    *,
    gallery: Optional[Tensor] = None,
    gallery_labels: Optional[Tensor] = None,
) -> float:
    """MAP@R ("A Metric Learning Reality Check", Musgrave et al., 2020): for a query with R
    relevant gallery items (same label; itself excluded without a gallery), the mean over
    its R nearest neighbours of precision@i at each rank i that is relevant, divided by R;
    averaged over the queries. Queries with no relevant item are left out (they have no
    R-precision to measure).

    Args: as :func:`recall_at_k`, without ``ks``.

    Returns:
        MAP@R as a Python float.
    """
    reference_labels = _check("map_at_r", embeddings, labels, gallery, gallery_labels)
    classes, counts = reference_labels.unique(return_counts=True)
    position = torch.searchsorted(classes, labels)
    found = (position < classes.numel()) & (classes[position.clamp(max=classes.numel() - 1)] == labels)
    relevant = torch.where(found, counts[position.clamp(max=classes.numel() - 1)], 0)
    if gallery is None:
        relevant = relevant - 1  # not itself
    keep = relevant > 0
    if not keep.any():
        raise ValueError("map_at_r: no query has a relevant item (every label is unique to its query)")
    r_max = int(relevant.max())
    # Without a gallery every row is the gallery of the others.
    neighbours = knn(embeddings, None, r_max)[1][keep] if gallery is None else knn(embeddings[keep], gallery, r_max)[1]
    R = relevant[keep].unsqueeze(1)
    ranks = torch.arange(1, r_max + 1, device=embeddings.device)
    hits = (reference_labels[neighbours] == labels[keep].unsqueeze(1)) & (ranks <= R)
    precision = hits.cumsum(1) / ranks
    return ((precision * hits).sum(1) / R.squeeze(1)).mean().item()
