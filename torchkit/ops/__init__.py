"""The fused ops: ``torch.ops.torchkit.*`` behind typed, documented Python functions.

One module per op (the basename of its csrc/ files) holds its function, its fake kernels
(for ``torch.compile``) and its autograd formula; schemas and kernels live in ``csrc/``.
"""

from torchkit.ops.bilinear_pool import bilinear_pool
from torchkit.ops.cdist import cdist
from torchkit.ops.covariance_pool import covariance_pool
from torchkit.ops.knn import knn
from torchkit.ops.label_smoothing_cross_entropy import label_smoothing_cross_entropy
from torchkit.ops.pair_losses import (
    contrastive_loss,
    multi_similarity_loss,
    ntxent_loss,
    proxy_anchor_loss,
    supcon_loss,
    triplet_margin_loss,
)
from torchkit.ops.region_confusion import permute_blocks, region_confusion

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
