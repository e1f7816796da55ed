"""What the pair losses' Triton engines share: the CPU kernels' checks of the arguments in their
order (csrc/pair_losses.cpp), the shard's, PML's batch rule, the shapes of a backward's
outputs, F.normalize's rows in float64 (_unit) as the exact recomputations take them, and the
exact distances of pairs (_pair_exact)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from torchkit.ops._common import check_scalars
from torchkit.ops.pair_losses import _check_inputs, _check_params, _check_proxy_inputs, _check_shard
from torchkit.triton import _launch

NORM_EPS = tl.constexpr(1e-12)  # F.normalize's (csrc/cpu/pair_losses_cpu.h's kNormEps)


@triton.jit
def _feature(block, ks, kk):
    """Feature kk of a block of rows' features (2-D; ks: the features' indices along its
    second axis) exactly: the sum of it and −0s, as x + (−0) is x for every x."""
    return tl.sum(tl.where(ks[None, :] == kk, block, -0.0), axis=1)


@triton.jit
def _unit(x, inv, ONE_FEATURE: tl.constexpr):
    """F.normalize's rows x / max(‖x‖, eps) in float64 from x (float64) and its float64 1/norm,
    as the CPU kernel's Points::Pair: x·inv, a multiplication for a division, except for rows
    of one feature (ONE_FEATURE: D = 1, a launch of its own), where x·inv is 1 − ulp for many x
    and the division exactly ±1 (or x/eps)."""
    if ONE_FEATURE:
        a = tl.abs(x)
        eps = tl.full(x.shape, NORM_EPS, tl.float64)
        out = x / tl.where(a < eps, eps, a)  # NaN stays NaN, ±∞ gives NaN as ∞/∞
    else:
        out = x * inv
    return out


@triton.jit
def _unit_row(inv):
    """Whether a row's normalised norm is 1 in exact arithmetic (Points::unit): its norm finite
    and above eps (1/norm in (0, 1/eps); NaN fails)."""
    return (inv > 0.0) & (inv < 1.0 / tl.full(inv.shape, NORM_EPS, tl.float64))


@triton.jit
def _zero_rows(xa_ptr, xb_ptr, sa, sb, inv_a, inv_b, rows, cols, row_mask, col_mask, D):
    """Which rows of either side (cols: a vector, or a 2-D block of ref rows) are all zero:
    F.normalize leaves them 0, at distance exactly 1 from every unit row (Points::zero). Read
    only where a row is clamped (1/norm >= 1/eps: a zero row is), which is rare."""
    zero_a = tl.zeros(rows.shape, tl.int1)
    zero_b = tl.zeros(cols.shape, tl.int1)
    big = 1.0 / tl.full((), NORM_EPS, tl.float64)
    clamped = tl.max((inv_a >= big).to(tl.int32), axis=0) + tl.max(tl.ravel((inv_b >= big).to(tl.int32)), axis=0)
    if clamped > 0:
        size_a = tl.zeros(rows.shape, tl.float64)
        size_b = tl.zeros(cols.shape, tl.float64)
        for k in range(0, D):
            size_a += tl.abs(tl.load(xa_ptr + rows * sa + k, mask=row_mask, other=0.0).to(tl.float64))
            size_b += tl.abs(tl.load(xb_ptr + cols * sb + k, mask=col_mask, other=0.0).to(tl.float64))
        zero_a = size_a == 0.0
        zero_b = size_b == 0.0
    return zero_a, zero_b


@triton.jit
def _eight(ptr, at, k0, D, mask):
    """Features k0 .. k0 + 7 of rows whose first features are at ptr + at (past D: feature
    D − 1 read again, for the caller to take as 0, rather than a masked lane: the interpreter
    gives a one-row tensor's masked lane no `other`). Loads only, used after the caller's
    other loads are issued: one round trip to memory for all of them."""
    x0 = tl.load(ptr + at + tl.minimum(k0, D - 1), mask=mask, other=0.0)
    x1 = tl.load(ptr + at + tl.minimum(k0 + 1, D - 1), mask=mask, other=0.0)
    x2 = tl.load(ptr + at + tl.minimum(k0 + 2, D - 1), mask=mask, other=0.0)
    x3 = tl.load(ptr + at + tl.minimum(k0 + 3, D - 1), mask=mask, other=0.0)
    x4 = tl.load(ptr + at + tl.minimum(k0 + 4, D - 1), mask=mask, other=0.0)
    x5 = tl.load(ptr + at + tl.minimum(k0 + 5, D - 1), mask=mask, other=0.0)
    x6 = tl.load(ptr + at + tl.minimum(k0 + 6, D - 1), mask=mask, other=0.0)
    x7 = tl.load(ptr + at + tl.minimum(k0 + 7, D - 1), mask=mask, other=0.0)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _square(out, a, b, k, D, inv_a, inv_b, ONE_FEATURE: tl.constexpr):
    """out + (a − b)², a and b feature k of the anchor rows and of their refs (_eight's: 0 past
    D), normalised (_unit) in float64: one step of the feature-order sum."""
    a = tl.where(k < D, a.to(tl.float64), 0.0)
    b = tl.where(k < D, b.to(tl.float64), 0.0)
    v = _unit(a, inv_a, ONE_FEATURE)[:, None] - _unit(b, inv_b, ONE_FEATURE)
    return out + v * v


@triton.jit
def _pair_exact(xa_ptr, xb_ptr, sa, sb, inv_a_ptr, inv_b_ptr, rows, js, row_mask, mask, D, ONE_FEATURE: tl.constexpr):
    """Exact distances (Points::direct: float64, feature order; 1 between a zero row and a unit
    one) of anchor rows[i] and ref rows js[i, p] (2-D): eight features of each at a time
    (_eight), their loads in flight together."""
    inv_a = tl.load(inv_a_ptr + rows, mask=row_mask, other=0.0)
    inv_b = tl.load(inv_b_ptr + js, mask=mask, other=0.0)
    out = tl.zeros(js.shape, tl.float64)
    for k0 in range(0, D, 8):
        a0, a1, a2, a3, a4, a5, a6, a7 = _eight(xa_ptr, rows * sa, k0, D, row_mask)
        b0, b1, b2, b3, b4, b5, b6, b7 = _eight(xb_ptr, js * sb, k0, D, mask)
        out = _square(out, a0, b0, k0 + 0, D, inv_a, inv_b, ONE_FEATURE)
        out = _square(out, a1, b1, k0 + 1, D, inv_a, inv_b, ONE_FEATURE)
        out = _square(out, a2, b2, k0 + 2, D, inv_a, inv_b, ONE_FEATURE)
        out = _square(out, a3, b3, k0 + 3, D, inv_a, inv_b, ONE_FEATURE)
        out = _square(out, a4, b4, k0 + 4, D, inv_a, inv_b, ONE_FEATURE)
        out = _square(out, a5, b5, k0 + 5, D, inv_a, inv_b, ONE_FEATURE)
        out = _square(out, a6, b6, k0 + 6, D, inv_a, inv_b, ONE_FEATURE)
        out = _square(out, a7, b7, k0 + 7, D, inv_a, inv_b, ONE_FEATURE)
    out = tl.sqrt(out)
    if not ONE_FEATURE:  # (one feature: |±1 − 0| is 1 exactly already)
        zero_a, zero_b = _zero_rows(xa_ptr, xb_ptr, sa, sb, inv_a, inv_b, rows, js, row_mask, mask, D)
        one = (zero_a[:, None] & _unit_row(inv_b)) | (_unit_row(inv_a)[:, None] & zero_b)
        out = tl.where(one, 1.0, out)
    return out


def _check(op: str, embeddings, labels, ref_embeddings, ref_labels, temperature, shard) -> tuple:
    """The CPU kernels' checks in their order (the fake kernels' too): the arguments' types,
    the inputs, the shard (_shard), the parameters' values; returns (τ, shard)."""
    check_scalars(op, ("float", "temperature", temperature))
    _check_inputs(op, embeddings, labels, ref_embeddings, ref_labels)
    shard = _shard(op, shard, embeddings, labels, ref_embeddings, ref_labels)
    _check_params(op, (float(temperature),))
    return float(temperature), shard


