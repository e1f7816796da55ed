"""The pair losses' Triton kernels (supcon_loss and ntxent_loss so far): their CUDA kernels
where torchkit.triton selects them.

The semantics are the CPU kernels' (csrc/pair_losses.h, csrc/cpu/pair_losses_cpu.cpp), the
stats included, so that either backward takes either forward's stats. Nothing N×M exists:

- Prefix (normalise_kernel): each row as F.normalize leaves it, x / max(‖x‖, 1e-12), in the
  accumulation type (a float32 copy of float16 and bfloat16 rows), from the row scaled by the
  power of two 2^-E of its largest |entry| first, so that no sum of squares over- or
  underflows anywhere in the finite range; per row E, 1/‖x·2^-E‖ (1e12 where the clamp holds)
  and whether it holds, for the backward's Jacobian.
- Forward (rows_kernel): one program per block of anchors, the similarity tiles of its rows
  against every ref block (IEEE products in float32 or float64, never TF32) folded into per
  anchor running statistics: SupCon's log-sum-exp over the pairs, NT-Xent's over the
  negatives, the positives' sum of x = s/τ and the counts. NT-Xent then takes a second pass
  for its positive pairs' terms, which need their anchor's whole negative sum. The per-anchor
  results become the loss and the stats with a few elementwise torch operations on the device
  (no host synchronisation), the totals in float64 as on the CPU.
- Backward: per anchor the coefficients of ∂loss/∂x_ij = coef_i·exp(x_ij − shift_i), with the
  positive pairs' own terms (PairGrad in pair_losses_cpu.cpp), formed on the device from the
  stats; grad_kernel recomputes each tile, turns it into ∂loss/∂s and multiplies it into the
  other side's normalised rows, one program per block of its own rows and block of features
  (the tile is recomputed per feature block: no atomics, the same bits on every run). Without
  refs one pass gives each row's gradient as anchor and as ref (s is symmetric); with refs a
  second pass, refs own, gives the refs'. jacobian_kernel takes each row through the
  normalisation, times the loss's gradient (read on the device).

Kernels never index past what the wrapper checked; offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from torchkit.ops._common import acc_dtype, check_same_device, check_scalars, dtype_name
from torchkit.ops.pair_losses import _check_inputs, _check_params, _check_proxy_inputs
from torchkit.triton import _math as tm
from torchkit.triton._launch import CompileCase, Config, float_bits

NORM_EPS = tl.constexpr(1e-12)  # F.normalize's (csrc/cpu/pair_losses_cpu.h's kNormEps)

# rows_kernel's modes: SupCon's pass, NT-Xent's negatives, NT-Xent's positive pairs, proxy
# anchor's pass.
SUPCON = tl.constexpr(0)
NTXENT_NEGATIVES = tl.constexpr(1)
NTXENT_POSITIVES = tl.constexpr(2)
PROXY = tl.constexpr(3)
# grad_kernel's losses.
LOSS_SUPCON = tl.constexpr(0)
LOSS_NTXENT = tl.constexpr(1)
LOSS_PROXY = tl.constexpr(2)

# Launch configurations. Each is run by the tests (every masking path) and compiled by
# tools/triton_check.py; `config` arguments pick one, the default being the first.
ROWS_CONFIGS = (
    Config(BLOCK_N=64, BLOCK_M=64, BLOCK_K=32, num_warps=8, num_stages=3),
    Config(BLOCK_N=32, BLOCK_M=64, BLOCK_K=32, num_warps=4, num_stages=3),
    Config(BLOCK_N=32, BLOCK_M=32, BLOCK_K=16, num_warps=4, num_stages=2),
)
GRAD_CONFIGS = (
    Config(BLOCK_N=64, BLOCK_M=32, BLOCK_K=32, BLOCK_F=64, num_warps=8, num_stages=2),
    Config(BLOCK_N=32, BLOCK_M=32, BLOCK_K=16, BLOCK_F=32, num_warps=4, num_stages=2),
)
ROW_CONFIGS = (
    Config(BLOCK_ROWS=16, BLOCK_D=128, num_warps=4, num_stages=2),
    Config(BLOCK_ROWS=8, BLOCK_D=16, num_warps=2, num_stages=2),
)


# --------------------------------------------------------------------------- shared pieces


@triton.jit
def _product(a, b, acc, IS64: tl.constexpr):
    """acc + a·bᵀ with IEEE products (float32 tl.dot defaults to TF32 on the GPU)."""
    if IS64:
        return tl.dot(a, tl.trans(b), acc, out_dtype=tl.float64)
    else:
        return tl.dot(a, tl.trans(b), acc, input_precision="ieee", out_dtype=tl.float32)


@triton.jit
def _tile(
    e_ptr, f_ptr, rows, cols, row_mask, col_mask, D, ACC: tl.constexpr, IS64: tl.constexpr, BLOCK_K: tl.constexpr
):
    """The cosine tile of normalised rows `rows` of e against rows `cols` of f (both (·, D),
    contiguous); 0 in masked lanes."""
    s = tl.zeros((rows.shape[0], cols.shape[0]), ACC)
    for k0 in range(0, D, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < D
        a = tl.load(e_ptr + rows[:, None] * D + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(f_ptr + cols[:, None] * D + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        s = _product(a, b, s, IS64)
    return s


@triton.jit
def _scalars(INV_T_BITS, IS64: tl.constexpr):
    """1/τ in the accumulation type (passed as float64 bits: _launch.float_bits), and tiny, PML's
    small_val: the accumulation type's smallest normal."""
    if IS64:
        tiny = tm.pow2(tl.full((), -1022, tl.int32), IS64)
    else:
        tiny = tm.pow2(tl.full((), -126, tl.int32), IS64)
    return tm.f64(INV_T_BITS).to(tiny.dtype), tiny


