"""multi_similarity_loss's forward on tensor cores under the CUDA precision contract
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
  adds the kept ones' terms as one more slice; lse.merge_kernel merges the slices.
- An anchor whose list outgrows CAP (near-duplicate rows that are not equal: adversarial) is
  taken whole by ms_exact_kernel: every pair's exact cosine, its choice and term, in place of
  the tiles' (its slices cleared).

Without the miner only TERMS runs, keeping every pair. float64 inputs take float64 tiles
(SCHEME FP64) and the same steps.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from torchkit.ops._common import acc_dtype, check_scalars
from torchkit.ops.pair_losses import _check_inputs, _check_params
from torchkit.triton import _math as tm
from torchkit.triton._launch import CompileCase, Config, acc_tl, blocks, float_bits, hot
from torchkit.triton.pair_losses import lse
from torchkit.triton.pair_losses._common import _parts, _self_pairs, _shard, _unit

# ms_rows_kernel's passes.
EXTREMES = tl.constexpr(0)
CANDIDATES = tl.constexpr(1)
TERMS = tl.constexpr(2)
# ms_exact_kernel's.
THRESHOLDS = tl.constexpr(0)
DECISIONS = tl.constexpr(1)

NO_COL = 2**62  # an empty slot (sorted last)

# Launch configurations (every one run by the tests and compiled by tools/triton_check.py; the
# first is the default, the last float64's).
ROWS_CONFIGS = (
    Config(BLOCK_N=64, BLOCK_M=32, BLOCK_K=16, num_warps=4, num_stages=3),
    Config(BLOCK_N=128, BLOCK_M=32, BLOCK_K=16, num_warps=8, num_stages=2),
    Config(BLOCK_N=32, BLOCK_M=32, BLOCK_K=16, num_warps=4, num_stages=2),
)
# ms_exact_kernel: float64 cosines summed in feature order (as the CPU kernel's), no FMA.
EXACT_CONFIGS = (
    Config(BLOCK_ROWS=16, num_warps=4, num_stages=2, fp_fusion=False),
    Config(BLOCK_ROWS=4, num_warps=2, num_stages=2, fp_fusion=False),
)


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
    TERMS (row 0, 1: the negatives' and positives' cuts, 2, 3: their bands, 4, 5: whether a
    negative, a positive of an equal row is kept; MINING): part 0, 1 = the kept negatives'
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
        band_n = tl.load(row_ptr + 2 * N + rows, mask=row_mask, other=0.0)
        band_p = tl.load(row_ptr + 3 * N + rows, mask=row_mask, other=0.0)
        same_n = tl.load(row_ptr + 4 * N + rows, mask=row_mask, other=0.0) != 0
        same_p = tl.load(row_ptr + 5 * N + rows, mask=row_mask, other=0.0) != 0
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
                near = (neg & (tl.abs(c - r0[:, None]) <= band_n[:, None])) | (
                    pos & (tl.abs(c - r1[:, None]) <= band_p[:, None])
                )
                near = near & (same == 0)
                if lse._any(near):
                    _append(near, rows, cols, fill_ptr, slot_ptr, CAP)
                keep_n = neg & (near == 0) & tl.where(same, same_n[:, None], (c > r0[:, None]) | (c != c))
                keep_p = pos & (near == 0) & tl.where(same, same_p[:, None], (c < r1[:, None]) | (c != c))
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
def _exact(xa_ptr, xb_ptr, sa, sb, inv_a, inv_b_ptr, rows, row_mask, cols, mask, D, ONE_FEATURE: tl.constexpr):
    """The exact cosines of anchors `rows` with refs `cols` (2-D, per anchor), as the CPU
    kernel's exact_cos: Σ_k (x_ik·inv_i)(y_jk·inv_j) in float64, in feature order."""
    inv_b = tl.load(inv_b_ptr + cols, mask=mask, other=0.0)
    out = tl.zeros(cols.shape, tl.float64)
    for k in range(0, D):
        a = _unit(tl.load(xa_ptr + rows * sa + k, mask=row_mask, other=0.0).to(tl.float64), inv_a, ONE_FEATURE)
        b = _unit(tl.load(xb_ptr + cols * sb + k, mask=mask, other=0.0).to(tl.float64), inv_b, ONE_FEATURE)
        out += a[:, None] * b
    return out