def _shard(op: str, shard, embeddings, labels, ref_embeddings, ref_labels) -> int | None:
    """csrc/pair_losses.cpp's checks of a shard (None: none; −1: refs apart from the anchors;
    >= 0: the anchors' first ref row), with the anchors' labels and rows, which must be those ref rows':
    read on the host for CPU tensors (the interpreter), asserted on the device for CUDA ones
    (no synchronisation)."""
    if shard is None:
        return None
    _check_shard(op, shard, embeddings, ref_embeddings)
    N = embeddings.shape[0]
    if shard >= 0 and N > 0:
        mine, theirs = labels.long(), ref_labels.narrow(0, shard, N).long()
        rule = (
            f"{op}: with shard = {shard}, labels must equal ref_labels[shard:shard + N] (the anchors are "
            "those ref rows)"
        )
        # And their rows, compared by their bits (a NaN row is that row too).
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[embeddings.element_size()]
        rows, refs = embeddings.view(bits), ref_embeddings.narrow(0, shard, N).view(bits)
        row_rule = (
            f"{op}: with shard = {shard}, embeddings must equal ref_embeddings[shard:shard + N] (the anchors are "
            "those ref rows)"
        )
        if _launch.checks_on_host(labels):
            differ = (mine != theirs).nonzero()
            if differ.numel():
                raise ValueError(f"{rule}, got a different label at anchor {int(differ[0, 0])}")
            unequal = (rows != refs).any(1).nonzero()
            if unequal.numel():
                raise ValueError(f"{row_rule}, got a different row at anchor {int(unequal[0, 0])}")
        else:
            torch._assert_async((mine == theirs).all(), rule)
            torch._assert_async((rows == refs).all(), row_rule)
    return int(shard)


