"""Exact k-nearest neighbours over the ranks of a ``torch.distributed`` process group.

Every rank passes its own shard of the queries and of the gallery; nobody gathers the data.

How it works: the gallery shards travel around a ring of the group's ranks. At step ``s``
rank ``r`` holds the shard of rank ``r - s`` (mod ``W``); it posts the send of that shard to
rank ``r + 1`` and the receive of the next one from rank ``r - 1`` (``batch_isend_irecv``),
ranks its own queries against the shard in hand with ``torchkit.ops.knn`` while they travel,
and merges the shard's ``k`` best into its running ``k`` best. After ``W`` steps every rank
has seen every shard. A rank holds its own shard, the one in hand, the one arriving and
``P_local x k`` results: memory ``O(N / W * M + P_local * k)``; each rank receives
``(W - 1) / W * N * M`` elements in all.

Exactness: ``torchkit.ops.knn`` returns each shard's ``k`` best under a total order (exact
``d^2`` computed directly from the inputs, ascending, NaN last, ties to the lower index), and
the ``k`` best of a union are the ``k`` best of the shards' ``k`` bests under the same
order. The shards are ranked on squared distances in the accumulation dtype (float32 for
float16 and bfloat16), so the merge compares exactly what a single call compares, and the
square root and the rounding to the input's dtype come last, as in a single call: the
results are those of ``torchkit.ops.knn`` on the concatenated data, bit for bit.

Before any data moves, the ranks exchange a description of their arguments
(``all_gather_object``), so that an argument one rank refuses, or that the ranks disagree on,
raises the same exception on every rank instead of leaving the others waiting.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from torchkit.ops import knn as _knn
from torchkit.ops._common import acc_dtype, as_int, check_bool, check_tensor, describe

__all__ = ["knn"]

_FLOATING = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def knn(
    query: Tensor, gallery: Optional[Tensor] = None, k: int = 1, *, squared: bool = False, group=None
) -> tuple[Tensor, Tensor]:
    """Exact k-nearest neighbours over the union of the shards of every rank of ``group``.

    Call it on every rank of ``group``, each with its own shard. For the rank's own queries it
    returns the ``k`` nearest rows of the union of all ranks' galleries, or, without a
    gallery, of all ranks' queries (leave-one-out: never the row itself). Indices are
    **global**: positions in the concatenation of the ranks' shards in rank order. The results
    equal ``torchkit.ops.knn`` on the concatenated data, distances and indices alike (ties to
    the lower global index, NaN rows last), whatever the shards' sizes.

    No rank holds more than its own shard, the shard in hand, the one arriving and its
    ``P x k`` results; each receives ``(W - 1) / W`` of the gallery over the call. CPU tensors
    need a group whose backend handles them (gloo), CUDA tensors one that handles CUDA
    (NCCL; ``init_process_group()`` without a backend creates both). With NCCL, each rank
    must have called ``torch.cuda.set_device`` first, as ``torch.distributed``'s object
    collectives require (the ranks' arguments are exchanged with one).

    This is evaluation: the results carry no gradient (use ``torchkit.ops.knn`` on one
    process to differentiate).

    Args:
        query (Tensor[P, M]): this rank's queries: float32, float64, float16 or bfloat16.
            May be empty ``(0, M)``.
        gallery (Tensor[R, M], optional): this rank's gallery shard, same dtype and device;
            may be empty. Every rank passes one, or none does.
        k: the number of neighbours, ``1 <= k <=`` the union's size (its number of rows minus
            one without a gallery); it may exceed any one shard's size. The same on every rank.
        squared: return squared distances. The same on every rank.
        group: the process group (default: the world).

    Returns:
        ``(distances, indices)``, each ``(P, k)``: distances ascending in ``query``'s dtype,
        indices int64 into the concatenated gallery (or queries).

    Raises:
        ValueError or TypeError, on every rank, when any rank's arguments are invalid or the
        ranks disagree on the feature size, dtype, device type, ``k``, ``squared`` or whether
        there is a gallery.
    """
    op = "torchkit.distributed.knn"
    group = _resolve_group(op, group)
    checked: dict = {}

    def check() -> None:
        _check_embeddings(op, "query", query, "gallery", gallery)
        checked["k"] = as_int(op, "k", k)
        check_bool(op, "squared", squared)

    error = _capture(check)
    shards = _agree(op, group, error, query=query, gallery=gallery, squared=squared, **checked)
    k = checked["k"]
    limit = shards.union_size
    if not 1 <= k <= limit:
        without = " (the other rows: leave-one-out)" if gallery is None else ""
        raise ValueError(f"{op}: k must be in [1, {limit}]{without}, the union's size over every rank, got {k}")
    d2, indices, _ = _ring_knn(query, gallery, k, group, shards)
    distances = d2 if squared else _ieee_sqrt(d2)
    return distances.to(query.dtype), indices


# ---------------------------------------------------------------------------------------
# What torchkit.metrics shares with knn (not part of the public API)


@dataclass(frozen=True)
class _Shards:
    """How the gallery (or, leave-one-out, the queries) is split over the group's ranks."""

    sizes: tuple[int, ...]  # rows of each rank's shard, in rank order
    rank: int  # this rank's place in the group
    leave_one_out: bool  # the shards are the queries themselves

    @property
    def world(self) -> int:
        return len(self.sizes)

    @property
    def offsets(self) -> tuple[int, ...]:
        """The global index of each shard's first row."""
        return (0, *itertools.accumulate(self.sizes))[:-1]

    @property
    def total(self) -> int:
        return sum(self.sizes)

    @property
    def union_size(self) -> int:
        """The most neighbours a query has: every row of the union, less itself leave-one-out."""
        return self.total - self.leave_one_out


