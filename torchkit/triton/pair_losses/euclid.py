"""contrastive_loss on tensor cores under the CUDA precision contract (docs/ops.md), with the
CPU kernel's choices: a pair's term counts exactly where the float64 distance
(Points::direct in pair_losses_euclidean_cpu.cpp) says it does, without a float64 value per
pair.

- Points (the package's _points, O(N·D)): F.normalize's rows centred on the float64 mean of the
  finite ones of both sides, rounded once to the accumulation type, and their squared norms, as
  the CPU kernel's make_points; points_operands_kernel lays them out as the products take them
  (lse's schemes: float32 rows' by PyTorch's fp32-matmul setting, the TF32 pair by default,
  TF32 or bfloat16; bfloat16 and float16 rows' as a bfloat16 pair whatever the setting
  (_scheme); float64 for float64 inputs; the points are float32 for every input dtype but
  float64), a NaN entry as 0 (such a row's squared norm is NaN: its pairs are recomputed).
- Forward (contrastive_rows_kernel): a program per block of anchors (their rows held whole up
  to 128 features, lse.HELD) and slice of refs (lse's slices), the tile's d² = |c_i|² +
  |c_j|² − 2c_i·c_j and d in the accumulation type. The tile's d is within a bound of the
  exact one (_decisions: the scheme's rounding of the products and their sums, the points'
  and the norms' roundings, the root's); a pair whose d² cancelled
  (below (|c_i|² + |c_j|²)/16: near-duplicates, a NaN row) or whose d lies within that bound
  of its margin is listed for its anchor (ms._append) and left out of the tile's sums; a pair
  of equal rows (_equal_rows) is at 0, counted or not by its margin, never listed. Per anchor
  and slice: the counted terms' sums (float64, a tile's row at a time) and counts.
- contrastive_exact_kernel: the listed pairs of each anchor, in ref order (the same bits on
  every run), on their exact distances (_pair_exact), added to its slices' sums (in slice
  order); an anchor whose list outgrew its CAP slots is taken whole (every pair exact, its
  slices left out). Per block of anchors, the partial sums of the batch.
- The batch (loss_kernel): PML's rule over the partials, in a fixed order, and the loss and
  stats written on the device (no host synchronisation, no torch operation after the
  kernels).
- Backward (contrastive_grad_kernel): the same tiles and decisions; per pair w = ∂loss/∂d / d,
  Σ_j w_ij (c_i − c_j) as rowsum(w)·c_i − w·C with w·C on tensor cores (lse._grad_product: w
  split as the operands are), per block of own rows, block of features and slice of the other
  rows; a listed pair is left out and listed for its own row, and contrastive_pairs_grad_kernel
  adds the listed pairs' w_ij (e_i − e_j) from the inputs' float64 differences as one more
  slice (near-duplicates: the points keep only the accumulation type's absolute accuracy).
  lse.jacobian_kernel sums the slices in order and takes each row through the normalisation.
  Without refs a pair is in the loss from both its rows: twice its weight. No float atomics.

A shard (the losses across ranks) is as in the package's other engines (__init__.py).
Kernels never index past what the wrapper checked; offsets are int64.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from torchkit.ops._common import acc_dtype, check_scalars
from torchkit.ops.pair_losses import _check_inputs, _check_loss_backward, _check_own_stats, _check_params, _whole_rows
from torchkit.triton import _math as tm
from torchkit.triton._launch import CompileCase, Config, acc_tl, blocks, float_bits, hot
from torchkit.triton.pair_losses import lse, ms
from torchkit.triton.pair_losses._common import _euclidean_only, _pair_exact, _self_pairs, _shard, _unit, _zeros

# Launch configurations (every one run by the tests and compiled by tools/triton_check.py; the
# first is the default, the last float64's).
# The second the TF32 pair's default where its rows are held whole (16 columns leave the
# registers the 128 features: none spilled, where 32 spilled 588 bytes).
ROWS_CONFIGS = (
    Config(BLOCK_N=64, BLOCK_M=32, BLOCK_K=32, num_warps=4, num_stages=3),
    Config(BLOCK_N=64, BLOCK_M=16, BLOCK_K=32, num_warps=4, num_stages=3),
    Config(BLOCK_N=64, BLOCK_M=64, BLOCK_K=16, num_warps=8, num_stages=2),
    Config(BLOCK_N=32, BLOCK_M=32, BLOCK_K=16, num_warps=4, num_stages=2),
)
# contrastive_grad_kernel's: feature blocks of up to 128 (each block recomputes the tile); the
# second the bfloat16 pair's default where its rows are held whole (the first's 32 columns
# spill 528 bytes beside them on sm_90).
GRAD_CONFIGS = (
    Config(BLOCK_N=64, BLOCK_M=32, BLOCK_K=32, BLOCK_F=128, num_warps=8, num_stages=3),
    Config(BLOCK_N=64, BLOCK_M=16, BLOCK_K=32, BLOCK_F=128, num_warps=8, num_stages=3),
    Config(BLOCK_N=32, BLOCK_M=32, BLOCK_K=32, BLOCK_F=128, num_warps=4, num_stages=2),
    Config(BLOCK_N=32, BLOCK_M=32, BLOCK_K=16, BLOCK_F=32, num_warps=4, num_stages=2),
)
# The exact kernels: float64 distances summed in feature order (Points::direct's), no FMA.
# BLOCK_C: the listed pairs taken at once (a row's CAP slots, or refs of a row taken whole).
EXACT_CONFIGS = (
    Config(BLOCK_ROWS=16, BLOCK_C=32, num_warps=4, num_stages=2, fp_fusion=False),
    Config(BLOCK_ROWS=4, BLOCK_C=16, num_warps=2, num_stages=2, fp_fusion=False),
)
PAIRS_CONFIG = Config(BLOCK_C=32, num_warps=4, num_stages=2, fp_fusion=False)


# --------------------------------------------------------------------------- kernels


@triton.jit
def points_operands_kernel(
    c_ptr, hi_ptr, lo_ptr, N, D, SCHEME: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr
):
    """The points (ACC, contiguous) as the products take them (lse's layouts: hi and lo for the
    TF32 pair and the bfloat16 pair), a NaN entry as 0."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < N
    for k0 in range(0, D, BLOCK_D):
        ks = k0 + tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (ks < D)[None, :]
        offsets = rows[:, None] * D + ks[None, :]
        x = tl.load(c_ptr + offsets, mask=mask, other=0.0)
        x = tl.where(x == x, x, 0.0)
        if SCHEME == lse.TF32X3:
            hi = lse._tf32(x)
            tl.store(hi_ptr + offsets, hi, mask=mask)
            tl.store(lo_ptr + offsets, lse._tf32(x - hi), mask=mask)
        elif SCHEME == lse.BF16X3:  # (rounded to nearest under the interpreter too: lse._bf16)
            hi = lse._bf16(x)
            tl.store(hi_ptr + offsets, hi.to(tl.bfloat16), mask=mask)
            tl.store(lo_ptr + offsets, lse._bf16(x - hi).to(tl.bfloat16), mask=mask)
        elif SCHEME == lse.TF32:
            tl.store(hi_ptr + offsets, lse._tf32(x), mask=mask)
        else:
            tl.store(hi_ptr + offsets, x.to(hi_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dots(
    a_hi,
    a_lo,
    b_hi,
    b_lo,
    ah,
    al,
    bh,
    bl,
    rows,
    cols,
    row_mask,
    col_mask,
    D,
    ACC: tl.constexpr,
    SCHEME: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The tile's products c_i·c_j: of the held rows ah, al and bh, bl (BLOCK_D > 0), or BLOCK_K
    features at a time."""
    if BLOCK_D > 0:
        v = lse._mma(ah, al, tl.trans(bh), tl.trans(bl), tl.zeros((rows.shape[0], cols.shape[0]), ACC), SCHEME)
    else:
        v = tl.zeros((rows.shape[0], cols.shape[0]), ACC)
        for k0 in range(0, D, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < D
            xh, xl = lse._load(a_hi, a_lo, rows, ks, row_mask[:, None] & k_mask[None, :], D, SCHEME, INTERPRET)
            yh, yl = lse._load(b_hi, b_lo, cols, ks, col_mask[:, None] & k_mask[None, :], D, SCHEME, INTERPRET)
            v = lse._mma(xh, xl, tl.trans(yh), tl.trans(yl), v, SCHEME)
    return v


@triton.jit
def _decisions(v, sq_a, sq_b, valid, pos, same, pm, nm, same_p, same_n, err, IS64: tl.constexpr):
    """A tile's squared distances d² and distances d, its terms x (d − pos_margin for a
    positive pair, neg_margin − d for a negative one, in the accumulation type), the pairs
    listed (valid, not of equal rows, and cancelled: d² <= (|c_i|² + |c_j|²)/16 or subnormal, a
    NaN norm included; or within their bound of their margin t: |d − t|·d <= err·(|c_i|² + |c_j|²) +
    u·(8d² + 4|t|·d): the tile's error e over d, the root's (the GPU's approximate float32 root,
    within 2u·d) and the bound's own roundings, the margin's to the accumulation type), and the
    counted ones (x > 0 or NaN, a pair of equal rows at d = 0 by same_p, same_n: the float64
    margins')."""
    if IS64:
        u = 2.0**-53
        TINY = 2.0**-1022
    else:
        u = 2.0**-24
        TINY = 2.0**-126
    total = sq_a[:, None] + sq_b[None, :]
    d2 = tl.maximum(total - 2.0 * v, 0.0)
    d = tl.sqrt(d2)
    t = tl.where(pos, pm, nm)
    e = (err * sq_a)[:, None] + (err * sq_b)[None, :]
    near = (tl.abs(d - t) * d > e + d * (8.0 * u * d + tl.where(pos, 4.0 * u * tl.abs(pm), 4.0 * u * tl.abs(nm)))) == 0
    # (a d² below the smallest normal is cancelled too: the GPU's float32 roots flush it to 0)
    listed = valid & (((d2 * 16.0 > total) == 0) | (d2 < TINY) | near) & (same == 0)
    d = tl.where(same, 0.0, d)
    x = tl.where(pos, d - pm, nm - d)
    counted = tl.where(same, tl.where(pos, same_p, same_n), (x <= 0) == 0)
    return d2, d, x, listed, valid & (listed == 0) & counted


@hot()
@triton.jit
def contrastive_rows_kernel(
    a_hi,
    a_lo,
    b_hi,
    b_lo,
    sq_a_ptr,
    sq_b_ptr,
    lab_ptr,
    ref_lab_ptr,
    grp_a_ptr,
    grp_b_ptr,
    sums_ptr,
    count_ptr,
    slot_ptr,
    fill_ptr,
    N,
    M,
    D,
    OFFSET,
    CHUNK,
    CAP,
    POS_BITS,
    NEG_BITS,
    ERR_BITS,
    SELF: tl.constexpr,
    ACC: tl.constexpr,
    IS64: tl.constexpr,
    SCHEME: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """For a block of anchors over the refs of slice program_id(1) (CHUNK refs from
    program_id(1)·CHUNK; SELF: anchor i is ref OFFSET + i, not a pair): the counted terms' sums
    (sums[slice, anchor, kind], float64) and counts (count[slice, anchor, kind]), kind 0 the
    negatives, 1 the positives; the listed pairs appended to their anchor's slots."""
    pm64 = tm.f64(POS_BITS)
    nm64 = tm.f64(NEG_BITS)
    pm = pm64.to(ACC)
    nm = nm64.to(ACC)
    err = tm.f64(ERR_BITS).to(ACC)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    me = rows + OFFSET
    lab = tl.load(lab_ptr + rows, mask=row_mask, other=0)
    grp = tl.load(grp_a_ptr + rows, mask=row_mask, other=-1)
    sq_a = tl.load(sq_a_ptr + rows, mask=row_mask, other=0.0)
    sum_n = tl.zeros((BLOCK_N,), tl.float64)
    sum_p = tl.zeros((BLOCK_N,), tl.float64)
    n_n = tl.zeros((BLOCK_N,), tl.int32)
    n_p = tl.zeros((BLOCK_N,), tl.int32)
    ah = sq_a
    al = sq_a
    if BLOCK_D > 0:  # the anchors' whole rows, held across the refs (BLOCK_D >= D)
        ks = tl.arange(0, BLOCK_D)
        ah, al = lse._load(a_hi, a_lo, rows, ks, row_mask[:, None] & (ks < D)[None, :], D, SCHEME, INTERPRET)
    first = tl.program_id(1).to(tl.int64) * CHUNK
    last = tl.minimum(first + CHUNK, M)
    for j0 in range(first, last, BLOCK_M):
        cols = j0 + tl.arange(0, BLOCK_M).to(tl.int64)
        col_mask = cols < last
        ref_lab = tl.load(ref_lab_ptr + cols, mask=col_mask, other=-1)
        grp_b = tl.load(grp_b_ptr + cols, mask=col_mask, other=-2)
        sq_b = tl.load(sq_b_ptr + cols, mask=col_mask, other=0.0)
        bh = sq_b
        bl = sq_b
        if BLOCK_D > 0:
            bh, bl = lse._load(b_hi, b_lo, cols, ks, col_mask[:, None] & (ks < D)[None, :], D, SCHEME, INTERPRET)
        v = _dots(
            a_hi, a_lo, b_hi, b_lo, ah, al, bh, bl, rows, cols, row_mask, col_mask, D, ACC, SCHEME, INTERPRET,
            BLOCK_K, BLOCK_D,
        )  # fmt: skip
        valid = row_mask[:, None] & col_mask[None, :]
        if SELF:
            valid = valid & (me[:, None] != cols[None, :])
        pos = lab[:, None] == ref_lab[None, :]
        same = grp[:, None] == grp_b[None, :]
        _, _, x, listed, counted = _decisions(v, sq_a, sq_b, valid, pos, same, pm, nm, pm64 < 0, nm64 > 0, err, IS64)
        if lse._any(listed):
            ms._append(listed, rows, cols, fill_ptr, slot_ptr, CAP)
        sum_p += tl.sum(tl.where(counted & pos, x, 0.0), axis=1).to(tl.float64)
        sum_n += tl.sum(tl.where(counted & (pos == 0), x, 0.0), axis=1).to(tl.float64)
        # (both counts in one sum: a tile's row holds at most BLOCK_M < 2^16 pairs)
        both = tl.sum(tl.where(counted, tl.where(pos, 65536, 1), 0), axis=1)
        n_p += both >> 16
        n_n += both & 65535
    at = (tl.program_id(1).to(tl.int64) * N + rows) * 2
    tl.store(sums_ptr + at, sum_n, mask=row_mask)
    tl.store(sums_ptr + at + 1, sum_p, mask=row_mask)
    tl.store(count_ptr + at, n_n, mask=row_mask)
    tl.store(count_ptr + at + 1, n_p, mask=row_mask)


@triton.jit
def _span(CAP, BLOCK_C: tl.constexpr):
    """The slots' rounds' span: CAP rounded up to whole rounds of BLOCK_C."""
    return tl.cdiv(CAP, BLOCK_C) * BLOCK_C


@triton.jit
def _listed(slot_ptr, fill, whole, rows, row_mask, j0, M, CAP, BLOCK_C: tl.constexpr):
    """Round j0 (from −_span, by BLOCK_C) of an exact kernel's pairs for anchors `rows`: their
    listed refs in slots [j0 + span, j0 + span + BLOCK_C) (j0 < 0), or for the anchors taken
    whole, refs [j0, j0 + BLOCK_C); (refs, mask), 2-D."""
    cs = tl.arange(0, BLOCK_C)
    if j0 < 0:
        slots = j0 + _span(CAP, BLOCK_C) + cs
        mask = (slots[None, :] < fill[:, None]) & (whole == 0)[:, None] & row_mask[:, None]
        cols = tl.load(slot_ptr + rows[:, None] * CAP + slots[None, :], mask=mask, other=0)
    else:
        cols = j0 + cs[None, :].to(tl.int64) + tl.zeros((rows.shape[0], BLOCK_C), tl.int64)
        mask = whole[:, None] & (cols < M)
    return cols, mask


@triton.jit
def contrastive_exact_kernel(
    xa_ptr,
    xb_ptr,
    sa,
    sb,
    inv_a_ptr,
    inv_b_ptr,
    lab_ptr,
    ref_lab_ptr,
    slot_ptr,
    fill_ptr,
    sums_ptr,
    count_ptr,
    npos_ptr,
    partial_ptr,
    N,
    M,
    D,
    OFFSET,
    SLICES,
    CAP,
    POS_BITS,
    NEG_BITS,
    SELF: tl.constexpr,
    ONE_FEATURE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """The listed pairs of a block of anchors on their exact distances (an anchor whose list
    outgrew CAP: every pair of it, BLOCK_C at a time, its slices left out), added to the
    anchors' tiles' sums and counts (SLICES of them, in slice order): the block's partial sums
    partial[k, block] in float64 (k: the negative and the positive terms, their counts, the
    anchors' positive pairs), for loss_kernel."""
    pm = tm.f64(POS_BITS)
    nm = tm.f64(NEG_BITS)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < N
    lab = tl.load(lab_ptr + rows, mask=row_mask, other=0)
    fill = tl.load(fill_ptr + rows, mask=row_mask, other=0)
    whole = row_mask & (fill > CAP)
    sum_n = tl.zeros((BLOCK_ROWS,), tl.float64)
    sum_p = tl.zeros((BLOCK_ROWS,), tl.float64)
    n_n = tl.zeros((BLOCK_ROWS,), tl.int32)
    n_p = tl.zeros((BLOCK_ROWS,), tl.int32)
    tiles = row_mask & (whole == 0)  # (an anchor taken whole has every pair here)
    for k in range(0, SLICES):
        at = (k * N + rows) * 2
        sum_n += tl.load(sums_ptr + at, mask=tiles, other=0.0)
        sum_p += tl.load(sums_ptr + at + 1, mask=tiles, other=0.0)
        n_n += tl.load(count_ptr + at, mask=tiles, other=0)
        n_p += tl.load(count_ptr + at + 1, mask=tiles, other=0)
    # The listed pairs first (rounds from j0 = −_span: the slots), then, for the anchors taken
    # whole, every ref.
    any_whole = tl.max(whole.to(tl.int32), axis=0) > 0
    for j0 in range(0 - _span(CAP, BLOCK_C), tl.where(any_whole, M, 0), BLOCK_C):
        cols, mask = _listed(slot_ptr, fill, whole, rows, row_mask, j0, M, CAP, BLOCK_C)
        if SELF:
            mask = mask & (cols != (rows + OFFSET)[:, None])
        if tl.max(tl.max(mask.to(tl.int32), axis=1), axis=0) > 0:
            d = _pair_exact(xa_ptr, xb_ptr, sa, sb, inv_a_ptr, inv_b_ptr, rows, cols, row_mask, mask, D, ONE_FEATURE)
            pos = mask & (tl.load(ref_lab_ptr + cols, mask=mask, other=-1) == lab[:, None])
            x = tl.where(pos, d - pm, nm - d)
            counted = mask & ((x <= 0) == 0)
            sum_p += tl.sum(tl.where(counted & pos, x, 0.0), axis=1)
            sum_n += tl.sum(tl.where(counted & (pos == 0), x, 0.0), axis=1)
            n_p += tl.sum((counted & pos).to(tl.int32), axis=1)
            n_n += tl.sum((counted & (pos == 0)).to(tl.int32), axis=1)
    npos = tl.load(npos_ptr + rows, mask=row_mask, other=0)
    blocks = tl.num_programs(0).to(tl.int64)
    at = partial_ptr + tl.program_id(0)
    tl.store(at, tl.sum(sum_n, axis=0))
    tl.store(at + blocks, tl.sum(sum_p, axis=0))
    tl.store(at + 2 * blocks, tl.sum(n_n.to(tl.int64), axis=0).to(tl.float64))
    tl.store(at + 3 * blocks, tl.sum(n_p.to(tl.int64), axis=0).to(tl.float64))
    tl.store(at + 4 * blocks, tl.sum(npos.to(tl.int64), axis=0).to(tl.float64))


@triton.jit
def loss_kernel(
    partial_ptr,
    stats_ptr,
    result_ptr,
    N,
    BLOCKS,
    PAIRS,
    SHARD: tl.constexpr,
    WIDE: tl.constexpr,
    BF16: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    """PML's batch rules (contrastive_forward in pair_losses_euclidean_cpu.cpp) over
    contrastive_exact_kernel's partials (BLOCKS of them, summed in a fixed order by every
    program: the same bits everywhere and on every run; PAIRS: the batch's pairs): each kind's
    mean of its counted terms, nothing where each kind has at most one pair. Per block of
    anchors their stats (the positive and the negative terms' weight: 1/count where the loss
    counts the kind, else 0), and from the first program the result: the loss in its dtype (as
    PyTorch casts it: lse._to_output), or a shard's parts in float64 (csrc/pair_losses.h; its
    caller applies the rule to the whole problem's parts)."""
    chunk = tl.arange(0, BLOCK_ROWS)
    sum_n = tl.zeros((BLOCK_ROWS,), tl.float64)
    sum_p = tl.zeros((BLOCK_ROWS,), tl.float64)
    n_n = tl.zeros((BLOCK_ROWS,), tl.float64)
    n_p = tl.zeros((BLOCK_ROWS,), tl.float64)
    positives = tl.zeros((BLOCK_ROWS,), tl.float64)
    for b0 in range(0, BLOCKS, BLOCK_ROWS):
        at = b0 + chunk
        mask = at < BLOCKS
        sum_n += tl.load(partial_ptr + at, mask=mask, other=0.0)
        sum_p += tl.load(partial_ptr + BLOCKS + at, mask=mask, other=0.0)
        n_n += tl.load(partial_ptr + 2 * BLOCKS + at, mask=mask, other=0.0)
        n_p += tl.load(partial_ptr + 3 * BLOCKS + at, mask=mask, other=0.0)
        positives += tl.load(partial_ptr + 4 * BLOCKS + at, mask=mask, other=0.0)
    sum_n = tl.sum(sum_n, axis=0)
    sum_p = tl.sum(sum_p, axis=0)
    n_n = tl.sum(n_n, axis=0)
    n_p = tl.sum(n_p, axis=0)
    positives = tl.sum(positives, axis=0)
    negatives = PAIRS.to(tl.float64) - positives
    use = ((negatives > 1) | (positives > 1)) | SHARD  # (a shard's: its caller's)
    w_p = tl.where(use & (n_p > 0), 1.0 / tl.maximum(n_p, 1.0), 0.0).to(ACC)
    w_n = tl.where(use & (n_n > 0), 1.0 / tl.maximum(n_n, 1.0), 0.0).to(ACC)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + chunk
    row_mask = rows < N
    tl.store(stats_ptr + 2 * rows, w_p + tl.zeros((BLOCK_ROWS,), ACC), mask=row_mask)
    tl.store(stats_ptr + 2 * rows + 1, w_n + tl.zeros((BLOCK_ROWS,), ACC), mask=row_mask)
    if tl.program_id(0) == 0:
        if SHARD:  # (positive, negative): terms, counted, pairs
            tl.store(result_ptr, sum_p)
            tl.store(result_ptr + 1, n_p)
            tl.store(result_ptr + 2, sum_n)
            tl.store(result_ptr + 3, n_n)
            tl.store(result_ptr + 4, positives)
            tl.store(result_ptr + 5, negatives)
        else:
            mean_n = tl.where(n_n > 0, sum_n / tl.maximum(n_n, 1.0), 0.0)
            mean_p = tl.where(n_p > 0, sum_p / tl.maximum(n_p, 1.0), 0.0)
            tl.store(result_ptr, lse._to_output(tl.where(use, mean_n + mean_p, 0.0), WIDE, BF16))


@hot()
@triton.jit
def contrastive_grad_kernel(
    own_hi,
    own_lo,
    other_hi,
    other_lo,
    c_own_ptr,
    sq_own_ptr,
    sq_other_ptr,
    own_lab_ptr,
    other_lab_ptr,
    grp_own_ptr,
    grp_other_ptr,
    st_ptr,
    slot_ptr,
    fill_ptr,
    out_ptr,
    N_OWN,
    N_OTHER,
    D,
    OFFSET,
    CHUNK,
    CAP,
    POS_BITS,
    NEG_BITS,
    ERR_BITS,
    SELF: tl.constexpr,
    ACC: tl.constexpr,
    IS64: tl.constexpr,
    SCHEME: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[slice, own rows, feature block] = Σ over the other rows of the slice of w_ij (c_i −
    c_j), w = ∂loss/∂d / d: 1/(positive terms) for a counted positive term, −1/(negative terms)
    for a counted negative one (st: the stats' first row), twice that with SELF (own row i is
    other row OFFSET + i, not a pair; the pair is in the loss from both its rows). A listed
    pair is left out and listed for its own row (slots, fill: as the forward's):
    contrastive_pairs_grad_kernel adds its term."""
    pm64 = tm.f64(POS_BITS)
    nm64 = tm.f64(NEG_BITS)
    pm = pm64.to(ACC)
    nm = nm64.to(ACC)
    err = tm.f64(ERR_BITS).to(ACC)
    w_pos = tl.load(st_ptr).to(ACC)
    w_neg = tl.load(st_ptr + 1).to(ACC)
    if SELF:
        w_pos = 2.0 * w_pos
        w_neg = 2.0 * w_neg
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    fs = tl.program_id(1).to(tl.int64) * BLOCK_F + tl.arange(0, BLOCK_F)
    row_mask = rows < N_OWN
    f_mask = fs < D
    me = rows + OFFSET
    lab = tl.load(own_lab_ptr + rows, mask=row_mask, other=0)
    grp = tl.load(grp_own_ptr + rows, mask=row_mask, other=-1)
    sq_i = tl.load(sq_own_ptr + rows, mask=row_mask, other=0.0)
    acc = tl.zeros((BLOCK_N, BLOCK_F), ACC)
    row_sum = tl.zeros((BLOCK_N,), ACC)
    ones = tl.full((BLOCK_M,), 1.0, ACC)  # (_grad_product's factors: the points are as they are)
    ah = sq_i
    al = sq_i
    if BLOCK_D > 0:  # the own rows whole, held across the other rows (BLOCK_D >= D)
        tl.static_assert(BLOCK_F == BLOCK_D, "held rows are one feature block")
        ks = tl.arange(0, BLOCK_D)
        ah, al = lse._load(own_hi, own_lo, rows, ks, row_mask[:, None] & (ks < D)[None, :], D, SCHEME, INTERPRET)
    first = tl.program_id(2).to(tl.int64) * CHUNK
    last = tl.minimum(first + CHUNK, N_OTHER)
    for j0 in range(first, last, BLOCK_M):
        cols = j0 + tl.arange(0, BLOCK_M).to(tl.int64)
        col_mask = cols < last
        other_lab = tl.load(other_lab_ptr + cols, mask=col_mask, other=-1)
        grp_b = tl.load(grp_other_ptr + cols, mask=col_mask, other=-2)
        sq_j = tl.load(sq_other_ptr + cols, mask=col_mask, other=0.0)
        bh = sq_j
        bl = sq_j
        if BLOCK_D > 0:
            bh, bl = lse._load(
                other_hi, other_lo, cols, ks, col_mask[:, None] & (ks < D)[None, :], D, SCHEME, INTERPRET
            )
        v = _dots(
            own_hi, own_lo, other_hi, other_lo, ah, al, bh, bl, rows, cols, row_mask, col_mask, D, ACC, SCHEME,
            INTERPRET, BLOCK_K, BLOCK_D,
        )  # fmt: skip
        valid = row_mask[:, None] & col_mask[None, :]
        if SELF:
            valid = valid & (me[:, None] != cols[None, :])
        pos = lab[:, None] == other_lab[None, :]
        same = grp[:, None] == grp_b[None, :]
        d2, d, _, listed, counted = _decisions(v, sq_i, sq_j, valid, pos, same, pm, nm, pm64 < 0, nm64 > 0, err, IS64)
        if lse._any(listed):
            if tl.program_id(1) == 0:  # (once per pair: the first feature block lists it)
                ms._append(listed, rows, cols, fill_ptr, slot_ptr, CAP)
        # (d > 0 where a pair counts and is not listed or of equal rows; at d = 0, cdist's
        # subgradient 0; 1/d as the GPU's approximate reciprocal root of d², within a few u)
        w = tl.where(
            counted & (d > 0), tl.where(pos, w_pos, 0.0 - w_neg) * tl.math.rsqrt(tl.where(d > 0, d2, 1.0)), 0.0
        )
        row_sum += tl.sum(w, axis=1)
        acc = lse._grad_product(
            0.0 - w, ones, bh, bl, other_hi, other_lo, cols, col_mask, fs, f_mask, D, 1.0, acc, SCHEME, INTERPRET,
            BLOCK_D,
        )  # fmt: skip
    c_i = tl.load(c_own_ptr + rows[:, None] * D + fs[None, :], mask=row_mask[:, None] & f_mask[None, :], other=0.0)
    acc += row_sum[:, None] * c_i
    out = out_ptr + (tl.program_id(2).to(tl.int64) * N_OWN + rows[:, None]) * D + fs[None, :]
    tl.store(out, acc, mask=row_mask[:, None] & f_mask[None, :])


@triton.jit
def contrastive_pairs_grad_kernel(
    xo_ptr,
    xt_ptr,
    s_own,
    s_other,
    inv_own_ptr,
    inv_other_ptr,
    own_lab_ptr,
    other_lab_ptr,
    st_ptr,
    slot_ptr,
    fill_ptr,
    out_ptr,
    N_OWN,
    N_OTHER,
    D,
    OFFSET,
    SLICES,
    CAP,
    POS_BITS,
    NEG_BITS,
    SELF: tl.constexpr,
    ONE_FEATURE: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Own row program_id(0)'s listed pairs on their exact distances (a row whose list outgrew
    CAP: every pair of it, its slices of contrastive_grad_kernel's output cleared): Σ_j w_ij
    (e_i − e_j) from the float64 normalised rows e = x·inv into out's slice SLICES, w as
    contrastive_grad_kernel's (a NaN distance with a weight: NaN)."""
    pm = tm.f64(POS_BITS)
    nm = tm.f64(NEG_BITS)
    w_pos = tl.load(st_ptr).to(tl.float64)
    w_neg = tl.load(st_ptr + 1).to(tl.float64)
    if SELF:
        w_pos = 2.0 * w_pos
        w_neg = 2.0 * w_neg
    row = tl.program_id(0).to(tl.int64)
    rows = row + tl.arange(0, 1).to(tl.int64)
    row_mask = rows < N_OWN
    lab = tl.load(own_lab_ptr + rows)
    inv_i = tl.load(inv_own_ptr + row)
    fill = tl.load(fill_ptr + rows)
    whole = fill > CAP
    ks = tl.arange(0, BLOCK_D)
    extra = out_ptr + (SLICES * N_OWN + row) * D
    for k0 in range(0, D, BLOCK_D):
        tl.store(extra + k0 + ks, tl.zeros((BLOCK_D,), ACC), mask=k0 + ks < D)
    any_whole = tl.max(whole.to(tl.int32), axis=0) > 0
    if any_whole:  # (every pair of this row is here: the tiles' slices cleared)
        for k in range(0, SLICES):
            for k0 in range(0, D, BLOCK_D):
                tl.store(out_ptr + (k * N_OWN + row) * D + k0 + ks, tl.zeros((BLOCK_D,), ACC), mask=k0 + ks < D)
    for j0 in range(0 - _span(CAP, BLOCK_C), tl.where(any_whole, N_OTHER, 0), BLOCK_C):
        cols2, mask2 = _listed(slot_ptr, fill, whole, rows, row_mask, j0, N_OTHER, CAP, BLOCK_C)
        if SELF:
            mask2 = mask2 & (cols2 != OFFSET + row)
        if tl.max(tl.max(mask2.to(tl.int32), axis=1), axis=0) > 0:
            d = _pair_exact(
                xo_ptr, xt_ptr, s_own, s_other, inv_own_ptr, inv_other_ptr, rows, cols2, row_mask, mask2, D, ONE_FEATURE
            )
            pos = mask2 & (tl.load(other_lab_ptr + cols2, mask=mask2, other=-1) == lab[:, None])
            x = tl.where(pos, d - pm, nm - d)
            counted = mask2 & ((x <= 0) == 0)
            g = tl.where(counted, tl.where(pos, w_pos, 0.0 - w_neg), 0.0)
            # (at d = 0 cdist's subgradient 0; one row: the sum is its values)
            w = tl.sum(tl.where((g != 0) & (d != 0), g / tl.where(d == 0, 1.0, d), 0.0), axis=0)
            cols = tl.sum(cols2, axis=0)
            mask = tl.sum(mask2.to(tl.int32), axis=0) > 0
            inv_j = tl.load(inv_other_ptr + cols, mask=mask, other=0.0)
            for k0 in range(0, D, BLOCK_D):
                k_mask = k0 + ks < D
                xi = tl.load(xo_ptr + row * s_own + k0 + ks, mask=k_mask, other=0.0).to(tl.float64)
                xj = tl.load(
                    xt_ptr + cols[:, None] * s_other + (k0 + ks)[None, :],
                    mask=mask[:, None] & k_mask[None, :],
                    other=0.0,
                ).to(tl.float64)
                e_i = _unit(xi, inv_i, ONE_FEATURE)
                e_j = _unit(xj, inv_j[:, None], ONE_FEATURE)
                part = tl.sum(tl.where(w[:, None] != 0, w[:, None] * (e_i[None, :] - e_j), 0.0), axis=0)
                tl.store(extra + k0 + ks, tl.load(extra + k0 + ks, mask=k_mask, other=0.0) + part.to(ACC), mask=k_mask)


# --------------------------------------------------------------------------- wrappers


class _Points:
    """One side's rows as the distance tiles take them: the package's _Side (the inputs and
    their float64 inverse norms, for the exact distances), the points c and |c|² (ACC), their
    operands by `scheme` (points_operands_kernel), the labels' int32 ids (lse._label_ids) and
    each row's group of equal rows."""

    def __init__(self, side, c: Tensor, sq: Tensor, group: Tensor, labels: Tensor, row_config: Config, scheme: int):
        N, D = c.shape
        self.n, self.side, self.c, self.sq, self.labels = N, side, c, sq, labels
        self.group = group.to(torch.int32)  # (int32 compares in the tiles, as the labels' ids)
        self.scheme = scheme
        operand = {lse.FP64.value: torch.float64, lse.TF32X3.value: torch.float32, lse.TF32.value: torch.float32}
        self.hi = torch.empty(N, D, dtype=operand.get(self.scheme, torch.bfloat16), device=c.device)
        pair = self.scheme in (lse.TF32X3.value, lse.BF16X3.value)
        self.lo = torch.empty_like(self.hi) if pair else self.hi
        if N > 0 and D > 0:
            k = row_config.kwargs
            points_operands_kernel[(blocks(N, k["BLOCK_ROWS"]),)](
                c, self.hi, self.lo, N, D, SCHEME=self.scheme, **row_config.launch
            )

    def narrow(self, first: int, n: int) -> _Points:
        """Rows [first, first + n) of these, as views."""
        view = object.__new__(_Points)
        view.n, view.scheme, view.side = n, self.scheme, self.side.narrow(first, n)
        for name in ("c", "sq", "group", "labels", "hi", "lo"):
            setattr(view, name, getattr(self, name).narrow(0, first, n))
        return view


def _scheme(dtype: torch.dtype, half_pairs: bool) -> int:
    """How the points of `dtype` rows are multiplied: with half_pairs (contrastive_loss), those of
    bfloat16 and float16 rows (float32 points, centred) as bfloat16 pairs, whatever the
    fp32-matmul setting (which is float32 inputs'): half the TF32 pair's bytes, and an error
    bound twice its at D = 128 (_error: 2^-14 beside the accumulation's, which the two
    share); otherwise, and for float32 and float64 rows, the points' dtype's by lse.scheme.
    (The triplets keep the TF32 pair: batch_hard's leaders lie so close together that the
    wider bound lists more than a row's slots and takes rows whole.)"""
    if half_pairs and dtype in (torch.bfloat16, torch.float16):
        return lse.BF16X3.value
    return lse.scheme(torch.float64 if dtype == torch.float64 else torch.float32)


def _sides(
    embeddings,
    labels,
    ref_embeddings,
    ref_labels,
    acc,
    row_config,
    self_: bool = False,
    half_pairs: bool = False,
) -> tuple[_Points, _Points, Tensor]:
    """The anchors' and the refs' _Points (one object without refs; their scheme: _scheme), and
    each anchor's positive pairs (lse._label_ids)."""
    # (The package's exact machinery: float64 norms, points, groups of equal rows; the package
    # imports this module.)
    from torchkit.triton.pair_losses import _points, _Side

    how = _scheme(embeddings.dtype, half_pairs)
    sa = _Side(embeddings, labels, acc, row_config, normalised=False)
    if ref_embeddings is None:
        (ids,), npos = lse._label_ids(labels, self_=self_)
        a = _Points(sa, *_points(sa, sa, acc, row_config)[0], ids, row_config, how)
        return a, a, npos
    sb = _Side(ref_embeddings, ref_labels, acc, row_config, normalised=False)
    pa, pb = _points(sa, sb, acc, row_config)
    (ids, ref_ids), npos = lse._label_ids(labels, ref_labels, self_=self_)
    return _Points(sa, *pa, ids, row_config, how), _Points(sb, *pb, ref_ids, row_config, how), npos


def _error(D: int, scheme: int, acc: torch.dtype) -> float:
    """_decisions' err: a bound on |tile d² − exact d²| over |c_i|² + |c_j|² for points of D
    features taken by the scheme: the operands' rounding (per product, relative to |c_ik·c_jk|:
    none in float64; TF32 pairs without lo·lo 2^-20; TF32 2^-10; bfloat16 2^-7), the products'
    sums (each addition within 2u of the running magnitude: the tensor cores' float32
    accumulation may truncate; three products per pair for a TF32 or bfloat16 pair, whose
    missing terms, lo·lo and those of the lo's rounding, are 3(1 + 2^-8)·2^-16 of a product's
    magnitude: 2^-14), twice (d² holds
    2c_i·c_j, and Σ|c_ik·c_jk| <= |c_i|·|c_j| <= (|c_i|² + |c_j|²)/2); the norms', the points'
    (each within u of e − μ: 4u·(|c_i|² + |c_j|²) on d²) and the expansion's roundings: 16u."""
    u = torch.finfo(acc).eps / 2
    operand, products = {
        lse.FP64.value: (0.0, 1),
        lse.TF32X3.value: (2.0**-20, 3),
        lse.BF16X3.value: (2.0**-14, 3),
        lse.TF32.value: (2.0**-10, 1),
        lse.HALF.value: (2.0**-7, 1),
    }[scheme]
    return operand + (2 * products * D + 16) * u


def _grad_default(acc: torch.dtype, scheme: int, held: int) -> Config:
    """contrastive_grad_kernel's default configuration: float64's, the bfloat16 pair's rows held
    whole's, or the first."""
    if acc == torch.float64:
        return GRAD_CONFIGS[-1]
    return GRAD_CONFIGS[1] if scheme == lse.BF16X3.value and held else GRAD_CONFIGS[0]


def _cap(scheme: int, M: int) -> int:
    """Slots per row for its listed pairs (ms's, bfloat16's being rounded points')."""
    cap = ms.CAP_ROUNDED if scheme == lse.HALF.value else ms.CAPS[scheme]
    return max(16, min(cap, triton.next_power_of_2(max(M, 1))))


def _contrastive_check(
    embeddings, labels, ref_embeddings, ref_labels, pos_margin, neg_margin, distance, shard
) -> tuple:
    op = "contrastive_loss"
    check_scalars(op, ("float", "pos_margin", pos_margin), ("float", "neg_margin", neg_margin))
    _check_inputs(op, embeddings, labels, ref_embeddings, ref_labels)
    shard = _shard(op, shard, embeddings, labels, ref_embeddings, ref_labels)
    _check_params(op, (float(pos_margin), float(neg_margin), distance))
    _euclidean_only(op, distance)
    return (float(pos_margin), float(neg_margin)), shard


def contrastive_forward(
    embeddings,
    labels,
    ref_embeddings,
    ref_labels,
    pos_margin,
    neg_margin,
    distance="euclidean",
    shard=None,
    *,
    config=None,
    row_config=None,
    exact_config=None,
):
    """torchkit::contrastive_loss's CUDA kernel (any device under the interpreter)."""
    from torchkit.triton.pair_losses import ROW_CONFIGS

    margins, shard = _contrastive_check(
        embeddings, labels, ref_embeddings, ref_labels, pos_margin, neg_margin, distance, shard
    )
    acc = acc_dtype(embeddings)
    row_config = row_config or ROW_CONFIGS[0]
    exact_config = exact_config or EXACT_CONFIGS[0]
    self_, offset = _self_pairs(ref_embeddings, shard)
    a, b, npos = _sides(embeddings, labels, ref_embeddings, ref_labels, acc, row_config, self_, half_pairs=True)
    N, D = embeddings.shape
    M = b.n
    dev = embeddings.device
    pairs = M - int(self_)  # (each anchor's: every ref but itself)
    stats = torch.empty(N, 2, dtype=acc, device=dev)
    if shard is None:
        result = torch.empty((), dtype=embeddings.dtype, device=dev)
    else:  # (a shard's parts: csrc/pair_losses.h)
        result = torch.empty(6, dtype=torch.float64, device=dev)
    partial = npos  # (no blocks: the loss kernel reads none)
    exact_blocks = 0
    if N > 0 and M > 0:
        # (the anchors' rows held whole up to 128 features, the TF32 pair's too: lse.HELD)
        held = lse._held(D, a.scheme)
        config = config or lse._held_default(ROWS_CONFIGS, acc, a.scheme, held)
        k = config.kwargs
        programs = blocks(N, k["BLOCK_N"])
        slices, chunk = lse._slices(programs, M, k["BLOCK_M"])
        cap = _cap(a.scheme, M)
        part = torch.empty(slices, N, 2, dtype=torch.float64, device=dev)
        count = torch.empty(slices, N, 2, dtype=torch.int32, device=dev)
        slot = torch.full((N, cap), ms.NO_COL, dtype=torch.int64, device=dev)
        fill = torch.zeros(N, dtype=torch.int32, device=dev)
        bits = [float_bits(v) for v in margins]
        contrastive_rows_kernel[(programs, slices)](
            a.hi,
            a.lo,
            b.hi,
            b.lo,
            a.sq,
            b.sq,
            a.labels,
            b.labels,
            a.group,
            b.group,
            part,
            count,
            slot,
            fill,
            N,
            M,
            D,
            offset,
            chunk,
            cap,
            *bits,
            float_bits(_error(D, a.scheme, acc)),
            SELF=self_,
            BLOCK_D=held,
            **lse._launch_flags(a, acc),
            **config.launch,
        )
        slot.copy_(slot.sort(dim=1).values)  # (the listed pairs in ref order: the same bits on every run)
        exact_blocks = blocks(N, exact_config.kwargs["BLOCK_ROWS"])
        partial = torch.empty(5, exact_blocks, dtype=torch.float64, device=dev)
        contrastive_exact_kernel[(exact_blocks,)](
            a.side.raw,
            b.side.raw,
            a.side.raw.stride(0),
            b.side.raw.stride(0),
            a.side.inv64,
            b.side.inv64,
            a.labels,
            b.labels,
            slot,
            fill,
            part,
            count,
            npos,
            partial,
            N,
            M,
            D,
            offset,
            slices,
            cap,
            *bits,
            SELF=self_,
            ONE_FEATURE=D == 1,
            **exact_config.launch,
        )
    bf16 = shard is None and embeddings.dtype == torch.bfloat16
    batch = lse.BATCH_CONFIG
    loss_kernel[(max(1, blocks(N, batch.kwargs["BLOCK_ROWS"])),)](
        partial,
        stats,
        result.view(torch.int16) if bf16 else result,
        N,
        exact_blocks,
        N * pairs,
        SHARD=shard is not None,
        WIDE=shard is not None or embeddings.dtype == torch.float64,
        BF16=bf16,
        ACC=acc_tl(acc),
        **batch.launch,
    )
    return result, stats


def contrastive_backward(
    grad,
    embeddings,
    labels,
    ref_embeddings,
    ref_labels,
    stats,
    pos_margin,
    neg_margin,
    distance,
    output_mask,
    shard=None,
    own_stats=False,
    *,
    config=None,
    row_config=None,
):
    """torchkit::_contrastive_loss_backward's CUDA kernel (any device under the interpreter):
    per side, contrastive_grad_kernel's tiles, contrastive_pairs_grad_kernel's listed pairs, and
    lse.jacobian_kernel through the normalisation."""
    from torchkit.triton.pair_losses import ROW_CONFIGS

    op = "contrastive_loss"
    margins, shard = _contrastive_check(
        embeddings, labels, ref_embeddings, ref_labels, pos_margin, neg_margin, distance, shard
    )
    _check_own_stats(op, own_stats, shard)
    whole = _whole_rows(op, shard, own_stats, ref_embeddings)
    _check_loss_backward(op, grad, embeddings, stats, shard, whole)
    among = shard is not None and shard >= 0  # (the anchors are ref rows: the refs' problem)
    self_ = ref_embeddings is None
    want_e = bool(output_mask[0])
    want_r = not self_ and bool(output_mask[1])
    empty = embeddings.new_empty(0)
    N, D = embeddings.shape
    M = N if self_ else ref_embeddings.shape[0]
    if N == 0 or M == 0 or D == 0 or not (want_e or want_r):
        return _zeros(want_e, embeddings, empty), _zeros(want_r, ref_embeddings, empty)
    acc = acc_dtype(embeddings)
    row_config = row_config or ROW_CONFIGS[0]
    if among:  # the refs' problem without refs, of whose rows the anchors are some
        a = b = _sides(ref_embeddings, ref_labels, None, None, acc, row_config, half_pairs=True)[0]
    else:
        a, b, _ = _sides(embeddings, labels, ref_embeddings, ref_labels, acc, row_config, half_pairs=True)
    pairs_self = self_ or among
    st = stats.contiguous()
    bits = [float_bits(v) for v in margins]
    err = float_bits(_error(D, a.scheme, acc))

    def rows_grad(own: _Points, other: _Points, like: Tensor, offset: int = 0, g_loss: Tensor = grad) -> Tensor:
        held = lse._held(D, own.scheme, lse.HELD_NARROW)
        launch = lse._grad_config(config or _grad_default(acc, own.scheme, held), D, held)
        k = launch.kwargs
        n = own.n
        grid = (blocks(n, k["BLOCK_N"]), blocks(D, k["BLOCK_F"]))
        slices, chunk = lse._slices(grid[0] * grid[1], other.n, k["BLOCK_M"])
        cap = _cap(own.scheme, other.n)
        g = torch.empty(slices + 1, n, D, dtype=acc, device=like.device)
        slot = torch.full((n, cap), ms.NO_COL, dtype=torch.int64, device=like.device)
        fill = torch.zeros(n, dtype=torch.int32, device=like.device)
        contrastive_grad_kernel[(*grid, slices)](
            own.hi,
            own.lo,
            other.hi,
            other.lo,
            own.c,
            own.sq,
            other.sq,
            own.labels,
            other.labels,
            own.group,
            other.group,
            st,
            slot,
            fill,
            g,
            n,
            other.n,
            D,
            offset,
            chunk,
            cap,
            *bits,
            err,
            SELF=pairs_self,
            BLOCK_D=held,
            **lse._launch_flags(own, acc),
            **launch.launch,
        )
        slot.copy_(slot.sort(dim=1).values)  # (the listed pairs in order: the same bits on every run)
        contrastive_pairs_grad_kernel[(n,)](
            own.side.raw,
            other.side.raw,
            own.side.raw.stride(0),
            other.side.raw.stride(0),
            own.side.inv64,
            other.side.inv64,
            own.labels,
            other.labels,
            st,
            slot,
            fill,
            g,
            n,
            other.n,
            D,
            offset,
            slices,
            cap,
            *bits,
            SELF=pairs_self,
            ONE_FEATURE=D == 1,
            ACC=acc_tl(acc),
            BLOCK_D=min(128, triton.next_power_of_2(D)),
            **PAIRS_CONFIG.launch,
        )
        # The normalisation's numbers (lse's prefix; its operands are not used).
        rows = lse._Operands(own.side.raw, own.labels, acc, row_config)
        out = torch.empty(n, D, dtype=like.dtype, device=like.device)
        lse.jacobian_kernel[(blocks(n, row_config.kwargs["BLOCK_ROWS"]),)](
            g,
            rows.raw,
            rows.exp,
            rows.inv,
            rows.clamped,
            g_loss,
            st,
            out,
            n,
            D,
            slices + 1,
            rows.raw.stride(0),
            LIVE=2,  # (a loss of 0 by PML's rule: its stats' two weights 0)
            ACC=acc_tl(acc),
            IS64=acc == torch.float64,
            **row_config.launch,
        )
        return out

    if among:  # (a is b: the refs)
        # own_stats: the anchors' pairs alone, the refs a memory that holds their rows. The
        # kernels take each pair from both its rows (SELF), with the same weights in every row:
        # half of that, exactly, is the anchor's side alone.
        g = grad if whole is not None else grad * 0.5
        ge = rows_grad(b.narrow(shard, N), b, embeddings, shard, g) if want_e else empty
        return ge, _zeros(want_r, ref_embeddings, empty)
    if self_:
        return rows_grad(a, a, embeddings), empty
    ge = rows_grad(a, b, embeddings) if want_e else empty
    gr = rows_grad(b, a, ref_embeddings) if want_r else empty
    return ge, gr


def compile_cases() -> list[CompileCase]:
    """This engine's kernels for tools/triton_check.py: the tiles' kernels with the TF32 pair
    (every configuration, without refs), the bfloat16 pair (bfloat16 inputs), bfloat16 operands
    (float32 at "medium": without refs only) and float64, rows of D = 128 held where the
    scheme holds them; the exact kernels from float32, bfloat16 and float64 inputs (the first
    also with D = 1); the batch's loss kernel of each (float32's also for a shard)."""
    ints = ("N", "M", "D", "OFFSET", "CHUNK", "CAP", "SLICES", "sa", "sb", "N_OWN", "N_OTHER", "s_own", "s_other")
    ints = dict.fromkeys(ints, "i32")
    # The headline launches' sizes (8,192 rows of 128 features, slices of whole tiles) are
    # divisible by 16, all but the slice count.
    case = functools.partial(CompileCase, divisible=tuple(k for k in ints if k != "SLICES"))
    bits = dict.fromkeys(("POS_BITS", "NEG_BITS", "ERR_BITS"), "i64")
    # (name, input dtype, operand dtype, accumulation type, scheme)
    schemes = (
        ("fp32", "fp32", "fp32", "fp32", lse.TF32X3),
        ("bf16", "bf16", "bf16", "fp32", lse.BF16X3),
        ("fp32 medium", "fp32", "bf16", "fp32", lse.HALF),
        ("fp64", "fp64", "fp64", "fp64", lse.FP64),
    )
    cases = []
    for name, dtype, operand, acc, how in schemes:
        is64 = acc == "fp64"
        first = name == "fp32"
        medium = how is lse.HALF  # (its tiles only: the other kernels are float32's)
        flags = dict(ACC=tl.float64 if is64 else tl.float32, IS64=is64)
        types = {
            **ints,
            **bits,
            **{f"{side}_{part}": "*" + operand for side in ("a", "b", "own", "other") for part in ("hi", "lo")},
            "hi_ptr": "*" + operand,
            "lo_ptr": "*" + operand,
            **dict.fromkeys(("c_ptr", "c_own_ptr", "sq_a_ptr", "sq_b_ptr", "sq_own_ptr", "sq_other_ptr"), "*" + acc),
            **dict.fromkeys(("st_ptr", "out_ptr"), "*" + acc),
            **dict.fromkeys(("lab_ptr", "ref_lab_ptr", "own_lab_ptr", "other_lab_ptr"), "*i32"),
            **dict.fromkeys(("grp_a_ptr", "grp_b_ptr", "grp_own_ptr", "grp_other_ptr"), "*i32"),
            "slot_ptr": "*i64",
            **dict.fromkeys(("count_ptr", "fill_ptr", "npos_ptr"), "*i32"),
            "partial_ptr": "*fp64",
            "BLOCKS": "i32",
            "PAIRS": "i64",
            "sums_ptr": "*fp64",
            **dict.fromkeys(("xa_ptr", "xb_ptr", "xo_ptr", "xt_ptr"), "*" + dtype),
            **dict.fromkeys(("inv_a_ptr", "inv_b_ptr", "inv_own_ptr", "inv_other_ptr"), "*fp64"),
        }
        held = lse._held(128, how.value, lse.HELD_NARROW)  # (the backward's)
        rows_held = lse._held(128, how.value)
        tiles = dict(SCHEME=how, INTERPRET=False, BLOCK_D=held, **flags)
        f64 = torch.float64 if is64 else torch.float32
        cases.append(
            case(
                f"pair_losses.euclid.points_operands {name}",
                points_operands_kernel,
                types,
                dict(SCHEME=how),
                lse.ROW_CONFIGS,
            )
        )
        for self_ in (True,) if medium else (True, False):
            every = first and self_
            if every:  # (rows of more than 128 features, streamed)
                cases.append(
                    case(
                        f"pair_losses.euclid.rows {name} self streamed",
                        contrastive_rows_kernel,
                        types,
                        dict(SELF=self_, **{**tiles, "BLOCK_D": 0}),
                        ROWS_CONFIGS,
                        tensor_cores=True,
                    )
                )
            cases.append(
                case(
                    f"pair_losses.euclid.rows {name}{' self' if self_ else ''}",
                    contrastive_rows_kernel,
                    types,
                    dict(SELF=self_, **{**tiles, "BLOCK_D": rows_held}),
                    (lse._held_default(ROWS_CONFIGS, f64, how.value, rows_held),),
                    tensor_cores=not is64,
                )
            )
            cases.append(
                case(
                    f"pair_losses.euclid.grad {name}{' self' if self_ else ''}",
                    contrastive_grad_kernel,
                    {**types, "st_ptr": "*" + acc},
                    dict(SELF=self_, **tiles),
                    tuple(
                        lse._grad_config(c, 128, held)
                        for c in (GRAD_CONFIGS if every else (_grad_default(f64, how.value, held),))
                    ),
                    tensor_cores=not is64,
                )
            )
            for one in () if medium else (False, True) if every else (False,):
                what = f"{name}{' self' if self_ else ''}{' one feature' if one else ''}"
                cases.append(
                    case(
                        f"pair_losses.euclid.exact {what}",
                        contrastive_exact_kernel,
                        types,
                        dict(SELF=self_, ONE_FEATURE=one),
                        EXACT_CONFIGS if every and not one else EXACT_CONFIGS[:1],
                    )
                )
                cases.append(
                    case(
                        f"pair_losses.euclid.pairs_grad {what}",
                        contrastive_pairs_grad_kernel,
                        {**types, "st_ptr": "*" + acc},
                        dict(SELF=self_, ONE_FEATURE=one, ACC=flags["ACC"], BLOCK_D=128),
                        (PAIRS_CONFIG,),
                    )
                )
        for shard in () if medium else (False, True) if first else (False,):  # (the loss; a shard's parts)
            result = "*fp64" if shard else ("*i16" if dtype == "bf16" else "*" + dtype)
            cases.append(
                case(
                    f"pair_losses.euclid.loss {name}{' shard' if shard else ''}",
                    loss_kernel,
                    {**types, "stats_ptr": "*" + acc, "result_ptr": result},
                    dict(SHARD=shard, WIDE=shard or is64, BF16=not shard and dtype == "bf16", ACC=flags["ACC"]),
                    (lse.BATCH_CONFIG,),
                )
            )
    return cases
