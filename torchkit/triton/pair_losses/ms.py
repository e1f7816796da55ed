"""multi_similarity_loss on tensor cores under the CUDA precision contract
(docs/ops.md), with the CPU kernel's choices: the miner keeps exactly the pairs that the
float64 cosines (exact_cos in pair_losses_cpu.cpp) say it keeps, without a float64 value per
pair. The tiles are the log-sum-exp engine's (lse.py: its operands, slices of the refs and
merge), in the accumulation type; a tile's cosine is within `slack` (_slack: the scheme's
rounding of the operands, the products' sums and the factors) of the exact one, so that a
choice farther than that from its threshold is the exact one's, and only the few pairs nearer
are recomputed, from a per-anchor list:

- EXTREMES (ms_rows_kernel): per anchor, its tiles' largest negative and smallest positive
  cosine (NaN where such a pair's cosine is).
- CANDIDATES: the pairs within two slacks of those (the exact extreme is among them) are
  listed per anchor (slots, CAP per anchor, appended with an atomic count per anchor); a pair
  of equal rows (_equal_rows) is never listed: its exact cosine is its anchor's own
  (_self_cos), which the tile counts at once. ms_exact_kernel (THRESHOLDS) then takes the
  listed pairs' exact cosines: the hardest negative and positive, exactly, as the CPU kernel's.
- TERMS: the pairs the miner keeps, a positive with s − ε below its anchor's hardest negative
  and a negative with s + ε above its hardest positive, decided on the tile's cosine against
  the per-anchor cut t ± ε rounded to the accumulation type, except within the anchor's band
  (the slack and those roundings) of it, where the pair is listed instead; the kept ones'
  log-sums log(1 + Σ e^{α(base − s)}) and log(1 + Σ e^{β(s − base)}) as lse.rows_kernel's
  PROXY mode forms them, per slice. ms_exact_kernel (DECISIONS) decides the listed pairs on
  their exact cosines (in the anchor's sorted list order: the same bits on every run) and
  adds the kept ones' terms as one more slice.
- The batch (ms_terms_kernel, ms_loss_kernel): the slices merged per anchor (lse._merge, in a
  fixed order) into the stats, PML's batch rules over the anchors' partial sums (float64, in
  a fixed order) and the loss and stats written on the device: no torch operation after the
  kernels, no host synchronisation.
- An anchor whose list outgrows CAP (near-duplicate rows that are not equal: adversarial) is
  taken whole by ms_exact_kernel: every pair's exact cosine, its choice and term, in place of
  the tiles' (its slices cleared).
- Backward (ms_grad_kernel): lse.grad_kernel's tiles and products (lse._grad_product), each
  pair's ∂loss/∂c as anchor of either row from the stats (the exact thresholds' cuts, the
  log-sums, the weight), its choices remade on the backward's own tiles against the same cuts;
  a pair within a band of either anchor's cut is left out and listed for its own row, and
  ms_pairs_grad_kernel adds the listed pairs' terms on their exact cosines as one more slice
  (a row whose list outgrows CAP: every pair of it, its slices cleared); lse.jacobian_kernel
  sums the slices in order. No float atomics: the same bits on every run.

Without the miner only TERMS runs (and the backward's tiles), keeping every pair. float64
inputs take float64 tiles (SCHEME FP64) and the same steps.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from torchkit.ops._common import acc_dtype, check_scalars
from torchkit.ops.pair_losses import _check_inputs, _check_loss_backward, _check_own_stats, _check_params, _whole_rows
from torchkit.triton import _math as tm
from torchkit.triton._launch import CompileCase, Config, acc_tl, blocks, float_bits, hot
from torchkit.triton.pair_losses import lse
from torchkit.triton.pair_losses._common import _feature, _own_rows, _self_pairs, _shard, _unit, _zeros

# ms_rows_kernel's passes.
EXTREMES = tl.constexpr(0)
CANDIDATES = tl.constexpr(1)
TERMS = tl.constexpr(2)
# ms_exact_kernel's.
THRESHOLDS = tl.constexpr(0)
DECISIONS = tl.constexpr(1)

NO_COL = 2**62  # an empty slot (sorted last)
EMPTY_SLOT = tl.constexpr(NO_COL)  # (the kernels')

# Launch configurations (every one run by the tests and compiled by tools/triton_check.py; the
# first is the default, the last float64's).
# ms_rows_kernel's: the second the TF32 pair's where its rows are held whole (32 anchors
# against 16 refs at a time: no spills on sm_80 or sm_90, where 64 x 16 spills 88 bytes in
# TERMS and 64 x 32 on eight warps 1.3 KB; 128 x 16 on eight spills none either, but the
# offline model's counted sizes do not split into its tiles, so it is unmeasured).
ROWS_CONFIGS = (
    Config(BLOCK_N=64, BLOCK_M=32, BLOCK_K=16, num_warps=4, num_stages=3),
    Config(BLOCK_N=32, BLOCK_M=16, BLOCK_K=32, num_warps=4, num_stages=3),
    Config(BLOCK_N=32, BLOCK_M=32, BLOCK_K=16, num_warps=4, num_stages=2),
)
# ms_exact_kernel: float64 cosines summed in feature order (as the CPU kernel's), no FMA;
# two blocks of BLOCK_K features loaded at once (_exact); 8 anchors a program (128 programs
# at N = 1,024).
EXACT_CONFIGS = (
    Config(BLOCK_ROWS=8, BLOCK_K=8, num_warps=4, num_stages=2, fp_fusion=False),
    Config(BLOCK_ROWS=4, BLOCK_K=4, num_warps=2, num_stages=2, fp_fusion=False),
)
# ms_grad_kernel: lse.grad_kernel's tiles with more per-anchor numbers (the second spills past
# 512 bytes on sm_80 with bfloat16 rows held: the first is every dtype's default). Each block
# of features recomputes the tile: 128 of them (eight warps hold the accumulator) read half
# the L2 bytes of 64 where the rows are not held (D = 512 in float32).
GRAD_CONFIGS = (
    Config(BLOCK_N=32, BLOCK_M=32, BLOCK_K=32, BLOCK_F=128, num_warps=8, num_stages=3),
    Config(BLOCK_N=64, BLOCK_M=32, BLOCK_K=32, BLOCK_F=64, num_warps=8, num_stages=2),
    Config(BLOCK_N=32, BLOCK_M=32, BLOCK_K=16, BLOCK_F=32, num_warps=4, num_stages=2),  # float64's
)
# ms_pairs_grad_kernel: a program per row (its listed pairs), exact cosines as the others.
PAIRS_CONFIG = Config(BLOCK_K=8, num_warps=4, num_stages=2, fp_fusion=False)


# --------------------------------------------------------------------------- kernels


@triton.jit
def _append(listed, rows, cols, fill_ptr, slot_ptr, CAP):
    """Appends the listed pairs of a tile to their anchors' slots (CAP per anchor) after an
    atomic count per anchor (fill, which may pass CAP: the anchor is then taken whole). The
    slots' order varies between runs; what reads them does not depend on it."""
    hits = listed.to(tl.int16)  # (a tile's row holds at most BLOCK_M)
    n = tl.sum(hits, axis=1).to(tl.int32)
    start = tl.atomic_add(fill_ptr + rows, n, mask=n > 0)
    at = tl.where(n > 0, start, 0)[:, None] + (tl.cumsum(hits, axis=1) - 1).to(tl.int32)
    refs = cols[None, :] + tl.zeros(listed.shape, tl.int64)
    tl.store(slot_ptr + rows[:, None] * CAP + at, refs, mask=listed & (at < CAP))


@triton.jit
def _near(c, pos, neg, cut_n, cut_p, slack, IS64: tl.constexpr):
    """The pairs decided on their exact cosines: within their band of their anchor's cut (the
    tile's slack, the cut's rounding to the accumulation type and e ± ε's in float64: 4u·(|cut|
    + 1); nothing is near an infinite cut)."""
    if IS64:
        u = 2.0**-53
    else:
        u = 2.0**-24
    band_n = tl.where(tl.abs(cut_n) == float("inf"), -1.0, slack + 4 * u * (tl.abs(cut_n) + 1))
    band_p = tl.where(tl.abs(cut_p) == float("inf"), -1.0, slack + 4 * u * (tl.abs(cut_p) + 1))
    return (neg & (tl.abs(c - cut_n) <= band_n)) | (pos & (tl.abs(c - cut_p) <= band_p))


@triton.jit
def _kept(c, pos, neg, same, code, cut_n, cut_p):
    """The miner's choices on the tile's cosines against their anchor's cuts, a pair of equal
    rows (same) by its anchor's choice on their exact cosine (code: 1 keeps a negative, 2 a
    positive); NaN keeps the pair."""
    choice = code.to(tl.int32)
    keep_n = neg & tl.where(same, (choice & 1) != 0, (c > cut_n) | (c != c))
    keep_p = pos & tl.where(same, (choice & 2) != 0, (c < cut_p) | (c != c))
    return keep_n, keep_p


