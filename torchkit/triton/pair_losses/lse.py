"""The log-sum-exp engine: supcon_loss, ntxent_loss and proxy_anchor_loss as FlashAttention
computes attention, on tensor cores, under the CUDA precision contract (docs/ops.md).

Each loss is a tile of cosines, an elementwise transform, per-row log-sum-exps, and a backward
that recomputes the tile:

- Prefix (operands_kernel), O(N·D): each row scaled by the power of two 2^-E of its largest
  |entry| (exact; float16 rows as they are: their products cannot over- or underflow float32),
  so that no product leaves float32's range anywhere in the finite range, and stored as the
  products take it: float64; bfloat16 or float16 as given; float32 as a TF32 pair hi + lo
  (PyTorch's default fp32-matmul precision: three TF32 products hi·hi + hi·lo + lo·hi, about
  float32's accuracy) or hi alone ("high": TF32), or bfloat16 ("medium"). The operands are
  rounded here, so the interpreter's IEEE products of them are the tensor cores' products and
  its results the GPU's up to the order of the sums. Per row the factor f that makes the scaled
  row F.normalize's (1/‖x·2^-E‖, or 2^E·1e12 where the clamp holds), whether the row holds a
  NaN or ±∞ (its operand is then 0 and its pairs NaN, injected only in the tiles that hold such
  a row), and the Jacobian's numbers.
- Forward (rows_kernel): a program per block of anchors and slice of refs (the slices fill
  the GPU where the anchors alone would not: FILL), the cosine tile c = (a·b)·f_a·f_b, its
  terms x in the accumulation type, folded into running log-sum-exps with exp2, partial sums
  and counts; merge_kernel merges the slices' partials per anchor in slice order (the same bits
  on every run). float64 only per row. SupCon's log-sum-exp is over every pair; NT-Xent's over
  the negatives, then a second pass, over only the tiles that hold a positive pair, takes each
  positive pair's term, which needs its anchor's whole negative sum; proxy-anchor's anchors
  are the proxies and its two log-sums, over the negatives of α(c + margin) and the positives
  of α(margin − c), hold the 1 (added by the merge, once).
- The labels (ids_kernel, after a sort of each side): their int32 ids, which the tiles compare,
  and each anchor's positive pairs, by 9-ary searches in the sorted labels (proxy-anchor's
  classes: count_kernel, positives_kernel).
- The batch (terms_kernel, loss_kernel): PML's batch rules applied to the anchors' outputs and
  the loss and stats written, on the device in two launches (no host synchronisation, no torch
  operation between them); the partial sums in float64, in a fixed order.
- Backward (grad_kernel): per anchor the coefficients of ∂loss/∂x_ij = coef_i·exp(x_ij −
  shift_i) and of the positive pairs' own terms (PairGrad in pair_losses_cpu.cpp), formed on
  the device from the stats (coef_kernel); each program recomputes its tiles, forms ∂loss/∂c and multiplies
  it into the other side's operands on tensor cores (the TF32 pair: ∂loss/∂c split in two
  too), for its block of own rows, block of features (rows held whole: all of them, so that
  each tile is formed once) and slice of the other rows; without refs a pair's terms as anchor
  i and as anchor j in one pass (c is symmetric). No atomics: jacobian_kernel sums the slices
  in order and takes each row through the normalisation.
- Each tile's loads are issued before any of them is used (one round trip to memory per tile,
  where Triton's pipeliner does not prefetch them: those that feed no product).

A shard (the losses across ranks: csrc/pair_losses.h) is as in the module that holds the other
engines (torchkit/triton/pair_losses/__init__.py). Kernels never index past what the wrapper
checked; offsets are int64.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from torchkit.ops._common import acc_dtype
from torchkit.ops.pair_losses import (
    _check_backward,
    _check_loss_backward,
    _check_own_stats,
    _check_proxy_shard,
    _whole_rows,
)
from torchkit.triton import _math as tm
from torchkit.triton import float32_products
from torchkit.triton._launch import CompileCase, Config, acc_tl, blocks, float_bits, hot, interpreting
from torchkit.triton.pair_losses._common import (
    NORM_EPS,
    _check,
    _own_rows,
    _proxy_check,
    _self_pairs,
    _zeros,
)

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

# How the products are taken (the operands' layout, operands_kernel's SCHEME).
FP64 = tl.constexpr(0)  # float64 rows, float64 products
TF32X3 = tl.constexpr(1)  # float32 rows as TF32 hi + lo: hi·hi + hi·lo + lo·hi
TF32 = tl.constexpr(2)  # float32 rows as TF32
HALF = tl.constexpr(3)  # bfloat16 or float16 rows, as given or rounded from float32 ("medium")
# float32 rows as bfloat16 hi + lo (16 of float32's 24 bits): hi·hi + hi·lo + lo·hi. The
# Euclidean engines' points of bfloat16 and float16 rows (euclid._Points): half the bytes of
# the TF32 pair and twice its products' rate, within 2^-14 of each product.
BF16X3 = tl.constexpr(4)

# rows_kernel's modes.
SUPCON = tl.constexpr(0)
NTXENT_NEGATIVES = tl.constexpr(1)
NTXENT_POSITIVES = tl.constexpr(2)
PROXY = tl.constexpr(3)
# grad_kernel's losses.
LOSS_SUPCON = tl.constexpr(0)
LOSS_NTXENT = tl.constexpr(1)
LOSS_PROXY = tl.constexpr(2)

# Programs a launch aims for: two per SM of an H100/H200 (132). The refs are split into
# slices until the anchors' blocks times the slices reach it.
FILL = 264

# The largest |scale| whose terms rows_kernel forms in base 2 with the scale folded into the
# anchors' factors (BASE2): times log2(e) and a factor (at most 1e12, a clamped row's) it stays
# far inside float32's range. A larger scale takes the terms in base e, as the CPU kernel.
BASE2_SCALE = 2.0**64

# Launch configurations; every one is run by the tests and compiled by tools/triton_check.py,
# the first being the default.
# rows_kernel's: the second the TF32 pair's default where its rows are held whole (two stages:
# three pass sm_90's shared memory).
ROWS_CONFIGS = (
    Config(BLOCK_N=64, BLOCK_M=64, BLOCK_K=32, num_warps=8, num_stages=3),
    Config(BLOCK_N=64, BLOCK_M=64, BLOCK_K=16, num_warps=8, num_stages=2),
    Config(BLOCK_N=32, BLOCK_M=32, BLOCK_K=16, num_warps=4, num_stages=2),  # float64's
)
# grad_kernel's: feature blocks at most BLOCK_F wide (_grad_config), the first's as wide as
# its accumulator fits in the registers (each block recomputes the tile); the second the TF32
# pair's default where its rows are held whole (eight warps spill them).
GRAD_CONFIGS = (
    Config(BLOCK_N=64, BLOCK_M=32, BLOCK_K=32, BLOCK_F=256, num_warps=8, num_stages=4),
    Config(BLOCK_N=64, BLOCK_M=32, BLOCK_K=32, BLOCK_F=256, num_warps=4, num_stages=2),
    Config(BLOCK_N=32, BLOCK_M=32, BLOCK_K=16, BLOCK_F=32, num_warps=4, num_stages=2),  # float64's
)
# The slices jacobian_kernel loads at once (it writes the four loads out).
SLICE_GROUP = tl.constexpr(4)
# The per-row kernels (prefix, merge, Jacobian); exact operations only (no FMA contraction),
# as the CPU kernels round the norms.
ROW_CONFIGS = (
    Config(BLOCK_ROWS=16, BLOCK_D=128, num_warps=4, num_stages=2, fp_fusion=False),
    Config(BLOCK_ROWS=8, BLOCK_D=16, num_warps=2, num_stages=2, fp_fusion=False),
)


def scheme(dtype: torch.dtype) -> int:
    """How products of `dtype` rows are taken: float64 as float64; bfloat16 and float16 as
    given; float32 by PyTorch's fp32-matmul setting, read at the call
    (torchkit.triton.float32_products)."""
    if dtype == torch.float64:
        return FP64.value
    if dtype != torch.float32:
        return HALF.value
    return {"3xTF32": TF32X3, "TF32": TF32, "bfloat16": HALF}[float32_products()].value


# --------------------------------------------------------------------------- shared pieces


@triton.jit
def _tf32(x):
    """x rounded to TF32 (10 mantissa bits; to nearest, ties to even), as float32; NaN stays
    NaN. The tensor cores ignore the 13 bits below, so they take such a value exactly."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0xFFF + ((bits >> 13) & 1)) & -8192
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def _bf16(x):
    """x rounded to bfloat16 (to nearest, ties to even), as float32; NaN stays NaN. The GPU's
    conversion rounds so, the interpreter's truncates: a value rounded here first converts
    exactly on both, so that operands whose rounding an error bound assumes (euclid's points)
    are the GPU's under the interpreter too."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def _load(hi_ptr, lo_ptr, rows, ks, mask, D, SCHEME: tl.constexpr, INTERPRET: tl.constexpr):
    """A tile of operands: hi (and lo for TF32X3 and BF16X3), 0 in masked lanes; half types
    upcast under the interpreter, whose bfloat16 arithmetic is on the raw bits (their products
    are exact in float32, so the result is the GPU's)."""
    offsets = rows[:, None] * D + ks[None, :]
    hi = tl.load(hi_ptr + offsets, mask=mask, other=0.0)
    lo = hi
    if SCHEME == TF32X3 or SCHEME == BF16X3:  # noqa: SIM109 (constexprs: Triton compares them, not tuples)
        lo = tl.load(lo_ptr + offsets, mask=mask, other=0.0)
    if SCHEME == HALF:
        if INTERPRET:
            hi = hi.to(tl.float32)
            lo = hi
    if SCHEME == BF16X3:
        if INTERPRET:
            hi = hi.to(tl.float32)
            lo = lo.to(tl.float32)
    return hi, lo


@triton.jit
def _mma(a_hi, a_lo, b_hi, b_lo, acc, SCHEME: tl.constexpr):
    """acc + a·b (a: (n, k), b: (k, m)) on tensor cores by the scheme: the small products first."""
    if SCHEME == FP64:
        return tl.dot(a_hi, b_hi, acc, out_dtype=tl.float64)
    elif SCHEME == TF32X3:
        acc = tl.dot(a_lo, b_hi, acc, input_precision="tf32", out_dtype=tl.float32)
        acc = tl.dot(a_hi, b_lo, acc, input_precision="tf32", out_dtype=tl.float32)
        return tl.dot(a_hi, b_hi, acc, input_precision="tf32", out_dtype=tl.float32)
    elif SCHEME == BF16X3:
        acc = tl.dot(a_lo, b_hi, acc, out_dtype=tl.float32)
        acc = tl.dot(a_hi, b_lo, acc, out_dtype=tl.float32)
        return tl.dot(a_hi, b_hi, acc, out_dtype=tl.float32)
    elif SCHEME == TF32:
        return tl.dot(a_hi, b_hi, acc, input_precision="tf32", out_dtype=tl.float32)
    else:
        return tl.dot(a_hi, b_hi, acc, out_dtype=tl.float32)


@triton.jit
def _split_mma(a, b, acc, SCHEME: tl.constexpr, INTERPRET: tl.constexpr):
    """acc + a·b for float32 tiles (a: (n, k), b: (k, m)) by a float32 scheme (TF32X3, TF32 or
    HALF: bfloat16), the operands rounded or split here rather than stored so (cdist's and
    bilinear_pool's GEMMs read the raw inputs). The tensor cores take a TF32 value exactly
    (_tf32), so the interpreter, whose dot ignores the precision, forms the GPU's products;
    bfloat16 × bfloat16 products are exact in float32, so it multiplies those upcast (its
    bfloat16 arithmetic works on the raw bits): the same products, summed in another order."""
    if SCHEME == TF32X3:
        a_hi = _tf32(a)
        b_hi = _tf32(b)
        acc = _mma(a_hi, _tf32(a - a_hi), b_hi, _tf32(b - b_hi), acc, SCHEME)
    elif SCHEME == TF32:
        acc = _mma(_tf32(a), a, _tf32(b), b, acc, SCHEME)
    else:
        a_h = a.to(tl.bfloat16)
        b_h = b.to(tl.bfloat16)
        if INTERPRET:
            a_h = a_h.to(tl.float32)
            b_h = b_h.to(tl.float32)
        acc = tl.dot(a_h, b_h, acc, out_dtype=tl.float32)
    return acc


@triton.jit
def _cosines(
    a_hi,
    a_lo,
    b_hi,
    b_lo,
    f_a,
    f_b,
    rows,
    cols,
    row_mask,
    col_mask,
    D,
    ACC: tl.constexpr,
    SCHEME: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The cosine tile of rows `rows` of a against rows `cols` of b: their scaled rows' products
    times both factors."""
    s = tl.zeros((rows.shape[0], cols.shape[0]), ACC)
    for k0 in range(0, D, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < D
        ah, al = _load(a_hi, a_lo, rows, ks, row_mask[:, None] & k_mask[None, :], D, SCHEME, INTERPRET)
        bh, bl = _load(b_hi, b_lo, cols, ks, col_mask[:, None] & k_mask[None, :], D, SCHEME, INTERPRET)
        s = _mma(ah, al, tl.trans(bh), tl.trans(bl), s, SCHEME)
    return s * f_a[:, None] * f_b[None, :]


@triton.jit
def _refs(
    b_hi, b_lo, b_f, b_bad, cols, col_mask, D, SCHEME: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_D: tl.constexpr
):
    """A tile's refs: their factors, bad flags (int8) and, where rows are held (BLOCK_D > 0),
    their whole rows' operands; every load issued before any is used: one round trip to memory."""
    f_b = tl.load(b_f + cols, mask=col_mask, other=0.0)
    bad_b = tl.load(b_bad + cols, mask=col_mask, other=0)
    bh = f_b
    bl = f_b
    if BLOCK_D > 0:
        ks = tl.arange(0, BLOCK_D)
        bh, bl = _load(b_hi, b_lo, cols, ks, col_mask[:, None] & (ks < D)[None, :], D, SCHEME, INTERPRET)
    return f_b, bad_b, bh, bl


@triton.jit
def _held_cosines(ah, al, bh, bl, f_a, f_b, ACC: tl.constexpr, SCHEME: tl.constexpr):
    """_cosines with both sides' whole rows loaded (ah, al: the anchors', held; bh, bl: the
    refs'): one product per tile."""
    s = _mma(ah, al, tl.trans(bh), tl.trans(bl), tl.zeros((ah.shape[0], bh.shape[0]), ACC), SCHEME)
    return s * f_a[:, None] * f_b[None, :]


@triton.jit
def _poison(c, bad_a, bad_b):
    """NaN for the pairs of a row that holds a NaN or ±∞ (its operand is 0)."""
    return tl.where(bad_a[:, None] | bad_b[None, :], float("nan"), c)


@triton.jit
def _any(mask):
    """Whether a 2-D mask holds anywhere (a branch that skips a tile's work)."""
    return tl.max(tl.max(mask.to(tl.int32), axis=1), axis=0) > 0


@triton.jit
def _exp(x):
    """e^x as the GPU's exp2 unit takes it."""
    return tl.exp2(x * LOG2E)


@triton.jit
def _power(x, BASE2: tl.constexpr):
    """2^x where x is in base 2 (BASE2), else e^x."""
    if BASE2:
        return tl.exp2(x)
    else:
        return _exp(x)


@triton.jit
def _fold(m, s, nan, x, keep, BASE2: tl.constexpr, MASKED: tl.constexpr = True):
    """Folds the kept entries of x (per row; every one unless MASKED) into the running
    log-sum-exp (m, s): s·e^m, or s·2^m where x is in base 2 (BASE2). A term of +∞ (a finite
    parameter's product past the accumulation type) makes the sum +∞ (m = ∞, s = 1), as the
    CPU kernels' LogSumExp::overflow; a NaN term sets nan."""
    if MASKED:
        x = tl.where(keep, x, float("-inf"))
    m_new = tl.maximum(m, tl.max(x, axis=1))
    live = (m_new != float("-inf")) & (m_new != float("inf"))
    shift = tl.where(live, m_new, 0.0)
    p = _power(x - shift[:, None], BASE2)  # (0 where masked: shift is finite)
    s_new = tl.where(live, s * _power(m - shift, BASE2), 0.0) + tl.sum(p, axis=1)
    nan = nan | (s_new != s_new)
    return m_new, tl.where(m_new == float("inf"), 1.0, s_new), nan


@triton.jit
def _log_add_exp(x, log_s):
    """log(exp(x) + exp(log_s)) as the CPU kernel forms it (x where log_s = −∞)."""
    top = tl.maximum(x, log_s, propagate_nan=tl.PropagateNan.ALL)
    return tl.where(log_s == float("-inf"), x, top + tl.log(1.0 + tl.exp(-tl.abs(x - log_s))))


@triton.jit
def _tiny(IS64: tl.constexpr):
    """PML's small_val: the accumulation type's smallest normal."""
    if IS64:
        return tm.pow2(tl.full((), -1022, tl.int32), IS64)
    else:
        return tm.pow2(tl.full((), -126, tl.int32), IS64)


# --------------------------------------------------------------------------- prefix


@triton.jit
def operands_kernel(
    x_ptr,
    hi_ptr,
    lo_ptr,
    f_ptr,
    bad_ptr,
    exp_ptr,
    inv_ptr,
    clamped_ptr,
    N,
    D,
    stride_row,
    ACC: tl.constexpr,
    IS64: tl.constexpr,
    SCHEME: tl.constexpr,
    SCALED: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Per row: its operand(s) x·2^-E in the scheme's layout (x as given where not SCALED; 0 for
    a row holding NaN or ±∞) and the factor f with F.normalize(x) = operand·f (0 for a row of
    zeros, or one holding NaN or ±∞); bad (int8) where the row holds NaN or ±∞; and as the
    Jacobian takes them, E (int32), inv = 1/‖x·2^-E‖ (1e12 where the clamp holds, 1/top for a
    bad row, E = 0 there) and whether the clamp holds."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < N
    top = tl.zeros((BLOCK_ROWS,), ACC)
    for k0 in range(0, D, BLOCK_D):
        ks = k0 + tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (ks < D)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_row + ks[None, :], mask=mask, other=0.0).to(ACC)
        top = tl.maximum(top, tl.max(tl.abs(x), axis=1), propagate_nan=tl.PropagateNan.ALL)
        top = tl.where(tl.max(tl.where(mask & (x != x), 1, 0), axis=1) > 0, float("nan"), top)
    bad = (top != top) | (top == float("inf"))
    special = (top == 0) | bad
    E = tl.where(special, 0, tm.ilogb(tl.where(special, 1.0, top), IS64) + 1)
    sq = tl.zeros((BLOCK_ROWS,), ACC)
    for k0 in range(0, D, BLOCK_D):
        ks = k0 + tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (ks < D)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_row + ks[None, :], mask=mask, other=0.0).to(ACC)
        v = tm.ldexp(x, 0 - E[:, None], IS64)
        sq += tl.sum(v * v, axis=1)
    norm = tm.sqrt_rn(sq, IS64)  # of the row times 2^-E: in [1/2, sqrt(D)] for an ordinary row
    clamped = (top == 0) | (tm.ldexp(norm, E, IS64) < NORM_EPS)
    one = tl.full((BLOCK_ROWS,), 1.0, ACC)
    eps_inv = one / tl.full((BLOCK_ROWS,), NORM_EPS, ACC)
    # (Each quotient's divisor made non-zero where the other branch is taken: masked rows too.)
    inv = tl.where(
        clamped,
        eps_inv,
        tl.where(special, one / tl.where(top == 0, 1.0, top), one / tl.where(norm == 0, 1.0, norm)),
    )
    # operand·f = x/max(‖x‖, eps): where the clamp holds x·1e12 = (x·2^-E)·(2^E·1e12).
    if SCALED:
        f = tl.where(clamped, tm.ldexp(eps_inv, E, IS64), inv)
    else:
        f = tl.where(clamped, eps_inv, tm.ldexp(inv, 0 - E, IS64))
    # (0 for a row of zeros, whose operand is 0 anyway: a backward multiplies f into ∂loss/∂c
    # before rounding it to the operands' type, where 1e12 would overflow float16)
    f = tl.where(bad | (top == 0), 0.0, f)
    for k0 in range(0, D, BLOCK_D):
        ks = k0 + tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (ks < D)[None, :]
        offsets = rows[:, None] * D + ks[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_row + ks[None, :], mask=mask, other=0.0).to(ACC)
        if SCALED:
            x = tm.ldexp(x, 0 - E[:, None], IS64)
        x = tl.where(bad[:, None], 0.0, x)
        if SCHEME == TF32X3:
            hi = _tf32(x)
            tl.store(hi_ptr + offsets, hi, mask=mask)
            tl.store(lo_ptr + offsets, _tf32(x - hi), mask=mask)
        elif SCHEME == TF32:
            tl.store(hi_ptr + offsets, _tf32(x), mask=mask)
        else:
            tl.store(hi_ptr + offsets, x.to(hi_ptr.dtype.element_ty), mask=mask)
    tl.store(f_ptr + rows, f, mask=row_mask)
    tl.store(bad_ptr + rows, bad.to(tl.int8), mask=row_mask)
    tl.store(exp_ptr + rows, E, mask=row_mask)
    tl.store(inv_ptr + rows, inv, mask=row_mask)
    tl.store(clamped_ptr + rows, clamped.to(tl.int8), mask=row_mask)


