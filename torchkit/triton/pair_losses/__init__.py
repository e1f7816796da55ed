"""The pair losses' Triton kernels (supcon_loss, ntxent_loss, contrastive_loss,
triplet_margin_loss, multi_similarity_loss, proxy_anchor_loss): their CUDA kernels where
torchkit.triton selects them. One engine per module: lse.py (supcon_loss, ntxent_loss and
proxy_anchor_loss: tensor-core tiles and log-sum-exps, under the CUDA precision contract);
ms.py (multi_similarity_loss: the same tiles, its choices exact); euclid.py
(contrastive_loss: tensor-core distance tiles, its choices exact); triplets.py
(triplet_margin_loss: the same tiles, its choices exact); this module holds the triplets'
backward but batch_hard's tiles (IEEE float32 or float64, exact decisions), and what the
engines share of the exact machinery.

The semantics are the CPU kernels' (csrc/pair_losses.h, csrc/cpu/pair_losses_cpu.cpp,
csrc/cpu/pair_losses_euclidean_cpu.cpp), the stats included, so that either backward takes
either forward's stats. Nothing N×M exists:

- Prefix (normalise_kernel): each row as F.normalize leaves it, x / max(‖x‖, 1e-12), in the
  accumulation type (a float32 copy of float16 and bfloat16 rows), from the row scaled by the
  power of two 2^-E of its largest |entry| first, so that no sum of squares over- or
  underflows anywhere in the finite range; per row E, 1/‖x·2^-E‖ (1e12 where the clamp holds)
  and whether it holds, for the backward's Jacobian (jacobian_kernel: each row's gradient
  through the normalisation, times the loss's gradient read on the device).
- Exact cosines (multi_similarity_loss's, ms.py): float64 inverse norms (norm64_kernel), the
  cosine of a row with an equal one (self_cos_kernel).
- Euclidean distances of the normalised rows (the triplets', and contrastive_loss's points):
  the rows centred on the float64 mean of the finite ones of both sides, rounded once
  (centre_sums_kernel, mean_kernel, points_kernel: _points); each tile's distances from the expansion
  |c_i|² + |c_j|² − 2c_i·c_j, and where it cancelled (near-duplicates) or a choice is within
  the tile's error bound of its threshold, the exact distance from the inputs in float64 (as
  the CPU kernel's Points::direct), a tile at a time and only for tiles that have such an
  entry.
- Equal rows (_equal_rows: the rows sorted by a key and compared with their neighbour, as
  the CPU kernels' equal_rows groups them): a pair of equal rows is at distance 0 and has
  one exact cosine (self_cos_kernel's), taken without a computation, so that a collapsed
  batch (every row one point, or 0: every pair cancelled, every choice a tie) costs what a
  random one does rather than an exact recomputation per pair.
- triplet_margin_loss, batch_hard: each anchor's farthest positive and nearest negative
  (triplets.py: contrastive_loss's tensor-core tiles, the choices exact) with their exact
  distances; the backward takes the chosen pairs' exact distances (pair_dist_kernel) and
  gathers each row's pairs
  (as anchor, and as a chosen positive or negative through the pairs sorted by row), in
  float64 from the inputs' differences, without atomics.
- triplet_margin_loss, all and semi_hard: the forward is triplets.py's (tensor-core tiles,
  each triplet decided on the tile's bounds or, listed, on exact distances). The backward
  takes the anchors a band at a time (BAND_PAIRS): triplets.all_triplets writes each pair's
  ∂loss/∂d·C (a negative: minus its counted positives; a positive: its counted triplets),
  then triplets.band_gradient (tensor-core tiles reading the band, the pairs whose d²
  cancelled from the inputs' float64 differences) adds the band's gradient to the anchors'
  and the refs' rows, bands in order.

- A shard (the losses across ranks; csrc/pair_losses.h) of supcon_loss, ntxent_loss,
  contrastive_loss and multi_similarity_loss: the forward is the one with refs, anchor i's
  pair with ref row OFFSET + i left out (shard >= 0), and returns the reducer's parts, formed
  on the device like the loss. The backward of a shard of the rows takes the whole problem's
  stats and is the refs' own problem (without refs) restricted to the anchors' rows: own
  rows [shard, shard + N) against every row, as anchor and as ref (lse.grad_kernel's and
  ms_grad_kernel's and euclid's OFFSET). With own_stats (a memory that holds the anchors'
  rows) it is the same problem as anchor alone: the shard's stats at the own rows of the
  refs' (_common._own_rows), the other rows not anchors (ANCHORS_OTHER off; euclid's kernels,
  which take each pair from both rows with the same weights, at half the grad).
  proxy_anchor_loss's shard
  (one rank's embeddings) is its forward's per-proxy log-sums without the 1.
  triplet_margin_loss's shard is its forward with refs, triplets.hard_rows_kernel and
  triplets.triplet_rows_kernel leaving out anchor i's pair with ref row OFFSET + i, returning the
  mean's sum and count; its backward takes the shard's own stats (a float64 grad scaled by
  the caller) and gives the refs' gradient from the shard's anchors, as the CPU kernel's.

Kernels never index past what the wrapper checked; offsets are int64.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from torch import Tensor

from torchkit.ops._common import acc_dtype, check_scalars
from torchkit.ops.pair_losses import _check_inputs, _check_loss_backward, _check_params
from torchkit.triton import _launch
from torchkit.triton import _math as tm
from torchkit.triton._launch import CompileCase, Config, acc_tl, blocks
from torchkit.triton.pair_losses import euclid, lse, ms, triplets
from torchkit.triton.pair_losses._common import (
    NORM_EPS,
    _eight,
    _euclidean_only,
    _pair_exact,
    _parts,
    _self_pairs,
    _shard,
    _unit,
    _zeros,
)
from torchkit.triton.pair_losses.euclid import contrastive_backward, contrastive_forward  # noqa: F401 (as below)
from torchkit.triton.pair_losses.lse import (  # noqa: F401 (the ops' kernels: torchkit.triton.TRITON_KERNELS)
    ntxent_backward,
    ntxent_forward,
    proxy_anchor_backward,
    proxy_anchor_forward,
    supcon_backward,
    supcon_forward,
)
from torchkit.triton.pair_losses.ms import multi_similarity_backward, multi_similarity_forward  # noqa: F401 (as below)


def _config(**kwargs) -> Config:
    """A launch configuration of this module's kernels, none of which lets the compiler fuse a
    product and a sum into an FMA: the exact distances and cosines, the norms and the centred
    points must round as the CPU kernels' do (their C++ contracts nothing), or a choice between
    near-equal distances could differ from theirs (a zero row is at distance 1 from every
    normalised row: batch_hard chose another negative for it on an H200 before)."""
    return Config(fp_fusion=False, **kwargs)


# Launch configurations. Each is run by the tests (every masking path) and compiled by
# tools/triton_check.py; `config` arguments pick one, the default being the first.
# batch_hard's backward: float64 rows of features, gathered a pair at a time.
HARD_GRAD_CONFIGS = (
    _config(BLOCK_ROWS=16, BLOCK_F=64, num_warps=4, num_stages=2),
    _config(BLOCK_ROWS=8, BLOCK_F=16, num_warps=2, num_stages=2),
)
# The per-row kernels (norms, keys, points, Jacobian): 8 rows a program (128 programs at
# N = 1,024, the SMs' count; fewer under the interpreter), features 128 at a time: one round
# trip to memory per 128 features (16 x 128 spilled equal_next_kernel's float64 registers).
ROW_CONFIGS = (
    _config(BLOCK_ROWS=8, BLOCK_D=128, num_warps=4, num_stages=2),
    _config(BLOCK_ROWS=8, BLOCK_D=16, num_warps=2, num_stages=2),
)


# --------------------------------------------------------------------------- prefix


@triton.jit
def normalise_kernel(
    x_ptr,
    e_ptr,
    exp_ptr,
    inv_ptr,
    clamped_ptr,
    N,
    D,
    stride_row,
    ACC: tl.constexpr,
    IS64: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """e = x / max(‖x‖, eps) per row (F.normalize), in ACC, contiguous; per row the exponent E
    (int32), inv = 1/‖x·2^-E‖ (or 1e12 where the clamp holds, 1/top for a row with ±inf or
    NaN, E = 0 there) and whether the clamp holds (int8)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < N
    top = tl.zeros((BLOCK_ROWS,), ACC)
    for k0 in range(0, D, BLOCK_D):
        ks = k0 + tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (ks < D)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_row + ks[None, :], mask=mask, other=0.0).to(ACC)
        top = tl.maximum(top, tl.max(tl.abs(x), axis=1), propagate_nan=tl.PropagateNan.ALL)
        top = tl.where(tl.max(tl.where(mask & (x != x), 1, 0), axis=1) > 0, float("nan"), top)
    special = (top == 0) | (top != top) | (top == float("inf"))
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
    # (Each quotient's divisor made non-zero where the other branch is taken: masked rows too.)
    inv = tl.where(
        clamped,
        one / tl.full((BLOCK_ROWS,), NORM_EPS, ACC),
        tl.where(special, one / tl.where(top == 0, 1.0, top), one / tl.where(norm == 0, 1.0, norm)),
    )
    for k0 in range(0, D, BLOCK_D):
        ks = k0 + tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (ks < D)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_row + ks[None, :], mask=mask, other=0.0).to(ACC)
        e = tl.where(clamped[:, None], x * inv[:, None], tm.ldexp(x, 0 - E[:, None], IS64) * inv[:, None])
        tl.store(e_ptr + rows[:, None] * D + ks[None, :], e, mask=mask)
    tl.store(exp_ptr + rows, E, mask=row_mask)
    tl.store(inv_ptr + rows, inv, mask=row_mask)
    tl.store(clamped_ptr + rows, clamped.to(tl.int8), mask=row_mask)