@triton.jit
def _log_add_exp(x, log_s):
    """log(exp(x) + exp(log_s)) as the CPU kernel forms it (x where log_s = −∞)."""
    top = tl.maximum(x, log_s, propagate_nan=tl.PropagateNan.ALL)
    return tl.where(log_s == float("-inf"), x, top + tl.log(1.0 + tl.exp(-tl.abs(x - log_s))))


@triton.jit
def _lse_fold(m, s, x, keep):
    """Folds the kept entries of x (per row) into the running log-sum-exp (m, s); NaN entries
    are the caller's to flag."""
    ok = keep & (x == x)
    m_new = tl.maximum(m, tl.max(tl.where(ok, x, float("-inf")), axis=1))
    live = m_new != float("-inf")
    shift = tl.where(live, m_new, 0.0)
    scale = tl.where(live, tl.exp(m - shift), 0.0)
    p = tl.where(ok, tl.exp(x - shift[:, None]), 0.0)
    return m_new, s * scale + tl.sum(p, axis=1)


@triton.jit
def _lse_value(m, s, nan):
    return tl.where(nan, float("nan"), tl.where(s > 0, m + tl.log(tl.where(s > 0, s, 1.0)), m))


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


@triton.jit
def rows_kernel(
    a_ptr,
    b_ptr,
    lab_ptr,
    ref_lab_ptr,
    log_s_ptr,
    out_ptr,
    sum_ptr,
    npos_ptr,
    npairs_ptr,
    N,
    M,
    D,
    INV_T_BITS,
    SHIFT_BITS,
    SELF: tl.constexpr,
    MODE: tl.constexpr,
    ACC: tl.constexpr,
    IS64: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Per anchor of a block, over every ref (x = s/τ; pairs: every ref but the anchor itself
    without refs; positives: equal labels):
    SUPCON: out = log Σ_pairs exp(x) (0 without pairs), sum = Σ_positives x, and the counts;
    NTXENT_NEGATIVES: out = log Σ_negatives exp(x) (−∞ without), sum = Σ_positives x, counts;
    NTXENT_POSITIVES (log_s: the negatives' pass's out): out = log R = log Σ_p q/(q + tiny) /
    (exp(x_p) + S), sum = Σ_p −log(q_p + tiny), q_p = exp(x_p)/(exp(x_p) + S); no counts;
    PROXY (anchors: the proxies, 1/τ = α, shift = α·margin): out = Ln = log(1 + Σ_negatives
    exp(x + shift)), sum = Lp = log(1 + Σ_positives exp(shift − x)), and the counts."""
    inv_t, tiny = _scalars(INV_T_BITS, IS64)
    shift = tm.f64(SHIFT_BITS).to(tiny.dtype)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    lab = tl.load(lab_ptr + rows, mask=row_mask, other=0)
    m = tl.full((BLOCK_N,), float("-inf"), ACC)
    s = tl.zeros((BLOCK_N,), ACC)
    total = tl.zeros((BLOCK_N,), ACC)
    nan = tl.zeros((BLOCK_N,), tl.int32)
    if MODE == PROXY:  # both log-sum-exps hold the 1 (exp(0)) from the start
        m = tl.zeros((BLOCK_N,), ACC)
        s = tl.full((BLOCK_N,), 1.0, ACC)
        m2 = tl.zeros((BLOCK_N,), ACC)
        s2 = tl.full((BLOCK_N,), 1.0, ACC)
        nan2 = tl.zeros((BLOCK_N,), tl.int32)
    npos = tl.zeros((BLOCK_N,), tl.int32)
    npairs = tl.zeros((BLOCK_N,), tl.int32)
    if MODE == NTXENT_POSITIVES:
        log_s = tl.load(log_s_ptr + rows, mask=row_mask, other=0.0)
    for j0 in range(0, M, BLOCK_M):
        cols = j0 + tl.arange(0, BLOCK_M).to(tl.int64)
        col_mask = cols < M
        ref_lab = tl.load(ref_lab_ptr + cols, mask=col_mask, other=0)
        x = _tile(a_ptr, b_ptr, rows, cols, row_mask, col_mask, D, ACC, IS64, BLOCK_K) * inv_t
        valid = row_mask[:, None] & col_mask[None, :]
        if SELF:
            valid = valid & (rows[:, None] != cols[None, :])
        pos = valid & (lab[:, None] == ref_lab[None, :])
        if MODE == NTXENT_POSITIVES:
            lse = _log_add_exp(x, log_s[:, None])
            q = tl.exp(x - lse)
            total += tl.sum(tl.where(pos, -tl.log(q + tiny), 0.0), axis=1)
            r = tl.where(q > 0, tl.log(tl.where(q > 0, q, 1.0) / (q + tiny)), float("-inf")) - lse
            nan = nan | tl.max(tl.where(pos & (r != r), 1, 0), axis=1)
            m, s = _lse_fold(m, s, r, pos)
        elif MODE == PROXY:
            negative = valid & (pos == 0)
            y = x + shift
            nan = nan | tl.max(tl.where(negative & (y != y), 1, 0), axis=1)
            m, s = _lse_fold(m, s, y, negative)
            z = shift - x
            nan2 = nan2 | tl.max(tl.where(pos & (z != z), 1, 0), axis=1)
            m2, s2 = _lse_fold(m2, s2, z, pos)
            npos += tl.sum(pos.to(tl.int32), axis=1)
            npairs += tl.sum(valid.to(tl.int32), axis=1)
        else:
            keep = valid
            if MODE == NTXENT_NEGATIVES:
                keep = valid & (pos == 0)
            nan = nan | tl.max(tl.where(keep & (x != x), 1, 0), axis=1)
            m, s = _lse_fold(m, s, x, keep)
            total += tl.sum(tl.where(pos, x, 0.0), axis=1)
            npos += tl.sum(pos.to(tl.int32), axis=1)
            npairs += tl.sum(valid.to(tl.int32), axis=1)
    out = _lse_value(m, s, nan != 0)
    if MODE == SUPCON:
        out = tl.where(npairs > 0, out, 0.0)
    if MODE == PROXY:
        total = _lse_value(m2, s2, nan2 != 0)
    tl.store(out_ptr + rows, out, mask=row_mask)
    tl.store(sum_ptr + rows, total, mask=row_mask)
    if MODE != NTXENT_POSITIVES:
        tl.store(npos_ptr + rows, npos, mask=row_mask)
        tl.store(npairs_ptr + rows, npairs, mask=row_mask)


# --------------------------------------------------------------------------- backward


@triton.jit
def _pair_terms(x, coef, shift, w, log_s, tiny, LOSS: tl.constexpr):
    """∂loss/∂x of one anchor's pairs (coef etc. broadcast along the anchor's axis): a
    negative pair's coef·exp(x − shift), and a positive pair's term: SupCon's and NT-Xent's as
    PairGrad in pair_losses_cpu.cpp forms them, proxy anchor's −w·exp(−x − log_s)."""
    live = coef != 0
    every = tl.where(live, coef * tl.exp(x - shift), 0.0)
    if LOSS == LOSS_NTXENT:
        q = tl.exp(x - _log_add_exp(x, log_s))
        positive = tl.where(live, -q * (1.0 - q) / (q + tiny) * coef, 0.0)
    elif LOSS == LOSS_PROXY:
        positive = tl.where(w != 0, -w * tl.exp(-x - log_s), 0.0)
    else:
        positive = tl.where(live, every - w, 0.0)
    return every, positive