@triton.jit
def _decide(e, pos, neg, hn, hp, eps):
    """The miner's choices on exact cosines e (MultiSimilarity::mined): a positive with
    e − ε < its anchor's hardest negative, a negative with e + ε > its hardest positive; NaN
    keeps the pair."""
    keep_p = pos & (((e - eps) < hn[:, None]) | (e != e) | (hn != hn)[:, None])
    keep_n = neg & (((e + eps) > hp[:, None]) | (e != e) | (hp != hp)[:, None])
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
            e = _exact(xa_ptr, xb_ptr, sa, sb, inv_a, inv_b_ptr, rows, row_mask, cols, mask, D, ONE_FEATURE)
            ref_lab = tl.load(ref_lab_ptr + cols, mask=mask, other=0)
            pos = mask & (ref_lab == lab[:, None])
            neg = mask & (ref_lab != lab[:, None])
            if PASS == THRESHOLDS:
                # (an anchor with a NaN pair has its NaN threshold already)
                top = tl.maximum(top, tl.max(tl.where(neg, e, float("-inf")), axis=1))
                bottom = tl.minimum(bottom, tl.min(tl.where(pos, e, float("inf")), axis=1))
            else:
                keep_n, keep_p = _decide(e, pos, neg, hn, hp, eps)
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
CAPS = {lse.FP64.value: 32, lse.TF32X3.value: 32, lse.TF32.value: 128, lse.HALF.value: 32}
CAP_ROUNDED = 512  # float32 rows rounded to bfloat16


def _cap(side: lse._Operands, M: int) -> int:
    cap = CAP_ROUNDED if side.scheme == lse.HALF.value and side.raw.dtype == torch.float32 else CAPS[side.scheme]
    return max(16, min(cap, triton.next_power_of_2(max(M, 1))))


def _row(values: list, acc: torch.dtype) -> Tensor:
    """Per-anchor inputs of ms_rows_kernel: planes of ACC."""
    return torch.stack([v.to(acc) for v in values]).contiguous()


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
    config = config or lse._default(ROWS_CONFIGS, acc)
    row_config = row_config or ROW_CONFIGS[0]
    exact_config = exact_config or EXACT_CONFIGS[0]
    self_, offset = _self_pairs(ref_embeddings, shard)
    a, b = lse._sides(embeddings, labels, ref_embeddings, ref_labels, acc, row_config)
    N, D = embeddings.shape
    M = b.n
    dev = embeddings.device
    st = torch.zeros(N, 5, dtype=torch.float64, device=dev)
    npos, npairs = lse._counts(a, b, self_)
    kept = torch.zeros(N, 2, dtype=torch.int32, device=dev)
    inf = float("inf")
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

        def launched(t):  # EXTREMES' and CANDIDATES' outputs: (2, slices, N)
            return t.view(-1)[: 2 * slices * N].view(2, slices, N)

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
                SELF=self_,
                PASS=step,
                MINING=mining,
                BLOCK_D=lse._held(D, a.scheme),
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
            rows(EXTREMES, part)
            extremes, flags = launched(part), launched(count)
            top, bottom = extremes[0].amax(0), extremes[1].amin(0)
            nan_n, nan_p = flags[0].amax(0) > 0, flags[1].amax(0) > 0
            near = 2 * slack + 4 * u
            floor = torch.where(nan_n | (top == -inf), inf, top.double() - near)
            ceiling = torch.where(nan_p | (bottom == inf), -inf, bottom.double() + near)
            rows(CANDIDATES, _row([floor, ceiling], acc))
            same_n, same_p = flags[0].amax(0) > 0, flags[1].amax(0) > 0
            cos = _self_cos(sa, row_config)
            st[:, 0] = torch.where(nan_n, float("nan"), torch.where(top == -inf, -inf, 0.0))
            st[:, 1] = torch.where(nan_p, float("nan"), torch.where(bottom == inf, inf, 0.0))
            st[:, 2] = torch.where(same_n, cos, -inf)
            st[:, 3] = torch.where(same_p, cos, inf)
            exact(THRESHOLDS)
            hn, hp = st[:, 0], st[:, 1]
            # The cuts (a NaN threshold keeps every pair), their bands, and the choices on
            # the pairs of equal rows.
            cut_p = torch.where(hn.isnan(), inf, hn + eps)
            cut_n = torch.where(hp.isnan(), -inf, hp - eps)
            band = lambda cut: torch.where(cut.to(acc).isinf(), -1.0, slack + 4 * u * (cut.abs() + 1))  # noqa: E731
            keep_same_p = ((cos - eps) < hn) | hn.isnan() | cos.isnan()
            keep_same_n = ((cos + eps) > hp) | hp.isnan() | cos.isnan()
            fill.zero_()
            slot.fill_(NO_COL)
            row = _row([cut_n, cut_p, band(cut_n), band(cut_p), keep_same_n, keep_same_p], acc)
            rows(TERMS, row)
            slot.copy_(slot.sort(dim=1).values)  # (the listed pairs in ref order)
            exact(DECISIONS)
        else:
            st[:, 0], st[:, 1] = -inf, inf
            part[:, slices].copy_(torch.tensor([-inf, 0.0, 0.0, -inf, 0.0], dtype=acc, device=dev)[:, None])
            count[:, slices].zero_()
            rows(TERMS, part)
        ln = torch.empty(N, dtype=acc, device=dev)
        lp = torch.empty(N, dtype=acc, device=dev)
        merge = lse._merge_config(row_config, slices + 1)
        lse.merge_kernel[(blocks(N, merge.kwargs["BLOCK_ROWS"]),)](
            part, ln, lp, N, slices + 1, MODE=lse.PROXY, ONE=True, ACC=acc_tl(acc), **merge.launch
        )
        st[:, 2] = lp.double()
        st[:, 3] = ln.double()
        kept = count.sum(dim=1, dtype=torch.int32).t()
    # ms_forward (pair_losses_cpu.cpp): with the miner, nothing without a negative or a positive
    # pair in the batch; and nothing when each kind keeps at most one pair (a shard's caller
    # applies that rule to the whole problem's parts).
    kept_negatives, kept_positives = kept.sum(dim=0, dtype=torch.int64).unbind()
    if shard is None:
        use = ~((kept_negatives <= 1) & (kept_positives <= 1))
    else:
        use = torch.full((), N > 0 and M > 0, dtype=torch.bool, device=dev)
    if mining:
        positives = npos.sum(dtype=torch.int64)
        use = use & (npairs.sum(dtype=torch.int64) - positives > 0) & (positives > 0)
    w = 1.0 / max(N, 1)
    total = (st[:, 2] / alpha + st[:, 3] / beta).sum()
    st[:, 4] = w
    stats = torch.where(use, st, 0.0)
    if shard is not None:
        zero = total.new_zeros(())
        kept_negatives, kept_positives = (torch.where(use, k, 0) for k in (kept_negatives, kept_positives))
        return _parts(torch.where(use, total, zero), zero + N, kept_negatives, kept_positives), stats
    return torch.where(use, total * w, 0.0).to(embeddings.dtype), stats