@triton.jit
def _probe(sorted_ptr, n, at, step, FANOUT: tl.constexpr):
    """A level of a search in n ascending values, each lane's: the FANOUT values step apart
    after at (FANOUT + 1 ranges), loaded together (one round trip to memory), those past the
    end masked (as above every x)."""
    probes = at[:, None] + (tl.arange(0, FANOUT)[None, :] + 1) * step
    ok = probes <= n
    return tl.load(sorted_ptr + (probes - 1), mask=ok, other=0), ok


@triton.jit
def _advance(at, v, ok, x, step, UPPER: tl.constexpr):
    """The lane moves past _probe's values below x (<= x with UPPER): a prefix of them, as the
    values ascend."""
    below = ok & ((v <= x[:, None]) if UPPER else (v < x[:, None]))
    return at + tl.sum(below.to(tl.int64), axis=1) * step


@triton.jit
def ids_kernel(
    a_ptr,
    sorted_a_ptr,
    NA,
    b_ptr,
    sorted_b_ptr,
    NB,
    LEVELS,
    ids_ptr,
    npos_ptr,
    TWO: tl.constexpr,
    SELF: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    FANOUT: tl.constexpr,
):
    """The labels' ids and the anchors' positive pairs (_label_ids). Into ids_ptr's NA (and with
    TWO, NB more) int32: each of the NA labels at a_ptr (then the NB at b_ptr) gets its rank
    among them all, the values below it in each side's sorted labels. Equal labels get equal
    ids, all below NA + NB. Into npos_ptr's NA: each of a's labels' count among b's (a's
    without TWO: the wrapper passes them as b), less itself with SELF.

    The searches ((FANOUT + 1)^LEVELS > NA, NB: steps from (FANOUT + 1)^(LEVELS − 1) down,
    probes past a side's end masked) share one loop: a round trip to memory a level, where a
    binary search takes one a bit (14 at 8,192 labels; 5 levels of 8 probes)."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    in_a = rows < NA
    x = tl.load(a_ptr + rows, mask=in_a, other=0)
    if TWO:
        in_b = (rows >= NA) & (rows < NA + NB)
        x = tl.where(in_a, x, tl.load(b_ptr + (rows - NA), mask=in_b, other=0))
    # (int64: a level's last probe may lie past 2^31 where the labels do not)
    below_a = tl.zeros(x.shape, tl.int64)  # (TWO: a's labels < x)
    below_b = tl.zeros(x.shape, tl.int64)  # b's labels < x
    upto_b = tl.zeros(x.shape, tl.int64)  # b's labels <= x
    step = tl.full((), 1, tl.int64)
    for _ in range(1, LEVELS):
        step *= FANOUT + 1
    for _ in range(0, LEVELS):
        if TWO:
            va, ok_a = _probe(sorted_a_ptr, NA, below_a, step, FANOUT)
        vb, ok_b = _probe(sorted_b_ptr, NB, below_b, step, FANOUT)
        vu, ok_u = _probe(sorted_b_ptr, NB, upto_b, step, FANOUT)
        if TWO:
            below_a = _advance(below_a, va, ok_a, x, step, False)
        below_b = _advance(below_b, vb, ok_b, x, step, False)
        upto_b = _advance(upto_b, vu, ok_u, x, step, True)
        step = step // (FANOUT + 1)
    if TWO:
        tl.store(ids_ptr + rows, (below_a + below_b).to(tl.int32), mask=in_a | in_b)
    else:
        tl.store(ids_ptr + rows, below_b.to(tl.int32), mask=in_a)
    npos = (upto_b - below_b).to(tl.int32)
    if SELF:
        npos -= 1
    tl.store(npos_ptr + rows, npos, mask=in_a)


@triton.jit
def count_kernel(ids_ptr, count_ptr, M, C, BLOCK_ROWS: tl.constexpr):
    """count[id] += 1 for each of M ids (proxy-anchor's labels: their classes) in [0, C), the
    count's length (others are refused by a device-side assertion, which may fire after this
    launch: they write nothing): int32 atomics, the same counts in any order."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    mask = rows < M
    ids = tl.load(ids_ptr + rows, mask=mask, other=0)
    mask &= (ids >= 0) & (ids < C)
    tl.atomic_add(count_ptr + ids, tl.full((BLOCK_ROWS,), 1, tl.int32), mask=mask, sem="relaxed")


