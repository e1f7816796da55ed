"""triplet_margin_loss's batch_hard mining on tensor cores under the CUDA precision contract
(docs/ops.md), with the CPU kernel's choices: each anchor's farthest positive and nearest
negative by their exact distances (Points::direct in pair_losses_euclidean_cpu.cpp: float64),
ties to the lower ref row, the first pair at a NaN distance winning, without a float64 value
per pair.

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

The loss and the backward are the package's (__init__.py), from the chosen pairs.
Kernels never index past what the wrapper checked; offsets are int64.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from torchkit.triton import _math as tm
from torchkit.triton._launch import CompileCase, Config, blocks, float_bits, hot
from torchkit.triton.pair_losses import euclid, lse
from torchkit.triton.pair_losses._common import _pair_exact

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

NONE = tl.constexpr(2**31 - 1)  # no column: above every one (the refs are fewer than 2^31)


# --------------------------------------------------------------------------- kernels


@triton.jit
def _bounds(v, e_a, e_b, sq_a, sq_b, IS64: tl.constexpr):
    """The tile's [lo, hi] of each pair's exact squared distance: d² ∓ (e + 4u·d²), with e_a, e_b
    the rows' shares of the tile's error and its roundings (_shares), 4u·d² the roundings of
    d², of lo and hi (one each: fused) and of the exact distance's float64 sum. Unclamped (a
    cancelled d² may be below 0, its interval still holds the exact value); NaN where a norm
    is."""
    if IS64:
        u4 = 2.0**-51
    else:
        u4 = 2.0**-22
    d2 = (sq_a[:, None] + sq_b[None, :]) - 2.0 * v
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
    return cases