# --------------------------------------------------------------------------- forward


# --------------------------------------------------------------------------- backward


@triton.jit
def jacobian_kernel(
    g_ptr,
    e_ptr,
    exp_ptr,
    inv_ptr,
    clamped_ptr,
    grad_ptr,
    out_ptr,
    N,
    D,
    ACC: tl.constexpr,
    IS64: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out = grad·∂/∂x of g·e for e = x / max(‖x‖, eps), per row: (g − e(e·g))·inv·2^-E where
    ‖x‖ > eps, g·1e12 where the clamp holds (its constant); in out's dtype."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < N
    dot = tl.zeros((BLOCK_ROWS,), ACC)
    for k0 in range(0, D, BLOCK_D):
        ks = k0 + tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (ks < D)[None, :]
        g = tl.load(g_ptr + rows[:, None] * D + ks[None, :], mask=mask, other=0.0)
        e = tl.load(e_ptr + rows[:, None] * D + ks[None, :], mask=mask, other=0.0)
        dot += tl.sum(g * e, axis=1)
    E = tl.load(exp_ptr + rows, mask=row_mask, other=0)
    inv = tl.load(inv_ptr + rows, mask=row_mask, other=0.0)
    clamped = tl.load(clamped_ptr + rows, mask=row_mask, other=0) != 0
    grad = tl.load(grad_ptr).to(ACC)
    along = tl.where(clamped, 0.0, dot)
    for k0 in range(0, D, BLOCK_D):
        ks = k0 + tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (ks < D)[None, :]
        g = tl.load(g_ptr + rows[:, None] * D + ks[None, :], mask=mask, other=0.0)
        e = tl.load(e_ptr + rows[:, None] * D + ks[None, :], mask=mask, other=0.0)
        v = (g - e * along[:, None]) * inv[:, None]
        v = tl.where(clamped[:, None], v, tm.ldexp(v, 0 - E[:, None], IS64)) * grad
        tl.store(out_ptr + rows[:, None] * D + ks[None, :], v.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- multi-similarity


@triton.jit
def _scaled_squares(total, xs, k0, D, f1, f2, s, NORMAL: tl.constexpr):
    """total plus the squares of features k0 .. k0 + 7 of rows (_eight's xs; features past D
    add nothing), each scaled by 2^s (norm64_kernel's: by f1·f2 where NORMAL), in feature
    order."""
    for kk in tl.static_range(8):
        v = xs[kk].to(tl.float64)
        if NORMAL:
            v = v * f1 * f2
        else:
            v = tm.ldexp(v, s, True)
        total = tl.where(k0 + kk < D, total + v * v, total)
    return total


@triton.jit
def _scaled_sum(total, x_ptr, at, row_mask, D, f1, f2, s, NORMAL: tl.constexpr):
    """total plus the scaled squares (_scaled_squares) of every feature of rows: thirty-two
    features' loads in flight together where NORMAL, eight by ldexp (its registers)."""
    if NORMAL:
        for k0 in range(0, D, 32):
            a = _eight(x_ptr, at, k0, D, row_mask)
            b = _eight(x_ptr, at, k0 + 8, D, row_mask)
            c = _eight(x_ptr, at, k0 + 16, D, row_mask)
            d = _eight(x_ptr, at, k0 + 24, D, row_mask)
            total = _scaled_squares(total, a, k0, D, f1, f2, s, NORMAL)
            total = _scaled_squares(total, b, k0 + 8, D, f1, f2, s, NORMAL)
            total = _scaled_squares(total, c, k0 + 16, D, f1, f2, s, NORMAL)
            total = _scaled_squares(total, d, k0 + 24, D, f1, f2, s, NORMAL)
    else:
        for k0 in range(0, D, 8):
            total = _scaled_squares(total, _eight(x_ptr, at, k0, D, row_mask), k0, D, f1, f2, s, NORMAL)
    return total


@triton.jit
def norm64_kernel(x_ptr, inv_ptr, N, D, stride_row, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """1 / max(‖x‖, eps) per row in float64, the norm as the CPU kernels' row_norms forms it:
    the row times 2^-e (e: frexp's exponent of its largest |entry|) squared and summed in
    feature order, so that an exact cosine is the CPU kernel's (‖x‖ = the largest |entry|
    where that is 0, ±∞ or NaN)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < N
    top = tl.zeros((BLOCK_ROWS,), tl.float64)
    nan = tl.zeros((BLOCK_ROWS,), tl.int32)
    for k0 in range(0, D, BLOCK_D):
        ks = k0 + tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (ks < D)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_row + ks[None, :], mask=mask, other=0.0).to(tl.float64)
        top = tl.maximum(top, tl.max(tl.abs(x), axis=1))
        nan = nan | tl.max(tl.where(mask & (x != x), 1, 0), axis=1)
    top = tl.where(nan != 0, float("nan"), top)
    special = (top == 0) | (top != top) | (top == float("inf"))
    e = tl.where(special, 0, tm.ilogb(tl.where(special, 1.0, top), True) + 1)
    total = tl.zeros((BLOCK_ROWS,), tl.float64)
    s = 0 - e
    # x·2^s as ldexp rounds it: by normal powers of two, one (rounding once) down, two (exact)
    # up; or, for a row of entries near the largest finite float (2^s subnormal), by ldexp.
    normal = tl.min(s, axis=0) >= -1022
    half = tl.where(s >= 0, s // 2, s)
    f1 = tm.pow2(tl.where(normal, half, 0), True)
    f2 = tm.pow2(tl.where(normal, s - half, 0), True)
    if normal:  # (ldexp's path: a block holding a row of entries near the largest float, rare)
        total = _scaled_sum(total, x_ptr, rows * stride_row, row_mask, D, f1, f2, s, True)
    else:
        total = _scaled_sum(total, x_ptr, rows * stride_row, row_mask, D, f1, f2, s, False)
    norm = tl.where(special, top, tm.ldexp(tl.sqrt(total), e, True))
    eps = tl.full((BLOCK_ROWS,), NORM_EPS, tl.float64)
    inv = 1.0 / tl.where(norm < eps, eps, norm)  # NaN stays NaN
    tl.store(inv_ptr + rows, inv, mask=row_mask)


@triton.jit
def row_keys_kernel(x_ptr, key_ptr, N, D, stride_row, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """A key per row for _equal_rows: Σ_k x_k·w_k in float64 over fixed weights w_k in
    [0.5, 1.5), the same for equal rows (one sum in one order; ±0 alike), not finite for a row
    holding NaN or ±∞, and rarely shared by rows of other values."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < N
    key = tl.zeros((BLOCK_ROWS,), tl.float64)
    for k0 in range(0, D, BLOCK_D):
        ks = k0 + tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (ks < D)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_row + ks[None, :], mask=mask, other=0.0).to(tl.float64)
        w = ((ks * 40503) % 65536).to(tl.float64) / 65536.0 + 0.5
        key += tl.sum(x * w[None, :], axis=1)
    tl.store(key_ptr + rows, key + 0.0, mask=row_mask)  # (+ 0.0: −0 as +0)


@triton.jit
def _entries(xa_ptr, xb_ptr, sa, sb, NA, r, ks, mask):
    """Loads entries ks of rows r numbered over two sides (a's rows, then b's from NA): a's
    and b's, for _pick (loads only: both rows' issued before either is used)."""
    in_a = r < NA
    va = tl.load(xa_ptr + r[:, None] * sa + ks[None, :], mask=mask & in_a[:, None], other=0.0)
    vb = tl.load(xb_ptr + (r - NA)[:, None] * sb + ks[None, :], mask=mask & (in_a == 0)[:, None], other=0.0)
    return va, vb


@triton.jit
def _pick(r, NA, va, vb):
    """_entries' values of rows r in float64 (exact; where ±0 compare equal also for 16-bit
    types under the interpreter)."""
    return tl.where((r < NA)[:, None], va.to(tl.float64), vb.to(tl.float64))


@triton.jit
def equal_next_kernel(
    xa_ptr, xb_ptr, sa, sb, NA, order_ptr, key_ptr, out_ptr, N, D, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr
):
    """out[t]: whether row order[t] equals row order[t − 1] entry by entry (±0 alike; NaN
    equals nothing), with a finite key (a row holding ±∞ equals none: its distances are NaN);
    rows numbered over both sides (_entries)."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    live = (t >= 1) & (t < N)
    i = tl.load(order_ptr + t, mask=live, other=0)
    j = tl.load(order_ptr + t - 1, mask=live, other=0)
    key = tl.load(key_ptr + i, mask=live, other=0.0)
    same = live & (key == tl.load(key_ptr + j, mask=live, other=0.0)) & (tl.abs(key) < float("inf"))
    for k0 in range(0, D, BLOCK_D):
        ks = k0 + tl.arange(0, BLOCK_D)
        mask = same[:, None] & (ks < D)[None, :]
        ia, ib = _entries(xa_ptr, xb_ptr, sa, sb, NA, i, ks, mask)
        ja, jb = _entries(xa_ptr, xb_ptr, sa, sb, NA, j, ks, mask)
        differ = mask & (_pick(i, NA, ia, ib) != _pick(j, NA, ja, jb))
        same = same & (tl.max(tl.where(differ, 1, 0), axis=1) == 0)
    tl.store(out_ptr + t, same, mask=t < N)


@triton.jit
def _unit_squares(out, xs, k0, D, inv):
    """out plus the squares of features k0 .. k0 + 7 of rows (_eight's xs; features past D add
    nothing), normalised as ms._exact normalises them, in feature order."""
    for kk in tl.static_range(8):
        a = xs[kk].to(tl.float64)
        a = tl.where(D == 1, _unit(a, inv, True), a * inv)
        out = tl.where(k0 + kk < D, out + a * a, out)
    return out


@triton.jit
def self_cos_kernel(x_ptr, inv_ptr, out_ptr, N, D, stride_row, BLOCK_ROWS: tl.constexpr):
    """Per row its exact cosine with an equal row, summed as ms._exact sums a pair's:
    Σ_k (x_k·inv)² in float64, in feature order (at D = 1, F.normalize's ±1 squared)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < N
    inv = tl.load(inv_ptr + rows, mask=row_mask, other=0.0)
    out = tl.zeros((BLOCK_ROWS,), tl.float64)
    at = rows * stride_row
    for k0 in range(0, D, 32):  # (thirty-two features' loads in flight together)
        a = _eight(x_ptr, at, k0, D, row_mask)
        b = _eight(x_ptr, at, k0 + 8, D, row_mask)
        c = _eight(x_ptr, at, k0 + 16, D, row_mask)
        d = _eight(x_ptr, at, k0 + 24, D, row_mask)
        out = _unit_squares(out, a, k0, D, inv)
        out = _unit_squares(out, b, k0 + 8, D, inv)
        out = _unit_squares(out, c, k0 + 16, D, inv)
        out = _unit_squares(out, d, k0 + 24, D, inv)
    tl.store(out_ptr + rows, out, mask=row_mask)


@triton.jit
def centre_sums_kernel(
    x_ptr, inv_ptr, sums_ptr, count_ptr, N, D, stride_row, CHUNK, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr
):
    """Per block of features and chunk of CHUNK rows (program_id(1)): Σ over the chunk's finite
    rows of x·inv (F.normalize's rows, float64 from the float64 inverse norms: norm64_kernel's,
    > 0 and finite exactly for a row of finite values whose norm is finite), added in row
    order, into sums[chunk]; the first block of features counts those rows into count[chunk]."""
    ks = tl.program_id(0).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    k_mask = ks < D
    first = tl.program_id(1).to(tl.int64) * CHUNK
    total = tl.zeros((BLOCK_D,), tl.float64)
    rows_kept = tl.zeros((BLOCK_ROWS,), tl.int32)
    for r0 in range(first, tl.minimum(first + CHUNK, N), BLOCK_ROWS):
        rows = (r0 + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
        row_mask = rows < N
        inv = tl.load(inv_ptr + rows, mask=row_mask, other=0.0)
        keep = row_mask & (inv > 0) & (inv < float("inf"))
        rows_kept += keep.to(tl.int32)
        mask = keep[:, None] & k_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_row + ks[None, :], mask=mask, other=0.0).to(tl.float64)
        total += tl.sum(tl.where(mask, x * inv[:, None], 0.0), axis=0)
    tl.store(sums_ptr + tl.program_id(1).to(tl.int64) * D + ks, total, mask=k_mask)
    if tl.program_id(0) == 0:
        tl.store(count_ptr + tl.program_id(1), tl.sum(rows_kept, axis=0))


@triton.jit
def mean_kernel(sums_ptr, count_ptr, mean_ptr, CHUNKS, D, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Per block of features, the mean of the finite rows of both sides: centre_sums_kernel's
    CHUNKS sums and counts (every side's chunks) added BLOCK_ROWS chunks at a time, in a fixed
    order (the same bits on every run), in float64."""
    ks = tl.program_id(0).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    k_mask = ks < D
    total = tl.zeros((BLOCK_D,), tl.float64)
    count = tl.zeros((BLOCK_ROWS,), tl.int64)
    for c0 in range(0, CHUNKS, BLOCK_ROWS):
        chunks = (c0 + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
        c_mask = chunks < CHUNKS
        mask = c_mask[:, None] & k_mask[None, :]
        total += tl.sum(tl.load(sums_ptr + chunks[:, None] * D + ks[None, :], mask=mask, other=0.0), axis=0)
        count += tl.load(count_ptr + chunks, mask=c_mask, other=0).to(tl.int64)
    count = tl.maximum(tl.sum(count, axis=0), 1).to(tl.float64)
    tl.store(mean_ptr + ks, total / count, mask=k_mask)


@triton.jit
def points_kernel(
    x_ptr,
    inv_ptr,
    mean_ptr,
    c_ptr,
    sq_ptr,
    N,
    D,
    stride_row,
    ACC: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """c = x·inv − mean rounded once to ACC (contiguous), and |c|² summed in float64, rounded
    to ACC (the CPU kernel's Points)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < N
    inv = tl.load(inv_ptr + rows, mask=row_mask, other=0.0)
    sq = tl.zeros((BLOCK_ROWS,), tl.float64)
    for k0 in range(0, D, BLOCK_D):
        ks = k0 + tl.arange(0, BLOCK_D)
        k_mask = ks < D
        mask = row_mask[:, None] & k_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_row + ks[None, :], mask=mask, other=0.0).to(tl.float64)
        mu = tl.load(mean_ptr + ks, mask=k_mask, other=0.0)
        c = (x * inv[:, None] - mu[None, :]).to(ACC)
        tl.store(c_ptr + rows[:, None] * D + ks[None, :], c, mask=mask)
        c64 = tl.where(mask, c.to(tl.float64), 0.0)
        sq += tl.sum(c64 * c64, axis=1)
    tl.store(sq_ptr + rows, sq.to(ACC), mask=row_mask)


# --------------------------------------------------------------------------- Euclidean (batch-hard triplets)


@triton.jit
def pair_dist_kernel(
    xa_ptr,
    xb_ptr,
    sa,
    sb,
    inv_a_ptr,
    inv_b_ptr,
    idx_ptr,
    out_ptr,
    N,
    M,
    D,
    K: tl.constexpr,
    ONE_FEATURE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    """out[a, k] = the exact distance (_pair_exact) of anchor a and ref row idx[a, k], for each
    of its K pairs (K a power of two); NaN where idx is outside [0, M)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < N
    ks = tl.arange(0, K)[None, :]
    at = rows[:, None] * K + ks
    js = tl.load(idx_ptr + at, mask=row_mask[:, None] & (ks < K), other=-1)
    ok = row_mask[:, None] & (js >= 0) & (js < M)
    d = _pair_exact(xa_ptr, xb_ptr, sa, sb, inv_a_ptr, inv_b_ptr, rows, js, row_mask, ok, D, ONE_FEATURE)
    tl.store(out_ptr + at, tl.where(ok, d, float("nan")), mask=row_mask[:, None] & (ks < K))


@triton.jit
def hard_grad_kernel(
    x_own_ptr,
    s_own,
    inv_own_ptr,
    x_b_ptr,
    s_b,
    inv_b_ptr,
    x_a_ptr,
    s_a,
    inv_a_ptr,
    idx_ptr,
    dist_ptr,
    order_ptr,
    lo_ptr,
    hi_ptr,
    scale_ptr,
    out_ptr,
    N_OWN,
    N,
    M,
    D,
    ANCHORS: tl.constexpr,
    TARGETS: tl.constexpr,
    ONE_FEATURE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    """batch_hard's backward for a block of own rows and features, in float64 from the
    inputs' differences (triplet_backward's add_pair): a counted anchor a's pairs (a, p) and
    (a, n) of exact distances d (idx, dist: (N, 2)) carry ±1/C (scale: 1/C)·(e_a − e_j)/d to
    row a (ANCHORS: own rows are the anchors) and ±1/C·(e_j − e_a)/d to row j (TARGETS: own
    rows are the refs; order: the pairs (k·N + a) sorted by j, [lo, hi) each own row's), in
    pair order (deterministic, no atomics); nothing at d = 0."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    fs = tl.program_id(1).to(tl.int64) * BLOCK_F + tl.arange(0, BLOCK_F)
    row_mask = rows < N_OWN
    f_mask = fs < D
    own_f = row_mask[:, None] & f_mask[None, :]
    scale = tl.load(scale_ptr)
    inv = tl.load(inv_own_ptr + rows, mask=row_mask, other=0.0)
    e = tl.load(x_own_ptr + rows[:, None] * s_own + fs[None, :], mask=own_f, other=0.0)
    e = _unit(e.to(tl.float64), inv[:, None], ONE_FEATURE)
    acc = tl.zeros((BLOCK_ROWS, BLOCK_F), tl.float64)
    if ANCHORS:
        for k in tl.static_range(2):
            j = tl.load(idx_ptr + rows * 2 + k, mask=row_mask, other=-1)
            d = tl.load(dist_ptr + rows * 2 + k, mask=row_mask, other=0.0)
            ok = row_mask & (j >= 0) & (j < M) & (d != 0)
            w = tl.where(ok, scale / tl.where(ok, d, 1.0), 0.0)
            if k == 1:
                w = 0.0 - w
            inv_j = tl.load(inv_b_ptr + j, mask=ok, other=0.0)
            f = tl.load(x_b_ptr + j[:, None] * s_b + fs[None, :], mask=ok[:, None] & f_mask[None, :], other=0.0)
            acc += tl.where(ok[:, None], w[:, None] * (e - _unit(f.to(tl.float64), inv_j[:, None], ONE_FEATURE)), 0.0)
    if TARGETS:
        lo = tl.load(lo_ptr + rows, mask=row_mask, other=0)
        n = tl.load(hi_ptr + rows, mask=row_mask, other=0) - lo
        for t in range(0, tl.max(n, axis=0)):
            live = row_mask & (t < n)
            pair = tl.load(order_ptr + lo + t, mask=live, other=0)
            a = pair % N
            kind = pair // N  # 0: the anchor's positive, 1: its negative
            d = tl.load(dist_ptr + a * 2 + kind, mask=live, other=0.0)
            ok = live & (d != 0) & (a >= 0) & (a < N)
            w = tl.where(ok, scale / tl.where(ok, d, 1.0), 0.0)
            w = tl.where(kind == 1, 0.0 - w, w)
            inv_j = tl.load(inv_a_ptr + a, mask=ok, other=0.0)
            f = tl.load(x_a_ptr + a[:, None] * s_a + fs[None, :], mask=ok[:, None] & f_mask[None, :], other=0.0)
            acc += tl.where(ok[:, None], w[:, None] * (e - _unit(f.to(tl.float64), inv_j[:, None], ONE_FEATURE)), 0.0)
    tl.store(out_ptr + rows[:, None] * D + fs[None, :], acc.to(out_ptr.dtype.element_ty), mask=own_f)


# --------------------------------------------------------------------------- wrappers


class _Side:
    """One set of rows as the kernels take them: normalised (ACC, contiguous), the Jacobian's
    per-row numbers, int64 labels (normalised=False: the inputs and labels only, for a
    forward that works from the float64 inverse norms)."""

    def __init__(self, x: Tensor, labels: Tensor, acc: torch.dtype, config: Config, normalised: bool = True):
        N, D = x.shape
        self.n = N
        self.labels = labels.to(torch.int64).contiguous()
        self.raw = x if x.stride(-1) == 1 else x.contiguous()
        self.config = config
        self._inv64 = None
        if not normalised:
            return
        self.e = torch.empty(N, D, dtype=acc, device=x.device)
        self.exp = torch.empty(N, dtype=torch.int32, device=x.device)
        self.inv = torch.empty(N, dtype=acc, device=x.device)
        self.clamped = torch.empty(N, dtype=torch.int8, device=x.device)
        if N == 0:
            return
        x = self.raw
        k = config.kwargs
        normalise_kernel[(blocks(N, k["BLOCK_ROWS"]),)](
            x,
            self.e,
            self.exp,
            self.inv,
            self.clamped,
            N,
            D,
            x.stride(0),
            ACC=acc_tl(acc),
            IS64=acc == torch.float64,
            **config.launch,
        )

    def narrow(self, first: int, n: int) -> _Side:
        """Rows [first, first + n) of this side, as views."""
        view = object.__new__(_Side)
        view.n, view.config = n, self.config
        for name in ("labels", "raw", "e", "exp", "inv", "clamped"):
            if hasattr(self, name):
                setattr(view, name, getattr(self, name).narrow(0, first, n))
        view._inv64 = None if self._inv64 is None else self._inv64.narrow(0, first, n)
        return view

    @property
    def inv64(self) -> Tensor:
        """1 / max(‖x‖, eps) per row in float64, as the CPU kernels' Side::inv64 (norm64_kernel),
        for exact cosines; formed on first use."""
        if self._inv64 is None:
            N, D = self.raw.shape
            self._inv64 = torch.empty(N, dtype=torch.float64, device=self.raw.device)
            if N > 0:
                norm64_kernel[(blocks(N, self.config.kwargs["BLOCK_ROWS"]),)](
                    self.raw, self._inv64, N, D, self.raw.stride(0), **self.config.launch
                )
        return self._inv64


def _sides(embeddings, labels, ref_embeddings, ref_labels, acc, config, normalised=True):
    a = _Side(embeddings, labels, acc, config, normalised)
    b = a if ref_embeddings is None else _Side(ref_embeddings, ref_labels, acc, config, normalised)
    return a, b


def _backward_sides(embeddings, labels, ref_embeddings, ref_labels, acc, config, whole: int | None):
    """A backward's sides: the call's, or, for a shard's backward with the whole problem's stats
    (whole: its rows), the refs' problem without refs, of whose rows the anchors are some (the
    CPU kernels' backward_inputs)."""
    if whole is not None:
        b = _Side(ref_embeddings, ref_labels, acc, config)
        return b, b
    return _sides(embeddings, labels, ref_embeddings, ref_labels, acc, config)


def _jacobian(own: _Side, g: Tensor, grad: Tensor, like: Tensor, row_config: Config) -> Tensor:
    """jacobian_kernel: g (∂loss/∂ own's normalised rows) through the normalisation, times grad,
    in like's dtype."""
    N, D = g.shape
    out = torch.empty(N, D, dtype=like.dtype, device=like.device)
    jacobian_kernel[(blocks(N, row_config.kwargs["BLOCK_ROWS"]),)](
        g,
        own.e,
        own.exp,
        own.inv,
        own.clamped,
        grad,
        out,
        N,
        D,
        ACC=acc_tl(g.dtype),
        IS64=g.dtype == torch.float64,
        **row_config.launch,
    )
    return out


def _equal_rows(a: _Side, b: _Side, config: Config) -> tuple[Tensor, Tensor]:
    """Per side, each row's group of equal rows over both (b's rows numbered after a's; one
    side where a is b): the lowest number of a row equal to it, as the CPU kernels'
    equal_rows. A collapsed batch (a model early in training that maps every input to one
    point, or to 0) has every pair cancel in the distance tiles and tie in every choice; the
    kernels take its equal rows' distances (0) and cosines without computing them. The rows
    are sorted by key (row_keys_kernel) and each compared with the one before, on the device:
    equal rows between which another row shares their key stay apart (a value computed,
    never a wrong one)."""
    sides = [a] if a is b else [a, b]
    device, D = a.raw.device, a.raw.shape[1]
    k = config.kwargs
    keys = torch.empty(sum(side.n for side in sides), dtype=torch.float64, device=device)
    start = 0
    for side in sides:
        if side.n > 0:
            row_keys_kernel[(blocks(side.n, k["BLOCK_ROWS"]),)](
                side.raw, keys[start:], side.n, D, side.raw.stride(0), **config.launch
            )
        start += side.n
    n = keys.numel()
    order = torch.argsort(keys, stable=True)
    equal = torch.empty(n, dtype=torch.bool, device=device)
    if n > 0:
        equal_next_kernel[(blocks(n, k["BLOCK_ROWS"]),)](
            a.raw, b.raw, a.raw.stride(0), b.raw.stride(0), a.n, order, keys, equal, n, D, **config.launch
        )
    first = torch.where(equal, 0, torch.arange(n, device=device)).cummax(0).values
    group = torch.empty_like(order).index_put_((order,), order[first])
    return (group, group) if a is b else (group[: a.n], group[a.n :])


def _self_cos(side: _Side, config: Config) -> Tensor:
    """self_cos_kernel: per row its exact cosine with an equal row (float64)."""
    out = torch.empty(side.n, dtype=torch.float64, device=side.raw.device)
    if side.n > 0:
        self_cos_kernel[(blocks(side.n, config.kwargs["BLOCK_ROWS"]),)](
            side.raw,
            side.inv64,
            out,
            side.n,
            side.raw.shape[1],
            side.raw.stride(0),
            BLOCK_ROWS=config.kwargs["BLOCK_ROWS"],
            **config.options,
        )
    return out


CENTRE_ROWS = 16  # centre_sums_kernel's chunks: blocks of rows each


def _points(a: _Side, b: _Side, acc: torch.dtype, config: Config) -> list:
    """The rows as the distance tiles take them (the CPU kernel's make_points): F.normalize's
    rows centred on the mean of the finite ones of both sides (float64), rounded once to
    ACC, and their squared norms; per side (c, |c|², its groups of equal rows)."""
    sides = [a] if a is b else [a, b]
    D = a.raw.shape[1]
    device = a.raw.device
    k = config.kwargs
    # (chunks of rows across programs, their sums added in chunk order by mean_kernel: one
    # program per block of features would take every row in turn)
    chunk = CENTRE_ROWS * k["BLOCK_ROWS"]
    chunks = [blocks(side.n, chunk) for side in sides]
    sums = torch.empty(sum(chunks), D, dtype=torch.float64, device=device)
    count = torch.empty(sum(chunks), dtype=torch.int32, device=device)
    mean = torch.empty(D, dtype=torch.float64, device=device)
    start = 0
    for side, n in zip(sides, chunks, strict=True):
        if n > 0 and D > 0:
            centre_sums_kernel[(blocks(D, k["BLOCK_D"]), n)](
                side.raw, side.inv64, sums[start:], count[start:], side.n, D, side.raw.stride(0), chunk, **config.launch
            )
        start += n
    if D > 0:
        mean_kernel[(blocks(D, k["BLOCK_D"]),)](sums, count, mean, sums.shape[0], D, **config.launch)
    out = []
    for side in sides:
        c = torch.empty(side.n, D, dtype=acc, device=device)
        sq = torch.empty(side.n, dtype=acc, device=device)
        if side.n > 0:
            points_kernel[(blocks(side.n, k["BLOCK_ROWS"]),)](
                side.raw, side.inv64, mean, c, sq, side.n, D, side.raw.stride(0), ACC=acc_tl(acc), **config.launch
            )
        out.append((c, sq))
    groups = _equal_rows(a, b, config)
    return [(*points, group) for points, group in zip(out * (2 if a is b else 1), groups, strict=True)]


def _triplet_check(embeddings, labels, ref_embeddings, ref_labels, margin, mining, distance, shard) -> tuple:
    op = "triplet_margin_loss"
    check_scalars(op, ("float", "margin", margin))
    _check_inputs(op, embeddings, labels, ref_embeddings, ref_labels)
    shard = _shard(op, shard, embeddings, labels, ref_embeddings, ref_labels)
    params = (float(margin), mining, distance)
    _check_params(op, params)
    _euclidean_only(op, distance)
    M = embeddings.shape[0] if ref_embeddings is None else ref_embeddings.shape[0]
    if M > 2**31 - 1:  # (the CPU kernel's limit, kept: one op, one contract)
        raise ValueError(f"{op}: at most 2^31 - 1 rows of ref_embeddings (or embeddings) are supported, got {M}")
    return params, shard


def _triplet_stats_check(stats: Tensor, M: int, batch_hard: bool) -> None:
    """csrc's check of the stats rows (the backward reads rows at their indices): a ValueError
    naming the first bad row on CPU tensors, a device-side assertion on CUDA ones (no
    synchronisation)."""
    op = "triplet_margin_loss"
    p, n, c = stats.unbind(1)
    ok = (c >= 0) & (p >= -1) & (p < M) & (n >= -1) & (n < M)
    if batch_hard:
        ok = ok & ((c == 0) | ((c == 1) & (p >= 0) & (n >= 0)))
    what = f"is not the forward's (hardest positive and negative in [-1, {M}), a count >= 0)"
    if not _launch.checks_on_host(stats):
        torch._assert_async(ok.all(), f"{op}: backward: a stats row {what}")
    elif not bool(ok.all()):
        a = int((~ok).nonzero()[0, 0])
        row = stats[a].tolist()
        raise ValueError(f"{op}: backward: stats row {a} {what}, got [{row[0]}, {row[1]}, {row[2]}]")


def _pair_dists(a: _Side, b: _Side, idx: Tensor, config: Config) -> Tensor:
    """pair_dist_kernel: (N, K) exact distances of each anchor's K pairs (NaN where none)."""
    N, K = idx.shape
    out = torch.empty(N, K, dtype=torch.float64, device=idx.device)
    if N > 0:
        pair_dist_kernel[(blocks(N, config.kwargs["BLOCK_ROWS"]),)](
            a.raw,
            b.raw,
            a.raw.stride(0),
            b.raw.stride(0),
            a.inv64,
            b.inv64,
            idx,
            out,
            N,
            b.n,
            a.raw.shape[1],
            ONE_FEATURE=a.raw.shape[1] == 1,
            K=K,
            BLOCK_ROWS=config.kwargs["BLOCK_ROWS"],
            **config.options,
        )
    return out


def triplet_margin_forward(
    embeddings,
    labels,
    ref_embeddings,
    ref_labels,
    margin,
    mining,
    distance="euclidean",
    shard=None,
    *,
    config=None,
    row_config=None,
    exact_config=None,
):
    """torchkit::triplet_margin_loss's CUDA kernel (any device under the interpreter; config:
    triplets.triplet_rows_kernel's with exact_config its triplet_exact_kernel's, or batch_hard's
    triplets.hard_rows_kernel's with exact_config its hard_pick_kernel's)."""
    (margin, mining, _), shard = _triplet_check(
        embeddings, labels, ref_embeddings, ref_labels, margin, mining, distance, shard
    )
    self_, offset = _self_pairs(ref_embeddings, shard)
    acc = acc_dtype(embeddings)
    hard = mining == "batch_hard"
    row_config = row_config or ROW_CONFIGS[0]
    N = embeddings.shape[0]
    M = N if ref_embeddings is None else ref_embeddings.shape[0]
    idx = torch.full((N, 2), -1, dtype=torch.int64, device=embeddings.device)

    def result(total: Tensor, count: Tensor, stats: Tensor) -> tuple[Tensor, Tensor]:
        """The loss (the mean of the counted terms, 0 for none), or a shard's parts."""
        if shard is not None:
            return _parts(total, count), stats
        return torch.where(count > 0, total / count.clamp(min=1), 0.0).to(embeddings.dtype), stats

    if N == 0 or M == 0:
        zero = idx.new_zeros(())
        return result(zero.double(), zero, torch.cat([idx, torch.zeros_like(idx[:, :1])], 1))
    if hard:
        config = config or lse._default(triplets.ROWS_CONFIGS, acc)
        exact_config = exact_config or triplets.EXACT_CONFIGS[0]
        pa, pb, _ = euclid._sides(embeddings, labels, ref_embeddings, ref_labels, acc, row_config)
        idx, dist = triplets.batch_hard(pa, pb, self_, offset, acc, config, exact_config)
        # triplet_forward (pair_losses_euclidean_cpu.cpp): per anchor with both, its triplet's
        # d_ap − d_an + margin from the exact distances; the mean of those > 0 (or NaN).
        per = dist[:, 0] - dist[:, 1] + margin
        counted = (idx >= 0).all(1) & ~(per <= 0)
        stats = torch.cat([idx, counted[:, None].long()], 1)
        return result(torch.where(counted, per, 0.0).sum(), counted.sum(), stats)
    # triplet_forward (pair_losses_euclidean_cpu.cpp): Σ over the counted triplets of
    # d_ap − d_an + margin over their number; NaN where a counted triplet has a positive at
    # a NaN distance.
    config = config or lse._default(triplets.ALL_ROWS_CONFIGS, acc)
    exact_config = exact_config or triplets.ALL_EXACT_CONFIGS[0]
    pa, pb, _ = euclid._sides(embeddings, labels, ref_embeddings, ref_labels, acc, row_config)
    semi = mining == "semi_hard"
    pos = triplets.positives(pa, pb, self_, offset, margin, semi, acc)
    sums, count = triplets.all_triplets(pa, pb, pos, self_, offset, margin, semi, acc, config, exact_config)
    per = torch.where((count > 0) & (pos[-1] > 0), float("nan"), sums)
    return result(per.sum(), count.sum(), torch.cat([idx, count[:, None]], 1))


# The anchors of one band of the triplet backward: at most this many (anchor, ref) pairs' int32
# coefficients (4 MiB), at least one block of anchors.
BAND_PAIRS = 1 << 20


def _triplet_band_backward(
    grad, a, b, margin, semi, count, want_e, want_r, config, rows_config, row_config, pairs: tuple[bool, int]
):
    """mining="all" / "semi_hard"'s backward (triplet_backward in the CPU kernel), a band of
    anchors at a time: triplets.all_triplets writes ∂loss/∂d·C of the band's pairs, then
    triplets.band_gradient adds their gradient to the anchors' rows and to the refs' rows (in
    band order: the same bits on every run); then the normalisation's Jacobian. pairs:
    _self_pairs's (a shard's anchors are rows of the refs apart from a)."""
    acc = a.e.dtype
    config = config or lse._default(triplets.BAND_GRAD_CONFIGS, acc)
    rows_config = rows_config or lse._default(triplets.ALL_ROWS_CONFIGS, acc)
    self_ = a is b
    N, D = a.e.shape
    M = b.n
    # (the forward's tiles: triplets.all_triplets)
    ids, _ = lse._label_ids(*([a.labels] if self_ else [a.labels, b.labels]))
    sides = (a,) if self_ else (a, b)
    points = _points(a, b, acc, row_config)
    how = euclid._scheme(a.raw.dtype, half_pairs=False)
    tiles = [euclid._Points(side, *p, i, row_config, how) for side, p, i in zip(sides, points, ids, strict=False)]
    ta, tb = tiles[0], tiles[-1]
    pos = triplets.positives(ta, tb, *pairs, margin, semi, acc)
    step = rows_config.kwargs["BLOCK_N"]
    width = min(N, max(step, BAND_PAIRS // M // step * step))
    band = torch.empty(width, M, dtype=torch.int32, device=a.e.device)
    scale = (1.0 / count.clamp(min=1).double()).reshape(1)
    ge = torch.zeros(N, D, dtype=acc, device=a.e.device) if want_e or self_ else None
    gr = torch.zeros(M, D, dtype=acc, device=a.e.device) if want_r else None
    exact_config = triplets.ALL_EXACT_CONFIGS[0]
    for row0 in range(0, N, width):
        end = min(row0 + width, N)
        anchors = ta.narrow(row0, end - row0)
        band.zero_()
        triplets.all_triplets(ta, tb, pos, *pairs, margin, semi, acc, rows_config, exact_config, row0, end, band)
        part = band[: end - row0]
        if ge is not None:
            triplets.band_gradient(ge, anchors, tb, part, scale, True, row0, acc, config)
        if self_:
            triplets.band_gradient(ge, ta, anchors, part, scale, False, 0, acc, config)
        elif gr is not None:
            triplets.band_gradient(gr, tb, anchors, part, scale, False, 0, acc, config)
    live = count > 0  # a zero loss: zero gradients, NaN rows included
    empty = a.raw.new_empty(0)
    out_e = torch.where(live, _jacobian(a, ge, grad, a.raw, row_config), 0.0) if want_e else empty
    out_r = torch.where(live, _jacobian(b, gr, grad, b.raw, row_config), 0.0) if want_r else empty
    return out_e, out_r


def triplet_margin_backward(
    grad,
    embeddings,
    labels,
    ref_embeddings,
    ref_labels,
    stats,
    margin,
    mining,
    distance,
    output_mask,
    shard=None,
    *,
    config=None,
    row_config=None,
    rows_config=None,
):
    """torchkit::_triplet_margin_loss_backward's CUDA kernel (config: hard_grad_kernel's for
    batch_hard, triplets.band_grad_kernel's for all and semi_hard, with triplets.triplet_rows_kernel's
    rows_config). A shard's takes its own stats and gives the refs' gradient from its anchors
    (csrc/pair_losses.h)."""
    op = "triplet_margin_loss"
    (margin, mining, _), shard = _triplet_check(
        embeddings, labels, ref_embeddings, ref_labels, margin, mining, distance, shard
    )
    _check_loss_backward(op, grad, embeddings, stats, shard)
    self_ = ref_embeddings is None
    N, D = embeddings.shape
    M = N if self_ else ref_embeddings.shape[0]
    _triplet_stats_check(stats, M, mining == "batch_hard")
    want_e = bool(output_mask[0])
    want_r = not self_ and bool(output_mask[1])
    empty = embeddings.new_empty(0)
    if N == 0 or M == 0 or D == 0 or not (want_e or want_r):
        return _zeros(want_e, embeddings, empty), _zeros(want_r, ref_embeddings, empty)
    acc = acc_dtype(embeddings)
    row_config = row_config or ROW_CONFIGS[0]
    a, b = _sides(embeddings, labels, ref_embeddings, ref_labels, acc, row_config)
    st = stats.contiguous()
    count = st[:, 2].sum()
    if mining != "batch_hard":
        pairs = _self_pairs(ref_embeddings, shard)
        return _triplet_band_backward(
            grad, a, b, margin, mining == "semi_hard", count, want_e, want_r, config, rows_config, row_config, pairs
        )
    config = config or HARD_GRAD_CONFIGS[0]
    idx = torch.where(st[:, 2:] != 0, st[:, :2], -1).contiguous()  # the counted anchors' pairs
    dist = _pair_dists(a, b, idx, row_config)
    scale = 1.0 / count.clamp(min=1).double()
    # Each pair k·N + a by its ref row (none: past the last), for the refs' side.
    targets = idx.t().reshape(-1)
    keys, order = torch.sort(torch.where(targets >= 0, targets, M), stable=True)
    ref_rows = torch.arange(M, device=embeddings.device)
    lo = torch.searchsorted(keys, ref_rows)
    hi = torch.searchsorted(keys, ref_rows, right=True)

    def rows_grad(own: _Side, anchors: bool, targets: bool, like: Tensor) -> Tensor:
        g = torch.empty(own.n, D, dtype=acc, device=like.device)
        k = config.kwargs
        hard_grad_kernel[(blocks(own.n, k["BLOCK_ROWS"]), blocks(D, k["BLOCK_F"]))](
            own.raw,
            own.raw.stride(0),
            own.inv64,
            b.raw,
            b.raw.stride(0),
            b.inv64,
            a.raw,
            a.raw.stride(0),
            a.inv64,
            idx,
            dist,
            order,
            lo,
            hi,
            scale,
            g,
            own.n,
            N,
            M,
            D,
            ONE_FEATURE=D == 1,
            ANCHORS=anchors,
            TARGETS=targets,
            **config.launch,
        )
        return torch.where(count > 0, _jacobian(own, g, grad, like, row_config), 0.0)

    if self_:
        return rows_grad(a, True, True, embeddings), empty
    ge = rows_grad(a, True, False, embeddings) if want_e else empty
    gr = rows_grad(b, False, True, ref_embeddings) if want_r else empty
    return ge, gr


# --------------------------------------------------------------------------- compile check


def compile_cases() -> list[CompileCase]:
    """Every kernel for tools/triton_check.py: each configuration in float32, float64 with the
    first; the log-sum-exp and multi-similarity engines' (lse.compile_cases, ms.compile_cases)
    first."""
    cases = lse.compile_cases() + ms.compile_cases() + euclid.compile_cases() + triplets.compile_cases()
    for dtype, acc in (("fp32", "fp32"), ("bf16", "fp32"), ("fp64", "fp64")):
        is64 = acc == "fp64"
        every = dtype == "fp32"
        flags = dict(ACC=tl.float64 if is64 else tl.float32, IS64=is64)
        ints = dict.fromkeys(("N", "M", "D", "N_OWN", "N_OTHER", "OFFSET", "stride_row"), "i32")
        accs = dict.fromkeys(
            (
                "a_ptr",
                "b_ptr",
                "e_ptr",
                "own_ptr",
                "other_ptr",
                "log_s_ptr",
                "sum_ptr",
                "coef_ptr",
                "shift_ptr",
                "w_ptr",
                "inv_ptr",
                "g_ptr",
            ),
            "*" + acc,
        )
        types = {
            **ints,
            **accs,
            "x_ptr": "*" + dtype,
            "grad_ptr": "*" + dtype,
            "lab_ptr": "*i64",
            "ref_lab_ptr": "*i64",
            "own_lab_ptr": "*i64",
            "other_lab_ptr": "*i64",
            "npos_ptr": "*i32",
            "npairs_ptr": "*i32",
            "exp_ptr": "*i32",
            "clamped_ptr": "*i8",
            "INV_T_BITS": "i64",
            "SHIFT_BITS": "i64",
        }
        if dtype != "bf16":
            ms_types = {
                **types,
                **dict.fromkeys(("xa_ptr", "xb_ptr", "x_own_ptr", "x_other_ptr"), "*" + dtype),
                **dict.fromkeys(("inv_a_ptr", "inv_b_ptr", "inv_own_ptr", "inv_other_ptr", "st_ptr"), "*fp64"),
                **dict.fromkeys(("sa", "sb", "s_own", "s_other"), "i32"),
                **dict.fromkeys(("grp_a_ptr", "grp_b_ptr", "grp_own_ptr", "grp_other_ptr"), "*i64"),
                **dict.fromkeys(("cos_a_ptr", "cos_own_ptr"), "*fp64"),
                **dict.fromkeys(("ALPHA_BITS", "BETA_BITS", "BASE_BITS", "EPS_BITS", "SLACK_BITS"), "i64"),
                "count_ptr": "*i32",
                "out_ptr": "*" + acc,
            }
            hard = {
                **ms_types,
                **dict.fromkeys(("x_b_ptr", "x_a_ptr"), "*" + dtype),
                **dict.fromkeys(("inv_b_ptr", "inv_a_ptr", "dist_ptr", "scale_ptr"), "*fp64"),
                **dict.fromkeys(("idx_ptr", "order_ptr", "lo_ptr", "hi_ptr"), "*i64"),
                **dict.fromkeys(("s_b", "s_a"), "i32"),
                "out_ptr": "*" + acc,
            }
            for anchors, targets in ((True, True), (True, False), (False, True)):
                cases.append(
                    CompileCase(
                        f"pair_losses.hard_grad {dtype}{' anchors' if anchors else ''}{' targets' if targets else ''}",
                        hard_grad_kernel,
                        hard,
                        dict(ANCHORS=anchors, TARGETS=targets),
                        HARD_GRAD_CONFIGS if every and anchors and targets else HARD_GRAD_CONFIGS[:1],
                    )
                )
            cases.append(
                CompileCase(
                    f"pair_losses.pair_dist {dtype}",
                    pair_dist_kernel,
                    {**ms_types, "idx_ptr": "*i64", "out_ptr": "*fp64"},
                    dict(K=2),
                    tuple(_config(BLOCK_ROWS=c.kwargs["BLOCK_ROWS"], num_warps=c.num_warps) for c in ROW_CONFIGS),
                )
            )
            cases.append(
                CompileCase(
                    f"pair_losses.points {dtype}",
                    points_kernel,
                    {**types, "inv_ptr": "*fp64", "mean_ptr": "*fp64", "c_ptr": "*" + acc, "sq_ptr": "*" + acc},
                    dict(ACC=flags["ACC"]),
                    ROW_CONFIGS if every else ROW_CONFIGS[:1],
                )
            )
            cases.append(
                CompileCase(
                    f"pair_losses.self_cos {dtype}",
                    self_cos_kernel,
                    {**types, "inv_ptr": "*fp64", "out_ptr": "*fp64"},
                    {},
                    tuple(_config(BLOCK_ROWS=c.kwargs["BLOCK_ROWS"], num_warps=c.num_warps) for c in ROW_CONFIGS),
                )
            )
            for kernel in (row_keys_kernel, equal_next_kernel):
                cases.append(
                    CompileCase(
                        f"pair_losses.{kernel.fn.__name__.removesuffix('_kernel')} {dtype}",
                        kernel,
                        {
                            **ms_types,
                            **dict.fromkeys(("key_ptr",), "*fp64"),
                            **dict.fromkeys(("NA", "sa", "sb"), "i32"),
                            "order_ptr": "*i64",
                            "out_ptr": "*i1",
                        },
                        {},
                        ROW_CONFIGS if every else ROW_CONFIGS[:1],
                    )
                )
            if dtype == "fp32":
                cases.append(CompileCase("pair_losses.norm64 fp32", norm64_kernel, types, {}, ROW_CONFIGS))
                centre = {**types, "inv_ptr": "*fp64", "sums_ptr": "*fp64", "count_ptr": "*i32", "CHUNK": "i32"}
                cases.append(CompileCase("pair_losses.centre_sums fp32", centre_sums_kernel, centre, {}, ROW_CONFIGS))
                mean = {**centre, "mean_ptr": "*fp64", "CHUNKS": "i32"}
                cases.append(CompileCase("pair_losses.mean", mean_kernel, mean, {}, ROW_CONFIGS))
        for kernel in (normalise_kernel, jacobian_kernel):
            cases.append(
                CompileCase(
                    f"pair_losses.{kernel.fn.__name__.removesuffix('_kernel')} {dtype}",
                    kernel,
                    {**types, "out_ptr": "*" + dtype},
                    flags,
                    ROW_CONFIGS if every else ROW_CONFIGS[:1],
                )
            )
        if dtype != "fp64":  # a shard's backward: the caller's float64 grad
            cases.append(
                CompileCase(
                    f"pair_losses.jacobian {dtype} shard",
                    jacobian_kernel,
                    {**types, "out_ptr": "*" + dtype, "grad_ptr": "*fp64"},
                    flags,
                    ROW_CONFIGS[:1],
                )
            )
    # The kernels of exact distances: each case as a launch with D > 1 compiles it, and the
    # first in float32 also as one with D = 1.
    one_feature = {
        triplets.band_pairs_kernel,
        triplets.triplet_rows_kernel,
        triplets.triplet_exact_kernel,
        triplets.positives_kernel,
        hard_grad_kernel,
        pair_dist_kernel,
    }
    out, seen = [], set()
    for case in cases:
        if case.kernel not in one_feature:
            out.append(case)
            continue
        out.append(dataclasses.replace(case, constexprs={**case.constexprs, "ONE_FEATURE": False}))
        if case.kernel not in seen and " fp32" in case.name:
            seen.add(case.kernel)
            out.append(
                dataclasses.replace(
                    case,
                    name=case.name + " one feature",
                    constexprs={**case.constexprs, "ONE_FEATURE": True},
                    configs=case.configs[:1],
                )
            )
    return out