@triton.jit
def positives_kernel(ids_ptr, count_ptr, npos_ptr, N, BLOCK_ROWS: tl.constexpr):
    """Each of N anchors' positive pairs: the refs counted under its id (count_kernel)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    mask = rows < N
    ids = tl.load(ids_ptr + rows, mask=mask, other=0)
    tl.store(npos_ptr + rows, tl.load(count_ptr + ids, mask=mask, other=0), mask=mask)


# --------------------------------------------------------------------------- forward


@hot()
@triton.jit
def rows_kernel(
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
    log_s_ptr,
    part_ptr,
    N,
    M,
    D,
    OFFSET,
    CHUNK,
    SCALE_BITS,
    SHIFT_BITS,
    SELF: tl.constexpr,
    MODE: tl.constexpr,
    BASE2: tl.constexpr,
    ACC: tl.constexpr,
    IS64: tl.constexpr,
    SCHEME: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Per anchor of a block, over the refs of slice program_id(1) (CHUNK refs from
    program_id(1)·CHUNK): the partials part[k, slice, anchor] (k: m, s, sum, m2, s2; each
    running log-sum-exp s·e^m, s NaN where a term was NaN). x = c·scale; pairs: every ref but
    the anchor itself with SELF, anchor i being ref OFFSET + i; positives: equal labels.
    SUPCON: (m, s) of every pair's x, sum = Σ_positives x;
    NTXENT_NEGATIVES: (m, s) of the negatives' x, sum;
    NTXENT_POSITIVES (log_s: log S of the negatives, whole): (m, s) of log R = log Σ_p
    q/(q + tiny)/(exp(x_p) + S), sum = Σ_p −log(q_p + tiny), q_p = exp(x_p)/(exp(x_p) + S);
    PROXY (anchors: the proxies, scale = α, shift = margin): (m, s) of the negatives'
    α(c + margin), (m2, s2) of the positives' α(margin − c).
    BASE2 (SUPCON and NTXENT_NEGATIVES, a scale whose product with log2(e) and a factor stays
    finite): x·log2(e) formed at once, the scale and log2(e) folded into the anchors'
    factors, and the running sums kept in base 2 (m and sum taken back to base e per anchor at
    the end). Their tiles wholly inside the problem and off the diagonal fold without masks."""
    scale = tm.f64(SCALE_BITS).to(ACC)
    shift = tm.f64(SHIFT_BITS).to(ACC)
    tiny = _tiny(IS64)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    me = rows.to(tl.int32) + OFFSET  # (int32 comparisons on the tile: fewer registers)
    lab = tl.load(lab_ptr + rows, mask=row_mask, other=0)
    f_a = tl.load(a_f + rows, mask=row_mask, other=0.0)
    if BASE2:
        f_a = f_a * (scale * LOG2E)
    bad_a = tl.load(a_bad + rows, mask=row_mask, other=0) != 0
    any_bad_a = tl.max(bad_a.to(tl.int32), axis=0) > 0
    # Where the tiles of this block of anchors are wholly inside the problem and off the diagonal.
    first_row = tl.program_id(0) * BLOCK_N
    full_rows = first_row + BLOCK_N <= N
    m = tl.full((BLOCK_N,), float("-inf"), ACC)
    s = tl.zeros((BLOCK_N,), ACC)
    nan = tl.zeros((BLOCK_N,), tl.int1)
    m2 = tl.full((BLOCK_N,), float("-inf"), ACC)
    s2 = tl.zeros((BLOCK_N,), ACC)
    nan2 = tl.zeros((BLOCK_N,), tl.int1)
    total = tl.zeros((BLOCK_N,), ACC)
    if MODE == NTXENT_POSITIVES:
        log_s = tl.load(log_s_ptr + rows, mask=row_mask, other=0.0)
    if BLOCK_D > 0:  # the anchors' whole rows, held across the refs (BLOCK_D >= D)
        ks = tl.arange(0, BLOCK_D)
        k_mask = ks < D
        ah, al = _load(a_hi, a_lo, rows, ks, row_mask[:, None] & k_mask[None, :], D, SCHEME, INTERPRET)
    first = tl.program_id(1).to(tl.int64) * CHUNK
    last = tl.minimum(first + CHUNK, M)
    for j0 in range(first, last, BLOCK_M):
        cols = j0 + tl.arange(0, BLOCK_M).to(tl.int64)
        col_mask = cols < last
        ref_lab = tl.load(ref_lab_ptr + cols, mask=col_mask, other=-1)
        if MODE != NTXENT_POSITIVES:  # (the positives' pass loads the rest in their tiles only)
            f_b, bad_b, bh, bl = _refs(b_hi, b_lo, b_f, b_bad, cols, col_mask, D, SCHEME, INTERPRET, BLOCK_D)
        valid = row_mask[:, None] & col_mask[None, :]
        if SELF:
            valid = valid & (me[:, None] != cols.to(tl.int32)[None, :])
        if MODE == NTXENT_POSITIVES:
            go = _any(valid & (lab[:, None] == ref_lab[None, :]))  # (the positive pairs' pass: their tiles only)
        else:
            go = True
        if go:
            if MODE == NTXENT_POSITIVES:
                f_b, bad_b, bh, bl = _refs(b_hi, b_lo, b_f, b_bad, cols, col_mask, D, SCHEME, INTERPRET, BLOCK_D)
            if BLOCK_D > 0:
                c = _held_cosines(ah, al, bh, bl, f_a, f_b, ACC, SCHEME)
            else:
                c = _cosines(
                    a_hi, a_lo, b_hi, b_lo, f_a, f_b, rows, cols, row_mask, col_mask, D, ACC, SCHEME, INTERPRET, BLOCK_K
                )
            if any_bad_a | (tl.max(bad_b.to(tl.int32), axis=0) > 0):
                c = _poison(c, bad_a, bad_b != 0)
            if MODE == PROXY:
                # α(c + margin) and α(margin − c), as the CPU kernel forms them: an α past the
                # accumulation type's range makes them ±∞ by their sign (+∞: the loss is ∞),
                # where α·c + α·margin would be ∞ − ∞; a zero factor stays 0.
                pos = valid & (lab[:, None] == ref_lab[None, :])
                y = tl.where(c + shift == 0, 0.0, (c + shift) * scale)
                m, s, nan = _fold(m, s, nan, y, valid & (pos == 0), False)
                if _any(pos):
                    z = tl.where(shift - c == 0, 0.0, (shift - c) * scale)
                    m2, s2, nan2 = _fold(m2, s2, nan2, z, pos, False)
            elif MODE == NTXENT_POSITIVES:
                pos = valid & (lab[:, None] == ref_lab[None, :])
                x = c * scale
                lse = _log_add_exp(x, log_s[:, None])
                q = tl.exp(x - lse)
                total += tl.sum(tl.where(pos, -tl.log(q + tiny), 0.0), axis=1)
                r = tl.where(q > 0, tl.log(tl.where(q > 0, q, 1.0) / (q + tiny)), float("-inf")) - lse
                m, s, nan = _fold(m, s, nan, r, pos, False)
            else:
                if BASE2:
                    x = c
                else:
                    x = c * scale
                interior = full_rows & (j0 + BLOCK_M <= last)
                if SELF:  # (off the diagonal: the anchors' own refs are elsewhere)
                    interior = interior & ((j0 >= first_row + OFFSET + BLOCK_N) | (j0 + BLOCK_M <= first_row + OFFSET))
                if interior:
                    pos = lab[:, None] == ref_lab[None, :]
                    if MODE == NTXENT_NEGATIVES:
                        m, s, nan = _fold(m, s, nan, x, pos == 0, BASE2)
                    else:
                        m, s, nan = _fold(m, s, nan, x, pos, BASE2, False)
                else:
                    pos = valid & (lab[:, None] == ref_lab[None, :])
                    keep = valid
                    if MODE == NTXENT_NEGATIVES:
                        keep = valid & (pos == 0)
                    m, s, nan = _fold(m, s, nan, x, keep, BASE2)
                total += tl.sum(tl.where(pos, x, 0.0), axis=1)
    if BASE2:  # (back to base e)
        m = m * LN2
        total = total * LN2
    at = tl.program_id(1).to(tl.int64) * N + rows
    plane = tl.num_programs(1).to(tl.int64) * N
    tl.store(part_ptr + at, m, mask=row_mask)
    tl.store(part_ptr + plane + at, tl.where(nan, float("nan"), s), mask=row_mask)
    tl.store(part_ptr + 2 * plane + at, total, mask=row_mask)
    tl.store(part_ptr + 3 * plane + at, m2, mask=row_mask)
    tl.store(part_ptr + 4 * plane + at, tl.where(nan2, float("nan"), s2), mask=row_mask)


@triton.jit
def _merge(part_ptr, k, at, mask, plane, ONE: tl.constexpr, ACC: tl.constexpr):
    """log Σ of the slices' running log-sum-exps (m, s) at part[k], part[k + 1] (at: a slice ×
    anchor tile of offsets; and of e^0 = 1 with ONE), summed in a fixed order: NaN where a
    slice's was, +∞ where one's was, −∞ for none."""
    mj = tl.load(part_ptr + k * plane + at, mask=mask, other=float("-inf"))
    sj = tl.load(part_ptr + (k + 1) * plane + at, mask=mask, other=0.0)
    mj = tl.where(mj == mj, mj, float("-inf"))
    m = tl.max(mj, axis=0)
    if ONE:
        m = tl.maximum(m, 0.0)
    live = (m != float("-inf")) & (m != float("inf"))
    shift = tl.where(live, m, 0.0)
    s = tl.sum(tl.where(live[None, :] & (mj != float("-inf")), sj * _exp(mj - shift[None, :]), 0.0), axis=0)
    if ONE:
        s += tl.where(live, _exp(0.0 - shift), 0.0)
    nan = tl.max((sj != sj).to(tl.int32), axis=0) > 0
    value = tl.where(s > 0, m + tl.log(tl.where(s > 0, s, 1.0)), m)
    return tl.where(nan, float("nan"), value)


