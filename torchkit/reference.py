"""Pure-PyTorch reference implementations: the cookbook formulations, short and obvious.

Same signatures as ``torchkit.ops``; tests use them as oracles and benchmarks as peers.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["cdist", "label_smoothing_cross_entropy"]


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
    build the smoothed distribution q explicitly, then ``−Σ w·q·log_softmax``."""
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
    """The cookbook's broadcasting formula ``sqrt(Σ (x1[:, None] − x2)²)``: exact, but
    O(P·R·M) memory. Zero distances get a zero gradient (``torch.cdist``'s convention)."""
    x2 = x1 if x2 is None else x2
    d2 = ((x1.unsqueeze(-2) - x2.unsqueeze(-3)) ** 2).sum(-1)
    if squared:
        return d2
    # sqrt'(0) is infinite; route zeros around it so that their gradient is 0, not NaN.
    zero = d2 == 0
    return torch.where(zero, 0.0, torch.where(zero, 1.0, d2).sqrt())