@triton.jit
def grad_kernel(
    own_ptr,
    other_ptr,
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
    INV_T_BITS,
    SELF: tl.constexpr,
    ANCHORS_OWN: tl.constexpr,
    ANCHORS_OTHER: tl.constexpr,
    LOSS: tl.constexpr,
    ACC: tl.constexpr,
    IS64: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    """out[own rows, feature block] = Σ_other ∂loss/∂s · other's normalised rows, ∂/∂s of the
    pairs whose anchor is the own row (ANCHORS_OWN) and of those whose anchor is the other row
    (ANCHORS_OTHER; both without refs), the per-anchor arrays indexed by anchor."""
    inv_t, tiny = _scalars(INV_T_BITS, IS64)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    fs = tl.program_id(1).to(tl.int64) * BLOCK_F + tl.arange(0, BLOCK_F)
    row_mask = rows < N_OWN
    f_mask = fs < D
    lab = tl.load(own_lab_ptr + rows, mask=row_mask, other=0)
    if ANCHORS_OWN:
        ci = tl.load(coef_ptr + rows, mask=row_mask, other=0.0)
        hi = tl.load(shift_ptr + rows, mask=row_mask, other=0.0)
        wi = tl.load(w_ptr + rows, mask=row_mask, other=0.0)
        si = tl.load(log_s_ptr + rows, mask=row_mask, other=0.0)
    acc = tl.zeros((BLOCK_N, BLOCK_F), ACC)
    for j0 in range(0, N_OTHER, BLOCK_M):
        cols = j0 + tl.arange(0, BLOCK_M).to(tl.int64)
        col_mask = cols < N_OTHER
        other_lab = tl.load(other_lab_ptr + cols, mask=col_mask, other=0)
        x = _tile(own_ptr, other_ptr, rows, cols, row_mask, col_mask, D, ACC, IS64, BLOCK_K) * inv_t
        g = tl.zeros((BLOCK_N, BLOCK_M), ACC)
        p = tl.zeros((BLOCK_N, BLOCK_M), ACC)
        if ANCHORS_OWN:
            every, positive = _pair_terms(x, ci[:, None], hi[:, None], wi[:, None], si[:, None], tiny, LOSS)
            g += every
            p += positive
        if ANCHORS_OTHER:
            cj = tl.load(coef_ptr + cols, mask=col_mask, other=0.0)
            hj = tl.load(shift_ptr + cols, mask=col_mask, other=0.0)
            wj = tl.load(w_ptr + cols, mask=col_mask, other=0.0)
            sj = tl.load(log_s_ptr + cols, mask=col_mask, other=0.0)
            every, positive = _pair_terms(x, cj[None, :], hj[None, :], wj[None, :], sj[None, :], tiny, LOSS)
            g += every
            p += positive
        valid = row_mask[:, None] & col_mask[None, :]
        if SELF:
            valid = valid & (rows[:, None] != cols[None, :])
        g = tl.where(lab[:, None] == other_lab[None, :], p, g)
        if LOSS != LOSS_PROXY:  # (proxy anchor's coefficients, its stats', hold ∂x/∂s = α)
            g = g * inv_t
        g = tl.where(valid, g, 0.0)
        f = tl.load(other_ptr + cols[:, None] * D + fs[None, :], mask=col_mask[:, None] & f_mask[None, :], other=0.0)
        acc = _product(g, tl.trans(f), acc, IS64)
    tl.store(out_ptr + rows[:, None] * D + fs[None, :], acc, mask=row_mask[:, None] & f_mask[None, :])


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


# --------------------------------------------------------------------------- wrappers


def _tl(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _blocks(n: int, block: int) -> int:
    return max(1, -(-n // block))


class _Side:
    """One set of rows as the kernels take them: normalised (ACC, contiguous), the Jacobian's
    per-row numbers, int64 labels."""

    def __init__(self, x: Tensor, labels: Tensor, acc: torch.dtype, config: Config):
        N, D = x.shape
        self.n = N
        self.e = torch.empty(N, D, dtype=acc, device=x.device)
        self.exp = torch.empty(N, dtype=torch.int32, device=x.device)
        self.inv = torch.empty(N, dtype=acc, device=x.device)
        self.clamped = torch.empty(N, dtype=torch.int8, device=x.device)
        self.labels = labels.to(torch.int64).contiguous()
        if N == 0:
            return
        x = x if x.stride(-1) == 1 else x.contiguous()
        k = config.kwargs
        normalise_kernel[(_blocks(N, k["BLOCK_ROWS"]),)](
            x,
            self.e,
            self.exp,
            self.inv,
            self.clamped,
            N,
            D,
            x.stride(0),
            ACC=_tl(acc),
            IS64=acc == torch.float64,
            **config.launch,
        )


def _sides(embeddings, labels, ref_embeddings, ref_labels, acc, config):
    a = _Side(embeddings, labels, acc, config)
    b = a if ref_embeddings is None else _Side(ref_embeddings, ref_labels, acc, config)
    return a, b


def _rows(a: _Side, b: _Side, mode, self_: bool, scale: float, acc, config: Config, log_s=None, shift=0.0):
    """rows_kernel over every anchor, x = s·scale: (out, sum, positives, pairs) per anchor."""
    N, D = a.e.shape
    out = torch.empty(N, dtype=acc, device=a.e.device)
    total = torch.empty(N, dtype=acc, device=a.e.device)
    npos = torch.empty(N, dtype=torch.int32, device=a.e.device)
    npairs = torch.empty(N, dtype=torch.int32, device=a.e.device)
    if N > 0:
        rows_kernel[(_blocks(N, config.kwargs["BLOCK_N"]),)](
            a.e,
            b.e,
            a.labels,
            b.labels,
            out if log_s is None else log_s,
            out,
            total,
            npos,
            npairs,
            N,
            b.n,
            D,
            float_bits(scale),
            float_bits(shift),
            SELF=self_,
            MODE=mode,
            ACC=_tl(acc),
            IS64=acc == torch.float64,
            **config.launch,
        )
    return out, total, npos, npairs


def _pml_counts(npos: Tensor, npairs: Tensor) -> Tensor:
    """PML's condition for a loss at all: a positive and a negative pair, and more than one of
    one kind (a bool tensor: no host synchronisation)."""
    positives = npos.sum(dtype=torch.int64)
    negatives = npairs.sum(dtype=torch.int64) - positives
    return (positives > 0) & (negatives > 0) & ((positives > 1) | (negatives > 1))


def _check(op: str, embeddings, labels, ref_embeddings, ref_labels, temperature) -> float:
    check_scalars(op, ("float", "temperature", temperature))
    _check_inputs(op, embeddings, labels, ref_embeddings, ref_labels)
    _check_params(op, (float(temperature),))
    return float(temperature)


def supcon_forward(embeddings, labels, ref_embeddings, ref_labels, temperature, *, config=None, row_config=None):
    """torchkit::supcon_loss's CUDA kernel (any device under the interpreter)."""
    op = "supcon_loss"
    t = _check(op, embeddings, labels, ref_embeddings, ref_labels, temperature)
    acc = acc_dtype(embeddings)
    a, b = _sides(embeddings, labels, ref_embeddings, ref_labels, acc, row_config or ROW_CONFIGS[0])
    lse, possum, npos, npairs = _rows(a, b, SUPCON, ref_embeddings is None, 1.0 / t, acc, config or ROWS_CONFIGS[0])
    # Per anchor as supcon_forward (pair_losses_cpu.cpp), in float64.
    lse64 = lse.double()
    has = npos > 0
    loss = torch.where(has, lse64 - possum.double() / npos.clamp(min=1).double(), 0.0)
    kept = (loss > 0) | loss.isnan()  # PML's AvgNonZero, keeping NaN
    counted = kept.sum(dtype=torch.int64)
    use = _pml_counts(npos, npairs) & (counted > 0)
    denominator = counted.clamp(min=1).double()
    total = torch.where(use, torch.where(kept, loss, 0.0).sum() / denominator, 0.0)
    w = torch.where(use & kept, 1.0 / (npos.clamp(min=1).double() * denominator), 0.0)
    stats = torch.stack([lse, w.to(acc)], dim=1)
    return total.to(embeddings.dtype), stats


def ntxent_forward(embeddings, labels, ref_embeddings, ref_labels, temperature, *, config=None, row_config=None):
    """torchkit::ntxent_loss's CUDA kernel (any device under the interpreter)."""
    op = "ntxent_loss"
    t = _check(op, embeddings, labels, ref_embeddings, ref_labels, temperature)
    acc = acc_dtype(embeddings)
    config = config or ROWS_CONFIGS[0]
    self_ = ref_embeddings is None
    a, b = _sides(embeddings, labels, ref_embeddings, ref_labels, acc, row_config or ROW_CONFIGS[0])
    log_s, _, npos, npairs = _rows(a, b, NTXENT_NEGATIVES, self_, 1.0 / t, acc, config)
    log_r, loss, _, _ = _rows(a, b, NTXENT_POSITIVES, self_, 1.0 / t, acc, config, log_s=log_s)
    use = _pml_counts(npos, npairs)
    positives = npos.sum(dtype=torch.int64)
    has = npos > 0
    log_r = torch.where(has, log_r, float("-inf"))
    total = torch.where(use, torch.where(has, loss.double(), 0.0).sum() / positives.clamp(min=1).double(), 0.0)
    share = torch.where(use, 1.0 / positives.clamp(min=1).double(), 0.0).to(acc)
    # All zero where the loss is zero by PML's rule, as the CPU kernel's.
    stats = torch.where(use, torch.stack([log_s, log_r, share.expand(a.n)], dim=1), 0.0)
    return total.to(embeddings.dtype), stats


def _check_backward(op: str, grad: Tensor, embeddings: Tensor, stats: Tensor, columns: int, anchors=None) -> None:
    """csrc/pair_losses.cpp's check_backward_inputs, with its messages (anchors: their number
    where they are not the embeddings' rows)."""
    if grad.dim() != 0:
        raise ValueError(f"{op}: backward: grad must be a scalar (the loss's), got shape {list(grad.shape)}")
    if grad.dtype != embeddings.dtype:
        raise TypeError(
            f"{op}: embeddings and grad must have the same dtype, got {dtype_name(embeddings.dtype)} and "
            f"{dtype_name(grad.dtype)}"
        )
    check_same_device(op, embeddings=embeddings, grad=grad)
    acc = acc_dtype(embeddings)
    N = embeddings.shape[0] if anchors is None else anchors
    if stats.dim() != 2 or stats.shape[0] != N or stats.shape[1] != columns or stats.dtype != acc:
        raise ValueError(
            f"{op}: backward: stats must be (N, {columns}) = ({N}, {columns}) of {dtype_name(acc)}, got "
            f"{list(stats.shape)} of {dtype_name(stats.dtype)}"
        )
    check_same_device(op, embeddings=embeddings, stats=stats)


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
    config,
    row_config,
):
    op = "ntxent_loss" if ntxent else "supcon_loss"
    t = _check(op, embeddings, labels, ref_embeddings, ref_labels, temperature)
    _check_backward(op, grad, embeddings, stats, 3 if ntxent else 2)
    self_ = ref_embeddings is None
    want_e = bool(output_mask[0])
    want_r = not self_ and bool(output_mask[1])
    empty = embeddings.new_empty(0)
    N, D = embeddings.shape
    M = N if self_ else ref_embeddings.shape[0]
    if N == 0 or M == 0 or D == 0 or not (want_e or want_r):
        zero = lambda want, x: torch.zeros_like(x, memory_format=torch.contiguous_format) if want else empty  # noqa: E731
        return zero(want_e, embeddings), zero(want_r, ref_embeddings)
    acc = acc_dtype(embeddings)
    row_config = row_config or ROW_CONFIGS[0]
    config = config or GRAD_CONFIGS[0]
    a, b = _sides(embeddings, labels, ref_embeddings, ref_labels, acc, row_config)
    # Per anchor: coef, shift, w and log S (PairGrad in pair_losses_cpu.cpp).
    inf = torch.tensor(float("inf"), dtype=acc, device=stats.device)
    if ntxent:
        log_s, log_r, share = stats.unbind(1)
        coef = torch.where(log_r == -inf, 0.0, share)
        shift = torch.where(coef != 0, -log_r, inf)
        w = torch.zeros_like(coef)
    else:
        lse, w = stats.unbind(1)
        counted = (w != 0).sum(dtype=torch.int64)
        coef = torch.where(w != 0, 1.0 / counted.clamp(min=1).to(acc), 0.0).to(acc)
        shift = torch.where(w != 0, lse, inf)
        log_s = torch.zeros_like(coef)
    coef, shift, w, log_s = (v.contiguous() for v in (coef, shift, w, log_s))
    terms = (coef, shift, w, log_s)
    loss = LOSS_NTXENT if ntxent else LOSS_SUPCON

    def rows_grad(own: _Side, other: _Side, anchors_own: bool, anchors_other: bool, like: Tensor) -> Tensor:
        return _grad(
            own, other, terms, self_, anchors_own, anchors_other, loss, 1.0 / t, grad, like, config, row_config
        )

    if self_:
        return rows_grad(a, a, True, True, embeddings), empty
    ge = rows_grad(a, b, True, False, embeddings) if want_e else empty
    gr = rows_grad(b, a, False, True, ref_embeddings) if want_r else empty
    return ge, gr


def _grad(
    own: _Side, other: _Side, terms, self_, anchors_own, anchors_other, loss, scale, grad, like, config, row_config
):
    """The gradient of the rows of `own` (in like's dtype): grad_kernel, x = s·scale, with the
    per-anchor (coef, shift, w, log_s) of `terms`, then jacobian_kernel."""
    acc = own.e.dtype
    D = own.e.shape[1]
    k = config.kwargs
    g = torch.empty(own.n, D, dtype=acc, device=own.e.device)
    grad_kernel[(_blocks(own.n, k["BLOCK_N"]), _blocks(D, k["BLOCK_F"]))](
        own.e,
        other.e,
        own.labels,
        other.labels,
        *terms,
        g,
        own.n,
        other.n,
        D,
        float_bits(scale),
        SELF=self_,
        ANCHORS_OWN=anchors_own,
        ANCHORS_OTHER=anchors_other,
        LOSS=loss,
        ACC=_tl(acc),
        IS64=acc == torch.float64,
        **config.launch,
    )
    out = torch.empty(own.n, D, dtype=like.dtype, device=like.device)
    jacobian_kernel[(_blocks(own.n, row_config.kwargs["BLOCK_ROWS"]),)](
        g,
        own.e,
        own.exp,
        own.inv,
        own.clamped,
        grad,
        out,
        own.n,
        D,
        ACC=_tl(acc),
        IS64=acc == torch.float64,
        **row_config.launch,
    )
    return out


def supcon_backward(
    grad,
    embeddings,
    labels,
    ref_embeddings,
    ref_labels,
    stats,
    temperature,
    output_mask,
    *,
    config=None,
    row_config=None,
):
    """torchkit::_supcon_loss_backward's CUDA kernel."""
    args = (grad, embeddings, labels, ref_embeddings, ref_labels, stats, temperature, output_mask)
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
    *,
    config=None,
    row_config=None,
):
    """torchkit::_ntxent_loss_backward's CUDA kernel."""
    args = (grad, embeddings, labels, ref_embeddings, ref_labels, stats, temperature, output_mask)
    return _backward(True, *args, config, row_config)


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
        if labels.device.type == "cpu":
            low, high = int(labels.min()), int(labels.max())
            if low < 0 or high >= C:
                bad = low if low < 0 else high
                raise IndexError(f"{op}: labels must lie in [0, C) = [0, {C}) (a row of proxies each), got {bad}")
        else:
            inside = ((labels >= 0) & (labels < C)).all()
            torch._assert_async(inside, f"{op}: labels must lie in [0, C) = [0, {C}) (a row of proxies each)")
    return margin, alpha


def _proxy_sides(embeddings, labels, proxies, acc, row_config):
    """The proxies as the anchors (label c for row c), the embeddings as the refs."""
    classes = torch.arange(proxies.shape[0], device=proxies.device)
    return _Side(proxies, classes, acc, row_config), _Side(embeddings, labels, acc, row_config)


def proxy_anchor_forward(embeddings, labels, proxies, margin, alpha, *, config=None, row_config=None):
    """torchkit::proxy_anchor_loss's CUDA kernel (any device under the interpreter)."""
    margin, alpha = _proxy_check(embeddings, labels, proxies, margin, alpha)
    acc = acc_dtype(embeddings)
    a, b = _proxy_sides(embeddings, labels, proxies, acc, row_config or ROW_CONFIGS[0])
    ln, lp, npos, _ = _rows(a, b, PROXY, False, alpha, acc, config or ROWS_CONFIGS[0], shift=alpha * margin)
    # PML's DivisorReducer: the positive terms over the P proxies with positives (0 without
    # any), the negative ones over all C proxies (proxy_anchor_forward in pair_losses_cpu.cpp).
    C = a.n
    P = (npos > 0).sum(dtype=torch.int64)
    pos = torch.where(P > 0, lp.double().sum() / P.clamp(min=1).double(), 0.0)
    total = pos + (ln.double().sum() / C if C > 0 else 0.0)
    share = torch.where(P > 0, alpha / P.clamp(min=1).double(), 0.0).to(acc)
    stats = torch.stack([lp, ln, share.expand(C), torch.full_like(ln, alpha / max(C, 1))], dim=1)
    return total.to(embeddings.dtype), stats


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
        zero = lambda want, x: torch.zeros_like(x, memory_format=torch.contiguous_format) if want else empty  # noqa: E731
        return zero(want_e, embeddings), zero(want_p, proxies)
    acc = acc_dtype(embeddings)
    row_config = row_config or ROW_CONFIGS[0]
    config = config or GRAD_CONFIGS[0]
    a, b = _proxy_sides(embeddings, labels, proxies, acc, row_config)
    # Per proxy (ProxyAnchorTerms in pair_losses_cpu.cpp), x = α·s: a negative's
    # α/C·exp(x − (Ln − α·margin)), a positive's −α/P·exp(−x − (Lp − α·margin)).
    lp, ln, share, per_proxy = stats.unbind(1)
    am = alpha * margin
    terms = tuple(v.contiguous() for v in (per_proxy, ln - am, share, lp - am))
    common = (terms, False)
    gp = _grad(a, b, *common, True, False, LOSS_PROXY, alpha, grad, proxies, config, row_config) if want_p else empty
    ge = _grad(b, a, *common, False, True, LOSS_PROXY, alpha, grad, embeddings, config, row_config) if want_e else empty
    return ge, gp


# --------------------------------------------------------------------------- compile check


def compile_cases() -> list[CompileCase]:
    """Every kernel for tools/triton_check.py: each configuration in float32, float64 with the
    first; rows_kernel in each mode, grad_kernel in each loss's passes."""
    cases = []
    for dtype, acc in (("fp32", "fp32"), ("bf16", "fp32"), ("fp64", "fp64")):
        is64 = acc == "fp64"
        every = dtype == "fp32"
        flags = dict(ACC=tl.float64 if is64 else tl.float32, IS64=is64)
        ints = dict.fromkeys(("N", "M", "D", "N_OWN", "N_OTHER", "stride_row"), "i32")
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
            modes = (
                (SUPCON, "supcon"),
                (NTXENT_NEGATIVES, "negatives"),
                (NTXENT_POSITIVES, "positives"),
                (PROXY, "proxy"),
            )
            for mode, name in modes:
                for self_ in (True, False) if mode == SUPCON else ((False,) if mode == PROXY else (True,)):
                    cases.append(
                        CompileCase(
                            f"pair_losses.rows {name} {dtype}{' self' if self_ else ''}",
                            rows_kernel,
                            {**types, "out_ptr": "*" + acc},
                            dict(SELF=self_, MODE=mode, **flags),
                            ROWS_CONFIGS if every and mode == SUPCON and self_ else ROWS_CONFIGS[:1],
                        )
                    )
            passes = [
                (loss, name, self_, own, other)
                for loss, name in ((LOSS_SUPCON, "supcon"), (LOSS_NTXENT, "ntxent"))
                for self_, own, other in ((True, True, True), (False, True, False), (False, False, True))
            ]
            passes += [(LOSS_PROXY, "proxy", False, True, False), (LOSS_PROXY, "proxy", False, False, True)]
            for loss, name, self_, own, other in passes:
                cases.append(
                    CompileCase(
                        f"pair_losses.grad {name} {dtype}{' self' if self_ else (' anchors' if own else ' refs')}",
                        grad_kernel,
                        {**types, "out_ptr": "*" + acc},
                        dict(SELF=self_, ANCHORS_OWN=own, ANCHORS_OTHER=other, LOSS=loss, **flags),
                        GRAD_CONFIGS if every and self_ and loss == LOSS_SUPCON else GRAD_CONFIGS[:1],
                    )
                )
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
    return cases