def _resolve_group(op: str, group):
    """``group`` itself, the world for ``None``; a clear error without a process group."""
    if group is not None and dist.is_available() and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{op}: group must be a torch.distributed ProcessGroup or None, got {describe(group)}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{op}: torch.distributed is not initialised; call torch.distributed.init_process_group() "
            "first (or use the single-process function)"
        )
    return dist.group.WORLD if group is None else group


def _capture(check) -> Optional[Exception]:
    """The TypeError or ValueError ``check()`` raises, or None: an error to share with the
    other ranks before raising it."""
    try:
        check()
    except (TypeError, ValueError) as err:
        return err
    return None


def _check_embeddings(op: str, name: str, x: Any, gallery_name: str, gallery: Any) -> None:
    """Shapes, dtypes and devices of a knn problem: x (P, M) floating, gallery (R, M) alike."""
    check_tensor(op, name, x)
    if x.dim() != 2:
        raise ValueError(f"{op}: {name} must be (N, M), got shape {tuple(x.shape)}")
    if x.dtype not in _FLOATING:
        raise TypeError(f"{op}: {name} must be float32, float64, float16 or bfloat16, got {x.dtype}")
    if gallery is None:
        return
    check_tensor(op, gallery_name, gallery)
    if gallery.dim() != 2 or gallery.shape[1] != x.shape[1]:
        raise ValueError(f"{op}: {gallery_name} must be (R, M) with M = {x.shape[1]}, got shape {tuple(gallery.shape)}")
    if gallery.dtype != x.dtype:
        raise TypeError(f"{op}: {name} and {gallery_name} must have the same dtype, got {x.dtype} and {gallery.dtype}")
    if gallery.device != x.device:
        raise ValueError(
            f"{op}: {name} and {gallery_name} must be on the same device, got {x.device} and {gallery.device}"
        )


def _agree(op: str, group, error: Optional[Exception], *, query, gallery, **same) -> _Shards:
    """Every rank's arguments, checked together: the first rank's error, or a disagreement
    on what must be the same everywhere, raised on every rank; otherwise the shards' sizes.
    ``same`` holds further values every rank must agree on (k, squared, ...)."""
    mine: dict[str, Any] = {"error": None if error is None else (type(error).__name__, str(error))}
    if error is None:
        mine.update(
            features=query.shape[1],
            dtype=str(query.dtype),
            device=query.device.type,
            gallery=gallery is not None,
            rows=query.shape[0] if gallery is None else gallery.shape[0],
            **same,
        )
    world = dist.get_world_size(group)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    for rank, theirs in enumerate(everyone):
        if theirs["error"] is not None:
            kind, message = theirs["error"]
            raise (TypeError if kind == "TypeError" else ValueError)(f"{message} (on rank {rank})")
    names = {
        "features": "the feature size M",
        "dtype": "the dtype",
        "device": "the device type",
        "gallery": "whether a gallery is given",
    }
    for key in ("features", "dtype", "device", "gallery", *same):
        values = [theirs[key] for theirs in everyone]
        if any(v != values[0] for v in values):
            listed = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            raise ValueError(f"{op}: the ranks disagree on {names.get(key, key)}: {listed}")
    return _Shards(tuple(theirs["rows"] for theirs in everyone), dist.get_rank(group), leave_one_out=gallery is None)