def _self_pairs(ref_embeddings, shard: int | None) -> tuple[bool, int]:
    """Whether the anchors are rows of the refs (left out of their own pairs), and the first's
    row there."""
    if shard is not None and shard >= 0:
        return True, shard
    return ref_embeddings is None, 0


def _own_rows(stats: Tensor, shard: int, M: int) -> Tensor:
    """A shard's own stats (own_stats: N rows) as the rows [shard, shard + N) of M, the others
    0: the refs' problem's layout, which a backward of the anchors' pairs alone (ANCHORS_OTHER
    off) reads at OFFSET + row, as with the whole problem's stats."""
    padded = stats.new_zeros((M, stats.shape[1]))
    padded[shard : shard + stats.shape[0]] = stats
    return padded


def _parts(*values: Tensor) -> Tensor:
    """A shard's loss output: its reducer's parts (csrc/pair_losses.h), float64."""
    return torch.stack([v.double() for v in values])


def _zeros(want: bool, like: Tensor | None, empty: Tensor) -> Tensor:
    """A backward's output where nothing is computed (csrc's backward_outputs): zeros of like's
    shape where wanted, `empty` ((0,)) where output_mask leaves it out."""
    return torch.zeros_like(like, memory_format=torch.contiguous_format) if want else empty


def _proxy_check(embeddings, labels, proxies, margin, alpha) -> tuple[float, float]:
    """csrc/pair_losses.cpp's check_proxy_inputs: the labels' range read on the host for CPU
    tensors (the interpreter), asserted on the device for CUDA ones (no synchronisation: a
    device-side assertion, as the cross-entropy's CUDA kernel gives)."""
    op = "proxy_anchor_loss"
    check_scalars(op, ("float", "margin", margin), ("float", "alpha", alpha))
    margin, alpha = float(margin), float(alpha)
    _check_proxy_inputs(embeddings, labels, proxies, margin, alpha)
    C = proxies.shape[0]
    if labels.numel() > 0:
        if _launch.checks_on_host(labels):
            low, high = int(labels.min()), int(labels.max())
            if low < 0 or high >= C:
                bad = low if low < 0 else high
                raise IndexError(f"{op}: labels must lie in [0, C) = [0, {C}) (a row of proxies each), got {bad}")
        else:
            inside = ((labels >= 0) & (labels < C)).all()
            torch._assert_async(inside, f"{op}: labels must lie in [0, C) = [0, {C}) (a row of proxies each)")
    return margin, alpha


def _euclidean_only(op: str, distance: str) -> None:
    """The Euclidean losses' kernels compute distance="euclidean" (the CPU kernel both)."""
    if distance != "euclidean":
        raise NotImplementedError(
            f"{op}: distance='{distance}' has no CUDA kernel yet (the CPU kernel has one); compute the loss on CPU "
            f"tensors, e.g. {op}(embeddings.cpu(), labels.cpu(), distance='{distance}')"
        )