@hot()
@triton.jit
def ms_rows_kernel(
    a_hi,
    a_lo,
    a_f,
    a_bad,
    b_hi,
    b_lo,
    b_f,
    b_bad,
    lab_ptr,
    ref_lab_ptr,
    grp_a_ptr,
    grp_b_ptr,
    row_ptr,
    part_ptr,
    count_ptr,
    slot_ptr,
    fill_ptr,
    N,
    M,
    D,
    OFFSET,
    CHUNK,
    CAP,
    ALPHA_BITS,
    BETA_BITS,
    BASE_BITS,
    SLACK_BITS,
    SELF: tl.constexpr,
    PASS: tl.constexpr,
    MINING: tl.constexpr,
    ACC: tl.constexpr,
    IS64: tl.constexpr,
    SCHEME: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One pass (the module's) for a block of anchors over the refs of slice program_id(1)
    (CHUNK refs from program_id(1)·CHUNK), anchor i being ref OFFSET + i with SELF. Per-anchor
    inputs row[k·N + anchor] (ACC); outputs per slice and anchor at [k, slice, anchor]:
    EXTREMES: part 0, 1 = the largest negative and smallest positive cosine; count 0, 1 =
    whether a negative's, a positive's cosine is NaN.
    CANDIDATES (row 0: the negatives' floor, 1: the positives' ceiling): the pairs past them
    listed but those of equal rows (grp); count 0, 1 = whether an equal row is a negative,
    a positive.
    TERMS (row 0, 1: the negatives' and positives' cuts, 2: the choices on equal rows, as
    _kept takes them; MINING): part 0, 1 = the kept negatives'
    log-sum-exp (m, s) of β(s − base), 3, 4 = the kept positives' of α(base − s), 2 = 0;
    count 0, 1 = the kept negatives and positives; pairs within a band of their cut listed."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    me = rows.to(tl.int32) + OFFSET
    lab = tl.load(lab_ptr + rows, mask=row_mask, other=0)
    f_a = tl.load(a_f + rows, mask=row_mask, other=0.0)
    bad_a = tl.load(a_bad + rows, mask=row_mask, other=0) != 0
    any_bad_a = tl.max(bad_a.to(tl.int32), axis=0) > 0
    if PASS != EXTREMES:
        r0 = tl.load(row_ptr + rows, mask=row_mask, other=0.0)
        r1 = tl.load(row_ptr + N + rows, mask=row_mask, other=0.0)
    if PASS == TERMS:
        code = tl.load(row_ptr + 2 * N + rows, mask=row_mask, other=0.0)
        slack = tm.f64(SLACK_BITS).to(ACC)
        alpha = tm.f64(ALPHA_BITS).to(ACC)
        beta = tm.f64(BETA_BITS).to(ACC)
        base = tm.f64(BASE_BITS).to(ACC)
    if MINING:
        if PASS != EXTREMES:
            grp = tl.load(grp_a_ptr + rows, mask=row_mask, other=-1)
    top = tl.full((BLOCK_N,), float("-inf"), ACC)  # EXTREMES' (and TERMS' m, s of the negatives)
    bottom = tl.full((BLOCK_N,), float("inf"), ACC)
    s_n = tl.zeros((BLOCK_N,), ACC)
    nan_n = tl.zeros((BLOCK_N,), tl.int1)
    m_p = tl.full((BLOCK_N,), float("-inf"), ACC)
    s_p = tl.zeros((BLOCK_N,), ACC)
    nan_p = tl.zeros((BLOCK_N,), tl.int1)
    c0 = tl.zeros((BLOCK_N,), tl.int32)
    c1 = tl.zeros((BLOCK_N,), tl.int32)
    if BLOCK_D > 0:  # the anchors' whole rows, held across the refs (BLOCK_D >= D)
        ks = tl.arange(0, BLOCK_D)
        ah, al = lse._load(a_hi, a_lo, rows, ks, row_mask[:, None] & (ks < D)[None, :], D, SCHEME, INTERPRET)
    first = tl.program_id(1).to(tl.int64) * CHUNK
    last = tl.minimum(first + CHUNK, M)
    for j0 in range(first, last, BLOCK_M):
        cols = j0 + tl.arange(0, BLOCK_M).to(tl.int64)
        col_mask = cols < last
        ref_lab = tl.load(ref_lab_ptr + cols, mask=col_mask, other=-1)
        f_b, bad_b, bh, bl = lse._refs(b_hi, b_lo, b_f, b_bad, cols, col_mask, D, SCHEME, INTERPRET, BLOCK_D)
        if MINING:
            if PASS != EXTREMES:
                grp_b = tl.load(grp_b_ptr + cols, mask=col_mask, other=-2)
        if BLOCK_D > 0:
            c = lse._held_cosines(ah, al, bh, bl, f_a, f_b, ACC, SCHEME)
        else:
            c = lse._cosines(
                a_hi, a_lo, b_hi, b_lo, f_a, f_b, rows, cols, row_mask, col_mask, D, ACC, SCHEME, INTERPRET, BLOCK_K
            )
        if any_bad_a | (tl.max(bad_b.to(tl.int32), axis=0) > 0):
            c = lse._poison(c, bad_a, bad_b != 0)
        # (the masks formed after the product: fewer registers live across it)
        valid = row_mask[:, None] & col_mask[None, :]
        if SELF:
            valid = valid & (me[:, None] != cols.to(tl.int32)[None, :])
        if MINING:
            if PASS != EXTREMES:
                same = grp[:, None] == grp_b[None, :]
        pos = valid & (lab[:, None] == ref_lab[None, :])
        neg = valid & (lab[:, None] != ref_lab[None, :])
        if PASS == EXTREMES:
            top = tl.maximum(top, tl.max(tl.where(neg & (c == c), c, float("-inf")), axis=1))
            bottom = tl.minimum(bottom, tl.min(tl.where(pos & (c == c), c, float("inf")), axis=1))
            c0 = c0 | tl.max((neg & (c != c)).to(tl.int32), axis=1)
            c1 = c1 | tl.max((pos & (c != c)).to(tl.int32), axis=1)
        elif PASS == CANDIDATES:
            c0 = c0 | tl.max((neg & same).to(tl.int32), axis=1)
            c1 = c1 | tl.max((pos & same).to(tl.int32), axis=1)
            listed = ((neg & (c >= r0[:, None])) | (pos & (c <= r1[:, None]))) & (same == 0)
            if lse._any(listed):
                _append(listed, rows, cols, fill_ptr, slot_ptr, CAP)
        else:
            keep_n = neg
            keep_p = pos
            if MINING:
                # Far from its cut the tile's cosine decides; within its band the pair is listed;
                # a pair of equal rows is decided per anchor; NaN keeps the pair.
                near = _near(c, pos, neg, r0[:, None], r1[:, None], slack, IS64) & (same == 0)
                if lse._any(near):
                    _append(near, rows, cols, fill_ptr, slot_ptr, CAP)
                keep_n, keep_p = _kept(c, pos, neg, same, code[:, None], r0[:, None], r1[:, None])
                keep_n = keep_n & (near == 0)
                keep_p = keep_p & (near == 0)
            # β(s − base) and α(base − s) as the CPU kernel forms them: an α or β past the
            # accumulation type's range makes them ±∞ by their sign, a zero difference 0.
            d = c - base
            y = tl.where(d == 0, 0.0, d * beta)
            top, s_n, nan_n = lse._fold(top, s_n, nan_n, y, keep_n, False)
            c0 += tl.sum(keep_n.to(tl.int32), axis=1)
            if lse._any(keep_p):
                z = tl.where(d == 0, 0.0, (base - c) * alpha)
                m_p, s_p, nan_p = lse._fold(m_p, s_p, nan_p, z, keep_p, False)
                c1 += tl.sum(keep_p.to(tl.int32), axis=1)
    at = tl.program_id(1).to(tl.int64) * N + rows
    plane = tl.num_programs(1).to(tl.int64) * N
    if PASS == EXTREMES:
        tl.store(part_ptr + at, top, mask=row_mask)
        tl.store(part_ptr + plane + at, bottom, mask=row_mask)
    if PASS == TERMS:
        # (plane: the partials' and counts' slices are those of the launch and one more)
        plane = plane + N
        tl.store(part_ptr + at, top, mask=row_mask)
        tl.store(part_ptr + plane + at, tl.where(nan_n, float("nan"), s_n), mask=row_mask)
        tl.store(part_ptr + 2 * plane + at, tl.zeros((BLOCK_N,), ACC), mask=row_mask)
        tl.store(part_ptr + 3 * plane + at, m_p, mask=row_mask)
        tl.store(part_ptr + 4 * plane + at, tl.where(nan_p, float("nan"), s_p), mask=row_mask)
    tl.store(count_ptr + at, c0, mask=row_mask)
    tl.store(count_ptr + plane + at, c1, mask=row_mask)


@triton.jit
def _exact_loads(xa_ptr, xb_ptr, sa, sb, rows, row_mask, cols, mask, k0, ks, D):
    """Features k0 + ks of the anchors `rows` and of their refs `cols` (2-D, per anchor): loads
    only, for _exact_sum."""
    k_mask = k0 + ks < D
    xa = tl.load(xa_ptr + rows[:, None] * sa + (k0 + ks)[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
    xb = tl.load(
        xb_ptr + cols[:, :, None] * sb + (k0 + ks)[None, None, :],
        mask=mask[:, :, None] & k_mask[None, None, :],
        other=0.0,
    )
    return xa, xb


@triton.jit
def _exact_sum(out, xa, xb, inv_a, inv_b, k0, ks, D, ONE_FEATURE: tl.constexpr, BLOCK_K: tl.constexpr):
    """out plus the products of _exact_loads' features, normalised, one after another
    (_feature)."""
    for kk in tl.static_range(BLOCK_K):
        a = _feature(xa, ks, kk)
        b = tl.sum(tl.where(ks[None, None, :] == kk, xb, -0.0), axis=2)  # (_feature's, in 3-D)
        a = _unit(a.to(tl.float64), inv_a, ONE_FEATURE)
        b = _unit(b.to(tl.float64), inv_b, ONE_FEATURE)
        out = tl.where(k0 + kk < D, out + a[:, None] * b, out)
    return out


@triton.jit
def _exact(
    xa_ptr,
    xb_ptr,
    sa,
    sb,
    inv_a,
    inv_b_ptr,
    rows,
    row_mask,
    cols,
    mask,
    D,
    ONE_FEATURE: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The exact cosines of anchors `rows` with refs `cols` (2-D, per anchor), as the CPU
    kernel's exact_cos: Σ_k (x_ik·inv_i)(y_jk·inv_j) in float64, in feature order. The
    features come two blocks of BLOCK_K at a time, loaded together (one round trip to memory,
    not one per feature), and are summed one after another (_exact_sum)."""
    inv_b = tl.load(inv_b_ptr + cols, mask=mask, other=0.0)
    out = tl.zeros(cols.shape, tl.float64)
    ks = tl.arange(0, BLOCK_K)
    for k0 in range(0, D, 2 * BLOCK_K):
        xa0, xb0 = _exact_loads(xa_ptr, xb_ptr, sa, sb, rows, row_mask, cols, mask, k0, ks, D)
        xa1, xb1 = _exact_loads(xa_ptr, xb_ptr, sa, sb, rows, row_mask, cols, mask, k0 + BLOCK_K, ks, D)
        out = _exact_sum(out, xa0, xb0, inv_a, inv_b, k0, ks, D, ONE_FEATURE, BLOCK_K)
        out = _exact_sum(out, xa1, xb1, inv_a, inv_b, k0 + BLOCK_K, ks, D, ONE_FEATURE, BLOCK_K)
    return out


@triton.jit
def _decide(e, pos, neg, hn, hp, eps):
    """The miner's choices on exact cosines e (MultiSimilarity::mined): a positive with
    e − ε < its anchor's hardest negative hn, a negative with e + ε > its hardest positive hp
    (broadcast as e); NaN keeps the pair."""
    keep_p = pos & (((e - eps) < hn) | (e != e) | (hn != hn))
    keep_n = neg & (((e + eps) > hp) | (e != e) | (hp != hp))
    return keep_n, keep_p


@triton.jit
def ms_exact_kernel(
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
    st_ptr,
    part_ptr,
    count_ptr,
    N,
    M,
    D,
    OFFSET,
    SLICES,
    ALPHA_BITS,
    BETA_BITS,
    BASE_BITS,
    EPS_BITS,
    SELF: tl.constexpr,
    PASS: tl.constexpr,
    ONE_FEATURE: tl.constexpr,
    ACC: tl.constexpr,
    CAP: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The listed pairs of a block of anchors on their exact cosines (an anchor whose list
    outgrew CAP: every pair of it, a CAP at a time), st: the stats (N, 5) float64.
    THRESHOLDS (st[:, 0:2]: the tiles' extremes' verdict, −∞/+∞ for none, NaN; st[:, 2:4]:
    the cosines of equal rows to count, −∞/+∞ for none): st[:, 0:2] = the hardest negative and
    positive, exact.
    DECISIONS: the kept pairs' terms folded into the partials' last slice (SLICES) and
    counted, the anchor's other slices cleared where it is taken whole."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < N
    lab = tl.load(lab_ptr + rows, mask=row_mask, other=0)
    inv_a = tl.load(inv_a_ptr + rows, mask=row_mask, other=0.0)
    fill = tl.load(fill_ptr + rows, mask=row_mask, other=0)
    whole = row_mask & (fill > CAP)
    slots = tl.arange(0, CAP)
    hn = tl.load(st_ptr + rows * 5, mask=row_mask, other=0.0)
    hp = tl.load(st_ptr + rows * 5 + 1, mask=row_mask, other=0.0)
    if PASS == THRESHOLDS:
        top = tl.load(st_ptr + rows * 5 + 2, mask=row_mask, other=float("-inf"))
        bottom = tl.load(st_ptr + rows * 5 + 3, mask=row_mask, other=float("inf"))
    else:
        alpha = tm.f64(ALPHA_BITS).to(ACC)
        beta = tm.f64(BETA_BITS).to(ACC)
        base = tm.f64(BASE_BITS).to(ACC)
        eps = tm.f64(EPS_BITS)
        m_n = tl.full((BLOCK_ROWS,), float("-inf"), ACC)
        s_n = tl.zeros((BLOCK_ROWS,), ACC)
        nan_n = tl.zeros((BLOCK_ROWS,), tl.int1)
        m_p = tl.full((BLOCK_ROWS,), float("-inf"), ACC)
        s_p = tl.zeros((BLOCK_ROWS,), ACC)
        nan_p = tl.zeros((BLOCK_ROWS,), tl.int1)
        n_n = tl.zeros((BLOCK_ROWS,), tl.int32)
        n_p = tl.zeros((BLOCK_ROWS,), tl.int32)
    # The listed pairs first (one round: j0 = −1), then, for the anchors taken whole, every ref.
    any_whole = tl.max(whole.to(tl.int32), axis=0) > 0
    end = tl.where(any_whole, M, 0)
    for j0 in range(-CAP, end, CAP):
        if j0 < 0:
            listed = (slots[None, :] < fill[:, None]) & (whole == 0)[:, None] & row_mask[:, None]
            cols = tl.load(slot_ptr + rows[:, None] * CAP + slots[None, :], mask=listed, other=0)
            mask = listed
        else:
            cols = j0 + slots[None, :].to(tl.int64) + tl.zeros((BLOCK_ROWS, CAP), tl.int64)
            mask = whole[:, None] & (cols < M)
        if SELF:
            mask = mask & (cols != (rows + OFFSET)[:, None])
        if tl.max(tl.max(mask.to(tl.int32), axis=1), axis=0) > 0:
            e = _exact(xa_ptr, xb_ptr, sa, sb, inv_a, inv_b_ptr, rows, row_mask, cols, mask, D, ONE_FEATURE, BLOCK_K)
            ref_lab = tl.load(ref_lab_ptr + cols, mask=mask, other=0)
            pos = mask & (ref_lab == lab[:, None])
            neg = mask & (ref_lab != lab[:, None])
            if PASS == THRESHOLDS:
                # (an anchor with a NaN pair has its NaN threshold already)
                top = tl.maximum(top, tl.max(tl.where(neg, e, float("-inf")), axis=1))
                bottom = tl.minimum(bottom, tl.min(tl.where(pos, e, float("inf")), axis=1))
            else:
                keep_n, keep_p = _decide(e, pos, neg, hn[:, None], hp[:, None], eps)
                x = e.to(ACC)
                d = x - base
                y = tl.where(d == 0, 0.0, d * beta)
                m_n, s_n, nan_n = lse._fold(m_n, s_n, nan_n, y, keep_n, False)
                z = tl.where(d == 0, 0.0, (base - x) * alpha)
                m_p, s_p, nan_p = lse._fold(m_p, s_p, nan_p, z, keep_p, False)
                n_n += tl.sum(keep_n.to(tl.int32), axis=1)
                n_p += tl.sum(keep_p.to(tl.int32), axis=1)
    if PASS == THRESHOLDS:
        # The tiles' verdict: NaN (a NaN candidate), or none of the kind, stands.
        done_n = (hn != hn) | (hn == float("-inf"))
        done_p = (hp != hp) | (hp == float("inf"))
        tl.store(st_ptr + rows * 5, tl.where(done_n, hn, top), mask=row_mask)
        tl.store(st_ptr + rows * 5 + 1, tl.where(done_p, hp, bottom), mask=row_mask)
    else:
        plane = (SLICES + 1 + tl.zeros((), tl.int64)) * N
        if any_whole:  # (their tiles' partials cleared: every pair of theirs is here)
            for k in range(0, SLICES):
                at = k * N + rows
                tl.store(part_ptr + at, float("-inf"), mask=whole)
                tl.store(part_ptr + plane + at, 0.0, mask=whole)
                tl.store(part_ptr + 3 * plane + at, float("-inf"), mask=whole)
                tl.store(part_ptr + 4 * plane + at, 0.0, mask=whole)
                tl.store(count_ptr + at, 0, mask=whole)
                tl.store(count_ptr + plane + at, 0, mask=whole)
        at = SLICES * N + rows
        tl.store(part_ptr + at, m_n, mask=row_mask)
        tl.store(part_ptr + plane + at, tl.where(nan_n, float("nan"), s_n), mask=row_mask)
        tl.store(part_ptr + 2 * plane + at, tl.zeros((BLOCK_ROWS,), ACC), mask=row_mask)
        tl.store(part_ptr + 3 * plane + at, m_p, mask=row_mask)
        tl.store(part_ptr + 4 * plane + at, tl.where(nan_p, float("nan"), s_p), mask=row_mask)
        tl.store(count_ptr + at, n_n, mask=row_mask)
        tl.store(count_ptr + plane + at, n_p, mask=row_mask)


# --------------------------------------------------------------------------- the miner's steps, the batch


@triton.jit
def ms_bounds_kernel(
    part_ptr,
    count_ptr,
    row_ptr,
    st_ptr,
    N,
    SLICES,
    NEAR_BITS,
    ACC: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """After EXTREMES, per anchor from its SLICES slices (planes of extremes and NaN flags): the
    bounds CANDIDATES lists the pairs within (row[0]: the floor a negative's tile cosine must
    reach, top − NEAR; row[1]: the ceiling a positive's must stay under, bottom + NEAR; none
    where a NaN pair or no pair of the kind is), and the thresholds' stats where no exact
    cosine decides them (NaN, or ∓∞ without a pair of the kind; 0 where ms_exact_kernel
    will)."""
    near = tm.f64(NEAR_BITS)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < N
    slices = tl.arange(0, BLOCK_S).to(tl.int64)
    plane = (SLICES + tl.zeros((), tl.int64)) * N
    at = slices[:, None] * N + rows[None, :]
    mask = (slices < SLICES)[:, None] & row_mask[None, :]
    top = tl.max(tl.load(part_ptr + at, mask=mask, other=float("-inf")), axis=0)
    bottom = tl.min(tl.load(part_ptr + plane + at, mask=mask, other=float("inf")), axis=0)
    nan_n = tl.max(tl.load(count_ptr + at, mask=mask, other=0), axis=0) > 0
    nan_p = tl.max(tl.load(count_ptr + plane + at, mask=mask, other=0), axis=0) > 0
    none_n = top == float("-inf")
    none_p = bottom == float("inf")
    floor = tl.where(nan_n | none_n, float("inf"), top.to(tl.float64) - near)
    ceiling = tl.where(nan_p | none_p, float("-inf"), bottom.to(tl.float64) + near)
    tl.store(row_ptr + rows, floor.to(ACC), mask=row_mask)
    tl.store(row_ptr + N + rows, ceiling.to(ACC), mask=row_mask)
    hn = tl.where(nan_n, float("nan"), tl.where(none_n, float("-inf"), 0.0))
    hp = tl.where(nan_p, float("nan"), tl.where(none_p, float("inf"), 0.0))
    tl.store(st_ptr + 5 * rows, hn.to(tl.float64), mask=row_mask)
    tl.store(st_ptr + 5 * rows + 1, hp.to(tl.float64), mask=row_mask)


@triton.jit
def ms_same_kernel(count_ptr, cos_ptr, st_ptr, N, SLICES, BLOCK_ROWS: tl.constexpr, BLOCK_S: tl.constexpr):
    """After CANDIDATES, per anchor: where a slice flagged a negative (count plane 0) or a
    positive (plane 1) among its equal rows, that pair's exact cosine (the anchor's own, cos)
    as the start of ms_exact_kernel's hardest negative (stats column 2, else −∞) and positive
    (column 3, else +∞)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < N
    slices = tl.arange(0, BLOCK_S).to(tl.int64)
    plane = (SLICES + tl.zeros((), tl.int64)) * N
    at = slices[:, None] * N + rows[None, :]
    mask = (slices < SLICES)[:, None] & row_mask[None, :]
    same_n = tl.max(tl.load(count_ptr + at, mask=mask, other=0), axis=0) > 0
    same_p = tl.max(tl.load(count_ptr + plane + at, mask=mask, other=0), axis=0) > 0
    cos = tl.load(cos_ptr + rows, mask=row_mask, other=0.0)
    tl.store(st_ptr + 5 * rows + 2, tl.where(same_n, cos, float("-inf")), mask=row_mask)
    tl.store(st_ptr + 5 * rows + 3, tl.where(same_p, cos, float("inf")), mask=row_mask)


@triton.jit
def ms_planes_kernel(
    st_ptr,
    cos_ptr,
    out_ptr,
    fill_ptr,
    slot_ptr,
    N,
    CAP,
    EPS_BITS,
    MINING: tl.constexpr,
    BACKWARD: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Per anchor, from its stats (hn, hp, Lp, Ln, w: the exact thresholds after THRESHOLDS)
    and cos (its exact cosine with itself), the planes the tiles take (out[k·N + i], ACC): the
    backward's W, LN and LP first (BACKWARD); then, with the miner, the cut a negative's tile
    cosine must pass (hp − ε) and a positive's stay below (hn + ε), a NaN threshold keeping
    every pair (a pair within _near's band of its cut is decided on its exact cosine instead),
    and the choices on a pair of equal rows (1 keeps a negative, 2 a positive, as _kept reads
    them). The forward's TERMS (not BACKWARD) also finds each list emptied (fill 0, every slot
    NO_COL)."""
    eps = tm.f64(EPS_BITS)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < N
    first = 0
    if BACKWARD:
        for k in range(0, 3):  # (w, Ln, Lp: the stats' columns 4, 3, 2)
            value = tl.load(st_ptr + 5 * rows + 4 - k, mask=row_mask, other=0.0)
            tl.store(out_ptr + k * N + rows, value.to(ACC), mask=row_mask)
        first = 3
    if MINING:
        hn = tl.load(st_ptr + 5 * rows, mask=row_mask, other=0.0)
        hp = tl.load(st_ptr + 5 * rows + 1, mask=row_mask, other=0.0)
        cos = tl.load(cos_ptr + rows, mask=row_mask, other=0.0)
        cut_n = tl.where(hp != hp, float("-inf"), hp - eps)
        cut_p = tl.where(hn != hn, float("inf"), hn + eps)
        same_n = ((cos + eps) > hp) | (hp != hp) | (cos != cos)
        same_p = ((cos - eps) < hn) | (hn != hn) | (cos != cos)
        code = same_n.to(tl.float64) + 2.0 * same_p.to(tl.float64)
        tl.store(out_ptr + first * N + rows, cut_n.to(ACC), mask=row_mask)
        tl.store(out_ptr + (first + 1) * N + rows, cut_p.to(ACC), mask=row_mask)
        tl.store(out_ptr + (first + 2) * N + rows, code.to(ACC), mask=row_mask)
    if not BACKWARD:
        tl.store(fill_ptr + rows, tl.zeros((BLOCK_ROWS,), tl.int32), mask=row_mask)
        for c0 in range(0, CAP, BLOCK_C):
            cs = c0 + tl.arange(0, BLOCK_C)
            empty = tl.full((BLOCK_ROWS, BLOCK_C), EMPTY_SLOT, tl.int64)
            tl.store(slot_ptr + rows[:, None] * CAP + cs[None, :], empty, mask=row_mask[:, None] & (cs < CAP)[None, :])


@triton.jit
def ms_terms_kernel(
    part_ptr,
    count_ptr,
    npos_ptr,
    st_ptr,
    partial_ptr,
    N,
    SLICES,
    ALPHA_BITS,
    BETA_BITS,
    MINING: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Per block of anchors: the slices' log-sums merged (lse._merge, in a fixed order) into
    the stats' Lp = log(1 + Σ positives) and Ln = log(1 + Σ negatives) (and, without the
    miner, its thresholds: −∞ and +∞), and the batch's partial sums partial[k, block] in
    float64 (k: the terms Lp/α + Ln/β, the kept negative and positive pairs, the positive
    pairs), for ms_loss_kernel."""
    alpha = tm.f64(ALPHA_BITS)
    beta = tm.f64(BETA_BITS)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < N
    slices = tl.arange(0, BLOCK_S).to(tl.int64)
    plane = (SLICES + tl.zeros((), tl.int64)) * N
    at = slices[:, None] * N + rows[None, :]
    mask = (slices < SLICES)[:, None] & row_mask[None, :]
    ln = lse._merge(part_ptr, 0, at, mask, plane, True, ACC).to(tl.float64)
    lp = lse._merge(part_ptr, 3, at, mask, plane, True, ACC).to(tl.float64)
    kept_n = tl.sum(tl.load(count_ptr + at, mask=mask, other=0), axis=0)
    kept_p = tl.sum(tl.load(count_ptr + plane + at, mask=mask, other=0), axis=0)
    if not MINING:
        tl.store(st_ptr + 5 * rows, tl.full((BLOCK_ROWS,), float("-inf"), tl.float64), mask=row_mask)
        tl.store(st_ptr + 5 * rows + 1, tl.full((BLOCK_ROWS,), float("inf"), tl.float64), mask=row_mask)
    tl.store(st_ptr + 5 * rows + 2, lp, mask=row_mask)
    tl.store(st_ptr + 5 * rows + 3, ln, mask=row_mask)
    npos = tl.load(npos_ptr + rows, mask=row_mask, other=0)
    blocks = tl.num_programs(0).to(tl.int64)
    out = partial_ptr + tl.program_id(0)
    tl.store(out, tl.sum(tl.where(row_mask, lp / alpha + ln / beta, 0.0), axis=0))
    tl.store(out + blocks, tl.sum(kept_n.to(tl.int64), axis=0).to(tl.float64))
    tl.store(out + 2 * blocks, tl.sum(kept_p.to(tl.int64), axis=0).to(tl.float64))
    tl.store(out + 3 * blocks, tl.sum(npos.to(tl.int64), axis=0).to(tl.float64))


@triton.jit
def ms_loss_kernel(
    partial_ptr,
    st_ptr,
    result_ptr,
    N,
    M,
    BLOCKS,
    PAIRS,
    SHARD: tl.constexpr,
    MINING: tl.constexpr,
    WIDE: tl.constexpr,
    BF16: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    """PML's batch rules (ms_forward in pair_losses_cpu.cpp) over ms_terms_kernel's partials
    (BLOCKS of them, summed in a fixed order by every program: the same bits everywhere and on
    every run; PAIRS: the batch's pairs): with the miner, nothing without a negative or a
    positive pair in the batch; nothing when each kind keeps at most one pair (a shard's
    caller applies that rule to the whole problem's parts). Per block of anchors their stats
    (all 0 where the rules make the loss 0; the weight 1/N), and from the first program the
    result: the loss in its dtype (as PyTorch casts it: lse._to_output), or a shard's parts in
    float64 (csrc/pair_losses.h)."""
    chunk = tl.arange(0, BLOCK_ROWS)
    terms = tl.zeros((BLOCK_ROWS,), tl.float64)
    kept_n = tl.zeros((BLOCK_ROWS,), tl.float64)
    kept_p = tl.zeros((BLOCK_ROWS,), tl.float64)
    positives = tl.zeros((BLOCK_ROWS,), tl.float64)
    for b0 in range(0, BLOCKS, BLOCK_ROWS):
        at = b0 + chunk
        mask = at < BLOCKS
        terms += tl.load(partial_ptr + at, mask=mask, other=0.0)
        kept_n += tl.load(partial_ptr + BLOCKS + at, mask=mask, other=0.0)
        kept_p += tl.load(partial_ptr + 2 * BLOCKS + at, mask=mask, other=0.0)
        positives += tl.load(partial_ptr + 3 * BLOCKS + at, mask=mask, other=0.0)
    terms = tl.sum(terms, axis=0)
    kept_n = tl.sum(kept_n, axis=0)
    kept_p = tl.sum(kept_p, axis=0)
    positives = tl.sum(positives, axis=0)
    if SHARD:
        use = (N > 0) & (M > 0)
    else:
        use = (kept_n > 1) | (kept_p > 1)
    if MINING:
        use = use & (PAIRS.to(tl.float64) - positives > 0) & (positives > 0)
    w = 1.0 / tl.maximum(N, 1).to(tl.float64)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + chunk
    row_mask = rows < N
    for k in range(0, 4):
        st = tl.load(st_ptr + 5 * rows + k, mask=row_mask, other=0.0)
        tl.store(st_ptr + 5 * rows + k, tl.where(use, st, 0.0), mask=row_mask)
    tl.store(st_ptr + 5 * rows + 4, tl.where(use, w, 0.0) + tl.zeros((BLOCK_ROWS,), tl.float64), mask=row_mask)
    if tl.program_id(0) == 0:
        if SHARD:  # (the terms, the anchors, the kept negative and positive pairs)
            tl.store(result_ptr, tl.where(use, terms, 0.0))
            tl.store(result_ptr + 1, N.to(tl.float64))
            tl.store(result_ptr + 2, tl.where(use, kept_n, 0.0))
            tl.store(result_ptr + 3, tl.where(use, kept_p, 0.0))
        else:
            tl.store(result_ptr, lse._to_output(tl.where(use, terms * w, 0.0), WIDE, BF16))


# --------------------------------------------------------------------------- backward

# The per-anchor planes of the backward (anchor[k·anchors + i], ACC): the terms' weight and
# log-sums, then the cuts' three (ms_planes_kernel's).
W, LN, LP, CUT_N, CUT_P, SAME = (tl.constexpr(k) for k in range(6))


@triton.jit
def _anchor(anchor_ptr, k, at, mask, n):
    return tl.load(anchor_ptr + k * n + at, mask=mask, other=0.0)


@triton.jit
def _ms_terms(c, d, pos, neg, same, w, ln, lp, cut_n, cut_p, code, alpha, beta, MINING: tl.constexpr):
    """∂loss/∂c of one anchor's pairs (its numbers broadcast along the anchor's axis), as
    MultiSimilarityTerms (pair_losses_cpu.cpp): w·e^{β(c − base) − Ln} for a kept negative,
    −w·e^{α(base − c) − Lp} for a kept positive (d = c − base; its products with α and β
    formed as the forward's), the miner's choices by _kept; 0 for an anchor of weight 0
    (PML's batch rules: a loss of 0)."""
    keep_n = neg
    keep_p = pos
    if MINING:
        keep_n, keep_p = _kept(c, pos, neg, same, code, cut_n, cut_p)
    y = tl.where(d == 0, 0.0, d * beta)
    z = tl.where(d == 0, 0.0, (0.0 - d) * alpha)
    g = tl.where(keep_n, w * lse._exp(y - ln), 0.0) - tl.where(keep_p, w * lse._exp(z - lp), 0.0)
    return tl.where(w != 0, g, 0.0)


@hot()
@triton.jit
def ms_grad_kernel(
    own_hi,
    own_lo,
    own_f,
    own_bad,
    other_hi,
    other_lo,
    other_f,
    other_bad,
    own_lab_ptr,
    other_lab_ptr,
    grp_own_ptr,
    grp_other_ptr,
    anchor_ptr,
    slot_ptr,
    fill_ptr,
    out_ptr,
    N_OWN,
    N_OTHER,
    ANCHORS,
    D,
    OFFSET,
    CHUNK,
    CAP,
    ALPHA_BITS,
    BETA_BITS,
    BASE_BITS,
    G_SCALE_BITS,
    SLACK_BITS,
    SELF: tl.constexpr,
    ANCHORS_OWN: tl.constexpr,
    ANCHORS_OTHER: tl.constexpr,
    MINING: tl.constexpr,
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
    """lse.grad_kernel's for multi-similarity: out[slice, own rows, feature block] = Σ over
    the other rows of the slice of ∂loss/∂c · their normalised rows, the pairs' terms as
    anchors of the own rows (ANCHORS_OWN; anchor OFFSET + i) and of the other rows
    (ANCHORS_OTHER; anchor j) by _ms_terms, from the per-anchor planes (ANCHORS of them).
    A pair within a band of either anchor's cut (but of equal rows) is left out and listed
    for its own row (slots, fill: as the forward's): ms_pairs_grad_kernel adds its terms."""
    alpha = tm.f64(ALPHA_BITS).to(ACC)
    beta = tm.f64(BETA_BITS).to(ACC)
    base = tm.f64(BASE_BITS).to(ACC)
    g_scale = tm.f64(G_SCALE_BITS).to(ACC)
    slack = tm.f64(SLACK_BITS).to(ACC)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    fs = tl.program_id(1).to(tl.int64) * BLOCK_F + tl.arange(0, BLOCK_F)
    row_mask = rows < N_OWN
    f_mask = fs < D
    me = rows.to(tl.int32) + OFFSET
    lab = tl.load(own_lab_ptr + rows, mask=row_mask, other=0)
    f_a = tl.load(own_f + rows, mask=row_mask, other=0.0)
    bad_a = tl.load(own_bad + rows, mask=row_mask, other=0) != 0
    any_bad_a = tl.max(bad_a.to(tl.int32), axis=0) > 0
    if MINING:
        grp = tl.load(grp_own_ptr + rows, mask=row_mask, other=-1)
    if ANCHORS_OWN:
        at = OFFSET + rows
        wi = _anchor(anchor_ptr, W, at, row_mask, ANCHORS)
        lni = _anchor(anchor_ptr, LN, at, row_mask, ANCHORS)
        lpi = _anchor(anchor_ptr, LP, at, row_mask, ANCHORS)
        if MINING:
            cni = _anchor(anchor_ptr, CUT_N, at, row_mask, ANCHORS)
            cpi = _anchor(anchor_ptr, CUT_P, at, row_mask, ANCHORS)
            sni = _anchor(anchor_ptr, SAME, at, row_mask, ANCHORS)
        else:
            cni, cpi, sni = wi, wi, wi
    acc = tl.zeros((BLOCK_N, BLOCK_F), ACC)
    if BLOCK_D > 0:  # the own rows whole, held across the other rows (BLOCK_D >= D)
        tl.static_assert(BLOCK_F == BLOCK_D, "held rows are one feature block")
        ks = tl.arange(0, BLOCK_D)
        ah, al = lse._load(own_hi, own_lo, rows, ks, row_mask[:, None] & (ks < D)[None, :], D, SCHEME, INTERPRET)
    first = tl.program_id(2).to(tl.int64) * CHUNK
    last = tl.minimum(first + CHUNK, N_OTHER)
    for j0 in range(first, last, BLOCK_M):
        cols = j0 + tl.arange(0, BLOCK_M).to(tl.int64)
        col_mask = cols < last
        if ANCHORS_OTHER:
            wj = _anchor(anchor_ptr, W, cols, col_mask, ANCHORS)
            lnj = _anchor(anchor_ptr, LN, cols, col_mask, ANCHORS)
            lpj = _anchor(anchor_ptr, LP, cols, col_mask, ANCHORS)
            if MINING:
                cnj = _anchor(anchor_ptr, CUT_N, cols, col_mask, ANCHORS)
                cpj = _anchor(anchor_ptr, CUT_P, cols, col_mask, ANCHORS)
                snj = _anchor(anchor_ptr, SAME, cols, col_mask, ANCHORS)
            else:
                cnj, cpj, snj = wj, wj, wj
        other_lab = tl.load(other_lab_ptr + cols, mask=col_mask, other=-1)
        if MINING:
            grp_b = tl.load(grp_other_ptr + cols, mask=col_mask, other=-2)
        f_b, bad_b, bh, bl = lse._refs(
            other_hi, other_lo, other_f, other_bad, cols, col_mask, D, SCHEME, INTERPRET, BLOCK_D
        )
        if BLOCK_D > 0:
            c = lse._held_cosines(ah, al, bh, bl, f_a, f_b, ACC, SCHEME)
        else:
            c = lse._cosines(
                own_hi,
                own_lo,
                other_hi,
                other_lo,
                f_a,
                f_b,
                rows,
                cols,
                row_mask,
                col_mask,
                D,
                ACC,
                SCHEME,
                INTERPRET,
                BLOCK_K,
            )
        if any_bad_a | (tl.max(bad_b.to(tl.int32), axis=0) > 0):
            c = lse._poison(c, bad_a, bad_b != 0)
        valid = row_mask[:, None] & col_mask[None, :]
        if SELF:
            valid = valid & (me[:, None] != cols.to(tl.int32)[None, :])
        same_lab = lab[:, None] == other_lab[None, :]
        pos = valid & same_lab
        neg = valid & (same_lab == 0)
        same = pos & False
        if MINING:
            same = grp[:, None] == grp_b[None, :]
        d = c - base
        g = tl.zeros(c.shape, ACC)
        near = pos & False
        if ANCHORS_OWN:
            g += _ms_terms(
                c, d, pos, neg, same, wi[:, None], lni[:, None], lpi[:, None], cni[:, None], cpi[:, None],
                sni[:, None], alpha, beta, MINING,
            )  # fmt: skip
            if MINING:
                near = near | _near(c, pos, neg, cni[:, None], cpi[:, None], slack, IS64)
        if ANCHORS_OTHER:
            g += _ms_terms(
                c, d, pos, neg, same, wj[None, :], lnj[None, :], lpj[None, :], cnj[None, :], cpj[None, :],
                snj[None, :], alpha, beta, MINING,
            )  # fmt: skip
            if MINING:
                near = near | _near(c, pos, neg, cnj[None, :], cpj[None, :], slack, IS64)
        if MINING:
            near = near & (same == 0)
            if lse._any(near):
                if tl.program_id(1) == 0:  # (once per pair: the first feature block lists it)
                    _append(near, rows, cols, fill_ptr, slot_ptr, CAP)
                g = tl.where(near, 0.0, g)
        acc = lse._grad_product(
            g, f_b, bh, bl, other_hi, other_lo, cols, col_mask, fs, f_mask, D, g_scale, acc, SCHEME, INTERPRET, BLOCK_D
        )
    if SCHEME == lse.HALF:
        acc = acc / g_scale
    out = out_ptr + (tl.program_id(2).to(tl.int64) * N_OWN + rows[:, None]) * D + fs[None, :]
    tl.store(out, acc, mask=row_mask[:, None] & f_mask[None, :])


@triton.jit
def ms_pairs_grad_kernel(
    xo_ptr,
    xt_ptr,
    s_own,
    s_other,
    inv_own_ptr,
    inv_other_ptr,
    own_lab_ptr,
    other_lab_ptr,
    stats_ptr,
    anchor_ptr,
    slot_ptr,
    fill_ptr,
    out_ptr,
    N_OWN,
    N_OTHER,
    ANCHORS,
    D,
    OFFSET,
    SLICES,
    ALPHA_BITS,
    BETA_BITS,
    BASE_BITS,
    EPS_BITS,
    SELF: tl.constexpr,
    ANCHORS_OWN: tl.constexpr,
    ANCHORS_OTHER: tl.constexpr,
    ONE_FEATURE: tl.constexpr,
    ACC: tl.constexpr,
    CAP: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Own row program_id(0)'s listed pairs on their exact cosines (an own row whose list
    outgrew CAP: every pair of it, its slices of ms_grad_kernel's output cleared): the
    miner's choices as anchor of either row (the stats' exact thresholds: (anchors, 5)
    float64) and their terms from the exact cosine, Σ_j ∂loss/∂c_ij · e_j into out's slice
    SLICES (e_j = x_j·inv_j; a row holding NaN or ±∞ as 0 where its weight is 0, NaN where
    it is not, as lse.grad_kernel's operands and poison give)."""
    alpha = tm.f64(ALPHA_BITS).to(ACC)
    beta = tm.f64(BETA_BITS).to(ACC)
    base = tm.f64(BASE_BITS).to(ACC)
    eps = tm.f64(EPS_BITS)
    row = tl.program_id(0).to(tl.int64)
    rows = row + tl.arange(0, 1).to(tl.int64)
    row_mask = rows < N_OWN
    lab = tl.load(own_lab_ptr + rows)
    inv_a = tl.load(inv_own_ptr + rows)
    fill = tl.load(fill_ptr + row)
    whole = fill > CAP
    slots = tl.arange(0, CAP)
    ks = tl.arange(0, BLOCK_D)
    at = OFFSET + rows
    if ANCHORS_OWN:
        hn = tl.load(stats_ptr + at * 5)[:, None]
        hp = tl.load(stats_ptr + at * 5 + 1)[:, None]
        wi = _anchor(anchor_ptr, W, at, row_mask, ANCHORS)[:, None]
        lni = _anchor(anchor_ptr, LN, at, row_mask, ANCHORS)[:, None]
        lpi = _anchor(anchor_ptr, LP, at, row_mask, ANCHORS)[:, None]
    extra = out_ptr + (SLICES * N_OWN + row) * D
    for k0 in range(0, D, BLOCK_D):
        tl.store(extra + k0 + ks, tl.zeros((BLOCK_D,), ACC), mask=k0 + ks < D)
    if whole:  # (every pair of this row is here: the tiles' slices cleared)
        for k in range(0, SLICES):
            for k0 in range(0, D, BLOCK_D):
                tl.store(out_ptr + (k * N_OWN + row) * D + k0 + ks, tl.zeros((BLOCK_D,), ACC), mask=k0 + ks < D)
    end = tl.where(whole, N_OTHER, 0)
    for j0 in range(-CAP, end, CAP):
        if j0 < 0:
            mask = slots < tl.where(whole, 0, fill)
            cols = tl.load(slot_ptr + row * CAP + slots, mask=mask, other=0)
        else:
            cols = j0 + slots.to(tl.int64)
            mask = cols < N_OTHER
        if SELF:
            mask = mask & (cols != OFFSET + row)
        if tl.max(mask.to(tl.int32), axis=0) > 0:
            cols2 = cols[None, :]
            mask2 = mask[None, :]
            e = _exact(
                xo_ptr,
                xt_ptr,
                s_own,
                s_other,
                inv_a,
                inv_other_ptr,
                rows,
                row_mask,
                cols2,
                mask2,
                D,
                ONE_FEATURE,
                BLOCK_K,
            )
            same_lab = lab[:, None] == tl.load(other_lab_ptr + cols2, mask=mask2, other=-1)
            pos = mask2 & same_lab
            neg = mask2 & (same_lab == 0)
            d = e.to(ACC) - base
            y = tl.where(d == 0, 0.0, d * beta)
            z = tl.where(d == 0, 0.0, (0.0 - d) * alpha)
            g = tl.zeros(e.shape, ACC)
            if ANCHORS_OWN:
                keep_n, keep_p = _decide(e, pos, neg, hn, hp, eps)
                g += tl.where(keep_n, wi * lse._exp(y - lni), 0.0) - tl.where(keep_p, wi * lse._exp(z - lpi), 0.0)
                g = tl.where(wi != 0, g, 0.0)
            if ANCHORS_OTHER:
                hnj = tl.load(stats_ptr + cols2 * 5, mask=mask2, other=0.0)
                hpj = tl.load(stats_ptr + cols2 * 5 + 1, mask=mask2, other=0.0)
                wj = _anchor(anchor_ptr, W, cols2, mask2, ANCHORS)
                lnj = _anchor(anchor_ptr, LN, cols2, mask2, ANCHORS)
                lpj = _anchor(anchor_ptr, LP, cols2, mask2, ANCHORS)
                keep_n, keep_p = _decide(e, pos, neg, hnj, hpj, eps)
                gj = tl.where(keep_n, wj * lse._exp(y - lnj), 0.0) - tl.where(keep_p, wj * lse._exp(z - lpj), 0.0)
                g += tl.where(wj != 0, gj, 0.0)
            # (a NaN cosine with a weight: the row's gradient is NaN)
            hit = tl.max(((g != 0) & (e != e)).to(tl.int32), axis=1) > 0
            inv_b = tl.load(inv_other_ptr + cols, mask=mask, other=0.0)
            for k0 in range(0, D, BLOCK_D):
                k_mask = k0 + ks < D
                x = tl.load(
                    xt_ptr + cols[:, None] * s_other + (k0 + ks)[None, :],
                    mask=mask[:, None] & k_mask[None, :],
                    other=0.0,
                )
                v = (x.to(tl.float64) * inv_b[:, None]).to(ACC)
                v = tl.where(v == v, v, 0.0)
                part = tl.sum(tl.trans(g) * v, axis=0)
                part = tl.where(hit, float("nan"), part)
                tl.store(extra + k0 + ks, tl.load(extra + k0 + ks, mask=k_mask, other=0.0) + part, mask=k_mask)


# --------------------------------------------------------------------------- wrappers


def _ms_check(embeddings, labels, ref_embeddings, ref_labels, alpha, beta, base, miner_epsilon, shard) -> tuple:
    """The CPU kernel's checks in its order: (α, β, base, ε or None), shard."""
    op = "multi_similarity_loss"
    floats = [("float", "alpha", alpha), ("float", "beta", beta), ("float", "base", base)]
    if miner_epsilon is not None:
        floats.append(("float", "miner_epsilon", miner_epsilon))
    check_scalars(op, *floats)
    _check_inputs(op, embeddings, labels, ref_embeddings, ref_labels)
    shard = _shard(op, shard, embeddings, labels, ref_embeddings, ref_labels)
    params = (float(alpha), float(beta), float(base), None if miner_epsilon is None else float(miner_epsilon))
    _check_params(op, params)
    return params, shard


def _slack(D: int, side: lse._Operands, acc: torch.dtype) -> float:
    """A bound on |tile cosine − exact_cos| for rows of D features taken by side's scheme:
    the operands' rounding (per product, relative to |x_k·y_k|: none as given or in float64;
    TF32 pairs without lo·lo 2^-20; TF32 2^-10; bfloat16 from float32 2^-7), the sums of the
    products (each addition within 2u of the running magnitude: the tensor cores' float32
    accumulation may truncate; three products per pair for a TF32 pair), the factors and their
    norms (16u), and exact_cos's own rounding ((D + 4)·2^-53). Every term is relative to
    Σ|x_k·y_k|·f_x·f_y <= 1 (Cauchy–Schwarz on F.normalize's rows)."""
    u = torch.finfo(acc).eps / 2
    operand, products = {
        lse.FP64.value: (0.0, 1),
        lse.TF32X3.value: (2.0**-20, 3),
        lse.TF32.value: (2.0**-10, 1),
        lse.HALF.value: (2.0**-7 if side.raw.dtype == torch.float32 else 0.0, 1),
    }[side.scheme]
    return operand + (2 * products * D + 16) * u + (D + 4) * 2.0**-53


# Slots per anchor for the listed pairs, by the scheme's slack: the pairs within it of a cut
# are a few where the products are float32-accurate, many more where they are TF32 or
# bfloat16 ("high", "medium"); an anchor with more is taken whole.
CAPS = {lse.FP64.value: 32, lse.TF32X3.value: 32, lse.TF32.value: 128, lse.HALF.value: 32, lse.BF16X3.value: 32}
CAP_ROUNDED = 512  # float32 rows rounded to bfloat16


def _cap(side: lse._Operands, M: int) -> int:
    cap = CAP_ROUNDED if side.scheme == lse.HALF.value and side.raw.dtype == torch.float32 else CAPS[side.scheme]
    return max(16, min(cap, triton.next_power_of_2(max(M, 1))))


def _planes_config(row_config: Config, cap: int) -> Config:
    """ms_planes_kernel's launch: the per-row kernels' rows and options, the lists' CAP slots
    emptied up to 64 at a time."""
    return Config(
        BLOCK_ROWS=row_config.kwargs["BLOCK_ROWS"],
        BLOCK_C=min(triton.next_power_of_2(cap), 64),
        num_warps=row_config.num_warps,
        num_stages=row_config.num_stages,
        fp_fusion=row_config.fp_fusion,
    )


def multi_similarity_forward(
    embeddings,
    labels,
    ref_embeddings,
    ref_labels,
    alpha,
    beta,
    base,
    miner_epsilon,
    shard=None,
    *,
    config=None,
    row_config=None,
    exact_config=None,
):
    """torchkit::multi_similarity_loss's CUDA kernel (any device under the interpreter)."""
    # (The package's exact machinery: float64 norms, groups of equal rows; the package imports
    # this module.)
    from torchkit.triton.pair_losses import ROW_CONFIGS, _equal_rows, _self_cos, _Side

    params, shard = _ms_check(embeddings, labels, ref_embeddings, ref_labels, alpha, beta, base, miner_epsilon, shard)
    alpha, beta, base, eps = params
    mining = eps is not None
    acc = acc_dtype(embeddings)
    row_config = row_config or ROW_CONFIGS[0]
    exact_config = exact_config or EXACT_CONFIGS[0]
    self_, offset = _self_pairs(ref_embeddings, shard)
    a, b, npos = lse._sides(embeddings, labels, ref_embeddings, ref_labels, acc, row_config, self_)
    N, D = embeddings.shape
    held = lse._held(D, a.scheme)
    config = config or lse._held_default(ROWS_CONFIGS, acc, a.scheme, held)
    M = b.n
    dev = embeddings.device
    pairs = M - int(self_)  # (each anchor's: every ref but itself)
    inf = float("inf")
    # The stats (hn, hp, Lp, Ln, weight), written by the kernels (zeros without a pair).
    st = (torch.empty if N > 0 and M > 0 else torch.zeros)(N, 5, dtype=torch.float64, device=dev)
    partial = npos  # (no blocks: ms_loss_kernel reads none)
    terms_blocks = 0
    if N > 0 and M > 0:
        k = config.kwargs
        programs = blocks(N, k["BLOCK_N"])
        slices, chunk = lse._slices(programs, M, k["BLOCK_M"])
        cap = _cap(a, M)
        slack = _slack(D, a, acc)
        u = torch.finfo(acc).eps / 2
        part = torch.empty(5, slices + 1, N, dtype=acc, device=dev)
        count = torch.empty(2, slices + 1, N, dtype=torch.int32, device=dev)
        slot = torch.empty(N, cap, dtype=torch.int64, device=dev)
        fill = torch.zeros(N, dtype=torch.int32, device=dev)
        grp = (a.labels, b.labels)  # (no groups without the miner)

        if mining:
            sa = _Side(a.raw, a.labels, acc, row_config, normalised=False)
            sb = sa if b is a else _Side(b.raw, b.labels, acc, row_config, normalised=False)
            grp = _equal_rows(sa, sb, row_config)

        def rows(step, row):
            ms_rows_kernel[(programs, slices)](
                *a.pointers,
                *b.pointers,
                a.labels,
                b.labels,
                *grp,
                row,
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
                float_bits(alpha),
                float_bits(beta),
                float_bits(base),
                float_bits(slack),
                SELF=self_,
                PASS=step,
                MINING=mining,
                BLOCK_D=held,
                **lse._launch_flags(a, acc),
                **config.launch,
            )

        def exact(step):
            ms_exact_kernel[(blocks(N, exact_config.kwargs["BLOCK_ROWS"]),)](
                sa.raw,
                sb.raw,
                sa.raw.stride(0),
                sb.raw.stride(0),
                sa.inv64,
                sb.inv64,
                a.labels,
                b.labels,
                slot,
                fill,
                st,
                part,
                count,
                N,
                M,
                D,
                offset,
                slices,
                float_bits(alpha),
                float_bits(beta),
                float_bits(base),
                float_bits(eps),
                SELF=self_,
                PASS=step,
                ONE_FEATURE=D == 1,
                ACC=acc_tl(acc),
                CAP=cap,
                **exact_config.launch,
            )

        if mining:
            # The tiles' extremes, then their candidates, then the thresholds exactly.
            row = torch.empty(3, N, dtype=acc, device=dev)
            anchors = lse._merge_config(row_config, slices)
            grid = (blocks(N, anchors.kwargs["BLOCK_ROWS"]),)
            rows(EXTREMES, part)
            ms_bounds_kernel[grid](
                part, count, row, st, N, slices, float_bits(2 * slack + 4 * u), ACC=acc_tl(acc), **anchors.launch
            )
            rows(CANDIDATES, row)
            cos = _self_cos(sa, row_config)
            ms_same_kernel[grid](count, cos, st, N, slices, **anchors.launch)
            exact(THRESHOLDS)
            ms_planes_kernel[grid](
                st,
                cos,
                row,
                fill,
                slot,
                N,
                cap,
                float_bits(eps),
                MINING=True,
                BACKWARD=False,
                ACC=acc_tl(acc),
                **_planes_config(row_config, cap).launch,
            )
            rows(TERMS, row)
            slot.copy_(slot.sort(dim=1).values)  # (the listed pairs in ref order)
            exact(DECISIONS)
        else:
            part[:, slices].copy_(torch.tensor([-inf, 0.0, 0.0, -inf, 0.0], dtype=acc, device=dev)[:, None])
            count[:, slices].zero_()
            rows(TERMS, part)
        merge = lse._merge_config(row_config, slices + 1)
        terms_blocks = blocks(N, merge.kwargs["BLOCK_ROWS"])
        partial = torch.empty(4, terms_blocks, dtype=torch.float64, device=dev)
        ms_terms_kernel[(terms_blocks,)](
            part,
            count,
            npos,
            st,
            partial,
            N,
            slices + 1,
            float_bits(alpha),
            float_bits(beta),
            MINING=mining,
            ACC=acc_tl(acc),
            **merge.launch,
        )
    # ms_loss_kernel: PML's rules, the stats and the loss (or a shard's parts) on the device.
    if shard is None:
        result = torch.empty((), dtype=embeddings.dtype, device=dev)
    else:
        result = torch.empty(4, dtype=torch.float64, device=dev)
    bf16 = shard is None and embeddings.dtype == torch.bfloat16
    batch = lse.BATCH_CONFIG
    ms_loss_kernel[(max(1, blocks(N, batch.kwargs["BLOCK_ROWS"])),)](
        partial,
        st,
        result.view(torch.int16) if bf16 else result,
        N,
        M,
        terms_blocks,
        N * pairs,
        SHARD=shard is not None,
        MINING=mining,
        WIDE=shard is not None or embeddings.dtype == torch.float64,
        BF16=bf16,
        **batch.launch,
    )
    return result, st


def multi_similarity_backward(
    grad,
    embeddings,
    labels,
    ref_embeddings,
    ref_labels,
    stats,
    alpha,
    beta,
    base,
    miner_epsilon,
    output_mask,
    shard=None,
    own_stats=False,
    *,
    config=None,
    row_config=None,
):
    """torchkit::_multi_similarity_loss_backward's CUDA kernel (any device under the
    interpreter): per side, ms_grad_kernel's tiles, ms_pairs_grad_kernel's listed pairs, and
    lse.jacobian_kernel through the normalisation."""
    from torchkit.triton.pair_losses import ROW_CONFIGS, _equal_rows, _self_cos, _Side

    op = "multi_similarity_loss"
    params, shard = _ms_check(embeddings, labels, ref_embeddings, ref_labels, alpha, beta, base, miner_epsilon, shard)
    alpha, beta, base, eps = params
    _check_own_stats(op, own_stats, shard)
    whole = _whole_rows(op, shard, own_stats, ref_embeddings)
    _check_loss_backward(op, grad, embeddings, stats, shard, whole)
    among = shard is not None and shard >= 0  # (the anchors are ref rows: the refs' problem)
    mining = eps is not None
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
    config = config or lse._default(GRAD_CONFIGS, acc)
    if among:  # the refs' problem without refs, of whose rows the anchors are some
        a = b = lse._Operands(ref_embeddings, *lse._label_ids(ref_labels)[0], acc, row_config)
    else:
        a, b, _ = lse._sides(embeddings, labels, ref_embeddings, ref_labels, acc, row_config)
    pairs_self = self_ or among
    st = _own_rows(stats, shard, M) if among and whole is None else stats.contiguous()
    slack = _slack(D, a, acc)
    # The anchors' numbers (the stats' rows: the whole problem's for a shard) as _ms_terms and
    # _near take them: ms_planes_kernel's planes.
    cos = st  # (not read without the miner)
    if mining:
        sa = _Side(a.raw, a.labels, acc, row_config, normalised=False)
        sb = sa if b is a else _Side(b.raw, b.labels, acc, row_config, normalised=False)
        groups = _equal_rows(sa, sb, row_config)
        cos = _self_cos(sb if among else sa, row_config)
    anchors = st.shape[0]
    planes = torch.empty(6 if mining else 3, anchors, dtype=acc, device=st.device)
    launch = _planes_config(row_config, 1)
    ms_planes_kernel[(blocks(anchors, launch.kwargs["BLOCK_ROWS"]),)](
        st,
        cos,
        planes,
        st,
        st,
        anchors,
        0,
        float_bits(eps if mining else 0.0),
        MINING=mining,
        BACKWARD=True,
        ACC=acc_tl(acc),
        **launch.launch,
    )

    def rows_grad(own, other, sides, own_groups, other_groups, anchors_own, anchors_other, like, offset=0):
        # (sides: own's and other's rows as the exact cosines take them; groups: of equal rows)
        held = lse._held(D, own.scheme, lse.HELD_NARROW)
        launch = lse._grad_config(config, D, held)
        k = launch.kwargs
        n = own.n
        programs = blocks(n, k["BLOCK_N"]) * blocks(D, k["BLOCK_F"])
        slices, chunk = lse._slices(programs, other.n, k["BLOCK_M"])
        cap = _cap(own, other.n)
        g = torch.empty(slices + 1, n, D, dtype=acc, device=like.device)
        slot = torch.full((n, cap), NO_COL, dtype=torch.int64, device=like.device)
        fill = torch.zeros(n, dtype=torch.int32, device=like.device)
        ms_grad_kernel[(blocks(n, k["BLOCK_N"]), blocks(D, k["BLOCK_F"]), slices)](
            *own.pointers,
            *other.pointers,
            own.labels,
            other.labels,
            own_groups,
            other_groups,
            planes,
            slot,
            fill,
            g,
            n,
            other.n,
            planes.shape[1],
            D,
            offset,
            chunk,
            cap,
            float_bits(alpha),
            float_bits(beta),
            float_bits(base),
            float_bits(lse._grad_scale(max(abs(alpha), abs(beta)), 4.0, own.hi.dtype)),
            float_bits(slack),
            SELF=pairs_self,
            ANCHORS_OWN=anchors_own,
            ANCHORS_OTHER=anchors_other,
            MINING=mining,
            BLOCK_D=held,
            **lse._launch_flags(own, acc),
            **launch.launch,
        )
        if mining:
            slot.copy_(slot.sort(dim=1).values)  # (the listed pairs in order: the same bits on every run)
            own_side, other_side = sides
            ms_pairs_grad_kernel[(n,)](
                own_side.raw,
                other_side.raw,
                own_side.raw.stride(0),
                other_side.raw.stride(0),
                own_side.inv64,
                other_side.inv64,
                own.labels,
                other.labels,
                st,
                planes,
                slot,
                fill,
                g,
                n,
                other.n,
                planes.shape[1],
                D,
                offset,
                slices,
                float_bits(alpha),
                float_bits(beta),
                float_bits(base),
                float_bits(eps),
                SELF=pairs_self,
                ANCHORS_OWN=anchors_own,
                ANCHORS_OTHER=anchors_other,
                ONE_FEATURE=D == 1,
                ACC=acc_tl(acc),
                CAP=cap,
                BLOCK_D=min(128, triton.next_power_of_2(D)),
                **PAIRS_CONFIG.launch,
            )
        else:
            g[slices].zero_()
        out = torch.empty(n, D, dtype=like.dtype, device=like.device)
        lse.jacobian_kernel[(blocks(n, row_config.kwargs["BLOCK_ROWS"]),)](
            g,
            own.raw,
            own.exp,
            own.inv,
            own.clamped,
            grad,
            grad,  # (not read)
            out,
            n,
            D,
            slices + 1,
            own.raw.stride(0),
            LIVE=0,
            ACC=acc_tl(acc),
            IS64=acc == torch.float64,
            **row_config.launch,
        )
        return out

    if not mining:  # (no groups, no exact cosines: the labels stand in for the groups)
        sa = sb = None
        groups = (a.labels, b.labels)
    if among:  # (a is b: the refs; own_stats: the anchors' pairs alone, the refs a memory that holds their rows)
        own = b.narrow(shard, N)
        sides = (sb.narrow(shard, N), sb) if mining else None
        own_groups = groups[0].narrow(0, shard, N)
        others = whole is not None
        ge = rows_grad(own, b, sides, own_groups, groups[1], True, others, embeddings, shard) if want_e else empty
        return ge, _zeros(want_r, ref_embeddings, empty)
    if self_:
        return rows_grad(a, a, (sa, sa), *groups, True, True, embeddings), empty
    ge = rows_grad(a, b, (sa, sb), *groups, True, False, embeddings) if want_e else empty
    gr = rows_grad(b, a, (sb, sa), groups[1], groups[0], False, True, ref_embeddings) if want_r else empty
    return ge, gr


def compile_cases() -> list[CompileCase]:
    """This engine's kernels for tools/triton_check.py: ms_rows_kernel's passes with the TF32
    pair (rows of D = 128 held whole, and a slice at a time with every configuration of
    CANDIDATES and TERMS with the miner), bfloat16 and float64, rows of D = 128 held where the
    scheme holds them; ms_exact_kernel's passes from float32, bfloat16 and
    float64 inputs; the miner's per-anchor steps and the batch's kernels of each;
    ms_grad_kernel's and ms_pairs_grad_kernel's passes (every configuration of the first: the
    TF32 pair's, without refs, with the miner)."""
    ints = ("N", "M", "D", "OFFSET", "CHUNK", "CAP", "SLICES", "sa", "sb", "N_OWN", "N_OTHER", "ANCHORS")
    ints = dict.fromkeys((*ints, "s_own", "s_other"), "i32")
    # The headline launches' sizes (8,192 rows of 128 features, slices of whole tiles) are
    # divisible by 16, all but the slice count.
    case = functools.partial(CompileCase, divisible=tuple(k for k in ints if k != "SLICES"))
    bits = dict.fromkeys(("ALPHA_BITS", "BETA_BITS", "BASE_BITS", "EPS_BITS", "G_SCALE_BITS", "SLACK_BITS"), "i64")
    # (name, input dtype, operand dtype, accumulation type, scheme)
    schemes = (
        ("fp32", "fp32", "fp32", "fp32", lse.TF32X3),
        ("bf16", "bf16", "bf16", "fp32", lse.HALF),
        ("fp64", "fp64", "fp64", "fp64", lse.FP64),
    )
    cases = []
    for name, dtype, operand, acc, how in schemes:
        is64 = acc == "fp64"
        first = name == "fp32"
        flags = dict(ACC=tl.float64 if is64 else tl.float32, IS64=is64)
        types = {
            **ints,
            **bits,
            **{
                f"{side}_{part}": t
                for side in ("a", "b", "own", "other")
                for part, t in (("hi", "*" + operand), ("lo", "*" + operand), ("f", "*" + acc), ("bad", "*i8"))
            },
            **dict.fromkeys(("lab_ptr", "ref_lab_ptr", "own_lab_ptr", "other_lab_ptr"), "*i32"),
            **dict.fromkeys(("grp_a_ptr", "grp_b_ptr", "grp_own_ptr", "grp_other_ptr", "slot_ptr"), "*i64"),
            **dict.fromkeys(("row_ptr", "part_ptr", "anchor_ptr", "out_ptr"), "*" + acc),
            **dict.fromkeys(("count_ptr", "fill_ptr"), "*i32"),
            **dict.fromkeys(("xa_ptr", "xb_ptr", "xo_ptr", "xt_ptr"), "*" + dtype),
            **dict.fromkeys(("inv_a_ptr", "inv_b_ptr", "st_ptr", "inv_own_ptr", "inv_other_ptr", "stats_ptr"), "*fp64"),
        }
        rows_held, held = lse._held(128, how.value), lse._held(128, how.value, lse.HELD_NARROW)
        steps = ((EXTREMES, "extremes", True), (CANDIDATES, "candidates", True), (TERMS, "terms", True))
        steps += ((TERMS, "terms all pairs", False),)
        for step, what, mining in steps:
            # (the TF32 pair's rows also multiplied a slice at a time, as wider rows are)
            for block_d in (rows_held, 0) if first else (rows_held,):
                every = first and not block_d and step != EXTREMES and mining
                default = lse._held_default(ROWS_CONFIGS, torch.float64 if is64 else torch.float32, how.value, block_d)
                flags_ = dict(SELF=True, PASS=step, MINING=mining, SCHEME=how, INTERPRET=False, **flags)
                cases.append(
                    case(
                        f"pair_losses.ms.rows {what} {name}{'' if block_d else ' D loop'}",
                        ms_rows_kernel,
                        types,
                        dict(BLOCK_D=block_d, **flags_),
                        ROWS_CONFIGS if every else (default,),
                        tensor_cores=not is64,
                    )
                )
        for step, what in ((THRESHOLDS, "thresholds"), (DECISIONS, "decisions")):
            cases.append(
                case(
                    f"pair_losses.ms.exact {what} {name}",
                    ms_exact_kernel,
                    types,
                    dict(SELF=True, PASS=step, ONE_FEATURE=False, ACC=flags["ACC"], CAP=CAPS[how.value]),
                    EXACT_CONFIGS if first else EXACT_CONFIGS[:1],
                )
            )
        anchors = lse._merge_config(lse.ROW_CONFIGS[0], 4)
        miner = {**types, "cos_ptr": "*fp64", "NEAR_BITS": "i64"}
        cases.append(case(f"pair_losses.ms.bounds {name}", ms_bounds_kernel, miner, dict(ACC=flags["ACC"]), (anchors,)))
        cases.append(case(f"pair_losses.ms.same {name}", ms_same_kernel, miner, {}, (anchors,)))
        for mining, backward in ((True, False), (True, True), (False, True)) if first else ((True, False),):
            what = ("" if mining else " all pairs") + (" backward" if backward else "")
            cases.append(
                case(
                    f"pair_losses.ms.planes {name}{what}",
                    ms_planes_kernel,
                    {**miner, "out_ptr": "*" + acc},
                    dict(MINING=mining, BACKWARD=backward, ACC=flags["ACC"]),
                    (_planes_config(lse.ROW_CONFIGS[0], CAPS[how.value]),),
                )
            )
        batch = {**types, "npos_ptr": "*i32", "partial_ptr": "*fp64", "BLOCKS": "i32", "PAIRS": "i64"}
        for mining in (True, False) if first else (True,):
            cases.append(
                case(
                    f"pair_losses.ms.terms {name}{'' if mining else ' all pairs'}",
                    ms_terms_kernel,
                    batch,
                    dict(MINING=mining, ACC=flags["ACC"]),
                    (lse._merge_config(lse.ROW_CONFIGS[0], 4),),
                )
            )
        for shard, mining in ((False, True), (True, True), (False, False)) if first else ((False, True),):
            result = "*fp64" if shard else ("*i16" if dtype == "bf16" else "*" + dtype)
            cases.append(
                case(
                    f"pair_losses.ms.loss {name}{' shard' if shard else ''}{'' if mining else ' all pairs'}",
                    ms_loss_kernel,
                    {**batch, "result_ptr": result},
                    dict(SHARD=shard, MINING=mining, WIDE=shard or is64, BF16=not shard and dtype == "bf16"),
                    (lse.BATCH_CONFIG,),
                )
            )
        default = lse._default(GRAD_CONFIGS, torch.float64 if is64 else torch.float32)
        for self_, own, other in ((True, True, True), (False, True, False), (False, False, True)):
            for mining in (True, False) if self_ else (True,):
                what = (" self" if self_ else (" anchors" if own else " refs")) + ("" if mining else " all pairs")
                cases.append(
                    case(
                        f"pair_losses.ms.grad {name}{what}",
                        ms_grad_kernel,
                        types,
                        dict(
                            SELF=self_,
                            ANCHORS_OWN=own,
                            ANCHORS_OTHER=other,
                            MINING=mining,
                            SCHEME=how,
                            INTERPRET=False,
                            BLOCK_D=held,
                            **flags,
                        ),
                        tuple(
                            lse._grad_config(c, 128, held)
                            for c in (GRAD_CONFIGS if first and self_ and mining else (default,))
                        ),
                        tensor_cores=not is64,
                    )
                )
                if mining:
                    cases.append(
                        case(
                            f"pair_losses.ms.pairs_grad {name}{what}",
                            ms_pairs_grad_kernel,
                            types,
                            dict(
                                SELF=self_,
                                ANCHORS_OWN=own,
                                ANCHORS_OTHER=other,
                                ONE_FEATURE=False,
                                ACC=flags["ACC"],
                                CAP=CAPS[how.value],
                                BLOCK_D=128,
                            ),
                            (PAIRS_CONFIG,),
                        )
                    )
    return cases
