"""triplet_margin_loss on tensor cores under the CUDA precision contract (docs/ops.md), with
the CPU kernel's choices, decided as on the exact distances (Points::direct in
pair_losses_euclidean_cpu.cpp: float64) without a float64 value per pair. batch_hard: each
anchor's farthest positive and nearest negative, ties to the lower ref row, the first pair
at a NaN distance winning. all and semi_hard: the triplets with d_ap − d_an + margin > 0
(semi_hard: and d_ap < d_an), counted and summed.

- The tiles are contrastive_loss's (euclid.py: the centred points, their operands by scheme,
  euclid._dots). A tile's squared distance d² = |c_i|² + |c_j|² − 2c_i·c_j is within
  err·(|c_i|² + |c_j|²) of the exact one (euclid._error), so each pair's exact squared distance
  lies in [lo, hi], d² less and plus that bound and the bound's own roundings (_bounds); a pair
  of equal rows (the package's _equal_rows) is at exactly 0. Squares order as distances do: no
  root is taken.
- hard_rows_kernel: a program per block of anchors and slice of refs (lse._slices). Per anchor
  and kind it keeps the leader: the largest lo of a positive (a negative: the smallest hi), the
  lowest column among equals. As each tile is taken, after its leader's update, the pairs
  whose bound still reaches the leader (a positive's hi >= its lo; a negative's lo <= its hi)
  are listed with that bound (_append). The leader only moves outwards, so the list holds
  every pair that may be the answer: in a random order, the records of a slice and their
  near-ties, a few pairs per anchor. A pair of equal rows at exactly the leader's bound with a
  higher column cannot win (the leader is as far at least, and lower) and is not listed: a
  collapsed batch lists one pair per slice.
- hard_pick_kernel: per anchor the slices' leaders merged, and of its listed pairs those whose
  bound reaches the final leader. One is the answer; between more (a near-tie), their exact
  distances decide (_pair_exact). An anchor whose list outgrew its CAP slots is decided on
  every pair's exact distance. A NaN distance (a NaN row's: its squared norm is NaN in the
  tiles) wins, the first of its kind. Then the chosen pairs' exact distances, for the loss.

- all and semi_hard (all_triplets): an anchor's positives are its label's segment of the
  refs in label order; positives_kernel keeps their exact distances t and, per positive, the
  squared distances below which a negative surely counts and above which it surely does not,
  whatever the CPU kernel's float64 rounding (_thresholds: the first POS_CAP, computed once
  for every slice). triplet_rows_kernel, a program per block of anchors and slice of refs,
  takes a chunk of BLOCK_P positives at a time; per tile of negatives and positive, the
  tile's [lo, hi] decides (_decide). A negative that some positive leaves undecided, or whose d² cancelled and that
  counts (its tile distance too coarse for the sum), is listed with the chunk, and
  triplet_exact_kernel decides its triplets on its exact distance; an anchor whose list
  outgrew CAP is taken whole. Sums per slice in float64 (a tile's row in ACC), added in
  slice order: the same bits on every run.
- Their backward, a band of anchors at a time (the package's _triplet_band_backward): the
  same kernels write each pair's coefficient ∂loss/∂d·C into the band (BAND), then
  band_grad_kernel forms Σ_j w_ij (c_i − c_j), w = g/(C·d), on tensor cores for the band's
  anchors and for the other side's rows, and band_pairs_kernel adds the slices and the pairs
  whose d² cancelled, from the inputs' float64 differences (no float atomics).

batch_hard's loss and backward are the package's (__init__.py), from the chosen pairs.
Kernels never index past what the wrapper checked; offsets are int64.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from torchkit.triton import _math as tm
from torchkit.triton._launch import CompileCase, Config, acc_tl, blocks, float_bits, hot
from torchkit.triton.pair_losses import euclid, lse, ms
from torchkit.triton.pair_losses._common import _pair_exact, _unit

# Launch configurations (every one run by the tests and compiled by tools/triton_check.py; the
# first is the default, the last float64's).
ROWS_CONFIGS = (
    Config(BLOCK_N=64, BLOCK_M=32, BLOCK_K=32, num_warps=8, num_stages=3),
    Config(BLOCK_N=64, BLOCK_M=32, BLOCK_K=16, num_warps=4, num_stages=2),
    Config(BLOCK_N=32, BLOCK_M=32, BLOCK_K=16, num_warps=4, num_stages=2),
)
# hard_pick_kernel's: exact distances summed in feature order (Points::direct's), no FMA.
# BLOCK_C: the listed pairs (or refs of an anchor taken whole) taken at once.
EXACT_CONFIGS = (
    Config(BLOCK_ROWS=16, BLOCK_C=32, num_warps=4, num_stages=2, fp_fusion=False),
    Config(BLOCK_ROWS=4, BLOCK_C=16, num_warps=2, num_stages=2, fp_fusion=False),
)

# mining="all" / "semi_hard": triplet_rows_kernel's (BLOCK_P: a chunk of each anchor's
# positives, a divisor of POS_CAP, whose thresholds the unrolled decisions hold in registers
# beside the tile: 4 keeps semi_hard's within sm_80's); triplet_exact_kernel's (its BLOCK_P is
# the rows kernel's); positives_kernel's.
ALL_ROWS_CONFIGS = (
    Config(BLOCK_N=64, BLOCK_M=32, BLOCK_P=4, BLOCK_K=32, num_warps=8, num_stages=2),
    Config(BLOCK_N=64, BLOCK_M=32, BLOCK_P=8, BLOCK_K=32, num_warps=8, num_stages=2),
    Config(BLOCK_N=32, BLOCK_M=32, BLOCK_P=4, BLOCK_K=16, num_warps=4, num_stages=2),
)
ALL_EXACT_CONFIGS = (
    Config(BLOCK_ROWS=16, BLOCK_C=32, num_warps=8, num_stages=2, fp_fusion=False),
    Config(BLOCK_ROWS=4, BLOCK_C=16, num_warps=2, num_stages=2, fp_fusion=False),
)
# band_grad_kernel's: feature blocks of up to 128 (each block recomputes the tile).
BAND_GRAD_CONFIGS = (
    Config(BLOCK_N=64, BLOCK_M=32, BLOCK_K=32, BLOCK_F=128, num_warps=8, num_stages=3),
    Config(BLOCK_N=32, BLOCK_M=32, BLOCK_K=32, BLOCK_F=128, num_warps=4, num_stages=2),
    Config(BLOCK_N=32, BLOCK_M=32, BLOCK_K=16, BLOCK_F=32, num_warps=4, num_stages=2),
)
POSITIVES_CONFIG = Config(BLOCK_ROWS=32, BLOCK_P=8, num_warps=4, num_stages=2, fp_fusion=False)
# band_pairs_kernel's: 4 rows a program, 32 slots of each and 32 features at a time (as many
# values as one row's 32 slots of 128 features; a lane per pair in _pair_exact).
BAND_PAIRS_CONFIG = Config(BLOCK_ROWS=4, BLOCK_C=32, BLOCK_D=32, num_warps=4, num_stages=2, fp_fusion=False)

NONE = tl.constexpr(2**31 - 1)  # no column: above every one (the refs are fewer than 2^31)


# --------------------------------------------------------------------------- kernels


@triton.jit
def _bounds(v, e_a, e_b, sq_a, sq_b, IS64: tl.constexpr):
    """The tile's [lo, hi] of each pair's exact squared distance: d² ∓ (e + 4u·d²), with e_a, e_b
    the rows' shares of the tile's error and its roundings (_shares), 4u·d² the roundings of
    d², of lo and hi (one each: fused) and of the exact distance's float64 sum. Unclamped (a
    cancelled d² may be below 0, its interval still holds the exact value); NaN where a norm
    is."""
    return _interval((sq_a[:, None] + sq_b[None, :]) - 2.0 * v, e_a, e_b, IS64)


@triton.jit
def _interval(d2, e_a, e_b, IS64: tl.constexpr):
    """_bounds' [lo, hi] from the tile's d²."""
    if IS64:
        u4 = 2.0**-51
    else:
        u4 = 2.0**-22
    e = e_a[:, None] + e_b[None, :]
    return d2 * (1.0 - u4) - e, d2 * (1.0 + u4) + e


@triton.jit
def _shares(sq, err, IS64: tl.constexpr):
    """A row's share of _bounds' e: err·|c|²·(1 + 4u), the rounding of e in it, and half of the
    roundings below the smallest normal (the GPU flushes them)."""
    if IS64:
        return sq * (err * (1.0 + 2.0**-51)) + 2.0**-1000
    else:
        return sq * (err * (1.0 + 2.0**-22)) + 2.0**-120


@triton.jit
def _append(listed, rows, cols, key, fill_ptr, slot_ptr, key_ptr, CAP):
    """Appends a tile's listed pairs (their int32 refs, cols: (1, BLOCK_M), and bounds) to their anchors' CAP slots
    after an atomic count per anchor (fill, which may pass CAP: the anchor is then taken
    whole). The slots' order varies between runs; hard_pick_kernel's choice does not depend
    on it."""
    hits = listed.to(tl.int16)  # (a tile's row holds at most BLOCK_M)
    n = tl.sum(hits, axis=1).to(tl.int32)
    start = tl.atomic_add(fill_ptr + rows, n, mask=n > 0)
    at = tl.where(n > 0, start, 0)[:, None] + (tl.cumsum(hits, axis=1) - 1).to(tl.int32)
    where = rows[:, None] * CAP + at
    keep = listed & (at < CAP)
    tl.store(slot_ptr + where, cols + tl.zeros(listed.shape, tl.int32), mask=keep)
    tl.store(key_ptr + where, key, mask=keep)


@triton.jit
def _first(mask, cols):
    """Per row, the lowest column where mask holds (NONE for none)."""
    return tl.min(tl.where(mask, cols, NONE), axis=1)


@hot()
@triton.jit
def hard_rows_kernel(
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
    lead_ptr,
    nan_ptr,
    eq_ptr,
    slot_ptr,
    key_ptr,
    fill_ptr,
    N,
    M,
    D,
    OFFSET,
    CHUNK,
    CAP,
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
    program_id(1)·CHUNK; SELF: anchor i is ref OFFSET + i, not a pair): per anchor and kind
    (0: positives, 1: negatives, [slice, anchor, kind]) its leader's bound (lead, ACC), its
    first pair at a NaN distance and its first pair of equal rows (nan, eq: int32, NONE for
    none); the other pairs that may beat the leader appended to their anchor's slots with
    their bound."""
    err = tm.f64(ERR_BITS).to(ACC)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    me = rows + OFFSET
    lab = tl.load(lab_ptr + rows, mask=row_mask, other=0)
    grp = tl.load(grp_a_ptr + rows, mask=row_mask, other=-1)
    sq_a = tl.load(sq_a_ptr + rows, mask=row_mask, other=0.0)
    e_a = _shares(sq_a, err, IS64)
    lead_p = tl.full((BLOCK_N,), float("-inf"), ACC)
    lead_n = tl.full((BLOCK_N,), float("inf"), ACC)
    nan_p = tl.full((BLOCK_N,), NONE, tl.int32)
    nan_n = tl.full((BLOCK_N,), NONE, tl.int32)
    eq_p = tl.full((BLOCK_N,), NONE, tl.int32)
    eq_n = tl.full((BLOCK_N,), NONE, tl.int32)
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
        c32 = cols.to(tl.int32)[None, :]
        ref_lab = tl.load(ref_lab_ptr + cols, mask=col_mask, other=-1)
        grp_b = tl.load(grp_b_ptr + cols, mask=col_mask, other=-2)
        sq_b = tl.load(sq_b_ptr + cols, mask=col_mask, other=0.0)
        bh = sq_b
        bl = sq_b
        if BLOCK_D > 0:
            bh, bl = lse._load(b_hi, b_lo, cols, ks, col_mask[:, None] & (ks < D)[None, :], D, SCHEME, INTERPRET)
        v = euclid._dots(
            a_hi, a_lo, b_hi, b_lo, ah, al, bh, bl, rows, cols, row_mask, col_mask, D, ACC, SCHEME, INTERPRET,
            BLOCK_K, BLOCK_D,
        )  # fmt: skip
        valid = row_mask[:, None] & col_mask[None, :]
        if SELF:
            valid = valid & (me[:, None] != cols[None, :])
        pos = lab[:, None] == ref_lab[None, :]
        lo, hi = _bounds(v, e_a, _shares(sq_b, err, IS64), sq_a, sq_b, IS64)
        # (NaN rows and equal rows are rare: each a branch)
        nan = valid & (lo != lo)
        if lse._any(nan):
            nan_p = tl.minimum(nan_p, _first(nan & pos, c32))
            nan_n = tl.minimum(nan_n, _first(nan & (pos == 0), c32))
        same = valid & (grp[:, None] == grp_b[None, :])
        if lse._any(same):
            eq_p = tl.minimum(eq_p, _first(same & pos, c32))
            eq_n = tl.minimum(eq_n, _first(same & (pos == 0), c32))
        ok = valid & (nan == 0) & (same == 0)
        ok_p = ok & pos
        ok_n = ok & (pos == 0)
        lead_p = tl.maximum(lead_p, tl.max(tl.where(ok_p, lo, float("-inf")), axis=1))
        lead_n = tl.minimum(lead_n, tl.min(tl.where(ok_n, hi, float("inf")), axis=1))
        listed = (ok_p & (hi >= lead_p[:, None])) | (ok_n & (lo <= lead_n[:, None]))
        if lse._any(listed):
            _append(listed, rows, c32, tl.where(pos, hi, lo), fill_ptr, slot_ptr, key_ptr, CAP)
    at = (tl.program_id(1).to(tl.int64) * N + rows) * 2
    tl.store(lead_ptr + at, lead_p, mask=row_mask)
    tl.store(lead_ptr + at + 1, lead_n, mask=row_mask)
    tl.store(nan_ptr + at, nan_p, mask=row_mask)
    tl.store(nan_ptr + at + 1, nan_n, mask=row_mask)
    tl.store(eq_ptr + at, eq_p, mask=row_mask)
    tl.store(eq_ptr + at + 1, eq_n, mask=row_mask)


