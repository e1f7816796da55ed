"""Drop-in ``torch.nn.Module`` wrappers of ``torchkit.ops``."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from torchkit import ops
from torchkit.ops._common import as_float, as_int, check_bool, describe
from torchkit.ops._listed_pairs import check_indices_tuple
from torchkit.ops.covariance_pool import MAX_ITERATIONS
from torchkit.ops.label_smoothing_cross_entropy import check_reduction
from torchkit.ops.pair_losses import (
    SPECS,
    _as_params,
    _check_device,
    _check_inputs,
    _check_params,
    _check_proxy_params,
)
from torchkit.ops.region_confusion import _check_args, _check_probability, _check_settings, _draw_permutations

__all__ = [
    "BilinearPool2d",
    "CDist",
    "ContrastiveLoss",
    "CovariancePool2d",
    "CrossBatchMemory",
    "LabelSmoothingCrossEntropy",
    "MultiSimilarityLoss",
    "NTXentLoss",
    "ProxyAnchorLoss",
    "RegionConfusion",
    "SupConLoss",
    "TripletMarginLoss",
]


class LabelSmoothingCrossEntropy(nn.Module):
    """``nn.CrossEntropyLoss(label_smoothing=ε)`` on the fused kernel; see
    :func:`torchkit.ops.label_smoothing_cross_entropy` for shapes and the two conventions.

    The arguments are ``nn.CrossEntropyLoss``'s, in its order: the first positional one is
    ``weight``, so ``LabelSmoothingCrossEntropy(0.1)`` is refused with a pointer to
    ``label_smoothing=0.1``. ``smoothing=`` (timm's name) is accepted as an alias of
    ``label_smoothing``. ``weight`` is a buffer: it follows ``.to()`` and is saved in the
    state dict.
    """

    def __init__(
        self,
        weight: Optional[Tensor] = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: Optional[float] = None,
        exclude_target: bool = False,
        *,
        smoothing: Optional[float] = None,
    ) -> None:
        super().__init__()
        if weight is not None and not isinstance(weight, Tensor):
            raise TypeError(
                "LabelSmoothingCrossEntropy: weight (the first positional argument, as in "
                f"nn.CrossEntropyLoss) must be a Tensor of class weights or None, got "
                f"{type(weight).__name__} {weight!r}; to set the smoothing, pass label_smoothing={weight!r}"
            )
        if smoothing is not None and label_smoothing is not None and smoothing != label_smoothing:
            raise ValueError(
                "LabelSmoothingCrossEntropy: smoothing is an alias of label_smoothing; got both, "
                f"with different values ({smoothing} and {label_smoothing})"
            )
        label_smoothing = next((v for v in (label_smoothing, smoothing) if v is not None), 0.1)
        name = "LabelSmoothingCrossEntropy"
        check_bool(name, "exclude_target", exclude_target)
        check_reduction(name, reduction)
        self.register_buffer("weight", weight)
        self.ignore_index = as_int(name, "ignore_index", ignore_index)
        self.reduction = reduction
        self.label_smoothing = as_float(name, "label_smoothing", label_smoothing)
        self.exclude_target = exclude_target

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return ops.label_smoothing_cross_entropy(
            input,
            target,
            self.weight,
            self.ignore_index,
            self.reduction,
            self.label_smoothing,
            exclude_target=self.exclude_target,
        )

    def extra_repr(self) -> str:
        return (
            f"label_smoothing={self.label_smoothing}, reduction={self.reduction!r}, "
            f"ignore_index={self.ignore_index}, exclude_target={self.exclude_target}, "
            f"weighted={self.weight is not None}"
        )


class CDist(nn.Module):
    """Pairwise Euclidean distances between two sets (or within one) as a module; see
    :func:`torchkit.ops.cdist`."""

    def __init__(self, squared: bool = False) -> None:
        super().__init__()
        check_bool("CDist", "squared", squared)
        self.squared = squared

    def forward(self, x1: Tensor, x2: Optional[Tensor] = None) -> Tensor:
        return ops.cdist(x1, x2, squared=self.squared)

    def extra_repr(self) -> str:
        return f"squared={self.squared}"


class RegionConfusion(nn.Module):
    """DCL's region confusion mechanism as a layer: in training mode each sample's blocks
    are shuffled with probability ``p`` (see :func:`torchkit.ops.region_confusion`); in
    eval mode it is the identity.

    ``forward(x)`` returns ``(x', permutation)``: ``permutation`` (int64, ``(N, n²)``, or
    ``(n²,)`` for a 3-D x) is the identity for unshuffled samples and in eval mode, so it can
    always serve as the location label.
    """

    def __init__(self, num_blocks: int = 7, neighbourhood: int = 2, p: float = 1.0) -> None:
        super().__init__()
        _check_probability("RegionConfusion", p)
        _check_settings("RegionConfusion", num_blocks, neighbourhood)
        self.num_blocks = num_blocks
        self.neighbourhood = neighbourhood
        self.p = p

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        _check_args(x, self.num_blocks, self.neighbourhood)
        samples = x.shape[0] if x.dim() == 4 else 1
        n2 = self.num_blocks**2
        if self.training and self.p > 0:
            perm = _draw_permutations(samples, self.num_blocks, self.neighbourhood, None, x.device, self.p)
            perm = perm if x.dim() == 4 else perm.squeeze(0)
            return ops.permute_blocks(x, perm, self.num_blocks), perm
        perm = torch.arange(n2, device=x.device).expand(samples, n2)
        return x, (perm.contiguous() if x.dim() == 4 else perm[0].clone())

    def extra_repr(self) -> str:
        return f"num_blocks={self.num_blocks}, neighbourhood={self.neighbourhood}, p={self.p}"


class BilinearPool2d(nn.Module):
    """B-CNN pooling of a feature map (or two): bilinear product, signed sqrt, L2
    normalisation; see :func:`torchkit.ops.bilinear_pool`. ``(N, D, H, W)`` → ``(N, D·D)``
    (``(N, D·E)`` with a second stream ``y``).

    With ``in_channels=D`` (and ``y_channels=E`` for two streams) the module knows its
    output size, ``output_dim = D·E``, which model builders (fast-MPN-COV's, for one) read
    to size the classifier; the inputs are then checked against it.
    """

    def __init__(
        self,
        sqrt_eps: float = 1e-5,
        l2_eps: float = 1e-12,
        *,
        in_channels: Optional[int] = None,
        y_channels: Optional[int] = None,
    ) -> None:
        super().__init__()
        for name, value in (("in_channels", in_channels), ("y_channels", y_channels)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"BilinearPool2d: {name} must be a positive int or None, got {value!r}")
        if y_channels is not None and in_channels is None:
            raise ValueError("BilinearPool2d: y_channels needs in_channels too")
        self.sqrt_eps = as_float("BilinearPool2d", "sqrt_eps", sqrt_eps)
        self.l2_eps = as_float("BilinearPool2d", "l2_eps", l2_eps)
        self.in_channels = in_channels
        self.y_channels = y_channels

    @property
    def output_dim(self) -> int:
        """``D·E`` (``D²`` for one stream): the length of each output row."""
        if self.in_channels is None:
            # An AttributeError (hasattr() is False); nn.Module.__getattr__ would replace its
            # message, so __getattr__ below words it.
            raise AttributeError("output_dim")
        return self.in_channels * (self.y_channels or self.in_channels)

    def __getattr__(self, name: str):
        if name == "output_dim":
            raise AttributeError(
                "BilinearPool2d: output_dim needs the channel count; construct it as "
                "BilinearPool2d(in_channels=D) (and y_channels=E for two streams)"
            )
        return super().__getattr__(name)

    def forward(self, x: Tensor, y: Optional[Tensor] = None) -> Tensor:
        if self.in_channels is not None:
            expected = (self.in_channels, self.y_channels if y is not None else None)
            got = (x.shape[1] if x.dim() > 1 else None, y.shape[1] if y is not None and y.dim() > 1 else None)
            if got != expected:
                raise ValueError(
                    f"BilinearPool2d: built for (x, y) channels {expected}, got {got} "
                    f"(x of shape {tuple(x.shape)}, y {'None' if y is None else tuple(y.shape)})"
                )
        return ops.bilinear_pool(x, y, sqrt_eps=self.sqrt_eps, l2_eps=self.l2_eps)

    def extra_repr(self) -> str:
        channels = "" if self.in_channels is None else f", in_channels={self.in_channels}"
        if self.y_channels is not None:
            channels += f", y_channels={self.y_channels}"
        return f"sqrt_eps={self.sqrt_eps}, l2_eps={self.l2_eps}{channels}"


class CovariancePool2d(nn.Module):
    """iSQRT-COV pooling of a feature map: covariance, Newton–Schulz matrix square root,
    upper triangle; see :func:`torchkit.ops.covariance_pool`. ``(N, D, H, W)`` →
    ``(N, D(D+1)/2)`` (``(N, D, D)`` with ``triu=False``). A drop-in for fast-MPN-COV's
    ``MPNCOV`` layer without its ``dimension_reduction`` block (put a 1×1 convolution before
    it).

    With ``in_channels=D`` the module knows its output size, ``output_dim`` (``D(D+1)/2``,
    or ``D²`` with ``triu=False``, as ``MPNCOV.output_dim``), which model builders read to
    size the classifier; the input is then checked against it.
    """

    def __init__(
        self, iterations: int = 5, sqrt: bool = True, triu: bool = True, *, in_channels: Optional[int] = None
    ) -> None:
        super().__init__()
        if isinstance(iterations, bool) or not isinstance(iterations, int) or not 1 <= iterations <= MAX_ITERATIONS:
            raise ValueError(
                f"CovariancePool2d: iterations must be an int between 1 and {MAX_ITERATIONS}, got {iterations!r}"
            )
        if in_channels is not None and (
            isinstance(in_channels, bool) or not isinstance(in_channels, int) or in_channels < 1
        ):
            raise ValueError(f"CovariancePool2d: in_channels must be a positive int or None, got {in_channels!r}")
        check_bool("CovariancePool2d", "sqrt", sqrt)
        check_bool("CovariancePool2d", "triu", triu)
        self.iterations = iterations
        self.sqrt = sqrt
        self.triu = triu
        self.in_channels = in_channels

    @property
    def output_dim(self) -> int:
        """``D(D+1)/2`` (``D²`` with ``triu=False``): the length of each flattened output."""
        if self.in_channels is None:
            raise AttributeError("output_dim")  # worded by __getattr__, as BilinearPool2d's
        D = self.in_channels
        return D * (D + 1) // 2 if self.triu else D * D

    def __getattr__(self, name: str):
        if name == "output_dim":
            raise AttributeError(
                "CovariancePool2d: output_dim needs the channel count; construct it as CovariancePool2d(in_channels=D)"
            )
        return super().__getattr__(name)

    def forward(self, x: Tensor) -> Tensor:
        if self.in_channels is not None and (x.dim() < 2 or x.shape[1] != self.in_channels):
            raise ValueError(
                f"CovariancePool2d: built for {self.in_channels} channels, got x of shape {tuple(x.shape)}"
            )
        return ops.covariance_pool(x, iterations=self.iterations, sqrt=self.sqrt, triu=self.triu)

    def extra_repr(self) -> str:
        channels = "" if self.in_channels is None else f", in_channels={self.in_channels}"
        return f"iterations={self.iterations}, sqrt={self.sqrt}, triu={self.triu}{channels}"


class _PairLoss(nn.Module):
    """A pair loss of torchkit.ops as PML's module: its parameters at construction,
    ``forward(embeddings, labels, ref_embeddings=None, ref_labels=None, *, indices_tuple=None)``
    as PML's ``(embeddings, labels, indices_tuple, ref_emb=, ref_labels=)``. ``group``: the loss across the ranks of
    that process group (the functions' ``group=``)."""

    _op: str

    def __init__(self, group=None, **params) -> None:
        super().__init__()
        self.group = group
        name = type(self).__name__
        kinds = SPECS[self._op].params
        values = _as_params(name, tuple(params[key] for _, key in kinds), loss=self._op)
        _check_params(name, values, loss=self._op)
        self._params = dict(zip((key for _, key in kinds), values, strict=True))
        for key, value in self._params.items():
            setattr(self, key, value)

    def forward(
        self,
        embeddings: Tensor,
        labels: Tensor,
        ref_embeddings: Optional[Tensor] = None,
        ref_labels: Optional[Tensor] = None,
        *,
        indices_tuple: Optional[tuple] = None,
    ) -> Tensor:
        name = type(self).__name__
        if isinstance(ref_embeddings, (tuple, list)):  # PML's loss(embeddings, labels, miner(...))
            raise TypeError(
                f"{name}: ref_embeddings must be a Tensor or None, got a {type(ref_embeddings).__name__}: a miner's "
                "output goes in indices_tuple= (PML's third positional argument is torchkit's ref_embeddings)"
            )
        params = {key: getattr(self, key) for key in self._params}
        if indices_tuple is not None:
            params["indices_tuple"] = indices_tuple
        return getattr(ops, self._op)(
            embeddings, labels, **params, ref_embeddings=ref_embeddings, ref_labels=ref_labels, group=self.group
        )

    def extra_repr(self) -> str:
        return ", ".join(f"{key}={getattr(self, key)!r}" for key in self._params)


class SupConLoss(_PairLoss):
    """pytorch-metric-learning's ``SupConLoss(temperature=0.1)`` on the fused kernel; see
    :func:`torchkit.ops.supcon_loss`."""

    _op = "supcon_loss"

    def __init__(self, temperature: float = 0.1, *, group=None) -> None:
        super().__init__(group, temperature=temperature)


class NTXentLoss(_PairLoss):
    """pytorch-metric-learning's ``NTXentLoss(temperature=0.07)`` on the fused kernel; see
    :func:`torchkit.ops.ntxent_loss`."""

    _op = "ntxent_loss"

    def __init__(self, temperature: float = 0.07, *, group=None) -> None:
        super().__init__(group, temperature=temperature)


class ContrastiveLoss(_PairLoss):
    """pytorch-metric-learning's ``ContrastiveLoss(pos_margin=0, neg_margin=1)`` on the fused
    kernel (``distance="cosine"``: with ``distance=CosineSimilarity()``); see
    :func:`torchkit.ops.contrastive_loss`."""

    _op = "contrastive_loss"

    def __init__(
        self, pos_margin: float = 0.0, neg_margin: float = 1.0, *, distance: str = "euclidean", group=None
    ) -> None:
        super().__init__(group, pos_margin=pos_margin, neg_margin=neg_margin, distance=distance)


class TripletMarginLoss(_PairLoss):
    """pytorch-metric-learning's ``TripletMarginLoss(margin=0.05)`` with the miner ``mining``
    names, on the fused kernel (``distance="cosine"``: both with
    ``distance=CosineSimilarity()``); see :func:`torchkit.ops.triplet_margin_loss`."""

    _op = "triplet_margin_loss"

    def __init__(self, margin: float = 0.05, mining: str = "all", *, distance: str = "euclidean", group=None) -> None:
        super().__init__(group, margin=margin, mining=mining, distance=distance)


class MultiSimilarityLoss(_PairLoss):
    """pytorch-metric-learning's ``MultiSimilarityLoss(alpha=2, beta=50, base=0.5)`` on the
    fused kernel, by default on every pair as PML's module (which has no miner);
    ``miner_epsilon=ε`` adds its ``MultiSimilarityMiner(epsilon=ε)``, the default of
    :func:`torchkit.ops.multi_similarity_loss` being ε = 0.1."""

    _op = "multi_similarity_loss"

    def __init__(
        self,
        alpha: float = 2.0,
        beta: float = 50.0,
        base: float = 0.5,
        miner_epsilon: Optional[float] = None,
        *,
        group=None,
    ) -> None:
        super().__init__(group, alpha=alpha, beta=beta, base=base, miner_epsilon=miner_epsilon)


class CrossBatchMemory(nn.Module):
    """pytorch-metric-learning's ``CrossBatchMemory(loss, embedding_size, memory_size=1024,
    miner=None)`` for torchkit's pair losses (``SupConLoss``, ``NTXentLoss``,
    ``ContrastiveLoss``, ``TripletMarginLoss``, ``MultiSimilarityLoss``): a queue of the last
    ``memory_size`` embeddings (detached) and their labels. Each call enqueues the batch, then
    takes the loss of its rows as anchors against the whole memory (its filled part until it is
    full), each row's own copy in the memory left out of its pairs: PML's wrapper, step by step.
    ``enqueue_mask`` (a bool per row, as PML's): the rows it marks only join the memory, the
    others are the anchors and are not enqueued (their pairs with every memory row count). The
    gradient flows through the anchors alone. Without a miner each step costs O(memory · D),
    nothing batch × memory is stored. ``miner`` (a PML miner, or any callable of
    ``(embeddings, labels, ref_emb, ref_labels)``) chooses the batch × memory pairs or triplets
    the loss takes (its ``indices_tuple=``), and ``forward``'s ``indices_tuple`` adds to them, as
    PML's do. The memory takes the dtype and device of the batch."""

    def __init__(self, loss: nn.Module, embedding_size: int, memory_size: int = 1024, miner=None) -> None:
        super().__init__()
        name = "CrossBatchMemory"
        if not isinstance(loss, _PairLoss):
            raise TypeError(
                f"{name}: loss must be one of torchkit.nn's SupConLoss, NTXentLoss, ContrastiveLoss, "
                f"TripletMarginLoss or MultiSimilarityLoss, got {type(loss).__name__}"
            )
        if loss.group is not None:
            raise ValueError(f"{name}: the loss's group= is not supported (each process keeps its own memory)")
        if miner is not None and not callable(miner):
            raise TypeError(
                f"{name}: miner must be a pytorch-metric-learning miner (a callable) or None, got {describe(miner)}"
            )
        self.loss = loss
        self.miner = miner
        self.embedding_size = as_int(name, "embedding_size", embedding_size)
        self.memory_size = as_int(name, "memory_size", memory_size)
        for key, value in (("embedding_size", self.embedding_size), ("memory_size", self.memory_size)):
            if value <= 0:
                raise ValueError(f"{name}: {key} must be > 0, got {value}")
        self.reset_queue()

    def reset_queue(self) -> None:
        """Empties the memory (PML's reset_queue)."""
        self.register_buffer("embedding_memory", torch.zeros(self.memory_size, self.embedding_size))
        self.register_buffer("label_memory", torch.zeros(self.memory_size, dtype=torch.long))
        self.has_been_filled = False
        self.queue_idx = 0

    def forward(
        self, embeddings: Tensor, labels: Tensor, indices_tuple=None, enqueue_mask: Optional[Tensor] = None
    ) -> Tensor:
        name = "CrossBatchMemory"
        if indices_tuple is not None and enqueue_mask is not None:
            raise ValueError(f"{name}: indices_tuple and enqueue_mask are mutually exclusive (as PML's)")
        _check_inputs(name, embeddings, labels, None, None)
        if self.miner is None and indices_tuple is None:  # (a miner's tuples need no kernel: any device)
            _check_device(self.loss._op, embeddings)
        if embeddings.shape[1] != self.embedding_size:
            raise ValueError(
                f"{name}: embeddings must have embedding_size = {self.embedding_size} features, got shape "
                f"{list(embeddings.shape)}"
            )
        if enqueue_mask is not None:
            if not isinstance(enqueue_mask, Tensor) or enqueue_mask.dtype != torch.bool:
                raise TypeError(f"{name}: enqueue_mask must be a bool Tensor, got {describe(enqueue_mask)}")
            if enqueue_mask.shape != labels.shape or enqueue_mask.device != embeddings.device:
                raise ValueError(
                    f"{name}: enqueue_mask must be 1-D with one entry per row of embeddings ({embeddings.shape[0]}), "
                    f"on its device ({embeddings.device}), got shape {list(enqueue_mask.shape)} on "
                    f"{enqueue_mask.device}"
                )
            queued, queued_labels = embeddings[enqueue_mask], labels[enqueue_mask]
            embeddings, labels = embeddings[~enqueue_mask], labels[~enqueue_mask]
        else:
            queued, queued_labels = embeddings, labels
        if queued.shape[0] > self.memory_size:
            raise ValueError(
                f"{name}: a step enqueues at most memory_size = {self.memory_size} rows, got {queued.shape[0]} "
                "(a larger batch would overwrite its own rows)"
            )
        if self.embedding_memory.dtype != embeddings.dtype or self.embedding_memory.device != embeddings.device:
            self.embedding_memory = self.embedding_memory.to(embeddings.device, embeddings.dtype)
        if self.label_memory.dtype != labels.dtype or self.label_memory.device != labels.device:
            self.label_memory = self.label_memory.to(labels.device, labels.dtype)
        if indices_tuple is not None:  # (refused before anything is enqueued: the memory's rows after it)
            rows = self.memory_size if self.has_been_filled else min(self.memory_size, self.queue_idx + queued.shape[0])
            check_indices_tuple(name, indices_tuple, embeddings.shape[0], rows, embeddings.device)
        first = self.queue_idx
        self._enqueue(queued, queued_labels)
        memory = self.embedding_memory if self.has_been_filled else self.embedding_memory[: self.queue_idx]
        memory_labels = self.label_memory if self.has_been_filled else self.label_memory[: self.queue_idx]
        params = tuple(getattr(self.loss, key) for key in self.loss._params)
        if self.miner is not None or indices_tuple is not None:
            own = None if enqueue_mask is not None else (first + torch.arange(queued.shape[0])) % self.memory_size
            indices = self._listed(embeddings, labels, memory, memory_labels, own, indices_tuple)
            return self.loss(embeddings, labels, memory, memory_labels, indices_tuple=indices)
        if enqueue_mask is not None:  # (anchors apart from the memory: every pair counts)
            loss = getattr(ops, self.loss._op)
            keywords = dict(zip(self.loss._params, params, strict=True))
            return loss(embeddings, labels, **keywords, ref_embeddings=memory, ref_labels=memory_labels)
        if first + queued.shape[0] > self.memory_size:  # the batch wraps: the memory from its first row on
            memory = torch.cat([memory[first:], memory[:first]])
            memory_labels = torch.cat([memory_labels[first:], memory_labels[:first]])
            first = 0
        from torchkit.ops._pair_losses_across_ranks import loss_against_memory

        return loss_against_memory(self.loss._op, embeddings, labels, memory, memory_labels, params, first)

    def _listed(self, embeddings, labels, memory, memory_labels, own, indices_tuple) -> tuple:
        """PML's create_indices_tuple: the miner's batch × memory pairs or triplets (every pair
        without one), less each anchor's pairs with its own copy (own: its memory row; None with
        enqueue_mask), then the given indices_tuple's appended in the same form."""
        if self.miner is not None:
            mined = tuple(self.miner(embeddings, labels, memory, memory_labels))
        else:
            same = labels[:, None] == memory_labels[None, :]
            mined = (*same.nonzero(as_tuple=True), *(~same).nonzero(as_tuple=True))
        if own is not None and len(mined) in (3, 4):
            own = own.to(mined[0].device)
            keep = mined[1] != own[mined[0]]  # (a positive that is the anchor's own copy)
            mined = (
                tuple(t[keep] for t in mined[:3]) if len(mined) == 3 else (*(t[keep] for t in mined[:2]), *mined[2:])
            )
        if indices_tuple is not None:
            given = tuple(indices_tuple)
            if len(given) == 3 and len(mined) == 4:  # (PML's conversions: triplets as pairs, and back)
                given = (given[0], given[1], given[0], given[2])
            elif len(given) == 4 and len(mined) == 3:
                p, n = torch.where(given[0][:, None] == given[2][None, :])
                given = (given[0][p], given[1][p], given[3][n])
            mined = tuple(torch.cat([x, y.to(x.device)]) for x, y in zip(mined, given, strict=True))
        return mined

    def _enqueue(self, embeddings: Tensor, labels: Tensor) -> None:
        n = embeddings.shape[0]
        rows = torch.arange(self.queue_idx, self.queue_idx + n, device=embeddings.device) % self.memory_size
        self.embedding_memory[rows] = embeddings.detach()
        self.label_memory[rows] = labels.detach()
        before, self.queue_idx = self.queue_idx, (self.queue_idx + n) % self.memory_size
        if n > 0 and self.queue_idx <= before:
            self.has_been_filled = True

    def extra_repr(self) -> str:
        return f"embedding_size={self.embedding_size}, memory_size={self.memory_size}"


class ProxyAnchorLoss(nn.Module):
    """pytorch-metric-learning's ``ProxyAnchorLoss(num_classes, embedding_size, margin=0.1,
    alpha=32)`` on the fused kernel: it holds the proxies, a ``(num_classes, embedding_size)``
    parameter initialised as PML's (Kaiming normal, fan-out); see
    :func:`torchkit.ops.proxy_anchor_loss`. Train them with their own optimiser group (the
    paper uses a 100× larger learning rate). ``group``: the loss across the ranks of that
    process group (the function's ``group=``)."""

    def __init__(
        self, num_classes: int, embedding_size: int, margin: float = 0.1, alpha: float = 32.0, *, group=None
    ) -> None:
        super().__init__()
        self.group = group
        name = "ProxyAnchorLoss"
        num_classes = as_int(name, "num_classes", num_classes)
        embedding_size = as_int(name, "embedding_size", embedding_size)
        if num_classes < 1 or embedding_size < 1:
            raise ValueError(
                f"{name}: num_classes and embedding_size must be >= 1, got {num_classes} and {embedding_size}"
            )
        self.margin = as_float(name, "margin", margin)
        self.alpha = as_float(name, "alpha", alpha)
        _check_proxy_params(name, self.margin, self.alpha)
        self.proxies = nn.Parameter(torch.empty(num_classes, embedding_size))
        nn.init.kaiming_normal_(self.proxies, mode="fan_out")

    def forward(self, embeddings: Tensor, labels: Tensor) -> Tensor:
        return ops.proxy_anchor_loss(embeddings, labels, self.proxies, self.margin, self.alpha, group=self.group)

    def extra_repr(self) -> str:
        n, d = self.proxies.shape
        return f"num_classes={n}, embedding_size={d}, margin={self.margin!r}, alpha={self.alpha!r}"