@triton.jit
def merge_kernel(
    part_ptr,
    out_ptr,
    sum_ptr,
    N,
    SLICES,
    MODE: tl.constexpr,
    ONE: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """rows_kernel's slices (at most BLOCK_S) merged per anchor, in a fixed order (the same
    bits on every run): out = the log-sum-exp (proxy-anchor's Ln = log(1 + Σ negatives),
    without the 1 unless ONE: a shard's) and sum (proxy-anchor's Lp = log(1 + Σ positives),
    likewise). Every slice is loaded at once: one round trip to memory."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < N
    slices = tl.arange(0, BLOCK_S).to(tl.int64)
    plane = (SLICES + tl.zeros((), tl.int64)) * N
    at = slices[:, None] * N + rows[None, :]
    mask = (slices < SLICES)[:, None] & row_mask[None, :]
    total = tl.sum(tl.load(part_ptr + 2 * plane + at, mask=mask, other=0.0), axis=0)
    out = _merge(part_ptr, 0, at, mask, plane, ONE, ACC)
    if MODE == PROXY:
        total = _merge(part_ptr, 3, at, mask, plane, ONE, ACC)
    tl.store(out_ptr + rows, out, mask=row_mask)
    tl.store(sum_ptr + rows, total, mask=row_mask)


# --------------------------------------------------------------------------- the batch's loss


@triton.jit
def _to_output(x, WIDE: tl.constexpr, BF16: tl.constexpr):
    """float64 x as PyTorch casts it to the loss's dtype: as it is (WIDE: float64), else
    rounded to float32, then to the dtype by the store; bfloat16 (BF16) as the bits of its
    value rounded to nearest even here (the interpreter's conversion truncates), the store
    taking them as int16."""
    if WIDE:
        out = x
    elif BF16:
        f = x.to(tl.float32)
        bits = f.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        out = tl.where(f != f, 0x7FC0, bits).to(tl.uint16).to(tl.int16, bitcast=True)
    else:
        out = x.to(tl.float32)
    return out


@triton.jit
def _supcon_terms(lse, possum, npos):
    """SupCon's per anchor loss in float64 (0 without a positive pair, as supcon_forward in
    pair_losses_cpu.cpp), and whether PML's AvgNonZero counts it (> 0 or NaN)."""
    loss = tl.where(npos > 0, lse.to(tl.float64) - possum.to(tl.float64) / tl.maximum(npos, 1).to(tl.float64), 0.0)
    return loss, (loss > 0) | (loss != loss)


@triton.jit
def terms_kernel(out_ptr, sum_ptr, npos_ptr, partial_ptr, N, LOSS: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """Per block of anchors, the batch's partial sums partial[k, block] in float64 (k: the loss
    terms, the anchors counted, the positive pairs), from merge_kernel's out and sum and the
    anchors' positive pairs: SupCon's terms over the anchors AvgNonZero counts; NT-Xent's
    (sum: Σ_p −log(q_p + tiny)) over the anchors with a positive pair, each counted.
    Proxy-anchor's (anchors: the proxies; out: Ln, sum: Lp): Σ Lp, Σ Ln and the proxies with
    a positive pair."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < N
    npos = tl.load(npos_ptr + rows, mask=row_mask, other=0)
    total = tl.load(sum_ptr + rows, mask=row_mask, other=0.0)
    blocks = tl.num_programs(0).to(tl.int64)
    at = partial_ptr + tl.program_id(0)
    if LOSS == LOSS_PROXY:
        tl.store(at, tl.sum(total.to(tl.float64), axis=0))
        tl.store(at + blocks, tl.sum(tl.load(out_ptr + rows, mask=row_mask, other=0.0).to(tl.float64), axis=0))
        tl.store(at + 2 * blocks, tl.sum((npos > 0).to(tl.float64), axis=0))
    else:
        if LOSS == LOSS_SUPCON:
            loss, kept = _supcon_terms(tl.load(out_ptr + rows, mask=row_mask, other=0.0), total, npos)
        else:
            kept = npos > 0
            loss = total.to(tl.float64)
        tl.store(at, tl.sum(tl.where(kept, loss, 0.0), axis=0))
        tl.store(at + blocks, tl.sum(kept.to(tl.float64), axis=0))
        tl.store(at + 2 * blocks, tl.sum(npos.to(tl.int64), axis=0).to(tl.float64))


@triton.jit
def loss_kernel(
    out_ptr,
    sum_ptr,
    log_s_ptr,
    npos_ptr,
    partial_ptr,
    stats_ptr,
    result_ptr,
    N,
    BLOCKS,
    PAIRS,
    SCALE_BITS,
    LOSS: tl.constexpr,
    SHARD: tl.constexpr,
    WIDE: tl.constexpr,
    BF16: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    """PML's batch rules over terms_kernel's partials (BLOCKS of them, summed in a fixed
    order by every program: the same bits everywhere and on every run; PAIRS: the batch's
    pairs), then per block of anchors their stats, and from the first program the result:
    the loss in its dtype (as PyTorch casts it: _to_output), or a shard's parts in float64
    (csrc/pair_losses.h; its caller applies the rules to the whole problem's parts).
    SupCon (out: the log-sum-exps, sum: the positives' terms): stats (lse, w), w = 1/(npos ·
    the anchors counted) where the loss counts the anchor, else 0.
    NT-Xent (log_s: the negatives' log-sums, out: log R, sum: Σ_p −log(q_p + tiny)): stats
    (log S, log R (−∞ without a positive pair), 1/positives), all 0 where PML's rules make the
    loss 0.
    Proxy-anchor (anchors: the C = N proxies; out: Ln, sum: Lp; scale: α; not a shard): PML's
    DivisorReducer, the positive terms over the P proxies with a positive pair (0 without any),
    the negative ones over all C (proxy_anchor_forward in pair_losses_cpu.cpp); stats (Lp, Ln,
    α/P (0 without any), α/C), the quotients in float64."""
    chunk = tl.arange(0, BLOCK_ROWS)
    terms = tl.zeros((BLOCK_ROWS,), tl.float64)
    counted = tl.zeros((BLOCK_ROWS,), tl.float64)
    positives = tl.zeros((BLOCK_ROWS,), tl.float64)
    for b0 in range(0, BLOCKS, BLOCK_ROWS):
        at = b0 + chunk
        mask = at < BLOCKS
        terms += tl.load(partial_ptr + at, mask=mask, other=0.0)
        counted += tl.load(partial_ptr + BLOCKS + at, mask=mask, other=0.0)
        positives += tl.load(partial_ptr + 2 * BLOCKS + at, mask=mask, other=0.0)
    terms = tl.sum(terms, axis=0)
    counted = tl.sum(counted, axis=0)
    positives = tl.sum(positives, axis=0)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + chunk
    row_mask = rows < N
    if LOSS == LOSS_PROXY:  # (terms: Σ Lp, counted: Σ Ln, positives: P)
        alpha = tm.f64(SCALE_BITS)
        some = positives > 0
        total = tl.where(some, terms / tl.maximum(positives, 1.0), 0.0) + counted / tl.maximum(N, 1).to(tl.float64)
        share = tl.where(some, alpha / tl.maximum(positives, 1.0), 0.0).to(ACC)
        per_proxy = (alpha / tl.maximum(N, 1).to(tl.float64)).to(ACC)
        zero = tl.zeros((BLOCK_ROWS,), ACC)
        tl.store(stats_ptr + 4 * rows, tl.load(sum_ptr + rows, mask=row_mask, other=0.0), mask=row_mask)
        tl.store(stats_ptr + 4 * rows + 1, tl.load(out_ptr + rows, mask=row_mask, other=0.0), mask=row_mask)
        tl.store(stats_ptr + 4 * rows + 2, share + zero, mask=row_mask)
        tl.store(stats_ptr + 4 * rows + 3, per_proxy + zero, mask=row_mask)
        if tl.program_id(0) == 0:
            tl.store(result_ptr, _to_output(total, WIDE, BF16))
    else:
        negatives = PAIRS.to(tl.float64) - positives
        # PML's condition for a loss at all: a positive and a negative pair, and more than one of
        # one kind; a shard's terms need only the first.
        use = (positives > 0) & (negatives > 0)
        if not SHARD:
            use = use & ((positives > 1) | (negatives > 1))
        if LOSS == LOSS_SUPCON:
            if SHARD:
                use = counted > 0
            else:
                use = use & (counted > 0)
            denominator = tl.maximum(counted, 1.0)
        else:
            denominator = tl.maximum(positives, 1.0)
        total = tl.where(use, terms, 0.0)
        npos = tl.load(npos_ptr + rows, mask=row_mask, other=0)
        out = tl.load(out_ptr + rows, mask=row_mask, other=0.0)
        if LOSS == LOSS_SUPCON:
            _, kept = _supcon_terms(out, tl.load(sum_ptr + rows, mask=row_mask, other=0.0), npos)
            w = tl.where(kept, tl.where(use, 1.0 / (tl.maximum(npos, 1).to(tl.float64) * denominator), 0.0), 0.0)
            tl.store(stats_ptr + 2 * rows, out, mask=row_mask)
            tl.store(stats_ptr + 2 * rows + 1, w.to(ACC), mask=row_mask)
        else:
            log_s = tl.load(log_s_ptr + rows, mask=row_mask, other=0.0)
            log_r = tl.where(npos > 0, out, float("-inf"))
            share = (1.0 / denominator).to(ACC)
            tl.store(stats_ptr + 3 * rows, tl.where(use, log_s, 0.0), mask=row_mask)
            tl.store(stats_ptr + 3 * rows + 1, tl.where(use, log_r, 0.0), mask=row_mask)
            tl.store(stats_ptr + 3 * rows + 2, tl.where(use, share + tl.zeros_like(log_s), 0.0), mask=row_mask)
        if tl.program_id(0) == 0:
            if SHARD:
                tl.store(result_ptr, total)
                if LOSS == LOSS_SUPCON:
                    tl.store(result_ptr + 1, counted)
                    tl.store(result_ptr + 2, positives)
                    tl.store(result_ptr + 3, negatives)
                else:
                    tl.store(result_ptr + 1, positives)
                    tl.store(result_ptr + 2, negatives)
            else:
                tl.store(result_ptr, _to_output(total / denominator, WIDE, BF16))


# --------------------------------------------------------------------------- backward


@triton.jit
def _pair_terms(x, coef, shift, w, log_s, tiny, pos, LOSS: tl.constexpr, CAREFUL: tl.constexpr):
    """∂loss/∂x of one anchor's pairs (coef etc. broadcast along the anchor's axis): a
    negative pair's coef·exp(x − shift), and a positive pair's: SupCon's and NT-Xent's as
    PairGrad in pair_losses_cpu.cpp forms them, proxy anchor's −w·exp(−x − log_s). An anchor
    without terms has coef = 0 and shift = +∞, so that its terms are 0 wherever x is finite;
    CAREFUL (a NaN or ±∞ x in the tile) selects them instead."""
    every = coef * _exp(x - shift)
    if CAREFUL:
        every = tl.where(coef != 0, every, 0.0)
    if LOSS == LOSS_SUPCON:
        g = every - tl.where(pos, w, 0.0)
        if CAREFUL:
            g = tl.where(coef != 0, g, 0.0)
    elif LOSS == LOSS_PROXY:
        g = tl.where(pos, tl.where(w != 0, -w * _exp(-x - log_s), 0.0), every)
    else:
        g = every
        if _any(pos):
            q = tl.exp(x - _log_add_exp(x, log_s))
            g = tl.where(pos, tl.where(coef != 0, -q * (1.0 - q) / (q + tiny) * coef, 0.0), g)
    return g


@triton.jit
def _grad_tile(
    c,
    pos,
    valid,
    scale,
    tiny,
    ci,
    hi,
    wi,
    si,
    cj,
    hj,
    wj,
    sj,
    ANCHORS_OWN: tl.constexpr,
    ANCHORS_OTHER: tl.constexpr,
    LOSS: tl.constexpr,
    CAREFUL: tl.constexpr,
):
    """∂loss/∂c of a tile: the pairs' terms as anchors of the own rows and of the other rows."""
    x = c * scale
    g = tl.zeros(c.shape, c.dtype)
    if ANCHORS_OWN:
        g += _pair_terms(x, ci[:, None], hi[:, None], wi[:, None], si[:, None], tiny, pos, LOSS, CAREFUL)
    if ANCHORS_OTHER:
        g += _pair_terms(x, cj[None, :], hj[None, :], wj[None, :], sj[None, :], tiny, pos, LOSS, CAREFUL)
    if LOSS != LOSS_PROXY:  # (proxy anchor's coefficients, its stats', hold ∂x/∂c = α)
        g = g * scale
    return tl.where(valid, g, 0.0)


@triton.jit
def _grad_product(
    g,
    f_b,
    bh,
    bl,
    other_hi,
    other_lo,
    cols,
    col_mask,
    fs,
    f_mask,
    D,
    g_scale,
    acc,
    SCHEME: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """acc + Σ_j g_ij·e_j over a tile (g: ∂loss/∂c; e_j = operand_j·f_j, the other side's
    normalised rows, features fs) on tensor cores by the scheme: the factor goes into g, and g
    is split as the operands are (a TF32 pair; a pair hi + lo of the half type, times the
    power of two g_scale that keeps hi within float16's range: the caller divides it out; a
    bfloat16 pair against BF16X3's, gl·fl left out as the forward's lo·lo).
    Where rows are held (BLOCK_D > 0) their loaded operands bh, bl are the features'."""
    g = g * f_b[None, :]
    if BLOCK_D > 0:
        fh = bh
        fl = bl
    else:  # (loaded here, not with the tile's other loads: fewer registers live in _cosines)
        fh, fl = _load(other_hi, other_lo, cols, fs, col_mask[:, None] & f_mask[None, :], D, SCHEME, INTERPRET)
    if SCHEME == TF32X3:
        g_hi = _tf32(g)
        acc = _mma(g_hi, _tf32(g - g_hi), fh, fl, acc, SCHEME)
    elif SCHEME == TF32:
        acc = _mma(_tf32(g), g, fh, fl, acc, SCHEME)
    elif SCHEME == BF16X3:
        # (the interpreter's conversion truncates where the GPU's rounds, _bf16: its split is
        # the coarser, and a gradient within a tolerance there is within it on the GPU)
        gh = g.to(tl.bfloat16)
        gl = (g - gh.to(tl.float32)).to(tl.bfloat16)
        if INTERPRET:
            gh = gh.to(tl.float32)
            gl = gl.to(tl.float32)
        acc = _mma(gh, gl, fh, fl, acc, SCHEME)
    elif SCHEME == HALF:
        # ∂loss/∂c as a pair hi + lo of the operands' type (about 16 bits): the products stay
        # exact in float32, as the forward's.
        g = g * g_scale
        gh = g.to(other_hi.dtype.element_ty)
        gl = (g - gh.to(tl.float32)).to(other_hi.dtype.element_ty)
        if INTERPRET:
            gh = gh.to(tl.float32)
            gl = gl.to(tl.float32)
        acc = _mma(gl, gl, fh, fl, acc, SCHEME)
        acc = _mma(gh, gh, fh, fl, acc, SCHEME)
    else:
        acc = _mma(g, g, fh, fl, acc, SCHEME)
    return acc


@hot()
@triton.jit
def grad_kernel(
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
    coef_ptr,
    shift_ptr,
    w_ptr,
    log_s_ptr,
    out_ptr,
    N_OWN,
    N_OTHER,
    D,
    OFFSET,
    CHUNK,
    SCALE_BITS,
    G_SCALE_BITS,
    SELF: tl.constexpr,
    ANCHORS_OWN: tl.constexpr,
    ANCHORS_OTHER: tl.constexpr,
    LOSS: tl.constexpr,
    CAREFUL: tl.constexpr,
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
    """out[slice, own rows, feature block] = Σ over the other rows of the slice (CHUNK from
    program_id(2)·CHUNK) of ∂loss/∂c · the other side's normalised rows: ∂/∂c of the pairs
    whose anchor is the own row (ANCHORS_OWN) and of those whose anchor is the other row
    (ANCHORS_OTHER; both without refs), the per-anchor arrays indexed by anchor. SELF: own row
    i is other's row OFFSET + i (a shard's rows of the whole problem; 0: the same rows), not
    a pair. CAREFUL: every tile as one that holds a NaN or ±∞ x (a scale or shift past the
    accumulation type's range). G_SCALE: a power of two that ∂loss/∂c is multiplied by before
    it is rounded to a half type (HALF)."""
    scale = tm.f64(SCALE_BITS).to(ACC)
    g_scale = tm.f64(G_SCALE_BITS).to(ACC)
    tiny = _tiny(IS64)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    fs = tl.program_id(1).to(tl.int64) * BLOCK_F + tl.arange(0, BLOCK_F)
    row_mask = rows < N_OWN
    f_mask = fs < D
    me = rows.to(tl.int32) + OFFSET  # (int32 comparisons on the tile: fewer registers)
    lab = tl.load(own_lab_ptr + rows, mask=row_mask, other=0)
    f_a = tl.load(own_f + rows, mask=row_mask, other=0.0)
    bad_a = tl.load(own_bad + rows, mask=row_mask, other=0) != 0
    any_bad_a = tl.max(bad_a.to(tl.int32), axis=0) > 0
    ci = tl.zeros((BLOCK_N,), ACC)
    hi = ci
    wi = ci
    si = ci
    if ANCHORS_OWN:
        ci = tl.load(coef_ptr + OFFSET + rows, mask=row_mask, other=0.0)
        hi = tl.load(shift_ptr + OFFSET + rows, mask=row_mask, other=0.0)
        wi = tl.load(w_ptr + OFFSET + rows, mask=row_mask, other=0.0)
        si = tl.load(log_s_ptr + OFFSET + rows, mask=row_mask, other=0.0)
    acc = tl.zeros((BLOCK_N, BLOCK_F), ACC)
    if BLOCK_D > 0:  # the own rows whole, held across the other rows (BLOCK_D >= D)
        tl.static_assert(BLOCK_F == BLOCK_D, "held rows are one feature block")
        ks = tl.arange(0, BLOCK_D)
        k_mask = ks < D
        ah, al = _load(own_hi, own_lo, rows, ks, row_mask[:, None] & k_mask[None, :], D, SCHEME, INTERPRET)
    first = tl.program_id(2).to(tl.int64) * CHUNK
    last = tl.minimum(first + CHUNK, N_OTHER)
    for j0 in range(first, last, BLOCK_M):
        cols = j0 + tl.arange(0, BLOCK_M).to(tl.int64)
        col_mask = cols < last
        # Every load of the tile issued before any is used: one round trip to memory (the
        # operands last: the interpreter's upcast of a half type uses them at once).
        cj = tl.zeros((BLOCK_M,), ACC)
        hj = cj
        wj = cj
        sj = cj
        if ANCHORS_OTHER:
            cj = tl.load(coef_ptr + cols, mask=col_mask, other=0.0)
            hj = tl.load(shift_ptr + cols, mask=col_mask, other=0.0)
            wj = tl.load(w_ptr + cols, mask=col_mask, other=0.0)
            sj = tl.load(log_s_ptr + cols, mask=col_mask, other=0.0)
        other_lab = tl.load(other_lab_ptr + cols, mask=col_mask, other=-1)
        f_b, bad_b, bh, bl = _refs(
            other_hi, other_lo, other_f, other_bad, cols, col_mask, D, SCHEME, INTERPRET, BLOCK_D
        )
        if BLOCK_D > 0:  # (the product's features are the whole rows: BLOCK_F == BLOCK_D)
            c = _held_cosines(ah, al, bh, bl, f_a, f_b, ACC, SCHEME)
        else:
            c = _cosines(
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
        valid = row_mask[:, None] & col_mask[None, :]
        if SELF:
            valid = valid & (me[:, None] != cols.to(tl.int32)[None, :])
        pos = lab[:, None] == other_lab[None, :]
        if (any_bad_a | (tl.max(bad_b.to(tl.int32), axis=0) > 0)) | CAREFUL:
            c = _poison(c, bad_a, bad_b != 0)
            g = _grad_tile(
                c, pos, valid, scale, tiny, ci, hi, wi, si, cj, hj, wj, sj, ANCHORS_OWN, ANCHORS_OTHER, LOSS, True
            )
        else:
            g = _grad_tile(
                c, pos, valid, scale, tiny, ci, hi, wi, si, cj, hj, wj, sj, ANCHORS_OWN, ANCHORS_OTHER, LOSS, False
            )
        acc = _grad_product(
            g, f_b, bh, bl, other_hi, other_lo, cols, col_mask, fs, f_mask, D, g_scale, acc, SCHEME, INTERPRET, BLOCK_D
        )
    if SCHEME == HALF:
        acc = acc / g_scale
    out = out_ptr + (tl.program_id(2).to(tl.int64) * N_OWN + rows[:, None]) * D + fs[None, :]
    tl.store(out, acc, mask=row_mask[:, None] & f_mask[None, :])


@triton.jit
def coef_kernel(
    stats_ptr, terms_ptr, N, LOSS: tl.constexpr, ACC: tl.constexpr, IS64: tl.constexpr, BLOCK_ROWS: tl.constexpr
):
    """Per anchor, grad_kernel's terms[k, anchor] (k: coef, shift, w, log S) from the forward's
    stats, as PairGrad in pair_losses_cpu.cpp forms them. NT-Xent (stats: log S, log R, share):
    coef = share where log R > −∞, shift = −log R where coef ≠ 0, w = 0. SupCon (stats: lse,
    w): where w ≠ 0, coef = 1/counted (the anchors with w ≠ 0: every program counts them
    over all the stats, O(N²/BLOCK_ROWS) reads, far below the backward's N² pairs; the
    quotient correctly rounded) and shift = lse; log S = 0. An anchor without terms has coef 0
    and shift +∞. The first program also writes terms[4N]: 1 where some anchor has terms, else 0
    (jacobian_kernel's LIVE: the CPU kernels' PairGrad::any)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < N
    if LOSS == LOSS_NTXENT:
        log_s = tl.load(stats_ptr + 3 * rows, mask=row_mask, other=0.0)
        log_r = tl.load(stats_ptr + 3 * rows + 1, mask=row_mask, other=0.0)
        share = tl.load(stats_ptr + 3 * rows + 2, mask=row_mask, other=0.0)
        coef = tl.where(log_r == float("-inf"), 0.0, share)
        shift = tl.where(coef != 0, -log_r, float("inf"))
        w = tl.zeros_like(coef)
        if tl.program_id(0) == 0:
            live = tl.zeros((BLOCK_ROWS,), tl.int32)
            for r0 in range(0, N, BLOCK_ROWS):
                at = r0 + tl.arange(0, BLOCK_ROWS).to(tl.int64)
                log_r_at = tl.load(stats_ptr + 3 * at + 1, mask=at < N, other=float("-inf"))
                share_at = tl.load(stats_ptr + 3 * at + 2, mask=at < N, other=0.0)
                live |= ((log_r_at != float("-inf")) & (share_at != 0)).to(tl.int32)
            tl.store(terms_ptr + 4 * N, (tl.max(live, axis=0) > 0).to(ACC))
    else:
        counted = tl.zeros((BLOCK_ROWS,), tl.int32)
        for r0 in range(0, N, BLOCK_ROWS):
            at = r0 + tl.arange(0, BLOCK_ROWS).to(tl.int64)
            counted += (tl.load(stats_ptr + 2 * at + 1, mask=at < N, other=0.0) != 0).to(tl.int32)
        if tl.program_id(0) == 0:
            tl.store(terms_ptr + 4 * N, (tl.sum(counted, axis=0) > 0).to(ACC))
        counted = tl.maximum(tl.sum(counted, axis=0), 1).to(ACC)
        lse = tl.load(stats_ptr + 2 * rows, mask=row_mask, other=0.0)
        w = tl.load(stats_ptr + 2 * rows + 1, mask=row_mask, other=0.0)
        coef = tl.where(w != 0, tm.div_rn(tl.full((BLOCK_ROWS,), 1.0, ACC), counted, IS64), 0.0)
        shift = tl.where(w != 0, lse, float("inf"))
        log_s = tl.zeros_like(coef)
    tl.store(terms_ptr + rows, coef, mask=row_mask)
    tl.store(terms_ptr + N + rows, shift, mask=row_mask)
    tl.store(terms_ptr + 2 * N + rows, w, mask=row_mask)
    tl.store(terms_ptr + 3 * N + rows, log_s, mask=row_mask)


@triton.jit
def jacobian_kernel(
    g_ptr,
    x_ptr,
    exp_ptr,
    inv_ptr,
    clamped_ptr,
    grad_ptr,
    live_ptr,
    out_ptr,
    N,
    D,
    SLICES,
    stride_row,
    LIVE: tl.constexpr,
    ACC: tl.constexpr,
    IS64: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out = grad·∂/∂x of g·e for e = x / max(‖x‖, eps), per row, g the sum of grad_kernel's
    slices (in slice order): (g − e(e·g))·inv·2^-E where ‖x‖ > eps, g·1e12 where the clamp
    holds (its constant); in out's dtype. e is formed from x as the prefix scaled it. The
    slices are loaded SLICE_GROUP at a time (one round trip to memory for each group: a few
    hundred proxies' rows are few programs, each summing dozens of slices), and their sum
    is kept in the first slice's plane (the callers' scratch) for the second pass. LIVE > 0:
    0 wherever the LIVE (1 or 2) values at live_ptr are all 0 (coef_kernel's flag: no anchor
    has a term; contrastive's stats of its first anchor: neither kind's terms count): a loss
    of 0 by PML's rules has gradients 0, a NaN row's included, as the CPU kernels'."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < N
    E = tl.load(exp_ptr + rows, mask=row_mask, other=0)
    inv = tl.load(inv_ptr + rows, mask=row_mask, other=0.0)
    clamped = tl.load(clamped_ptr + rows, mask=row_mask, other=0) != 0
    plane = (N + tl.zeros((), tl.int64)) * D
    dot = tl.zeros((BLOCK_ROWS,), ACC)
    for k0 in range(0, D, BLOCK_D):
        ks = k0 + tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (ks < D)[None, :]
        at = g_ptr + rows[:, None] * D + ks[None, :]
        g = tl.zeros((BLOCK_ROWS, BLOCK_D), ACC)
        for j in range(0, SLICES, SLICE_GROUP):
            # (a slice past the last adds +0: g, a sum from +0, is never −0)
            p0 = tl.load(at + j * plane, mask=mask, other=0.0)
            p1 = tl.load(at + (j + 1) * plane, mask=mask & (j + 1 < SLICES), other=0.0)
            p2 = tl.load(at + (j + 2) * plane, mask=mask & (j + 2 < SLICES), other=0.0)
            p3 = tl.load(at + (j + 3) * plane, mask=mask & (j + 3 < SLICES), other=0.0)
            g = g + p0 + p1 + p2 + p3
        tl.store(at, g, mask=mask)
        x = tl.load(x_ptr + rows[:, None] * stride_row + ks[None, :], mask=mask, other=0.0).to(ACC)
        e = tl.where(clamped[:, None], x * inv[:, None], tm.ldexp(x, 0 - E[:, None], IS64) * inv[:, None])
        dot += tl.sum(g * e, axis=1)
    tl.debug_barrier()  # (the sums stored, each by the thread that reads it back below)
    grad = tl.load(grad_ptr).to(ACC)
    live = True
    if LIVE > 0:
        live = tl.load(live_ptr) != 0
    if LIVE > 1:
        live = live | (tl.load(live_ptr + 1) != 0)
    along = tl.where(clamped, 0.0, dot)
    for k0 in range(0, D, BLOCK_D):
        ks = k0 + tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (ks < D)[None, :]
        g = tl.load(g_ptr + rows[:, None] * D + ks[None, :], mask=mask, other=0.0)
        x = tl.load(x_ptr + rows[:, None] * stride_row + ks[None, :], mask=mask, other=0.0).to(ACC)
        e = tl.where(clamped[:, None], x * inv[:, None], tm.ldexp(x, 0 - E[:, None], IS64) * inv[:, None])
        v = (g - e * along[:, None]) * inv[:, None]
        v = tl.where(clamped[:, None], v, tm.ldexp(v, 0 - E[:, None], IS64)) * grad
        if LIVE > 0:
            v = tl.where(live, v, 0.0)
        tl.store(out_ptr + rows[:, None] * D + ks[None, :], v.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- wrappers


def _label_ids(*labels: Tensor, self_: bool = False) -> tuple[list[Tensor], Tensor]:
    """The labels of each side (one or two) as int32 ids, equal where the labels are (a label's
    rank among them all): the tiles compare int32. And each anchor's positive pairs: the refs
    (the last side) of its label, less itself with self_. Each side sorted, then ids_kernel:
    one launch more than the sorts, no host synchronisation."""
    common = labels[0].dtype if all(v.dtype == labels[0].dtype for v in labels) else torch.int64
    if common not in _SORTED:  # (as the CPU kernels compare: in int64, a bijection of each)
        common = torch.int64
    sides = [v.reshape(-1).to(common).contiguous() for v in labels]
    ordered = [v.sort().values for v in sides]
    a, b = sides[0], sides[-1]
    na, nb = a.numel(), b.numel()
    ids = torch.empty(na + (nb if len(sides) == 2 else 0), dtype=torch.int32, device=a.device)
    npos = torch.empty(na, dtype=torch.int32, device=a.device)
    if ids.numel():
        ids_kernel[(blocks(ids.numel(), IDS_CONFIG.kwargs["BLOCK_ROWS"]),)](
            a,
            ordered[0],
            na,
            b,
            ordered[-1],
            nb,
            _search_levels(max(na, nb)),
            ids,
            npos,
            TWO=len(sides) == 2,
            SELF=self_,
            **IDS_CONFIG.launch,
        )
    return list(ids.split([v.numel() for v in sides])), npos


def _search_levels(n: int) -> int:
    """ids_kernel's search levels over at most n sorted labels: (FANOUT + 1)^levels > n.
    tools/gpu_model.py counts them as deep as at its headline size."""
    ranges = IDS_CONFIG.kwargs["FANOUT"] + 1
    levels = 1
    while ranges**levels <= n:
        levels += 1
    return levels


# The labels' dtypes the ids take as they are (every platform's sort takes them); others are
# compared as int64.
_SORTED = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


class _Operands:
    """One set of rows as the kernels take them: operands_kernel's outputs and the labels'
    int32 ids (_label_ids)."""

    def __init__(self, x: Tensor, labels: Tensor, acc: torch.dtype, row_config: Config):
        N, D = x.shape
        self.n = N
        self.labels = labels
        self.raw = x if x.stride(-1) == 1 or N == 0 else x.contiguous()
        self.scheme = scheme(x.dtype)
        dev = x.device
        operand = {FP64.value: torch.float64, TF32X3.value: torch.float32, TF32.value: torch.float32}
        dtype = operand.get(self.scheme, torch.bfloat16 if x.dtype == torch.float32 else x.dtype)
        self.hi = torch.empty(N, D, dtype=dtype, device=dev)
        self.lo = torch.empty_like(self.hi) if self.scheme == TF32X3.value else self.hi
        self.f = torch.empty(N, dtype=acc, device=dev)
        self.bad = torch.empty(N, dtype=torch.int8, device=dev)
        self.exp = torch.empty(N, dtype=torch.int32, device=dev)
        self.inv = torch.empty(N, dtype=acc, device=dev)
        self.clamped = torch.empty(N, dtype=torch.int8, device=dev)
        if N == 0:
            return
        operands_kernel[(blocks(N, row_config.kwargs["BLOCK_ROWS"]),)](
            self.raw,
            self.hi,
            self.lo,
            self.f,
            self.bad,
            self.exp,
            self.inv,
            self.clamped,
            N,
            D,
            self.raw.stride(0),
            ACC=acc_tl(acc),
            IS64=acc == torch.float64,
            SCHEME=self.scheme,
            SCALED=x.dtype != torch.float16,
            **row_config.launch,
        )

    def narrow(self, first: int, n: int) -> _Operands:
        """Rows [first, first + n) of these, as views."""
        view = object.__new__(_Operands)
        view.n, view.scheme = n, self.scheme
        for name in ("labels", "raw", "hi", "lo", "f", "bad", "exp", "inv", "clamped"):
            setattr(view, name, getattr(self, name).narrow(0, first, n))
        return view

    @property
    def pointers(self) -> tuple:
        return self.hi, self.lo, self.f, self.bad


def _sides(embeddings, labels, ref_embeddings, ref_labels, acc, row_config, self_: bool = False):
    """The anchors' and the refs' _Operands (one object without refs), and each anchor's
    positive pairs (_label_ids)."""
    if ref_embeddings is None:
        (ids,), npos = _label_ids(labels, self_=self_)
        a = _Operands(embeddings, ids, acc, row_config)
        return a, a, npos
    (ids, ref_ids), npos = _label_ids(labels, ref_labels, self_=self_)
    a = _Operands(embeddings, ids, acc, row_config)
    b = _Operands(ref_embeddings, ref_ids, acc, row_config)
    return a, b, npos


def _slices(programs: int, columns: int, block: int) -> tuple[int, int]:
    """(slices, columns per slice, a multiple of block) of `columns` so that `programs` times
    the slices reach FILL, no slice being empty."""
    tiles = blocks(columns, block)
    want = min(tiles, max(1, -(-FILL // max(programs, 1))))
    chunk = blocks(tiles, want) * block
    return blocks(columns, chunk), chunk


# The widest rows whose operands a hot kernel holds whole (one product per tile: no loop over
# the features, one round trip to memory per tile; the backward's feature block is then the
# whole row), by scheme; wider rows are multiplied a BLOCK_K slice at a time. HELD_NARROW:
# the TF32 pair's to 64 features only, where more lives beside the rows and 128 spill the
# registers: grad_kernel on sm_80, rows_kernel's NT-Xent positives and proxy-anchor passes,
# multi-similarity's backward (ms.py), the Euclidean engines' backward (euclid.py, triplets.py)
# and the triplets' forward.
HELD = {FP64.value: 0, TF32X3.value: 128, TF32.value: 128, HALF.value: 128, BF16X3.value: 128}
HELD_NARROW = {**HELD, TF32X3.value: 64}


def _held(D: int, scheme: int, table: dict = HELD) -> int:
    """The hot kernels' BLOCK_D: D's power of two where the rows are held whole, else 0."""
    block = triton.next_power_of_2(max(D, 16))
    return block if block <= table[scheme] else 0


def _rows_held(D: int, scheme: int, mode) -> int:
    """rows_kernel's BLOCK_D in `mode`."""
    return _held(D, scheme, HELD if mode in (SUPCON, NTXENT_NEGATIVES) else HELD_NARROW)


def _arch(device: torch.device) -> int:
    """The compute capability the kernels compile for on `device` (major·10 + minor); the
    interpreter's (a CPU tensor) is the headline GPU's, sm_90."""
    if device.type != "cuda":
        return 90
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def _grad_held(D: int, scheme: int, device: torch.device) -> int:
    """grad_kernel's BLOCK_D on `device`."""
    return _held(D, scheme, HELD if _arch(device) >= 90 else HELD_NARROW)


def _held_default(configs: tuple, acc: torch.dtype, scheme: int, held: int) -> Config:
    """A hot kernel's default configuration among `configs` (the engines' rows kernels and
    this one's grad_kernel): float64's (the last), the TF32 pair's rows held whole's (the
    second), or the first."""
    if acc == torch.float64:
        return configs[-1]
    return configs[1] if scheme == TF32X3.value and held else configs[0]


def _rows_default(acc: torch.dtype, scheme: int, held: int) -> Config:
    """rows_kernel's default configuration (_held_default)."""
    return _held_default(ROWS_CONFIGS, acc, scheme, held)


def _grad_default(acc: torch.dtype, scheme: int, held: int) -> Config:
    """grad_kernel's default configuration (_held_default)."""
    return _held_default(GRAD_CONFIGS, acc, scheme, held)


def _grad_config(config: Config, D: int, held: int) -> Config:
    """grad_kernel's launch of `config` for rows of D features, held whole when held > 0 (its
    BLOCK_D): they are one feature block, whose tile the program forms once; otherwise each
    block of features recomputes the tile (its products over all D and its terms), so the
    blocks are as wide as config's BLOCK_F allows (the registers' limit) and no wider than the
    rows."""
    block_f = held or min(config.kwargs["BLOCK_F"], triton.next_power_of_2(max(D, 16)))
    if block_f == config.kwargs["BLOCK_F"]:
        return config
    kwargs = {**config.kwargs, "BLOCK_F": block_f}
    return Config(num_warps=config.num_warps, num_stages=config.num_stages, fp_fusion=config.fp_fusion, **kwargs)


def _default(configs: tuple, acc: torch.dtype) -> Config:
    """A hot kernel's default configuration: the first, or float64's (the last: smaller tiles)."""
    return configs[-1] if acc == torch.float64 else configs[0]


def _merge_config(row_config: Config, slices: int) -> Config:
    """merge_kernel's launch: the per-row kernels' rows and options, `slices` at once."""
    return Config(
        BLOCK_ROWS=row_config.kwargs["BLOCK_ROWS"],
        BLOCK_S=triton.next_power_of_2(slices),
        num_warps=row_config.num_warps,
        num_stages=row_config.num_stages,
        fp_fusion=row_config.fp_fusion,
    )


def _launch_flags(side: _Operands, acc: torch.dtype) -> dict:
    return dict(ACC=acc_tl(acc), IS64=acc == torch.float64, SCHEME=side.scheme, INTERPRET=interpreting())


def _rows(
    a: _Operands,
    b: _Operands,
    mode,
    self_: bool,
    scale: float,
    acc,
    config: Config,
    row_config: Config,
    log_s=None,
    shift=0.0,
    offset=0,
    one=False,
):
    """rows_kernel over every anchor, its slices merged: (out, sum) per anchor (self_: anchor
    i is b's row offset + i, not a pair; one: proxy-anchor's log-sums hold the 1; config None:
    the default). SupCon's out is 0 without pairs."""
    N, D = a.hi.shape
    dev = a.hi.device
    held = _rows_held(D, a.scheme, mode)
    config = config or _rows_default(acc, a.scheme, held)
    out = torch.empty(N, dtype=acc, device=dev)
    total = torch.empty(N, dtype=acc, device=dev)
    if N == 0:
        return out, total
    k = config.kwargs
    programs = blocks(N, k["BLOCK_N"])
    slices, chunk = _slices(programs, b.n, k["BLOCK_M"])
    part = torch.empty(5, slices, N, dtype=acc, device=dev)
    rows_kernel[(programs, slices)](
        *a.pointers,
        *b.pointers,
        a.labels,
        b.labels,
        out if log_s is None else log_s,
        part,
        N,
        b.n,
        D,
        offset,
        chunk,
        float_bits(scale),
        float_bits(shift),
        SELF=self_,
        MODE=mode,
        BASE2=mode in (SUPCON, NTXENT_NEGATIVES) and abs(scale) <= BASE2_SCALE,
        BLOCK_D=held,
        **_launch_flags(a, acc),
        **config.launch,
    )
    merge = _merge_config(row_config, slices)
    merge_kernel[(blocks(N, merge.kwargs["BLOCK_ROWS"]),)](
        part,
        out,
        total,
        N,
        slices,
        MODE=mode,
        ONE=one,
        ACC=acc_tl(acc),
        **merge.launch,
    )
    if mode == SUPCON and b.n - self_ == 0:  # (no pairs: no log-sum-exp)
        out.zero_()
    return out, total


# The labels' and the batch's kernels (count_kernel, positives_kernel, terms_kernel,
# loss_kernel): blocks of rows, four warps.
BATCH_CONFIG = Config(BLOCK_ROWS=1024, num_warps=4, num_stages=1, fp_fusion=False)
# ids_kernel's: FANOUT probes a level per search and row, three searches: fewer rows a block
# (and at N = 8,192, 128 programs: the SMs' latency spread).
IDS_CONFIG = Config(BLOCK_ROWS=64, FANOUT=8, num_warps=2, num_stages=1, fp_fusion=False)


def _proxy_positives(a: _Operands, b: _Operands) -> Tensor:
    """Per proxy (a's rows, labelled by their class), its positive pairs: the embeddings (b)
    of its class, counted by their labels (in [0, C): checked), O(C + N), no host
    synchronisation."""
    dev = a.labels.device
    count = torch.zeros(a.n, dtype=torch.int32, device=dev)
    npos = torch.empty(a.n, dtype=torch.int32, device=dev)
    rows = BATCH_CONFIG.kwargs["BLOCK_ROWS"]
    if b.n:
        count_kernel[(blocks(b.n, rows),)](b.labels, count, b.n, a.n, **BATCH_CONFIG.launch)
    if a.n:
        positives_kernel[(blocks(a.n, rows),)](a.labels, count, npos, a.n, **BATCH_CONFIG.launch)
    return npos


def _loss(
    loss, out, total, npos, log_s, pairs: int, shard, dtype: torch.dtype, acc: torch.dtype, scale: float = 0.0
) -> tuple:
    """The loss (or a shard's parts) and the stats of SupCon, NT-Xent or proxy-anchor (loss;
    the last's scale: α, not a shard) from _rows' per anchor outputs (NT-Xent's positives pass;
    log_s: its negatives'), by PML's batch rules on the device: terms_kernel and loss_kernel,
    two launches, no host synchronisation."""
    N = npos.shape[0]
    dev = npos.device
    stats = torch.empty(N, {LOSS_SUPCON: 2, LOSS_NTXENT: 3, LOSS_PROXY: 4}[loss], dtype=acc, device=dev)
    if shard is None:
        result = torch.empty((), dtype=dtype, device=dev)
    else:
        result = torch.empty(4 if loss == LOSS_SUPCON else 3, dtype=torch.float64, device=dev)
    bf16 = shard is None and dtype == torch.bfloat16
    launch = BATCH_CONFIG.launch
    grid = (max(1, blocks(N, BATCH_CONFIG.kwargs["BLOCK_ROWS"])),)
    partial = torch.empty(3, grid[0], dtype=torch.float64, device=dev)
    terms_kernel[grid](out, total, npos, partial, N, LOSS=loss, **launch)
    loss_kernel[grid](
        out,
        total,
        out if log_s is None else log_s,
        npos,
        partial,
        stats,
        result.view(torch.int16) if bf16 else result,
        N,
        grid[0],
        pairs,
        float_bits(scale),
        LOSS=loss,
        SHARD=shard is not None,
        WIDE=shard is not None or dtype == torch.float64,
        BF16=bf16,
        ACC=acc_tl(acc),
        **launch,
    )
    return result, stats


def supcon_forward(
    embeddings, labels, ref_embeddings, ref_labels, temperature, shard=None, *, config=None, row_config=None
):
    """torchkit::supcon_loss's CUDA kernel (any device under the interpreter)."""
    op = "supcon_loss"
    t, shard = _check(op, embeddings, labels, ref_embeddings, ref_labels, temperature, shard)
    acc = acc_dtype(embeddings)
    row_config = row_config or ROW_CONFIGS[0]
    self_, offset = _self_pairs(ref_embeddings, shard)
    a, b, npos = _sides(embeddings, labels, ref_embeddings, ref_labels, acc, row_config, self_)
    lse, possum = _rows(a, b, SUPCON, self_, 1.0 / t, acc, config, row_config, offset=offset)
    pairs = b.n - int(self_)  # (each anchor's: every ref but itself)
    return _loss(LOSS_SUPCON, lse, possum, npos, None, a.n * pairs, shard, embeddings.dtype, acc)


def ntxent_forward(
    embeddings, labels, ref_embeddings, ref_labels, temperature, shard=None, *, config=None, row_config=None
):
    """torchkit::ntxent_loss's CUDA kernel (any device under the interpreter)."""
    op = "ntxent_loss"
    t, shard = _check(op, embeddings, labels, ref_embeddings, ref_labels, temperature, shard)
    acc = acc_dtype(embeddings)
    row_config = row_config or ROW_CONFIGS[0]
    self_, offset = _self_pairs(ref_embeddings, shard)
    a, b, npos = _sides(embeddings, labels, ref_embeddings, ref_labels, acc, row_config, self_)
    log_s, _ = _rows(a, b, NTXENT_NEGATIVES, self_, 1.0 / t, acc, config, row_config, offset=offset)
    log_r, loss = _rows(a, b, NTXENT_POSITIVES, self_, 1.0 / t, acc, config, row_config, log_s=log_s, offset=offset)
    pairs = b.n - int(self_)
    return _loss(LOSS_NTXENT, log_r, loss, npos, log_s, a.n * pairs, shard, embeddings.dtype, acc)


def _grad_scale(scale: float, bound: float, operand: torch.dtype) -> float:
    """The power of two that keeps ∂loss/∂c (at most bound·|scale|, times a factor f <= 2)
    below float16's largest value 65504 when rounded to it: 1 for other operands."""
    top = 2.0 * bound * abs(scale)
    if operand != torch.float16 or not math.isfinite(top) or top < 2.0**14:
        return 1.0
    return 2.0 ** (14 - math.ceil(math.log2(top)))


def _careful(scale: float, shift: float, acc: torch.dtype) -> bool:
    """Whether a term x = c·scale (or α(c ± margin)) may be ±∞ for a cosine |c| <= 1 (up to
    rounding): then every tile of the backward takes grad_kernel's careful path."""
    top = torch.finfo(acc).max / 4
    return not (math.isfinite(scale) and abs(scale) * (1.0 + abs(shift)) < top)


def _grad(
    own: _Operands,
    other: _Operands,
    terms,
    self_,
    anchors_own,
    anchors_other,
    loss,
    scale,
    grad,
    like,
    config,
    row_config,
    offset=0,
    careful=False,
    bound=4.0,
    live=None,
):
    """The gradient of the rows of `own` (in like's dtype): grad_kernel, x = c·scale, with the
    per-anchor (coef, shift, w, log_s) of `terms`, then jacobian_kernel (self_: own row i is
    other's row offset + i; bound·|scale|: at most |∂loss/∂c|; config None: the default;
    live: coef_kernel's flag, 0 where no anchor has terms: zero gradients)."""
    acc = own.f.dtype
    N, D = own.hi.shape
    held = _grad_held(D, own.scheme, own.hi.device)
    config = _grad_config(config or _grad_default(acc, own.scheme, held), D, held)
    k = config.kwargs
    programs = blocks(N, k["BLOCK_N"]) * blocks(D, k["BLOCK_F"])
    slices, chunk = _slices(programs, other.n, k["BLOCK_M"])
    g = torch.empty(slices, N, D, dtype=acc, device=own.hi.device)
    grad_kernel[(blocks(N, k["BLOCK_N"]), blocks(D, k["BLOCK_F"]), slices)](
        *own.pointers,
        *other.pointers,
        own.labels,
        other.labels,
        *terms,
        g,
        N,
        other.n,
        D,
        offset,
        chunk,
        float_bits(scale),
        float_bits(_grad_scale(scale, bound, own.hi.dtype)),
        SELF=self_,
        ANCHORS_OWN=anchors_own,
        ANCHORS_OTHER=anchors_other,
        LOSS=loss,
        CAREFUL=careful,
        BLOCK_D=held,
        **_launch_flags(own, acc),
        **config.launch,
    )
    out = torch.empty(N, D, dtype=like.dtype, device=like.device)
    jacobian_kernel[(blocks(N, row_config.kwargs["BLOCK_ROWS"]),)](
        g,
        own.raw,
        own.exp,
        own.inv,
        own.clamped,
        grad,
        grad if live is None else live,
        out,
        N,
        D,
        slices,
        own.raw.stride(0),
        LIVE=0 if live is None else 1,
        ACC=acc_tl(acc),
        IS64=acc == torch.float64,
        **row_config.launch,
    )
    return out


def _backward(
    ntxent: bool,
    grad,
    embeddings,
    labels,
    ref_embeddings,
    ref_labels,
    stats,
    temperature,
    output_mask,
    shard,
    own_stats,
    config,
    row_config,
):
    op = "ntxent_loss" if ntxent else "supcon_loss"
    t, shard = _check(op, embeddings, labels, ref_embeddings, ref_labels, temperature, shard)
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
        a = b = _Operands(ref_embeddings, *_label_ids(ref_labels)[0], acc, row_config)
    else:
        a, b, _ = _sides(embeddings, labels, ref_embeddings, ref_labels, acc, row_config)
    # Per anchor: coef, shift, w and log S (coef_kernel).
    loss = LOSS_NTXENT if ntxent else LOSS_SUPCON
    stats = _own_rows(stats, shard, M) if among and whole is None else stats.contiguous()
    anchors = stats.shape[0]
    flat = torch.empty(4 * anchors + 1, dtype=acc, device=stats.device)  # (and the flag: some anchor has terms)
    grid = (blocks(anchors, BATCH_CONFIG.kwargs["BLOCK_ROWS"]),)
    coef_kernel[grid](
        stats, flat, anchors, LOSS=loss, ACC=acc_tl(acc), IS64=acc == torch.float64, **BATCH_CONFIG.launch
    )
    terms, live = flat[: 4 * anchors].view(4, anchors).unbind(0), flat[4 * anchors :]
    pairs_self = self_ or among
    careful = _careful(1.0 / t, 0.0, acc)

    def rows_grad(own, other, anchors_own: bool, anchors_other: bool, like: Tensor, offset=0) -> Tensor:
        common = (terms, pairs_self, anchors_own, anchors_other, loss, 1.0 / t, grad, like, config, row_config)
        return _grad(own, other, *common, offset, careful, live=live)

    if among:  # (own_stats: the anchors' pairs alone, the refs a memory that holds their rows)
        ge = rows_grad(b.narrow(shard, N), b, True, whole is not None, embeddings, offset=shard) if want_e else empty
        return ge, _zeros(want_r, ref_embeddings, empty)
    if self_:
        return rows_grad(a, a, True, True, embeddings), empty
    ge = rows_grad(a, b, True, False, embeddings) if want_e else empty
    gr = rows_grad(b, a, False, True, ref_embeddings) if want_r else empty
    return ge, gr


def supcon_backward(
    grad,
    embeddings,
    labels,
    ref_embeddings,
    ref_labels,
    stats,
    temperature,
    output_mask,
    shard=None,
    own_stats=False,
    *,
    config=None,
    row_config=None,
):
    """torchkit::_supcon_loss_backward's CUDA kernel."""
    args = (grad, embeddings, labels, ref_embeddings, ref_labels, stats, temperature, output_mask, shard, own_stats)
    return _backward(False, *args, config, row_config)


def ntxent_backward(
    grad,
    embeddings,
    labels,
    ref_embeddings,
    ref_labels,
    stats,
    temperature,
    output_mask,
    shard=None,
    own_stats=False,
    *,
    config=None,
    row_config=None,
):
    """torchkit::_ntxent_loss_backward's CUDA kernel."""
    args = (grad, embeddings, labels, ref_embeddings, ref_labels, stats, temperature, output_mask, shard, own_stats)
    return _backward(True, *args, config, row_config)


def _proxy_sides(embeddings, labels, proxies, acc, row_config):
    """The proxies as the anchors (label c for row c), the embeddings as the refs."""
    classes = torch.arange(proxies.shape[0], dtype=torch.int32, device=proxies.device)
    ids = labels.to(torch.int32).contiguous()  # (in [0, C): checked)
    return _Operands(proxies, classes, acc, row_config), _Operands(embeddings, ids, acc, row_config)


def proxy_anchor_forward(embeddings, labels, proxies, margin, alpha, shard=None, *, config=None, row_config=None):
    """torchkit::proxy_anchor_loss's CUDA kernel (any device under the interpreter). A shard
    (−1: these embeddings are one rank's): per proxy its two log-sums without the 1 and whether
    it has positives (csrc/pair_losses.h)."""
    margin, alpha = _proxy_check(embeddings, labels, proxies, margin, alpha)
    _check_proxy_shard(shard)
    acc = acc_dtype(embeddings)
    row_config = row_config or ROW_CONFIGS[0]
    a, b = _proxy_sides(embeddings, labels, proxies, acc, row_config)
    ln, lp = _rows(a, b, PROXY, False, alpha, acc, config, row_config, shift=margin, one=shard is None)
    npos = _proxy_positives(a, b)
    if shard is not None:
        parts = torch.stack([lp.double(), ln.double(), (npos > 0).double()], dim=1)
        return parts, torch.zeros(a.n, 4, dtype=acc, device=proxies.device)
    return _loss(LOSS_PROXY, ln, lp, npos, None, 0, None, embeddings.dtype, acc, alpha)


def proxy_anchor_backward(
    grad, embeddings, labels, proxies, stats, margin, alpha, output_mask, *, config=None, row_config=None
):
    """torchkit::_proxy_anchor_loss_backward's CUDA kernel."""
    op = "proxy_anchor_loss"
    margin, alpha = _proxy_check(embeddings, labels, proxies, margin, alpha)
    want_e, want_p = bool(output_mask[0]), bool(output_mask[1])
    C, D = proxies.shape
    N = embeddings.shape[0]
    _check_backward(op, grad, embeddings, stats, 4, anchors=C)
    empty = embeddings.new_empty(0)
    if N == 0 or C == 0 or D == 0 or not (want_e or want_p):
        return _zeros(want_e, embeddings, empty), _zeros(want_p, proxies, empty)
    acc = acc_dtype(embeddings)
    row_config = row_config or ROW_CONFIGS[0]
    a, b = _proxy_sides(embeddings, labels, proxies, acc, row_config)
    # Per proxy (ProxyAnchorTerms in pair_losses_cpu.cpp), x = α·c: a negative's
    # α/C·exp(x − (Ln − α·margin)), a positive's −α/P·exp(−x − (Lp − α·margin)).
    lp, ln, share, per_proxy = stats.unbind(1)
    am = alpha * margin
    terms = tuple(v.contiguous() for v in (per_proxy, ln - am, share, lp - am))
    careful = _careful(alpha, margin, acc)
    common = (terms, False)
    gp, ge = empty, empty
    if want_p:
        gp = _grad(a, b, *common, True, False, LOSS_PROXY, alpha, grad, proxies, config, row_config, 0, careful)
    if want_e:
        ge = _grad(b, a, *common, False, True, LOSS_PROXY, alpha, grad, embeddings, config, row_config, 0, careful)
    return ge, gp


def compile_cases() -> list[CompileCase]:
    """This engine's kernels for tools/triton_check.py: each scheme's operands (float32 as the
    TF32 pair, TF32 and bfloat16; bfloat16 and float16 as given; float64), rows_kernel in each
    mode and grad_kernel in each loss's passes with the TF32 pair (every configuration of the
    first), bfloat16 and float64."""
    ints = dict.fromkeys(("N", "M", "D", "N_OWN", "N_OTHER", "OFFSET", "CHUNK", "SLICES", "stride_row"), "i32")
    # The headline launches' sizes (8,192 rows of 128 features from offset 0, slices of whole
    # tiles) are divisible by 16, all but the slice count.
    case = functools.partial(CompileCase, divisible=tuple(k for k in ints if k != "SLICES"))
    bits = dict.fromkeys(("SCALE_BITS", "SHIFT_BITS", "G_SCALE_BITS"), "i64")
    # (name, input dtype, operand dtype, accumulation type, scheme)
    schemes = (
        ("fp32", "fp32", "fp32", "fp32", TF32X3),
        ("fp32 tf32", "fp32", "fp32", "fp32", TF32),
        ("fp32 medium", "fp32", "bf16", "fp32", HALF),
        ("bf16", "bf16", "bf16", "fp32", HALF),
        ("fp16", "fp16", "fp16", "fp32", HALF),
        ("fp64", "fp64", "fp64", "fp64", FP64),
    )
    cases = []
    for name, dtype, operand, acc, how in schemes:
        is64 = acc == "fp64"
        acc64 = torch.float64 if is64 else torch.float32
        first = name == "fp32"
        flags = dict(ACC=tl.float64 if is64 else tl.float32, IS64=is64)
        sides = {
            f"{side}_{part}": t
            for side in ("a", "b", "own", "other")
            for part, t in (("hi", "*" + operand), ("lo", "*" + operand), ("f", "*" + acc), ("bad", "*i8"))
        }
        types = {
            **ints,
            **bits,
            **sides,
            **dict.fromkeys(("hi_ptr", "lo_ptr"), "*" + operand),
            **dict.fromkeys(("f_ptr", "inv_ptr", "log_s_ptr", "part_ptr", "out_ptr", "sum_ptr", "g_ptr"), "*" + acc),
            **dict.fromkeys(("coef_ptr", "shift_ptr", "w_ptr"), "*" + acc),
            **dict.fromkeys(("lab_ptr", "ref_lab_ptr", "own_lab_ptr", "other_lab_ptr"), "*i32"),
            **dict.fromkeys(("count_ptr", "npos_ptr", "exp_ptr", "ids_ptr"), "*i32"),
            **dict.fromkeys(("bad_ptr", "clamped_ptr"), "*i8"),
            "x_ptr": "*" + dtype,
            "grad_ptr": "*" + dtype,
        }
        cases.append(
            case(
                f"pair_losses.lse.operands {name}",
                operands_kernel,
                types,
                dict(SCHEME=how, SCALED=dtype != "fp16", **flags),
                ROW_CONFIGS if first else ROW_CONFIGS[:1],
            )
        )
        if first:  # (the labels' ids: no scheme; int64 labels, one side and two; proxies' counts)
            labels = dict.fromkeys(("a_ptr", "sorted_a_ptr", "b_ptr", "sorted_b_ptr"), "*i64")
            sizes = dict.fromkeys(("NA", "NB", "LEVELS"), "i32")
            for two, self_ in itertools.product((False, True), repeat=2):
                cases.append(
                    CompileCase(
                        f"pair_losses.lse.ids{' two' if two else ''}{' self' if self_ else ''}",
                        ids_kernel,
                        {**labels, **sizes, "ids_ptr": "*i32", "npos_ptr": "*i32"},
                        dict(TWO=two, SELF=self_),
                        (IDS_CONFIG,),
                        divisible=("NA", "NB"),
                    )
                )
            cases.append(case("pair_losses.lse.count", count_kernel, {**types, "C": "i32"}, {}, (BATCH_CONFIG,)))
            cases.append(case("pair_losses.lse.positives", positives_kernel, types, {}, (BATCH_CONFIG,)))
        if name in ("fp16", "fp32 medium"):  # (their hot kernels are bfloat16's)
            continue
        hot_flags = dict(SCHEME=how, INTERPRET=False, **flags)
        modes = ((SUPCON, "supcon", True), (SUPCON, "supcon", False), (NTXENT_NEGATIVES, "negatives", True))
        modes += ((NTXENT_POSITIVES, "positives", True), (PROXY, "proxy", False))
        # Rows of D = 128 (the headline cases'): held whole where the scheme holds them, and
        # multiplied a slice at a time (the first case of each kernel also so).
        held = _held(128, how.value)
        for mode, what, self_ in modes if name != "fp32 tf32" else modes[:1]:
            rows_held = _rows_held(128, how.value, mode)
            for block_d in (rows_held, 0) if rows_held and what == "supcon" and self_ else (rows_held,):
                rows_configs = (_rows_default(acc64, how.value, block_d),)
                if first and mode == SUPCON and self_:  # (but the TF32 pair's rows held whole on three
                    # stages: they pass sm_90's shared memory)
                    rows_configs = ROWS_CONFIGS[1:] if block_d and how == TF32X3 else ROWS_CONFIGS
                cases.append(
                    case(
                        f"pair_losses.lse.rows {what} {name}{' self' if self_ else ''}{'' if block_d else ' D loop'}",
                        rows_kernel,
                        types,
                        dict(
                            SELF=self_,
                            MODE=mode,
                            BASE2=mode in (SUPCON, NTXENT_NEGATIVES),
                            BLOCK_D=block_d,
                            **hot_flags,
                        ),
                        rows_configs,
                        tensor_cores=not is64,
                    )
                )
        passes = [
            (loss, what, self_, own, other)
            for loss, what in ((LOSS_SUPCON, "supcon"), (LOSS_NTXENT, "ntxent"))
            for self_, own, other in ((True, True, True), (False, True, False), (False, False, True))
        ]
        passes += [(LOSS_PROXY, "proxy", False, True, False), (LOSS_PROXY, "proxy", False, False, True)]
        for loss, what, self_, own, other in passes if first else passes[:1]:
            for careful in (False, True) if first and loss == LOSS_PROXY and own else (False,):
                # The rows held whole as sm_90 holds them (sm_80 too, but the TF32 pair's),
                # and multiplied a slice at a time as wider rows are (and the TF32 pair's of
                # 128 on sm_80): proxy-anchor's of the headline's 512 features.
                gheld = _held(128, how.value, HELD_NARROW)
                ways = [(held, (80, 90) if gheld else (90,))] if held else []
                if not held or not gheld or (loss == LOSS_SUPCON and self_):
                    ways.append((0, (80, 90)))
                for block_d, archs in ways:
                    pass_ = " self" if self_ else (" anchors" if own else " refs")
                    width = 512 if not block_d and (loss == LOSS_PROXY or gheld) else 128
                    every = first and self_ and loss == LOSS_SUPCON
                    configs = (_grad_default(acc64, how.value, block_d),)
                    if every:  # (but the TF32 pair's rows held whole on eight warps: they spill)
                        configs = GRAD_CONFIGS[1:] if block_d and how == TF32X3 else GRAD_CONFIGS
                    flags_ = dict(CAREFUL=careful, BLOCK_D=block_d, **hot_flags)
                    cases.append(
                        case(
                            f"pair_losses.lse.grad {what} {name}{pass_}{' careful' if careful else ''}"
                            f"{'' if block_d else ' D loop'}",
                            grad_kernel,
                            types,
                            dict(SELF=self_, ANCHORS_OWN=own, ANCHORS_OTHER=other, LOSS=loss, **flags_),
                            tuple(_grad_config(c, width, block_d) for c in configs),
                            tensor_cores=not is64,
                            archs=archs,
                        )
                    )
        if name == "fp32 tf32":
            continue
        for mode, one in ((SUPCON, False), (PROXY, True), (PROXY, False)) if first else ((SUPCON, False),):
            cases.append(
                case(
                    f"pair_losses.lse.merge {'proxy' if mode == PROXY else 'supcon'} {name}{' one' if one else ''}",
                    merge_kernel,
                    types,
                    dict(MODE=mode, ONE=one, ACC=flags["ACC"]),
                    (_merge_config(ROW_CONFIGS[0], 4),),
                )
            )
        for loss, what in ((LOSS_SUPCON, "supcon"), (LOSS_NTXENT, "ntxent"), (LOSS_PROXY, "proxy")):
            loss_types = {**types, "partial_ptr": "*fp64", "stats_ptr": "*" + acc, "BLOCKS": "i32", "PAIRS": "i64"}
            cases.append(
                case(f"pair_losses.lse.terms {what} {name}", terms_kernel, loss_types, dict(LOSS=loss), (BATCH_CONFIG,))
            )
            if loss != LOSS_PROXY:  # (proxy-anchor's coefficients are its stats)
                cases.append(
                    case(
                        f"pair_losses.lse.coef {what} {name}",
                        coef_kernel,
                        {**loss_types, "terms_ptr": "*" + acc},
                        dict(LOSS=loss, **flags),
                        (BATCH_CONFIG,),
                    )
                )
            # (the loss in its dtype; a shard's parts: proxy-anchor's shards take theirs otherwise)
            for shard in (False, True) if first and loss != LOSS_PROXY else (False,):
                result = "*fp64" if shard else ("*i16" if dtype == "bf16" else "*" + dtype)
                cases.append(
                    case(
                        f"pair_losses.lse.loss {what} {name}{' shard' if shard else ''}",
                        loss_kernel,
                        {**loss_types, "result_ptr": result},
                        dict(
                            LOSS=loss,
                            SHARD=shard,
                            WIDE=shard or is64,
                            BF16=not shard and dtype == "bf16",
                            ACC=flags["ACC"],
                        ),
                        (BATCH_CONFIG,),
                    )
                )
        # (a shard's backward: the caller's float64 grad; contrastive's: LIVE from its stats)
        jacobians = [("", types, 0), (" live", types, 1), (" live two", types, 2)]
        if dtype != "fp64":
            jacobians.append((" shard", {**types, "grad_ptr": "*fp64"}, 0))
            jacobians.append((" shard live", {**types, "grad_ptr": "*fp64"}, 1))
        for what, jacobian_types, live in jacobians:
            cases.append(
                case(
                    f"pair_losses.lse.jacobian {name}{what}",
                    jacobian_kernel,
                    {**jacobian_types, "live_ptr": "*" + acc, "out_ptr": "*" + dtype},
                    dict(LIVE=live, **flags),
                    ROW_CONFIGS if first and not what else ROW_CONFIGS[:1],
                )
            )
    return cases