@triton.jit
def _best(d, cand, cols, best, at, FARTHEST: tl.constexpr):
    """The running choice (best distance, its column) per row with the candidates' exact
    distances d: the farthest (FARTHEST) or the nearest, ties to the lower column."""
    if FARTHEST:
        t = tl.max(tl.where(cand, d, float("-inf")), axis=1)
        better_t = t > best
    else:
        t = tl.min(tl.where(cand, d, float("inf")), axis=1)
        better_t = t < best
    t_at = _first(cand & (d == t[:, None]), cols)
    better = better_t | ((t == best) & (t_at < at))
    return tl.where(better, t, best), tl.where(better, t_at, at)


@triton.jit
def _listed(slot_ptr, key_ptr, ref_lab_ptr, lab, fill, open_, rows, j0, CAP, BLOCK_C: tl.constexpr):
    """Slots [j0, j0 + BLOCK_C) of the anchors `rows` where open_: their refs (int32), bounds and
    kinds (positive), and which hold a pair."""
    slots = j0 + tl.arange(0, BLOCK_C)
    mask = open_[:, None] & (slots[None, :] < fill[:, None]) & (slots < CAP)[None, :]
    at = rows[:, None] * CAP + slots[None, :]
    cols = tl.load(slot_ptr + at, mask=mask, other=0)
    key = tl.load(key_ptr + at, mask=mask, other=0.0)
    pos = tl.load(ref_lab_ptr + cols, mask=mask, other=-1) == lab[:, None]
    return cols, key, pos, mask