def compile_cases() -> list[CompileCase]:
    """This engine's kernels for tools/triton_check.py: ms_rows_kernel's passes with the TF32
    pair (every configuration of TERMS with the miner), bfloat16 and float64, rows of D = 128
    held where the scheme holds them; ms_exact_kernel's passes from float32, bfloat16 and
    float64 inputs."""
    ints = dict.fromkeys(("N", "M", "D", "OFFSET", "CHUNK", "CAP", "SLICES", "sa", "sb"), "i32")
    # The headline launches' sizes (8,192 rows of 128 features, slices of whole tiles) are
    # divisible by 16, all but the slice count.
    case = functools.partial(CompileCase, divisible=tuple(k for k in ints if k != "SLICES"))
    bits = dict.fromkeys(("ALPHA_BITS", "BETA_BITS", "BASE_BITS", "EPS_BITS"), "i64")
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
                for side in ("a", "b")
                for part, t in (("hi", "*" + operand), ("lo", "*" + operand), ("f", "*" + acc), ("bad", "*i8"))
            },
            **dict.fromkeys(("lab_ptr", "ref_lab_ptr"), "*i32"),
            **dict.fromkeys(("grp_a_ptr", "grp_b_ptr", "slot_ptr"), "*i64"),
            **dict.fromkeys(("row_ptr", "part_ptr"), "*" + acc),
            **dict.fromkeys(("count_ptr", "fill_ptr"), "*i32"),
            **dict.fromkeys(("xa_ptr", "xb_ptr"), "*" + dtype),
            **dict.fromkeys(("inv_a_ptr", "inv_b_ptr", "st_ptr"), "*fp64"),
        }
        held = lse._held(128, how.value)
        steps = ((EXTREMES, "extremes", True), (CANDIDATES, "candidates", True), (TERMS, "terms", True))
        steps += ((TERMS, "terms all pairs", False),)
        for step, what, mining in steps:
            every = first and step != EXTREMES and mining
            cases.append(
                case(
                    f"pair_losses.ms.rows {what} {name}",
                    ms_rows_kernel,
                    types,
                    dict(SELF=True, PASS=step, MINING=mining, SCHEME=how, INTERPRET=False, BLOCK_D=held, **flags),
                    ROWS_CONFIGS if every else (lse._default(ROWS_CONFIGS, torch.float64 if is64 else torch.float32),),
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
    return cases