def _all_gather(values: Any, group) -> list:
    """Every rank's ``values`` (any picklable object), in rank order."""
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, values, group=group)
    return out


@torch.no_grad()
def _ring_knn(
    query: Tensor, gallery: Optional[Tensor], k: int, group, shards: _Shards, labels: Optional[Tensor] = None
) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """The k best (squared distance in the accumulation dtype, global index, and the label
    that travelled with that row if ``labels`` is given) of this rank's queries over every
    rank's shard. ``gallery`` None: the shards are the queries, leave-one-out."""
    world, rank = shards.world, shards.rank
    acc = acc_dtype(query)
    own = (query if gallery is None else gallery).contiguous()
    queries = query.to(acc)
    P = query.shape[0]
    width = 0 if P else k  # no candidates yet; without queries, the (0, k) results
    best_d = queries.new_empty((P, width))
    best_i = torch.empty((P, width), dtype=torch.long, device=query.device)
    best_l = None if labels is None else labels.new_empty((P, width))
    send_to = dist.get_global_rank(group, (rank + 1) % world) if world > 1 else rank
    receive_from = dist.get_global_rank(group, (rank - 1) % world) if world > 1 else rank
    current, current_labels = own, None if labels is None else labels.contiguous()
    for step in range(world):
        owner = (rank - step) % world
        incoming = incoming_labels = None
        works = []
        if step < world - 1:
            ops = []
            if shards.sizes[owner]:
                ops.append(dist.P2POp(dist.isend, current, send_to, group, tag=0))
                if labels is not None:
                    ops.append(dist.P2POp(dist.isend, current_labels, send_to, group, tag=1))
            arriving = shards.sizes[(owner - 1) % world]
            if arriving:
                incoming = own.new_empty((arriving, own.shape[1]))
                ops.append(dist.P2POp(dist.irecv, incoming, receive_from, group, tag=0))
                if labels is not None:
                    incoming_labels = labels.new_empty((arriving,))
                    ops.append(dist.P2POp(dist.irecv, incoming_labels, receive_from, group, tag=1))
            if ops:
                works = dist.batch_isend_irecv(ops)
        self_shard = gallery is None and owner == rank
        n = shards.sizes[owner] - self_shard
        if P and min(k, n) > 0:
            d, i = _knn(queries, None if self_shard else current.to(acc), min(k, n), squared=True)
            i = i + shards.offsets[owner]
            neighbour_labels = None if labels is None else current_labels[i - shards.offsets[owner]]
            best_d, best_i, best_l = _merge(best_d, best_i, best_l, d, i, neighbour_labels, k)
        for work in works:
            work.wait()
        if step < world - 1:
            current, current_labels = incoming, incoming_labels
    return best_d, best_i, best_l


def _ieee_sqrt(x: Tensor) -> Tensor:
    """The correctly rounded square root that ``torchkit.ops.knn`` takes (C++ ``std::sqrt`` on
    the CPU, ``Tensor.sqrt`` on CUDA). PyTorch's vectorised CPU sqrt can be one unit in the
    last place off; float32 through float64 rounds correctly (the double square root of a
    float32 is far closer than the float32 rounding needs), float64 goes through numpy."""
    if x.device.type != "cpu":
        return x.sqrt()
    if x.dtype == torch.float32:
        return x.double().sqrt().float()
    try:
        import numpy
    except ImportError:  # without numpy: Python's math.sqrt, also IEEE, element by element
        return torch.tensor([math.sqrt(v) for v in x.flatten().tolist()], dtype=x.dtype).view(x.shape)
    return torch.from_numpy(numpy.sqrt(x.numpy()))


def _merge(best_d, best_i, best_l, d, i, labels, k):
    """The k first of two candidate lists under knn's total order: d ascending, NaN last,
    ties to the lower index (sorted by index, then stably by distance; torch.sort puts NaN
    last)."""
    if best_d.shape[1] == 0:
        return d, i, labels
    d, i = torch.cat([best_d, d], 1), torch.cat([best_i, i], 1)
    by_index = i.argsort(1)
    d, i = d.gather(1, by_index), i.gather(1, by_index)
    order = d.sort(dim=1, stable=True).indices[:, :k]
    if labels is not None:
        labels = torch.cat([best_l, labels], 1).gather(1, by_index).gather(1, order)
    return d.gather(1, order), i.gather(1, order), labels