@triton.jit
def hard_pick_kernel(
    xa_ptr,
    xb_ptr,
    sa,
    sb,
    inv_a_ptr,
    inv_b_ptr,
    lab_ptr,
    ref_lab_ptr,
    lead_ptr,
    nan_ptr,
    eq_ptr,
    slot_ptr,
    key_ptr,
    fill_ptr,
    idx_ptr,
    dist_ptr,
    N,
    M,
    D,
    OFFSET,
    SLICES,
    CAP,
    SELF: tl.constexpr,
    ONE_FEATURE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """A block of anchors' choices from hard_rows_kernel's leaders and lists: idx (N, 2) int64,
    the farthest positive and the nearest negative (−1 for none), and dist (N, 2) float64,
    their exact distances (NaN for none). A pair of equal rows (the first of its kind) is at
    exactly 0: a leader's bound at 0 (a positive's lo, a negative's hi) and a candidate."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < N
    lab = tl.load(lab_ptr + rows, mask=row_mask, other=0)
    lead_p = tl.load(lead_ptr + rows * 2, mask=row_mask, other=0.0)
    lead_n = tl.load(lead_ptr + rows * 2 + 1, mask=row_mask, other=0.0)
    nan_p = tl.load(nan_ptr + rows * 2, mask=row_mask, other=NONE)
    nan_n = tl.load(nan_ptr + rows * 2 + 1, mask=row_mask, other=NONE)
    eq_p = tl.load(eq_ptr + rows * 2, mask=row_mask, other=NONE)
    eq_n = tl.load(eq_ptr + rows * 2 + 1, mask=row_mask, other=NONE)
    for k in range(1, SLICES):
        at = (k * N + rows) * 2
        lead_p = tl.maximum(lead_p, tl.load(lead_ptr + at, mask=row_mask, other=0.0))
        lead_n = tl.minimum(lead_n, tl.load(lead_ptr + at + 1, mask=row_mask, other=0.0))
        nan_p = tl.minimum(nan_p, tl.load(nan_ptr + at, mask=row_mask, other=NONE))
        nan_n = tl.minimum(nan_n, tl.load(nan_ptr + at + 1, mask=row_mask, other=NONE))
        eq_p = tl.minimum(eq_p, tl.load(eq_ptr + at, mask=row_mask, other=NONE))
        eq_n = tl.minimum(eq_n, tl.load(eq_ptr + at + 1, mask=row_mask, other=NONE))
    lead_p = tl.where(eq_p < NONE, tl.maximum(lead_p, 0.0), lead_p)
    lead_n = tl.where(eq_n < NONE, tl.minimum(lead_n, 0.0), lead_n)
    fill = tl.load(fill_ptr + rows, mask=row_mask, other=0)
    whole = row_mask & (fill > CAP)
    listed = row_mask & (whole == 0)
    span = tl.minimum(tl.max(fill, axis=0), CAP)
    # The candidates, those that reach the final leaders: one is the answer.
    eq_cand_p = (eq_p < NONE) & (lead_p <= 0.0)  # (every positive within its bound of 0)
    eq_cand_n = eq_n < NONE  # (none is nearer)
    n_p = eq_cand_p.to(tl.int32)
    n_n = eq_cand_n.to(tl.int32)
    one_p = tl.where(eq_cand_p, eq_p, NONE)
    one_n = tl.where(eq_cand_n, eq_n, NONE)
    for j0 in range(0, span, BLOCK_C):
        cols, key, pos, mask = _listed(slot_ptr, key_ptr, ref_lab_ptr, lab, fill, listed, rows, j0, CAP, BLOCK_C)
        cand_p = mask & pos & (key >= lead_p[:, None])
        cand_n = mask & (pos == 0) & (key <= lead_n[:, None])
        n_p += tl.sum(cand_p.to(tl.int32), axis=1)
        n_n += tl.sum(cand_n.to(tl.int32), axis=1)
        one_p = tl.minimum(one_p, _first(cand_p, cols))
        one_n = tl.minimum(one_n, _first(cand_n, cols))
    # More (a near-tie), or an anchor taken whole: exact distances decide.
    exact_p = row_mask & (nan_p == NONE) & (whole | (n_p > 1))
    exact_n = row_mask & (nan_n == NONE) & (whole | (n_n > 1))
    best_p = tl.where(eq_cand_p, 0.0, float("-inf")).to(tl.float64)
    best_n = tl.where(eq_cand_n, 0.0, float("inf")).to(tl.float64)
    at_p = tl.where(eq_cand_p, eq_p, NONE)
    at_n = tl.where(eq_cand_n, eq_n, NONE)
    near = listed & (exact_p | exact_n)
    if tl.max(near.to(tl.int32), axis=0) > 0:
        for j0 in range(0, span, BLOCK_C):
            cols, key, pos, mask = _listed(slot_ptr, key_ptr, ref_lab_ptr, lab, fill, near, rows, j0, CAP, BLOCK_C)
            cand_p = mask & pos & (key >= lead_p[:, None]) & exact_p[:, None]
            cand_n = mask & (pos == 0) & (key <= lead_n[:, None]) & exact_n[:, None]
            if lse._any(cand_p | cand_n):
                d = _pair_exact(
                    xa_ptr, xb_ptr, sa, sb, inv_a_ptr, inv_b_ptr, rows, cols.to(tl.int64), row_mask,
                    cand_p | cand_n, D, ONE_FEATURE,
                )  # fmt: skip
                best_p, at_p = _best(d, cand_p, cols, best_p, at_p, True)
                best_n, at_n = _best(d, cand_n, cols, best_n, at_n, False)
    if tl.max(whole.to(tl.int32), axis=0) > 0:
        for j0 in range(0, M, BLOCK_C):
            cols = j0 + tl.arange(0, BLOCK_C)[None, :] + tl.zeros((BLOCK_ROWS, BLOCK_C), tl.int32)
            mask = whole[:, None] & (cols < M)
            if SELF:
                mask = mask & (cols.to(tl.int64) != (rows + OFFSET)[:, None])
            pos = tl.load(ref_lab_ptr + cols, mask=mask, other=-1) == lab[:, None]
            d = _pair_exact(
                xa_ptr, xb_ptr, sa, sb, inv_a_ptr, inv_b_ptr, rows, cols.to(tl.int64), row_mask, mask, D, ONE_FEATURE
            )
            best_p, at_p = _best(d, mask & pos & exact_p[:, None], cols, best_p, at_p, True)
            best_n, at_n = _best(d, mask & (pos == 0) & exact_n[:, None], cols, best_n, at_n, False)
    idx_p = tl.where(nan_p < NONE, nan_p, tl.where(exact_p, at_p, tl.where(n_p > 0, one_p, NONE)))
    idx_n = tl.where(nan_n < NONE, nan_n, tl.where(exact_n, at_n, tl.where(n_n > 0, one_n, NONE)))
    # The chosen pairs' exact distances.
    kinds = tl.arange(0, 2)[None, :]
    js = tl.where(kinds == 0, idx_p[:, None], idx_n[:, None]).to(tl.int64)
    chosen = row_mask[:, None] & (js < NONE)
    d = _pair_exact(xa_ptr, xb_ptr, sa, sb, inv_a_ptr, inv_b_ptr, rows, js, row_mask, chosen, D, ONE_FEATURE)
    out = rows[:, None] * 2 + kinds
    out_mask = row_mask[:, None] & (kinds < 2)
    tl.store(idx_ptr + out, tl.where(chosen, js, -1), mask=out_mask)
    tl.store(dist_ptr + out, tl.where(chosen, d, float("nan")), mask=out_mask)


# --------------------------------------------------------------------------- all and semi_hard

# Each anchor's first POS_CAP positives' exact distances and thresholds, kept by
# positives_kernel for the other kernels (KEPT; further positives, in classes past POS_CAP
# rows, are computed where used). A multiple of the rows kernels' BLOCK_P.
POS_CAP = 64


@triton.jit
def _down(x, IS64: tl.constexpr):
    """A value of the tile's type at most x >= 0 (float64)."""
    if IS64:
        return x * (1.0 - 2.0**-50)
    else:
        return tl.where(x < 2.0**-100, 0.0, (x * (1.0 - 2.0**-22)).to(tl.float32))


@triton.jit
def _up(x, IS64: tl.constexpr):
    """A value of the tile's type at least x >= 0 (float64)."""
    if IS64:
        return x * (1.0 + 2.0**-50) + 2.0**-1000
    else:
        return (x * (1.0 + 2.0**-22)).to(tl.float32) + 2.0**-120


@triton.jit
def _thresholds(t, margin, SEMI: tl.constexpr, ACC: tl.constexpr, IS64: tl.constexpr):
    """From a chunk of each anchor's positives' exact distances t (−1: no positive; NaN: one at
    a NaN distance), the squared distances that decide a negative for each (_decide): below
    hit a triplet counts surely, above miss surely not, whatever the CPU kernel's float64
    rounding of t − d + margin (δ: 2^-49·(t + |margin|)); semi_hard's second condition, t < d,
    surely holds above semi and surely fails at or below not_semi. Then the terms' T = t +
    margin (ACC) and whether a negative at exactly 0 (equal rows) counts (the CPU's
    t − 0 + margin > 0, never for semi_hard)."""
    pok = t >= 0
    T = t + margin
    delta = (tl.abs(t) + tl.abs(margin)) * 2.0**-49
    low = T - delta
    high = T + delta
    hit = tl.where(pok & (low > 0), _down(low * low, IS64), float("-inf"))
    miss = tl.where(pok & (high > 0), _up(high * high, IS64), float("-inf"))
    sq = tl.where(pok, t * t, 0.0)
    zero = pok & (T > 0)
    if SEMI:
        zero = zero & (t < 0)
    return hit, miss, _up(sq, IS64), _down(sq, IS64), T.to(ACC), zero


@triton.jit
def _column(x, ps, p):
    """Column p of a (rows, BLOCK_P) block, per row."""
    return tl.sum(tl.where(ps[None, :] == p, x, 0), axis=1)


@triton.jit
def _decide(lo, hi, hit, miss, semi, not_semi, ps, p, SEMI: tl.constexpr):
    """Positive p's triplets with a tile of negatives of squared distances in [lo, hi]: which
    surely count, which surely do not (_thresholds)."""
    sure = hi < _column(hit, ps, p)[:, None]
    never = lo > _column(miss, ps, p)[:, None]
    if SEMI:
        sure = sure & (lo > _column(semi, ps, p)[:, None])
        never = never | (hi <= _column(not_semi, ps, p)[:, None])
    return sure, never


@triton.jit
def _positives(
    tpos_ptr, order_ptr, xa_ptr, xb_ptr, sa, sb, inv_a_ptr, inv_b_ptr, rows, row_mask, lo, hi, p0, OFFSET, D,
    SELF: tl.constexpr, ONE_FEATURE: tl.constexpr, KEPT: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    """Positives [p0, p0 + BLOCK_P) of each anchor (its label's segment [lo, hi) of the refs in
    label order, less itself): their ref rows and exact distances t (−1 for none), kept by
    positives_kernel for the first KEPT, else computed (_pair_exact)."""
    ps = p0 + tl.arange(0, BLOCK_P)
    q = lo[:, None] + ps[None, :]
    p_mask = row_mask[:, None] & (q < hi[:, None])
    js = tl.load(order_ptr + q, mask=p_mask, other=0)
    if SELF:
        p_mask = p_mask & (js - OFFSET != rows[:, None])
    if p0 < KEPT:
        t = tl.load(tpos_ptr + rows[:, None] * KEPT + ps[None, :], mask=p_mask, other=-1.0)
    else:
        t = _pair_exact(xa_ptr, xb_ptr, sa, sb, inv_a_ptr, inv_b_ptr, rows, js, row_mask, p_mask, D, ONE_FEATURE)
    return js, tl.where(p_mask, t, -1.0)


@triton.jit
def _chunk(
    thr_ptr, kind_ptr, tpos_ptr, order_ptr, xa_ptr, xb_ptr, sa, sb, inv_a_ptr, inv_b_ptr, rows, row_mask, lo, hi, p0,
    margin, OFFSET, D, SELF: tl.constexpr, SEMI: tl.constexpr, ONE_FEATURE: tl.constexpr, KEPT: tl.constexpr,
    ACC: tl.constexpr, IS64: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    """Positives [p0, p0 + BLOCK_P) of each anchor (_positives): their ref rows, _thresholds'
    values and which are positives (pok, int32), kept by positives_kernel for the first KEPT
    (no float64 work in the tiles' kernel), else computed."""
    if p0 < KEPT:
        ps = p0 + tl.arange(0, BLOCK_P)
        q = lo[:, None] + ps[None, :]
        p_mask = row_mask[:, None] & (q < hi[:, None])
        js = tl.load(order_ptr + q, mask=p_mask, other=0)
        at = thr_ptr + rows[:, None] * (5 * KEPT) + ps[None, :]
        # (past an anchor's positives: none, which decides nothing)
        hit = tl.load(at, mask=p_mask, other=float("-inf"))
        miss = tl.load(at + KEPT, mask=p_mask, other=float("-inf"))
        semi = tl.load(at + 2 * KEPT, mask=p_mask, other=0.0)
        not_semi = tl.load(at + 3 * KEPT, mask=p_mask, other=0.0)
        T = tl.load(at + 4 * KEPT, mask=p_mask, other=0.0)
        kind = tl.load(kind_ptr + rows[:, None] * KEPT + ps[None, :], mask=p_mask, other=0).to(tl.int32)
        pok = kind & 1
        zero = kind >= 2
    else:
        js, t = _positives(
            tpos_ptr, order_ptr, xa_ptr, xb_ptr, sa, sb, inv_a_ptr, inv_b_ptr, rows, row_mask, lo, hi, p0, OFFSET, D,
            SELF, ONE_FEATURE, KEPT, BLOCK_P,
        )  # fmt: skip
        hit, miss, semi, not_semi, T, zero = _thresholds(t, margin, SEMI, ACC, IS64)
        pok = (t >= 0).to(tl.int32)
    return js, hit, miss, semi, not_semi, T, zero, pok


@triton.jit
def positives_kernel(
    xa_ptr,
    xb_ptr,
    sa,
    sb,
    inv_a_ptr,
    inv_b_ptr,
    order_ptr,
    lo_ptr,
    hi_ptr,
    tpos_ptr,
    nan_ptr,
    thr_ptr,
    kind_ptr,
    N,
    D,
    OFFSET,
    MARGIN_BITS,
    SELF: tl.constexpr,
    SEMI: tl.constexpr,
    ONE_FEATURE: tl.constexpr,
    KEPT: tl.constexpr,
    ACC: tl.constexpr,
    IS64: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Per anchor, its positives' exact distances (the first KEPT: tpos, (N, KEPT)
    float64, −1 past its positives), how many are NaN (nan, int64), and the first KEPT's
    _thresholds, once for every slice of triplet_rows_kernel (thr, (N, 5, KEPT) ACC: hit,
    miss, semi, not_semi, T; kind, (N, KEPT) int8: 1 a positive, 2 a negative at 0 counts)."""
    margin = tm.f64(MARGIN_BITS)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < N
    lo = tl.load(lo_ptr + rows, mask=row_mask, other=0)
    hi = tl.load(hi_ptr + rows, mask=row_mask, other=0)
    nan = tl.zeros((BLOCK_ROWS,), tl.int64)
    for p0 in range(0, tl.max(hi - lo, axis=0), BLOCK_P):
        ps = p0 + tl.arange(0, BLOCK_P)
        q = lo[:, None] + ps[None, :]
        p_mask = row_mask[:, None] & (q < hi[:, None])
        js = tl.load(order_ptr + q, mask=p_mask, other=0)
        if SELF:
            p_mask = p_mask & (js - OFFSET != rows[:, None])
        t = _pair_exact(xa_ptr, xb_ptr, sa, sb, inv_a_ptr, inv_b_ptr, rows, js, row_mask, p_mask, D, ONE_FEATURE)
        t = tl.where(p_mask, t, -1.0)
        nan += tl.sum((t != t).to(tl.int64), axis=1)
        kept = row_mask[:, None] & (ps < KEPT)[None, :]
        tl.store(tpos_ptr + rows[:, None] * KEPT + ps[None, :], t, mask=kept)
        hit, miss, semi, not_semi, T, zero = _thresholds(t, margin, SEMI, ACC, IS64)
        at = thr_ptr + rows[:, None] * (5 * KEPT) + ps[None, :]
        tl.store(at, hit, mask=kept)
        tl.store(at + KEPT, miss, mask=kept)
        tl.store(at + 2 * KEPT, semi, mask=kept)
        tl.store(at + 3 * KEPT, not_semi, mask=kept)
        tl.store(at + 4 * KEPT, T, mask=kept)
        kind = (t >= 0).to(tl.int8) + 2 * zero.to(tl.int8)
        tl.store(kind_ptr + rows[:, None] * KEPT + ps[None, :], kind, mask=kept)
    tl.store(nan_ptr + rows, nan, mask=row_mask)


@hot()
@triton.jit
def triplet_rows_kernel(
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
    xa_ptr,
    xb_ptr,
    sa,
    sb,
    inv_a_ptr,
    inv_b_ptr,
    order_ptr,
    lo_ptr,
    hi_ptr,
    tpos_ptr,
    thr_ptr,
    kind_ptr,
    nan_ptr,
    sums_ptr,
    count_ptr,
    band_ptr,
    slot_ptr,
    fill_ptr,
    ROW0,
    N,
    M,
    D,
    OFFSET,
    CHUNK,
    CAP,
    MARGIN_BITS,
    ERR_BITS,
    SELF: tl.constexpr,
    SEMI: tl.constexpr,
    BAND: tl.constexpr,
    ONE_FEATURE: tl.constexpr,
    KEPT: tl.constexpr,
    ACC: tl.constexpr,
    IS64: tl.constexpr,
    SCHEME: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """mining="all" / "semi_hard" for a block of anchors of [ROW0, N) over the refs of slice
    program_id(1) (CHUNK refs from program_id(1)·CHUNK): the triplets (a, p, n) with
    d_ap − d_an + margin > 0 (semi_hard: and d_ap < d_an), or a NaN d_an, and a non-NaN d_ap
    (count_triplets in the CPU kernel). A chunk of each anchor's positives (_positives) at a
    time, against each tile of negatives: per positive, the tile's bounds decide (_decide);
    a negative that some positive of the chunk leaves undecided, or whose d² cancelled
    (near-duplicates) and that counts, is listed for its anchor with the chunk (ms._append)
    and left to triplet_exact_kernel for that chunk's positives;
    a negative of an equal row is at exactly 0.
    Forward (BAND false): per slice and anchor, the tile's counted terms' sum (sums, float64:
    Σ d_ap + margin − d_an, a tile's row in ACC) and count (count, int64: each negative's
    counted positives plus the anchor's positives at a NaN distance, nan).
    BAND: ∂loss/∂d·C of the pairs of the anchors [ROW0, N) into band (rows from ROW0, M
    columns, zeroed by the caller): −(its counted positives) for a negative, +(its counted
    triplets) for a positive, an integer atomic add across slices (the same on every run).
    Slots and fill are the band's (rows from ROW0)."""
    margin = tm.f64(MARGIN_BITS)
    err = tm.f64(ERR_BITS).to(ACC)
    if IS64:
        TINY = 2.0**-1022
    else:
        TINY = 2.0**-126
    rows = ROW0 + tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    lab = tl.load(lab_ptr + rows, mask=row_mask, other=0)
    grp = tl.load(grp_a_ptr + rows, mask=row_mask, other=-1)
    sq_a = tl.load(sq_a_ptr + rows, mask=row_mask, other=0.0)
    e_a = _shares(sq_a, err, IS64)
    lo = tl.load(lo_ptr + rows, mask=row_mask, other=0)
    hi = tl.load(hi_ptr + rows, mask=row_mask, other=0)
    nan_p = tl.load(nan_ptr + rows, mask=row_mask, other=0).to(tl.int32)
    ah = sq_a
    al = sq_a
    if BLOCK_D > 0:  # the anchors' whole rows, held across the refs (BLOCK_D >= D)
        ks = tl.arange(0, BLOCK_D)
        ah, al = lse._load(a_hi, a_lo, rows, ks, row_mask[:, None] & (ks < D)[None, :], D, SCHEME, INTERPRET)
    first = tl.program_id(1).to(tl.int64) * CHUNK
    last = tl.minimum(first + CHUNK, M)
    total_sum = tl.zeros((BLOCK_N,), tl.float64)
    total_count = tl.zeros((BLOCK_N,), tl.int64)
    ps = tl.arange(0, BLOCK_P)
    for p0 in range(0, tl.max(hi - lo, axis=0), BLOCK_P):
        js, hit, miss, semi, not_semi, T, zero, pok = _chunk(
            thr_ptr, kind_ptr, tpos_ptr, order_ptr, xa_ptr, xb_ptr, sa, sb, inv_a_ptr, inv_b_ptr, rows, row_mask, lo,
            hi, p0, margin, OFFSET, D, SELF, SEMI, ONE_FEATURE, KEPT, ACC, IS64, BLOCK_P,
        )  # fmt: skip
        counted_nan = tl.sum(pok, axis=1)  # (a NaN negative counts with each)
        counted_zero = tl.sum(zero.to(tl.int32), axis=1)
        term_zero = tl.sum(tl.where(zero, T, 0.0), axis=1)
        uses = tl.zeros((BLOCK_N, BLOCK_P), tl.int32)
        for j0 in range(first, last, BLOCK_M):
            cols = j0 + tl.arange(0, BLOCK_M).to(tl.int64)
            col_mask = cols < last
            ref_lab = tl.load(ref_lab_ptr + cols, mask=col_mask, other=0)
            grp_b = tl.load(grp_b_ptr + cols, mask=col_mask, other=-2)
            sq_b = tl.load(sq_b_ptr + cols, mask=col_mask, other=0.0)
            bh = sq_b
            bl = sq_b
            if BLOCK_D > 0:
                bh, bl = lse._load(b_hi, b_lo, cols, ks, col_mask[:, None] & (ks < D)[None, :], D, SCHEME, INTERPRET)
            v = euclid._dots(
                a_hi, a_lo, b_hi, b_lo, ah, al, bh, bl, rows, cols, row_mask, col_mask, D, ACC, SCHEME, INTERPRET,
                BLOCK_K, BLOCK_D,
            )  # fmt: skip
            total = sq_a[:, None] + sq_b[None, :]
            d2 = total - 2.0 * v
            lo2, hi2 = _interval(d2, e_a, _shares(sq_b, err, IS64), IS64)
            k = tl.zeros((BLOCK_N, BLOCK_M), tl.int32)
            terms = tl.zeros((BLOCK_N, BLOCK_M), ACC)
            open_ = tl.zeros((BLOCK_N, BLOCK_M), tl.int32)
            for p in tl.static_range(BLOCK_P):
                sure, never = _decide(lo2, hi2, hit, miss, semi, not_semi, ps, p, SEMI)
                k += sure.to(tl.int32)
                terms += tl.where(sure, _column(T, ps, p)[:, None], 0.0)
                open_ = open_ | ((sure | never) == 0).to(tl.int32)
            neg = row_mask[:, None] & col_mask[None, :] & (lab[:, None] != ref_lab[None, :])
            same = grp[:, None] == grp_b[None, :]
            nan = lo2 != lo2
            k = tl.where(same, counted_zero[:, None], tl.where(nan, counted_nan[:, None], k))
            terms = tl.where(same, term_zero[:, None], terms)
            # (a d² below the smallest normal is cancelled too: the GPU's float32 roots flush it)
            cancelled = ((d2 * 16.0 > total) == 0) | (d2 < TINY)
            listed = neg & (same == 0) & (nan == 0) & ((open_ != 0) | (cancelled & (k > 0)))
            if lse._any(listed):
                # (with its chunk of positives: the pair is decided there for those only)
                ms._append(listed, rows - ROW0, cols + (p0 // BLOCK_P) * M, fill_ptr, slot_ptr, CAP)
            keep = neg & (listed == 0)
            if BAND:
                at = band_ptr + (rows - ROW0)[:, None] * M + cols[None, :]
                tl.store(at, tl.load(at, mask=keep, other=0) - k, mask=keep)
                for p in tl.static_range(BLOCK_P):  # each positive's triplets of the kept negatives
                    sure, _ = _decide(lo2, hi2, hit, miss, semi, not_semi, ps, p, SEMI)
                    sure = tl.where(same, (_column(zero.to(tl.int32), ps, p) != 0)[:, None], sure)
                    sure = tl.where(nan, (_column(pok, ps, p) != 0)[:, None], sure)
                    n = tl.sum((keep & sure).to(tl.int32), axis=1)
                    uses += tl.where(ps[None, :] == p, n[:, None], 0)
            else:
                d = tl.where(same, 0.0, tl.sqrt(tl.maximum(d2, 0.0)))
                term = tl.where(keep & (k > 0), terms - k.to(ACC) * d, 0.0)
                total_sum += tl.sum(term, axis=1).to(tl.float64)
                total_count += tl.sum(tl.where(keep, k + nan_p[:, None], 0), axis=1).to(tl.int64)
        if BAND:
            at = band_ptr + (rows - ROW0)[:, None] * M + js
            tl.atomic_add(at, uses, mask=(pok != 0) & (uses != 0))
    if not BAND:
        at = tl.program_id(1).to(tl.int64) * N + rows
        tl.store(sums_ptr + at, total_sum, mask=row_mask)
        tl.store(count_ptr + at, total_count, mask=row_mask)


@triton.jit
def triplet_exact_kernel(
    xa_ptr,
    xb_ptr,
    sa,
    sb,
    inv_a_ptr,
    inv_b_ptr,
    lab_ptr,
    ref_lab_ptr,
    order_ptr,
    lo_ptr,
    hi_ptr,
    tpos_ptr,
    nan_ptr,
    slot_ptr,
    fill_ptr,
    sums_ptr,
    count_ptr,
    out_sum_ptr,
    out_count_ptr,
    band_ptr,
    ROW0,
    N,
    M,
    D,
    OFFSET,
    SLICES,
    CAP,
    MARGIN_BITS,
    SELF: tl.constexpr,
    SEMI: tl.constexpr,
    BAND: tl.constexpr,
    ONE_FEATURE: tl.constexpr,
    KEPT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """triplet_rows_kernel's listed negatives of a block of anchors (an anchor whose list
    outgrew CAP: every ref, its tiles' results left out) decided on their exact distances
    (_pair_exact) in float64 as the CPU kernel does. Forward: the tiles'
    sums and counts (SLICES of them, in slice order) plus the listed ones', per anchor
    (out_sum float64, out_count int64). BAND: their coefficients into band (an anchor taken
    whole: every one of its pairs' written anew). A listed pair is decided with the positives
    of the chunk that listed it (BLOCK_P: triplet_rows_kernel's)."""
    margin = tm.f64(MARGIN_BITS)
    rows = ROW0 + tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < N
    rel = rows - ROW0
    lab = tl.load(lab_ptr + rows, mask=row_mask, other=0)
    lo = tl.load(lo_ptr + rows, mask=row_mask, other=0)
    hi = tl.load(hi_ptr + rows, mask=row_mask, other=0)
    nan_p = tl.load(nan_ptr + rows, mask=row_mask, other=0)
    fill = tl.load(fill_ptr + rel, mask=row_mask, other=0)
    whole = row_mask & (fill > CAP)
    total_sum = tl.zeros((BLOCK_ROWS,), tl.float64)
    total_count = tl.zeros((BLOCK_ROWS,), tl.int64)
    if not BAND:
        tiles = row_mask & (whole == 0)  # (an anchor taken whole has every pair here)
        for s in range(0, SLICES):
            total_sum += tl.load(sums_ptr + s * N + rows, mask=tiles, other=0.0)
            total_count += tl.load(count_ptr + s * N + rows, mask=tiles, other=0)
    any_whole = tl.max(whole.to(tl.int32), axis=0) > 0
    # (the rounds of slots up to the block's longest list, then the refs of anchors taken whole)
    longest = tl.max(tl.where(whole, 0, tl.minimum(fill, CAP)), axis=0)
    span = tl.cdiv(longest, BLOCK_C) * BLOCK_C
    for p0 in range(0, tl.max(hi - lo, axis=0), BLOCK_P):
        js, t = _positives(
            tpos_ptr, order_ptr, xa_ptr, xb_ptr, sa, sb, inv_a_ptr, inv_b_ptr, rows, row_mask, lo, hi, p0, OFFSET, D,
            SELF, ONE_FEATURE, KEPT, BLOCK_P,
        )  # fmt: skip
        pok = t >= 0
        uses = tl.zeros((BLOCK_ROWS, BLOCK_P), tl.int32)
        for j0 in range(0 - span, tl.where(any_whole, M, 0), BLOCK_C):
            cs = tl.arange(0, BLOCK_C)
            if j0 < 0:  # slots [j0 + span, j0 + span + BLOCK_C)
                slots = j0 + span + cs
                mask = (slots[None, :] < fill[:, None]) & (whole == 0)[:, None] & row_mask[:, None]
                listed = tl.load(slot_ptr + rel[:, None] * CAP + slots[None, :], mask=mask, other=0)
                chunk = listed // M  # (a slot: its chunk of positives and ref row)
                cols = listed - chunk * M
                mask = mask & (chunk == p0 // BLOCK_P)
            else:
                cols = j0 + cs[None, :].to(tl.int64) + tl.zeros((BLOCK_ROWS, BLOCK_C), tl.int64)
                mask = whole[:, None] & (cols < M)
            neg = mask & (tl.load(ref_lab_ptr + cols, mask=mask, other=0) != lab[:, None])
            if lse._any(neg):
                d = _pair_exact(xa_ptr, xb_ptr, sa, sb, inv_a_ptr, inv_b_ptr, rows, cols, row_mask, neg, D, ONE_FEATURE)
                dn = d[:, None, :]
                tp = t[:, :, None]
                hit = (tp - dn) + margin > 0
                if SEMI:
                    hit = hit & (tp < dn)
                counted = (pok[:, :, None] & neg[:, None, :]) & (hit | (dn != dn))
                k = tl.sum(counted.to(tl.int32), axis=1)
                uses += tl.sum(counted.to(tl.int32), axis=2)
                if BAND:
                    at = band_ptr + rel[:, None] * M + cols
                    fresh = (whole & (p0 == 0))[:, None]
                    tl.store(at, tl.where(fresh, 0, tl.load(at, mask=neg, other=0)) - k, mask=neg)
                else:
                    term = tl.where(counted, (tp + margin) - dn, 0.0)
                    total_sum += tl.sum(tl.sum(term, axis=2), axis=1)
                    total_count += tl.sum(tl.where(neg, k.to(tl.int64) + nan_p[:, None], 0), axis=1)
        if BAND:
            at = band_ptr + rel[:, None] * M + js
            fresh = whole[:, None] & pok
            tl.store(at, tl.where(fresh, 0, tl.load(at, mask=pok, other=0)) + uses, mask=pok & (fresh | (uses != 0)))
    if not BAND:
        tl.store(out_sum_ptr + rows, total_sum, mask=row_mask)
        tl.store(out_count_ptr + rows, total_count, mask=row_mask)


@hot()
@triton.jit
def band_grad_kernel(
    own_hi,
    own_lo,
    other_hi,
    other_lo,
    c_own_ptr,
    sq_own_ptr,
    sq_other_ptr,
    grp_own_ptr,
    grp_other_ptr,
    scale_ptr,
    band_ptr,
    slot_ptr,
    fill_ptr,
    out_ptr,
    N_OWN,
    N_OTHER,
    BAND_STRIDE,
    D,
    CHUNK,
    CAP,
    ANCHORS_OWN: tl.constexpr,
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
    """The backward of mining="all" / "semi_hard" from a band of all_triplets' coefficients g
    (ANCHORS_OWN: the own rows are the band's anchors, g_ij = band[i, j]; else the other rows
    are, g_ij = band[j, i]): out[slice, own rows, feature block] = Σ over the other rows of
    the slice of w_ij (c_i − c_j), w = g·scale/d (scale: 1/C), on the tile's distance, with
    w·C on tensor cores as contrastive_grad_kernel's. A pair with g ≠ 0 whose d² cancelled (a
    NaN one included) is left out and listed for its own row (band_pairs_kernel adds its term
    from exact differences); a pair of equal rows is at d = 0: no term (cdist's subgradient)."""
    if IS64:
        TINY = 2.0**-1022
    else:
        TINY = 2.0**-126
    scale = tl.load(scale_ptr).to(ACC)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    fs = tl.program_id(1).to(tl.int64) * BLOCK_F + tl.arange(0, BLOCK_F)
    row_mask = rows < N_OWN
    f_mask = fs < D
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
        valid = row_mask[:, None] & col_mask[None, :]
        if ANCHORS_OWN:
            at = band_ptr + rows[:, None] * BAND_STRIDE + cols[None, :]
        else:
            at = band_ptr + cols[None, :] * BAND_STRIDE + rows[:, None]
        g = tl.load(at, mask=valid, other=0)
        if lse._any(g != 0):
            grp_b = tl.load(grp_other_ptr + cols, mask=col_mask, other=-2)
            sq_j = tl.load(sq_other_ptr + cols, mask=col_mask, other=0.0)
            bh = sq_j
            bl = sq_j
            if BLOCK_D > 0:
                bh, bl = lse._load(
                    other_hi, other_lo, cols, ks, col_mask[:, None] & (ks < D)[None, :], D, SCHEME, INTERPRET
                )
            v = euclid._dots(
                own_hi, own_lo, other_hi, other_lo, ah, al, bh, bl, rows, cols, row_mask, col_mask, D, ACC, SCHEME,
                INTERPRET, BLOCK_K, BLOCK_D,
            )  # fmt: skip
            total = sq_i[:, None] + sq_j[None, :]
            d2 = total - 2.0 * v
            live = (g != 0) & (grp[:, None] != grp_b[None, :])
            # (a d² below the smallest normal is cancelled too: the GPU's float32 roots flush it)
            cancelled = ((d2 * 16.0 > total) == 0) | (d2 < TINY)
            listed = live & cancelled
            if lse._any(listed):
                if tl.program_id(1) == 0:  # (once per pair: the first feature block lists it)
                    ms._append(listed, rows, cols, fill_ptr, slot_ptr, CAP)
            # (1/d as the GPU's approximate reciprocal root of d², within a few u)
            w = tl.where(live & (cancelled == 0), g.to(ACC) * scale * tl.math.rsqrt(tl.where(cancelled, 1.0, d2)), 0.0)
            row_sum += tl.sum(w, axis=1)
            acc = lse._grad_product(
                0.0 - w, ones, bh, bl, other_hi, other_lo, cols, col_mask, fs, f_mask, D, 1.0, acc, SCHEME,
                INTERPRET, BLOCK_D,
            )  # fmt: skip
    c_i = tl.load(c_own_ptr + rows[:, None] * D + fs[None, :], mask=row_mask[:, None] & f_mask[None, :], other=0.0)
    acc += row_sum[:, None] * c_i
    out = out_ptr + (tl.program_id(2).to(tl.int64) * N_OWN + rows[:, None]) * D + fs[None, :]
    tl.store(out, acc, mask=row_mask[:, None] & f_mask[None, :])


@triton.jit
def band_pairs_kernel(
    xo_ptr,
    xt_ptr,
    s_own,
    s_other,
    inv_own_ptr,
    inv_other_ptr,
    scale_ptr,
    band_ptr,
    slot_ptr,
    fill_ptr,
    planes_ptr,
    out_ptr,
    N_OWN,
    N_OTHER,
    OUT0,
    BAND_STRIDE,
    D,
    SLICES,
    CAP,
    ANCHORS_OWN: tl.constexpr,
    ONE_FEATURE: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Own rows' part of a band, BLOCK_ROWS rows a program: band_grad_kernel's slices (planes,
    in order) and the rows' listed pairs' terms on their exact distances (a row whose list
    outgrew CAP: every pair of it, its slices left out), Σ_j w_ij (e_i − e_j) from the float64
    normalised rows e = x·inv, w = g·scale/d (a NaN distance with a coefficient: NaN), added to
    out's rows OUT0 + row (the bands in order: the same bits on every run). The pairs come
    BLOCK_C slots of each row at a time, their features BLOCK_D at a time."""
    scale = tl.load(scale_ptr)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < N_OWN
    inv_i = tl.load(inv_own_ptr + rows, mask=row_mask, other=0.0)
    fill = tl.load(fill_ptr + rows, mask=row_mask, other=0)
    whole = fill > CAP
    any_whole = tl.max(whole.to(tl.int32), axis=0) > 0
    ks = tl.arange(0, BLOCK_D)
    dest = out_ptr + (OUT0 + rows[:, None]) * D
    for k0 in range(0, D, BLOCK_D):
        k_mask = row_mask[:, None] & (k0 + ks < D)[None, :]
        total = tl.load(dest + k0 + ks[None, :], mask=k_mask, other=0.0)
        sliced = k_mask & (whole == 0)[:, None]  # (a row taken whole has every pair below)
        for s in range(0, SLICES):
            planes = planes_ptr + (s * N_OWN + rows[:, None]) * D + k0 + ks[None, :]
            total += tl.load(planes, mask=sliced, other=0.0)
        tl.store(dest + k0 + ks[None, :], total, mask=k_mask)
    for j0 in range(0 - euclid._span(CAP, BLOCK_C), tl.where(any_whole, N_OTHER, 0), BLOCK_C):
        cols, mask = euclid._listed(slot_ptr, fill, whole, rows, row_mask, j0, N_OTHER, CAP, BLOCK_C)
        if ANCHORS_OWN:
            g = tl.load(band_ptr + rows[:, None] * BAND_STRIDE + cols, mask=mask, other=0)
        else:
            g = tl.load(band_ptr + cols * BAND_STRIDE + rows[:, None], mask=mask, other=0)
        mask = mask & (g != 0)
        if tl.max(tl.max(mask.to(tl.int32), axis=1), axis=0) > 0:
            d = _pair_exact(
                xo_ptr, xt_ptr, s_own, s_other, inv_own_ptr, inv_other_ptr, rows, cols, row_mask, mask, D, ONE_FEATURE
            )
            # (at d = 0 cdist's subgradient 0)
            w = tl.where(mask & (d != 0), g.to(tl.float64) * scale / tl.where(d == 0, 1.0, d), 0.0)
            inv_j = tl.load(inv_other_ptr + cols, mask=mask, other=0.0)
            for k0 in range(0, D, BLOCK_D):
                k_mask = (k0 + ks < D)[None, :]
                xi = tl.load(
                    xo_ptr + rows[:, None] * s_own + k0 + ks[None, :], mask=row_mask[:, None] & k_mask, other=0.0
                ).to(tl.float64)
                xj = tl.load(
                    xt_ptr + cols[:, :, None] * s_other + (k0 + ks)[None, None, :],
                    mask=mask[:, :, None] & k_mask[:, None, :],
                    other=0.0,
                ).to(tl.float64)
                e_i = _unit(xi, inv_i[:, None], ONE_FEATURE)
                e_j = _unit(xj, inv_j[:, :, None], ONE_FEATURE)
                part = tl.sum(tl.where(w[:, :, None] != 0, w[:, :, None] * (e_i[:, None, :] - e_j), 0.0), axis=1)
                out_mask = row_mask[:, None] & k_mask
                total = tl.load(dest + k0 + ks[None, :], mask=out_mask, other=0.0) + part.to(ACC)
                tl.store(dest + k0 + ks[None, :], total, mask=out_mask)


# --------------------------------------------------------------------------- wrappers


def batch_hard(
    a: euclid._Points,
    b: euclid._Points,
    self_: bool,
    offset: int,
    acc: torch.dtype,
    config: Config,
    exact_config: Config,
) -> tuple[Tensor, Tensor]:
    """Each anchor's batch_hard pairs (N, 2) int64, its farthest positive and nearest negative
    (−1 for none), and their exact distances (N, 2) float64 (NaN for none); self_: anchor i is
    b's row offset + i, not a pair. N and M > 0."""
    N, D = a.c.shape
    M = b.n
    dev = a.c.device
    k = config.kwargs
    programs = blocks(N, k["BLOCK_N"])
    slices, chunk = lse._slices(programs, M, k["BLOCK_M"])
    cap = euclid._cap(a.scheme, M)
    lead = torch.empty(slices, N, 2, dtype=acc, device=dev)
    nan = torch.empty(slices, N, 2, dtype=torch.int32, device=dev)
    eq = torch.empty_like(nan)
    slot = torch.empty(N, cap, dtype=torch.int32, device=dev)  # (read below fill only)
    key = torch.empty(N, cap, dtype=acc, device=dev)
    fill = torch.zeros(N, dtype=torch.int32, device=dev)
    hard_rows_kernel[(programs, slices)](
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
        lead,
        nan,
        eq,
        slot,
        key,
        fill,
        N,
        M,
        D,
        offset,
        chunk,
        cap,
        float_bits(euclid._error(D, a.scheme, acc)),
        SELF=self_,
        BLOCK_D=lse._held(D, a.scheme, lse.HELD_NARROW),
        **lse._launch_flags(a, acc),
        **config.launch,
    )
    idx = torch.empty(N, 2, dtype=torch.int64, device=dev)
    dist = torch.empty(N, 2, dtype=torch.float64, device=dev)
    hard_pick_kernel[(blocks(N, exact_config.kwargs["BLOCK_ROWS"]),)](
        a.side.raw,
        b.side.raw,
        a.side.raw.stride(0),
        b.side.raw.stride(0),
        a.side.inv64,
        b.side.inv64,
        a.labels,
        b.labels,
        lead,
        nan,
        eq,
        slot,
        key,
        fill,
        idx,
        dist,
        N,
        M,
        D,
        offset,
        slices,
        cap,
        SELF=self_,
        ONE_FEATURE=D == 1,
        **exact_config.launch,
    )
    return idx, dist


def positives(
    a: euclid._Points, b: euclid._Points, self_: bool, offset: int, margin: float, semi: bool, acc: torch.dtype
) -> tuple:
    """mining="all" / "semi_hard"'s positives: (order, lo, hi), the refs' rows in label order and
    each anchor's label's segment of them, then positives_kernel's (tpos, thr, kind, nan)."""
    keys, order = torch.sort(b.labels, stable=True)
    lo = torch.searchsorted(keys, a.labels)
    hi = torch.searchsorted(keys, a.labels, right=True)
    N, D = a.c.shape
    dev = a.c.device
    tpos = torch.empty(N, POS_CAP, dtype=torch.float64, device=dev)
    thr = torch.empty(N, 5, POS_CAP, dtype=acc, device=dev)
    kind = torch.empty(N, POS_CAP, dtype=torch.int8, device=dev)
    nan = torch.empty(N, dtype=torch.int64, device=dev)
    if N > 0:
        positives_kernel[(blocks(N, POSITIVES_CONFIG.kwargs["BLOCK_ROWS"]),)](
            a.side.raw,
            b.side.raw,
            a.side.raw.stride(0),
            b.side.raw.stride(0),
            a.side.inv64,
            b.side.inv64,
            order,
            lo,
            hi,
            tpos,
            nan,
            thr,
            kind,
            N,
            D,
            offset,
            float_bits(margin),
            SELF=self_,
            SEMI=semi,
            ONE_FEATURE=D == 1,
            KEPT=POS_CAP,
            ACC=acc_tl(acc),
            IS64=acc == torch.float64,
            **POSITIVES_CONFIG.launch,
        )
    return order, lo, hi, tpos, thr, kind, nan


def _all_cap(scheme: int, M: int) -> int:
    """Slots per anchor for triplet_rows_kernel's listed pairs: a pair is undecided where any of
    its anchor's positives' thresholds is within the tile's bound of it (contrastive_loss's
    two margins: euclid._cap), eight times as many."""
    return max(16, min(8 * euclid._cap(scheme, M), triton.next_power_of_2(max(M, 1))))


def all_triplets(
    a: euclid._Points,
    b: euclid._Points,
    pos: tuple,
    self_: bool,
    offset: int,
    margin: float,
    semi: bool,
    acc: torch.dtype,
    config: Config,
    exact_config: Config,
    row0: int = 0,
    end: int | None = None,
    band: Tensor | None = None,
) -> tuple[Tensor, Tensor] | None:
    """mining="all" / "semi_hard" (pos: positives()'s; self_: anchor i is b's row offset + i,
    not a pair). Forward (band None): per anchor, its counted triplets' sum of
    d_ap + margin − d_an (float64) and their count with its NaN positives' (int64). Else the
    coefficients of the anchors [row0, end)'s pairs into band (zeroed: (end − row0, M))."""
    N, D = a.c.shape
    end = N if end is None else end
    M = b.n
    dev = a.c.device
    k = config.kwargs
    programs = blocks(end - row0, k["BLOCK_N"])
    slices, chunk = lse._slices(programs, M, k["BLOCK_M"])
    cap = _all_cap(a.scheme, M)
    slot = torch.full((end - row0, cap), ms.NO_COL, dtype=torch.int64, device=dev)
    fill = torch.zeros(end - row0, dtype=torch.int32, device=dev)
    forward = band is None
    sums = torch.empty((slices, N) if forward else (0,), dtype=torch.float64, device=dev)
    count = torch.empty((slices, N) if forward else (0,), dtype=torch.int64, device=dev)
    band = torch.empty(0, dtype=torch.int32, device=dev) if forward else band
    order, lo, hi, tpos, thr, kind, nan = pos
    inputs = (a.side.raw, b.side.raw, a.side.raw.stride(0), b.side.raw.stride(0), a.side.inv64, b.side.inv64)
    bits = float_bits(margin)
    flags = dict(SELF=self_, SEMI=semi, BAND=not forward, ONE_FEATURE=D == 1, KEPT=POS_CAP)
    triplet_rows_kernel[(programs, slices)](
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
        *inputs,
        order,
        lo,
        hi,
        tpos,
        thr,
        kind,
        nan,
        sums,
        count,
        band,
        slot,
        fill,
        row0,
        end,
        M,
        D,
        offset,
        chunk,
        cap,
        bits,
        float_bits(euclid._error(D, a.scheme, acc)),
        BLOCK_D=lse._held(D, a.scheme, lse.HELD_NARROW),
        **flags,
        **lse._launch_flags(a, acc),
        **config.launch,
    )
    slot.copy_(slot.sort(dim=1).values)  # (the listed pairs in order: the same bits on every run)
    out_sum = torch.empty(N if forward else 0, dtype=torch.float64, device=dev)
    out_count = torch.empty(N if forward else 0, dtype=torch.int64, device=dev)
    triplet_exact_kernel[(blocks(end - row0, exact_config.kwargs["BLOCK_ROWS"]),)](
        *inputs,
        a.labels,
        b.labels,
        order,
        lo,
        hi,
        tpos,
        nan,
        slot,
        fill,
        sums,
        count,
        out_sum,
        out_count,
        band,
        row0,
        end,
        M,
        D,
        offset,
        slices,
        cap,
        bits,
        BLOCK_P=k["BLOCK_P"],
        **flags,
        **exact_config.launch,
    )
    return (out_sum, out_count) if forward else None


def band_gradient(
    out: Tensor,
    own: euclid._Points,
    other: euclid._Points,
    band: Tensor,
    scale: Tensor,
    anchors_own: bool,
    out0: int,
    acc: torch.dtype,
    config: Config,
) -> None:
    """Adds a band's gradient (band_grad_kernel's tiles, band_pairs_kernel's listed pairs) to
    out's rows [out0, out0 + own.n): the band's anchors' (anchors_own: own is them, other the
    refs) or the other side's (other is the band's anchors)."""
    n, D = own.c.shape
    held = lse._held(D, own.scheme, lse.HELD_NARROW)
    launch = lse._grad_config(config, D, held)
    k = launch.kwargs
    grid = (blocks(n, k["BLOCK_N"]), blocks(D, k["BLOCK_F"]))
    slices, chunk = lse._slices(grid[0] * grid[1], other.n, k["BLOCK_M"])
    cap = euclid._cap(own.scheme, other.n)
    planes = torch.empty(slices, n, D, dtype=acc, device=out.device)
    slot = torch.full((n, cap), ms.NO_COL, dtype=torch.int64, device=out.device)
    fill = torch.zeros(n, dtype=torch.int32, device=out.device)
    stride = band.shape[1]
    band_grad_kernel[(*grid, slices)](
        own.hi,
        own.lo,
        other.hi,
        other.lo,
        own.c,
        own.sq,
        other.sq,
        own.group,
        other.group,
        scale,
        band,
        slot,
        fill,
        planes,
        n,
        other.n,
        stride,
        D,
        chunk,
        cap,
        ANCHORS_OWN=anchors_own,
        BLOCK_D=held,
        **lse._launch_flags(own, acc),
        **launch.launch,
    )
    slot.copy_(slot.sort(dim=1).values)  # (the listed pairs in order: the same bits on every run)
    band_pairs_kernel[(blocks(n, BAND_PAIRS_CONFIG.kwargs["BLOCK_ROWS"]),)](
        own.side.raw,
        other.side.raw,
        own.side.raw.stride(0),
        other.side.raw.stride(0),
        own.side.inv64,
        other.side.inv64,
        scale,
        band,
        slot,
        fill,
        planes,
        out,
        n,
        other.n,
        out0,
        stride,
        D,
        slices,
        cap,
        ANCHORS_OWN=anchors_own,
        ONE_FEATURE=D == 1,
        ACC=acc_tl(acc),
        **BAND_PAIRS_CONFIG.launch,
    )


def compile_cases() -> list[CompileCase]:
    """This engine's kernels for tools/triton_check.py: hard_rows_kernel with the TF32 pair (every
    configuration, without refs), bfloat16 operands ("medium") and float64, rows of D = 128
    held where the scheme holds them; hard_pick_kernel from float32, bfloat16 and float64
    inputs (the first also with D = 1)."""
    ints = dict.fromkeys(("N", "M", "D", "OFFSET", "CHUNK", "CAP", "SLICES", "sa", "sb"), "i32")
    case = functools.partial(CompileCase, divisible=tuple(k for k in ints if k != "SLICES"))
    schemes = (
        ("fp32", "fp32", "fp32", "fp32", lse.TF32X3),
        ("bf16", "bf16", "bf16", "fp32", lse.HALF),
        ("fp64", "fp64", "fp64", "fp64", lse.FP64),
    )
    cases = []
    for name, dtype, operand, acc, how in schemes:
        is64 = acc == "fp64"
        first = name == "fp32"
        types = {
            **ints,
            "ERR_BITS": "i64",
            **{f"{side}_{part}": "*" + operand for side in ("a", "b") for part in ("hi", "lo")},
            **dict.fromkeys(("sq_a_ptr", "sq_b_ptr", "lead_ptr", "key_ptr"), "*" + acc),
            **dict.fromkeys(("lab_ptr", "ref_lab_ptr", "grp_a_ptr", "grp_b_ptr"), "*i32"),
            **dict.fromkeys(("nan_ptr", "eq_ptr", "slot_ptr", "fill_ptr"), "*i32"),
            **dict.fromkeys(("xa_ptr", "xb_ptr"), "*" + dtype),
            **dict.fromkeys(("inv_a_ptr", "inv_b_ptr", "dist_ptr"), "*fp64"),
            "idx_ptr": "*i64",
        }
        held = lse._held(128, how.value, lse.HELD_NARROW)
        flags = dict(ACC=tl.float64 if is64 else tl.float32, IS64=is64, SCHEME=how, INTERPRET=False, BLOCK_D=held)
        for self_ in (True, False):
            every = first and self_
            suffix = f"{name}{' self' if self_ else ''}"
            cases.append(
                case(
                    f"pair_losses.triplets.hard_rows {suffix}",
                    hard_rows_kernel,
                    types,
                    dict(SELF=self_, **flags),
                    ROWS_CONFIGS if every else (lse._default(ROWS_CONFIGS, torch.float64 if is64 else torch.float32),),
                    tensor_cores=not is64,
                )
            )
            for one in (False, True) if every else (False,):
                cases.append(
                    case(
                        f"pair_losses.triplets.hard_pick {suffix}{' one feature' if one else ''}",
                        hard_pick_kernel,
                        types,
                        dict(SELF=self_, ONE_FEATURE=one),
                        EXACT_CONFIGS if every and not one else EXACT_CONFIGS[:1],
                    )
                )
        # mining="all" / "semi_hard"
        types = {
            **types,
            **dict.fromkeys(("ROW0", "MARGIN_BITS"), "i64"),
            "ROW0": "i32",
            **dict.fromkeys(("order_ptr", "lo_ptr", "hi_ptr", "nan_ptr", "count_ptr", "out_count_ptr"), "*i64"),
            **dict.fromkeys(("tpos_ptr", "sums_ptr", "out_sum_ptr"), "*fp64"),
            "thr_ptr": "*" + acc,
            "kind_ptr": "*i8",
            "slot_ptr": "*i64",
            "band_ptr": "*i32",
        }
        for semi in (False, True):
            for band in (False, True):
                for self_ in (True, False) if not band and not semi else (True,):
                    every = first and self_ and not band and not semi
                    mode = f"{'semi_hard' if semi else 'all'}{' band' if band else ''}"
                    suffix = f"{mode} {name}{' self' if self_ else ''}"
                    modes = dict(SELF=self_, SEMI=semi, BAND=band, ONE_FEATURE=False, KEPT=POS_CAP)
                    cases.append(
                        case(
                            f"pair_losses.triplets.rows {suffix}",
                            triplet_rows_kernel,
                            types,
                            {**modes, **flags},
                            ALL_ROWS_CONFIGS
                            if every
                            else (lse._default(ALL_ROWS_CONFIGS, torch.float64 if is64 else torch.float32),),
                            tensor_cores=not is64,
                        )
                    )
                    rows_configs = ALL_ROWS_CONFIGS if every else ALL_ROWS_CONFIGS[:1]
                    cases += [
                        case(
                            f"pair_losses.triplets.exact {suffix} BLOCK_P={p}",
                            triplet_exact_kernel,
                            types,
                            {**modes, "BLOCK_P": p},
                            ALL_EXACT_CONFIGS if every else ALL_EXACT_CONFIGS[:1],
                        )
                        for p in sorted({c.kwargs["BLOCK_P"] for c in rows_configs})
                    ]
        for self_ in (True, False):
            cases.append(
                case(
                    f"pair_losses.triplets.positives {name}{' self' if self_ else ''}",
                    positives_kernel,
                    types,
                    dict(SELF=self_, SEMI=False, ONE_FEATURE=False, KEPT=POS_CAP, ACC=flags["ACC"], IS64=is64),
                    (POSITIVES_CONFIG,),
                )
            )
        # The backward's bands
        band = {
            **types,
            **dict.fromkeys(("N_OWN", "N_OTHER", "BAND_STRIDE", "OUT0"), "i32"),
            **{f"{side}_{part}": "*" + operand for side in ("own", "other") for part in ("hi", "lo")},
            **dict.fromkeys(("c_own_ptr", "sq_own_ptr", "sq_other_ptr", "out_ptr", "planes_ptr"), "*" + acc),
            **dict.fromkeys(("grp_own_ptr", "grp_other_ptr"), "*i32"),
            **dict.fromkeys(("xo_ptr", "xt_ptr"), "*" + dtype),
            **dict.fromkeys(("inv_own_ptr", "inv_other_ptr", "scale_ptr"), "*fp64"),
            **dict.fromkeys(("s_own", "s_other"), "i32"),
        }
        band_case = functools.partial(
            CompileCase, divisible=("N_OWN", "N_OTHER", "BAND_STRIDE", "D", "CHUNK", "CAP", "s_own", "s_other")
        )
        for anchors_own in (True, False):
            suffix = f"{name}{' anchors' if anchors_own else ' refs'}"
            cases.append(
                band_case(
                    f"pair_losses.triplets.band_grad {suffix}",
                    band_grad_kernel,
                    band,
                    dict(ANCHORS_OWN=anchors_own, **flags),
                    tuple(
                        lse._grad_config(c, 128, held)
                        for c in (
                            BAND_GRAD_CONFIGS
                            if first and anchors_own
                            else (lse._default(BAND_GRAD_CONFIGS, torch.float64 if is64 else torch.float32),)
                        )
                    ),
                    tensor_cores=not is64,
                )
            )
            cases.append(
                band_case(
                    f"pair_losses.triplets.band_pairs {suffix}",
                    band_pairs_kernel,
                    band,
                    dict(ANCHORS_OWN=anchors_own, ONE_FEATURE=False, ACC=flags["ACC"]),
                    (BAND_PAIRS_CONFIG,),
                )
            )
    return cases
