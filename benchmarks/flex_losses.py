"""SupCon, NT-Xent and proxy-anchor written on torch.nn.attention.flex_attention the way a user
would: the similarities as attention scores (queries and keys the L2-normalised rows, the scale
1/τ or α), a mask_mod over the captured labels, and the log-sum-exp flex_attention returns
(differentiable); the positives' terms from class sums or gathered pairs. PML's defaults, for
the GPU benchmark (bench_pair_losses.py's "flex_attention" peer): what a user picks instead of
torchkit. `flex` is flex_attention itself (eager) or its torch.compile."""

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

VALUE_DIM = 16  # the attention output is unused: the smallest value rows the kernels take


def _lse(flex, q, k, scale, mask_mod, score_mod=None):
    """Per query row, log Σ over the keys mask_mod keeps of exp(scale·q·k (+ score_mod))."""
    Q, K = q.shape[0], k.shape[0]
    mask = create_block_mask(mask_mod, None, None, Q, K, device=q.device)
    value = q.new_zeros(1, 1, K, VALUE_DIM)
    _, lse = flex(
        q[None, None], k[None, None], value, score_mod=score_mod, block_mask=mask, scale=scale, return_lse=True
    )
    return lse[0, 0].float()


def supcon_loss(e, labels, temperature=0.1, flex=flex_attention):
    z = F.normalize(e, dim=1)
    lse = _lse(flex, z, z, 1.0 / temperature, lambda b, h, i, j: i != j)
    classes, ids = labels.unique(return_inverse=True)
    sums = torch.zeros(len(classes), z.shape[1], dtype=z.dtype, device=z.device).index_add_(0, ids, z)
    npos = torch.bincount(ids, minlength=len(classes))[ids] - 1
    positives = ((z * sums[ids]).sum(1) - (z * z).sum(1)).float() / temperature
    loss = lse - positives / npos.clamp(min=1)
    kept = (npos > 0) & (loss > 0)
    return torch.where(kept, loss, 0.0).sum() / kept.sum().clamp(min=1)


def _positive_pairs(labels):
    """Every (anchor, positive) pair of equal labels, from the labels sorted: O(pairs)."""
    ordered, order = labels.sort()
    _, counts = torch.unique_consecutive(ordered, return_counts=True)
    size = torch.repeat_interleave(counts, counts)  # each sorted row's class size
    start = torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    anchor = torch.repeat_interleave(torch.arange(len(labels), device=labels.device), size)
    first = torch.repeat_interleave(size.cumsum(0) - size, size)
    partner = start[anchor] + torch.arange(len(anchor), device=labels.device) - first
    keep = anchor != partner
    return order[anchor[keep]], order[partner[keep]]


def ntxent_loss(e, labels, temperature=0.07, flex=flex_attention):
    z = F.normalize(e, dim=1)
    negatives = _lse(flex, z, z, 1.0 / temperature, lambda b, h, i, j: labels[i] != labels[j])
    a, p = _positive_pairs(labels)
    x = (z[a] * z[p]).sum(1).float() / temperature
    return (torch.logaddexp(x, negatives[a]) - x).mean()


def proxy_anchor_loss(e, labels, proxies, margin=0.1, alpha=32.0, flex=flex_attention):
    z, zp = F.normalize(e, dim=1), F.normalize(proxies, dim=1)
    shift = lambda score, b, h, c, j: score + alpha * margin  # noqa: E731
    negatives = _lse(flex, zp, z, alpha, lambda b, h, c, j: labels[j] != c, shift)
    positives = _lse(flex, -zp, z, alpha, lambda b, h, c, j: labels[j] == c, shift)
    with_positives = (torch.bincount(labels, minlength=len(proxies)) > 0).sum()
    return F.softplus(positives).sum() / with_positives.clamp(min=1) + F.softplus(negatives).sum() / len(proxies)
