"""Drop-in ``torch.nn.Module`` wrappers of ``torchkit.ops``."""

from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from torchkit import ops

__all__ = ["CDist", "LabelSmoothingCrossEntropy"]


class LabelSmoothingCrossEntropy(nn.Module):
    """``nn.CrossEntropyLoss(label_smoothing=ε)`` on the fused kernel; see
    :func:`torchkit.ops.label_smoothing_cross_entropy` for shapes and the two conventions.

    ``weight`` is a buffer: it follows ``.to()`` and is saved in the state dict.
    """

    def __init__(
        self,
        weight: Optional[Tensor] = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.1,
        exclude_target: bool = False,
    ) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
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
        self.squared = squared

    def forward(self, x1: Tensor, x2: Optional[Tensor] = None) -> Tensor:
        return ops.cdist(x1, x2, squared=self.squared)

    def extra_repr(self) -> str:
        return f"squared={self.squared}"
