"""bilinear_pool's Triton kernels: the op's CUDA kernel where torchkit.triton selects it.

The semantics are the CPU kernel's (csrc/bilinear_pool.h, csrc/cpu/bilinear_pool_cpu.cpp),
its power-of-two protocol for samples of extreme magnitude included, computed from the
inputs as they lie in memory (no copy in another type; channels_last read in place):

- Prefix: each sample's largest |entry| of x and of y (max_abs_kernel, NaN-propagating), and
  from it the sample's scale (scales_kernel): a sample whose largest entries lie outside
  [2^-W, 2^W] (W = 32 for float32 accumulation, 256 for float64), or any sample when
  sqrt_eps > 2^2W, is computed at a power of two, a = x·2^ex and b = y·2^ey with the largest
  |entry| in [1/2, 1), and its epilogue forms s·2^h = sign(P)·sqrt(|P|·4^h/HW + sqrt_eps·4^h).
- Forward (forward_kernel): one Z tile per program, the product on tensor cores under the
  CUDA precision contract (docs/ops.md): float16 and bfloat16 as loaded (exact products,
  float32 accumulation); float32 by PyTorch's fp32-matmul setting, read at each call (the
  default: each value split into a TF32 pair, three products, as accurate as IEEE float32
  products; "high": TF32; "medium": bfloat16; lse._split_mma); float64 in float64. The
  epilogue takes the signed square root (correctly rounded) and the tile's sum of squares. For
  y = None only the tiles on and above the diagonal are computed and each is stored mirrored.
  The kernel is launched twice, once for the ordinary samples and once for the scaled ones
  (each launch skips the other's samples), so that the ordinary GEMM loop carries no scaling.
  norm_kernel sums each sample's tile sums in float64 (_sum_partials: the same bits on every run)
  and forms 1 / max(‖s‖, l2_eps), for a scaled sample by exponents (bilinear_pool_cpu.cpp's
  inverse_denominator); normalise_kernel multiplies. The norm is stored negated for a scaled
  sample, as the CPU kernel does.
- Backward: dot_kernel's per-chunk partials of dot(out, grad), summed in float64 by
  coef_kernel, which forms each sample's coefficient of ∂L/∂Z (for a scaled sample as a
  mantissa and an exponent, so that it stays finite); grad_z_kernel forms ∂L/∂Z · 1/HW once,
  symmetrised for y = None (a program owns a pair of mirrored tiles: no atomics); grad_kernel
  multiplies it into the other operand (∂L/∂Z in bfloat16 halves for reduced types; float32
  by the forward's scheme), for a scaled sample from the scaled operand, multiplied back into
  the input's units in its epilogue, and writes the gradient in the input's dtype and memory
  format.

Kernels never index past what the wrapper checked; offsets are int64.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from torchkit.ops._common import acc_dtype, check_same_device, check_scalars, dtype_name
from torchkit.ops.bilinear_pool import _bilinear_channels_last, _bilinear_grad_like, _check_inputs
from torchkit.triton import _math as tm
from torchkit.triton._launch import CompileCase, Config, acc_tl, blocks, float_bits, hot, interpreting
from torchkit.triton.pair_losses import lse

# Launch configurations. Each is run by the tests and compiled by tools/triton_check.py;
# `config` arguments pick one, the default being the first. Z tiles are square (BLOCK_C on
# both sides) so that y = None can mirror them. The 128-wide tile takes 16 features a step:
# with 32, a float32 TF32 pair's split operands spill 21 KB on sm_80.
FORWARD_CONFIGS = (
    Config(BLOCK_C=64, BLOCK_K=32, num_warps=4, num_stages=3),
    Config(BLOCK_C=128, BLOCK_K=16, num_warps=8, num_stages=2),
    Config(BLOCK_C=32, BLOCK_K=16, num_warps=4, num_stages=2),
)
GRAD_CONFIGS = (
    Config(BLOCK_OWN=64, BLOCK_HW=64, BLOCK_R=32, num_warps=4, num_stages=3),
    Config(BLOCK_OWN=32, BLOCK_HW=32, BLOCK_R=16, num_warps=4, num_stages=2),
)
# The launch for scaled samples (rare): small tiles, whose exact ldexp epilogue keeps within
# the registers where a 64 × 64 float32 tile's spills (tools/triton_check.py).
SCALED_GRAD_CONFIG = GRAD_CONFIGS[-1]
GRAD_Z_BLOCK = 32  # grad_z_kernel's square tiles
# Elementwise and per-sample kernels: BLOCK entries (or channels) per program; BLOCK_N samples
# per program of the per-sample kernels, which read their samples' partials BLOCK_P at a time
# (one round trip to memory per BLOCK_P partials: a loop of one load per partial took 256
# round trips, 0.18 ms, for the backward's dot at D = 512).
ELEMENTWISE_CONFIGS = (
    Config(BLOCK=1024, BLOCK_ROWS=32, BLOCK_N=16, BLOCK_P=128, num_warps=4, num_stages=2),
    Config(BLOCK=64, BLOCK_ROWS=16, BLOCK_N=16, BLOCK_P=2, num_warps=2, num_stages=2),
)

# _dot's modes: float32 by a scheme of PyTorch's fp32-matmul setting (lse.scheme), float64,
# and reduced types as loaded; all but float64 on tensor cores.
DOT_FP32 = tl.constexpr(0)
DOT_FP64 = tl.constexpr(1)
DOT_REDUCED = tl.constexpr(2)


# --------------------------------------------------------------------------- shared pieces


@triton.jit
def _scale_factors(e, IS64: tl.constexpr):
    """The two factors whose product is 2^e (|e| may pass the normal exponents: a subnormal
    largest entry gives e = 148 in float32)."""
    h = e // 2
    return tm.pow2(h, IS64), tm.pow2(e - h, IS64)


@triton.jit
def _runs_on(scale_ptr, n, SCALED: tl.constexpr):
    """Whether the launch for SCALED (scaled samples or ordinary ones) computes sample n."""
    flag = tl.load(scale_ptr + n * 4 + 3)
    if SCALED:
        return flag != 0
    else:
        return flag == 0


@triton.jit
def _halves(v):
    """A float32 tile as bfloat16 hi + lo (16 of its 24 bits; exact for float16 and bfloat16
    values)."""
    hi = v.to(tl.bfloat16)
    return hi, (v - hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _mm(a, b, acc, INTERPRET: tl.constexpr):
    """acc + a·b for two float16 or two bfloat16 tiles, float32 accumulation. Their products are
    exact in float32, so the interpreter, whose bfloat16 arithmetic works on the raw bits,
    multiplies them upcast: the same products, summed in another order."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee", out_dtype=tl.float32)
    else:
        return tl.dot(a, b, acc, out_dtype=tl.float32)


@triton.jit
def _dot(
    a,
    b,
    acc,
    DOT: tl.constexpr,
    SPLIT_A: tl.constexpr,
    SPLIT_B: tl.constexpr,
    SCHEME: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """acc + a·b. DOT_FP32: float32 tiles by SCHEME (lse._split_mma: a TF32 pair by default,
    TF32 at "high", bfloat16 at "medium"). DOT_REDUCED: tensor-core products with float32
    accumulation; an operand with SPLIT_* is float32 values taken as bfloat16 hi + lo (three
    products, lo·lo dropped: 2^-16 of the rest), the other is float16 or bfloat16 as loaded."""
    if DOT == DOT_FP64:
        acc = tl.dot(a, b, acc, out_dtype=tl.float64)
    elif DOT == DOT_FP32:
        acc = lse._split_mma(a, b, acc, SCHEME, INTERPRET)
    elif SPLIT_A and SPLIT_B:
        a_hi, a_lo = _halves(a)
        b_hi, b_lo = _halves(b)
        acc = _mm(a_hi, b_hi, acc, INTERPRET)
        acc = _mm(a_hi, b_lo, acc, INTERPRET)
        acc = _mm(a_lo, b_hi, acc, INTERPRET)
    elif SPLIT_A:
        a_hi, a_lo = _halves(a)
        acc = _mm(a_hi, b, acc, INTERPRET)
        acc = _mm(a_lo, b, acc, INTERPRET)
    else:
        acc = _mm(a, b, acc, INTERPRET)
    return acc


@triton.jit
def _frexp(v, IS64: tl.constexpr):
    """std::frexp: (m, e) with v = m·2^e, |m| in [1/2, 1); (v, 0) for 0, ±inf and NaN."""
    special = (v == 0) | (v != v) | (tl.abs(v) == float("inf"))
    e = tl.where(special, 0, tm.ilogb(tl.where(special, 1.0, v), IS64) + 1)
    return tl.where(special, v, tm.ldexp(v, 0 - e, IS64)), e


@triton.jit
def _inverse_denominator(v, l2, h):
    """bilinear_pool_cpu.cpp's inverse_denominator in float64: for a scaled sample's
    v = ‖s·2^h‖, whether v passes l2_eps·2^h (compared by exponents: l2_eps·2^h can leave
    float64's range where the output it gives is a number) and 1 / max(v, l2_eps·2^h) as
    m·2^e."""
    l2 = l2 + tl.zeros_like(v)  # the interpreter cannot combine a scalar mask with a vector one
    ml, el = _frexp(l2, True)
    mv, ev = _frexp(v, True)
    passes = (l2 == 0) | ((v != 0) & ((ev > el + h) | ((ev == el + h) & (mv >= ml))))
    mi, ei = _frexp(tl.where(v == 0, float("inf"), 1.0 / tl.where(v == 0, 1.0, v)), True)
    m = tl.where(passes, mi, 1.0 / tl.where(l2 == 0, 1.0, ml))
    e = tl.where(passes, ei, 0 - el - h)
    return passes, m, e


@triton.jit
def _partials(partial_ptr, n, mask, count, p0, BLOCK_P: tl.constexpr):
    """partial[n, p0 : p0 + BLOCK_P] of the samples n (rows of `count` partials), 0 where masked
    or past the row: one load for BLOCK_N × BLOCK_P partials."""
    p = p0 + tl.arange(0, BLOCK_P)
    return tl.load(partial_ptr + n[:, None] * count + p[None, :], mask=mask[:, None] & (p < count)[None, :], other=0.0)


@triton.jit
def _sum_partials(partial_ptr, n, mask, count, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr):
    """Σ partial[n, :count] per sample, in float64 (0 where masked): in a fixed order for a
    configuration, the same bits on every run."""
    total = tl.zeros((BLOCK_N,), tl.float64)
    for p0 in range(0, count, BLOCK_P):
        total += tl.sum(_partials(partial_ptr, n, mask, count, p0, BLOCK_P).to(tl.float64), axis=1)
    return total


@triton.jit
def _max_partials(partial_ptr, n, mask, count, ACC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr):
    """max partial[n, :count] per sample of non-negative partials, NaN if one is (0 where
    masked). tl.max drops NaN on the GPU: NaN is reduced separately."""
    top = tl.zeros((BLOCK_N,), ACC)
    nan = tl.zeros((BLOCK_N,), tl.int32)
    for p0 in range(0, count, BLOCK_P):
        v = _partials(partial_ptr, n, mask, count, p0, BLOCK_P)
        top = tl.maximum(top, tl.max(v, axis=1))
        nan = tl.maximum(nan, tl.max((v != v).to(tl.int32), axis=1))
    return tl.where(nan > 0, float("nan"), top)


# --------------------------------------------------------------------------- prefix


@triton.jit
def max_abs_kernel(
    x_ptr,
    norm_ptr,
    partial_ptr,
    C,
    HW,
    s_n,
    s_c,
    s_k,
    chunks,
    ONLY_SCALED: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """partial[n, chunk] = the largest |entry| (NaN if one is) of a block of BLOCK_ROWS channels
    of sample n. ONLY_SCALED (the backward): only for the samples whose norm the forward stored
    negated (scaled); the others' partials are not read."""
    pid = tl.program_id(0).to(tl.int64)
    n = pid // chunks
    rows = (pid % chunks) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < C
    run = True
    if ONLY_SCALED:
        run = tl.load(norm_ptr + n) < 0
    if run:
        largest = tl.zeros((BLOCK_ROWS, BLOCK), ACC)
        for k0 in range(0, HW, BLOCK):
            ks = k0 + tl.arange(0, BLOCK)
            mask = row_mask[:, None] & (ks < HW)[None, :]
            x = tl.load(x_ptr + n * s_n + rows[:, None] * s_c + ks[None, :] * s_k, mask=mask, other=0.0).to(ACC)
            largest = tl.maximum(largest, tl.abs(x), propagate_nan=tl.PropagateNan.ALL)
        # tl.max drops NaN on the GPU (and a reduction with a NaN-propagating combine runs
        # element by element under the interpreter): NaN is reduced separately.
        top = tl.max(tl.max(largest, axis=1), axis=0)
        nan = tl.max(tl.max((largest != largest).to(tl.int32), axis=1), axis=0)
        tl.store(partial_ptr + pid, tl.where(nan > 0, float("nan"), top))


@triton.jit
def scales_kernel(
    pa_ptr,
    pb_ptr,
    norm_ptr,
    scale_ptr,
    N,
    chunks_a,
    chunks_b,
    EPS_INSIDE,
    H_CAP,
    SELF: tl.constexpr,
    ONLY_SCALED: tl.constexpr,
    ACC: tl.constexpr,
    IS64: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Each sample's scale (bilinear_pool_cpu.cpp's sample_scale) into scale[n] = (ex, ey, h,
    scaled), int32: none for a NaN, infinite or all-zero operand; else, where the largest
    entries' exponents pass ±W or sqrt_eps passes 2^2W (EPS_INSIDE = 0), ex and ey bring them
    into [1/2, 1) (ey one lower where ex + ey is odd), h = (ex + ey)/2 capped at H_CAP, where
    sqrt_eps·4^h would pass 2^2W. ONLY_SCALED: only for the samples whose norm is negated."""
    if IS64:
        W: tl.constexpr = 256
    else:
        W: tl.constexpr = 32
    n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    need = n < N
    if ONLY_SCALED:
        need = need & (tl.load(norm_ptr + n, mask=need, other=0.0) < 0)
    ax = _max_partials(pa_ptr, n, need, chunks_a, ACC, BLOCK_N, BLOCK_P)
    if SELF:
        ay = ax
    else:
        ay = _max_partials(pb_ptr, n, need, chunks_b, ACC, BLOCK_N, BLOCK_P)
    ok = need & (ax > 0) & (ax != float("inf")) & (ay > 0) & (ay != float("inf"))  # NaN fails ax > 0
    fx = tl.where(ok, tm.ilogb(tl.where(ok, ax, 1.0), IS64) + 1, 0)
    fy = tl.where(ok, tm.ilogb(tl.where(ok, ay, 1.0), IS64) + 1, 0)
    inside = (tl.abs(fx) <= W) & (tl.abs(fy) <= W) & (EPS_INSIDE + tl.zeros_like(fx) != 0)  # vector: see above
    scaled = ok & ~inside
    ex = tl.where(scaled, 0 - fx, 0)
    ey = tl.where(scaled, 0 - fy, 0)
    ey = ey - ((ex + ey) & 1)  # never for y = None: ex = ey
    h = tl.where(scaled, tl.minimum((ex + ey) >> 1, H_CAP), 0)
    row = scale_ptr + n * 4
    tl.store(row, ex, mask=n < N)
    tl.store(row + 1, ey, mask=n < N)
    tl.store(row + 2, h, mask=n < N)
    tl.store(row + 3, scaled.to(tl.int32), mask=n < N)


# --------------------------------------------------------------------------- forward


@hot()
@triton.jit
def forward_kernel(
    a_ptr,
    b_ptr,
    scale_ptr,
    s_ptr,
    partial_ptr,
    D,
    E,
    HW,
    sa_n,
    sa_c,
    sa_k,
    sb_n,
    sb_c,
    sb_k,
    tiles_j,
    tiles,
    EPS_BITS,
    SELF: tl.constexpr,
    SCALED: tl.constexpr,
    ACC: tl.constexpr,
    IS64: tl.constexpr,
    DOT: tl.constexpr,
    SCHEME: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """s·2^h for one (BLOCK_C × BLOCK_C) tile of sample n's Z, into s (N, D·E), and the tile's
    Σ s² into partial[n, tile] (for y = None a tile above the diagonal counts twice and is
    stored mirrored too; one below stores 0). Runs on the samples whose scale flag is SCALED."""
    pid = tl.program_id(0).to(tl.int64)
    n = pid // tiles
    tile = pid % tiles
    if _runs_on(scale_ptr, n, SCALED):
        ti = tile // tiles_j
        tj = tile % tiles_j
        if SELF:
            lower = ti > tj
        else:
            lower = ti < 0  # never
        if lower:
            tl.store(partial_ptr + pid, tl.zeros((), ACC))
        else:
            rows = ti * BLOCK_C + tl.arange(0, BLOCK_C)
            cols = tj * BLOCK_C + tl.arange(0, BLOCK_C)
            row_mask = rows < D
            col_mask = cols < E
            if SCALED:
                ex = tl.load(scale_ptr + n * 4)
                ey = tl.load(scale_ptr + n * 4 + 1)
                fa1, fa2 = _scale_factors(ex, IS64)
                fb1, fb2 = _scale_factors(ey, IS64)
            acc = tl.zeros((BLOCK_C, BLOCK_C), ACC)
            for k0 in range(0, HW, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_mask = ks < HW
                a = tl.load(
                    a_ptr + n * sa_n + rows[:, None] * sa_c + ks[None, :] * sa_k,
                    mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0,
                )
                b = tl.load(  # (BLOCK_K, BLOCK_C): bᵀ as it is loaded
                    b_ptr + n * sb_n + cols[None, :] * sb_c + ks[:, None] * sb_k,
                    mask=k_mask[:, None] & col_mask[None, :],
                    other=0.0,
                )
                if SCALED:
                    a = a.to(ACC) * fa1 * fa2
                    b = b.to(ACC) * fb1 * fb2
                    acc = _dot(a, b, acc, DOT, True, True, SCHEME, INTERPRET)
                else:
                    acc = _dot(a, b, acc, DOT, False, False, SCHEME, INTERPRET)
            inv_hw = tm.div_rn(1.0, HW + tl.zeros((), ACC), IS64)
            eps64 = tm.f64(EPS_BITS)
            if SCALED:
                h = tl.load(scale_ptr + n * 4 + 2)
                mul = tm.ldexp(inv_hw, 2 * h - ex - ey, IS64)
                eps = tm.ldexp(eps64, 2 * h, True).to(ACC)
            else:
                mul = inv_hw
                eps = eps64.to(ACC)
            # s = signed_sqrt(P·mul, eps) with P's own sign (P·mul may underflow: sample_scale).
            root = tm.sqrt_rn(tl.abs(acc * mul) + eps, IS64)
            s = tl.where(acc > 0, root, tl.where(acc < 0, 0.0 - root, tl.where(acc == acc, 0.0, acc)))
            valid = row_mask[:, None] & col_mask[None, :]
            sumsq = tl.sum(tl.sum(tl.where(valid, s * s, 0.0), axis=1), axis=0)
            base = s_ptr + n * D * E
            tl.store(base + rows[:, None] * E + cols[None, :], s.to(s_ptr.dtype.element_ty), mask=valid)
            if SELF:
                if ti < tj:
                    tl.store(base + cols[None, :] * E + rows[:, None], s.to(s_ptr.dtype.element_ty), mask=valid)
                    sumsq = 2.0 * sumsq
            tl.store(partial_ptr + pid, sumsq)


@triton.jit
def norm_kernel(
    partial_ptr,
    scale_ptr,
    norm_ptr,
    inv_ptr,
    N,
    tiles,
    L2_BITS,
    ACC: tl.constexpr,
    IS64: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Per sample v = sqrt(Σ tiles' Σ s²) (float64, _sum_partials), norm = v (−v for a scaled
    sample) and inv = 1 / max(v, l2_eps) (by exponents for a scaled sample; NaN stays NaN)."""
    n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask = n < N
    v = tl.sqrt(_sum_partials(partial_ptr, n, mask, tiles, BLOCK_N, BLOCK_P)).to(ACC)
    scaled = tl.load(scale_ptr + n * 4 + 3, mask=mask, other=0) != 0
    h = tl.load(scale_ptr + n * 4 + 2, mask=mask, other=0)
    l2 = tm.f64(L2_BITS)
    l2_acc = l2.to(ACC)
    plain = tm.div_rn(1.0, tl.where(v < l2_acc, l2_acc, v), IS64)
    _, m, e = _inverse_denominator(v.to(tl.float64), l2, h)
    inv = tl.where(scaled, tm.ldexp(m, e, True).to(ACC), plain)
    tl.store(norm_ptr + n, tl.where(scaled, 0.0 - v, v), mask=mask)
    tl.store(inv_ptr + n, inv, mask=mask)


@triton.jit
def normalise_kernel(s_ptr, inv_ptr, out_ptr, DE, chunks, BLOCK: tl.constexpr):
    """out = s·inv[n] per sample, in out's dtype (in place where s is the output)."""
    pid = tl.program_id(0).to(tl.int64)
    n = pid // chunks
    ks = (pid % chunks) * BLOCK + tl.arange(0, BLOCK)
    mask = ks < DE
    s = tl.load(s_ptr + n * DE + ks, mask=mask, other=0.0)
    tl.store(out_ptr + n * DE + ks, (s * tl.load(inv_ptr + n)).to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- backward


@triton.jit
def dot_kernel(o_ptr, g_ptr, partial_ptr, DE, sg_n, sg_k, chunks, ACC: tl.constexpr, BLOCK: tl.constexpr):
    """partial[n, chunk] = Σ out·grad over a chunk of sample n (grad read by its strides: an
    expanded scalar gradient in place)."""
    pid = tl.program_id(0).to(tl.int64)
    n = pid // chunks
    ks = (pid % chunks) * BLOCK + tl.arange(0, BLOCK)
    mask = ks < DE
    o = tl.load(o_ptr + n * DE + ks, mask=mask, other=0.0).to(ACC)
    g = tl.load(g_ptr + n * sg_n + ks * sg_k, mask=mask, other=0.0).to(ACC)
    tl.store(partial_ptr + pid, tl.sum(o * g, axis=0))


@triton.jit
def coef_kernel(
    partial_ptr,
    norm_ptr,
    scale_ptr,
    dot_ptr,
    coef_ptr,
    exp_ptr,
    N,
    HW,
    chunks,
    L2_BITS,
    ACC: tl.constexpr,
    IS64: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Per sample what ∂L/∂Z·1/HW = (g − o·dot)·coef/|o| needs (bilinear_pool_cpu.cpp's
    sample_coefficients): dot(out, grad) where ‖s‖ passes l2_eps (F.normalize's clamp passes the
    gradient there), else 0, summed in float64 (_sum_partials); coef = 1 / (2·HW·max(‖s‖,
    l2_eps)²), for a scaled sample as coef·2^exp with coef = m·2^-(max_exponent/2)."""
    if IS64:
        SHIFT: tl.constexpr = 512
    else:
        SHIFT: tl.constexpr = 64
    n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask = n < N
    nrm = tl.load(norm_ptr + n, mask=mask, other=1.0)
    scaled = tl.load(scale_ptr + n * 4 + 3, mask=mask, other=0) != 0
    h = tl.load(scale_ptr + n * 4 + 2, mask=mask, other=0)
    l2 = tm.f64(L2_BITS)
    l2_acc = l2.to(ACC)
    passes_s, m, e = _inverse_denominator(0.0 - nrm.to(tl.float64), l2, h)
    passes = tl.where(scaled, passes_s, nrm >= l2_acc)
    total = _sum_partials(partial_ptr, n, mask & passes, chunks, BLOCK_N, BLOCK_P)
    hw = HW + tl.zeros((), ACC)
    inv_hw = tm.div_rn(1.0, hw, IS64)
    denom = tl.where(passes, nrm, l2_acc)
    plain = tm.div_rn(inv_hw, 2.0 * denom * denom, IS64)
    cm, ce = _frexp((m * m) / (2.0 * (HW + tl.zeros((), tl.float64))), True)
    coef = tl.where(scaled, tm.ldexp(cm, tl.full((), 0 - SHIFT, tl.int32), True).to(ACC), plain)
    tl.store(dot_ptr + n, total.to(ACC), mask=mask)
    tl.store(coef_ptr + n, coef, mask=mask)
    tl.store(exp_ptr + n, tl.where(scaled, ce + 2 * e + SHIFT, 0), mask=mask)


@triton.jit
def _grad_z(o_ptr, g_ptr, k, valid, sg_k, dot, coef, ACC: tl.constexpr):
    """(g − o·dot)·coef/|o| at a sample's flat indices k; 0 where o = 0 (NaN stays NaN)."""
    o = tl.load(o_ptr + k, mask=valid, other=1.0).to(ACC)
    g = tl.load(g_ptr + k * sg_k, mask=valid, other=0.0).to(ACC)
    return tl.where(o == 0, 0.0, (g - o * dot) * coef / tl.abs(o))


@triton.jit
def grad_z_kernel(
    o_ptr,
    g_ptr,
    dot_ptr,
    coef_ptr,
    dz_ptr,
    D,
    E,
    sg_n,
    sg_k,
    tiles_j,
    tiles,
    SELF: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """∂L/∂Z·1/HW (in ACC, (N, D, E)) for one tile; for y = None the program of a tile on or above
    the diagonal forms the tile and its mirror, adds them (entries (i, j) and (j, i) are one sum
    of Z = x·xᵀ) and writes both."""
    pid = tl.program_id(0).to(tl.int64)
    n = pid // tiles
    tile = pid % tiles
    ti = tile // tiles_j
    tj = tile % tiles_j
    if SELF:
        mine = ti <= tj
    else:
        mine = ti >= 0  # every tile
    if mine:
        rows = ti * BLOCK_C + tl.arange(0, BLOCK_C)
        cols = tj * BLOCK_C + tl.arange(0, BLOCK_C)
        valid = (rows < D)[:, None] & (cols < E)[None, :]
        dot = tl.load(dot_ptr + n)
        coef = tl.load(coef_ptr + n)
        o = o_ptr + n * D * E
        g = g_ptr + n * sg_n
        dz = dz_ptr + n * D * E
        here = rows[:, None] * E + cols[None, :]
        v = _grad_z(o, g, here, valid, sg_k, dot, coef, ACC)
        if SELF:
            # The mirror tile at its place: element (r, c) here is entry (cols[c], rows[r]).
            mirror = cols[None, :] * E + rows[:, None]
            v = v + _grad_z(o, g, mirror, valid, sg_k, dot, coef, ACC)
            tl.store(dz + mirror, v, mask=valid)
        tl.store(dz + here, v, mask=valid)


@hot()
@triton.jit
def grad_kernel(
    dz_ptr,
    other_ptr,
    scale_ptr,
    exp_ptr,
    out_ptr,
    C_OWN,
    C_OTHER,
    HW,
    sdz_n,
    sdz_own,
    sdz_other,
    so_n,
    so_c,
    so_k,
    sout_n,
    sout_c,
    sout_k,
    tiles_k,
    tiles,
    WHICH: tl.constexpr,
    SCALED: tl.constexpr,
    ACC: tl.constexpr,
    IS64: tl.constexpr,
    DOT: tl.constexpr,
    SPLIT_OTHER: tl.constexpr,
    SCHEME: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_OWN: tl.constexpr,
    BLOCK_HW: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """One (BLOCK_OWN × BLOCK_HW) tile of an input's gradient, Σ_r dZ[own, r]·other[r, k]: x's
    (WHICH = 0: dZ's rows, y's operand) or y's (WHICH = 1: dZ's columns, x's operand), written
    in the input's dtype and layout. A scaled sample (SCALED) multiplies the scaled operand
    (other·2^e_other) and its result by 2^(2h − e_other + exp), exp its coefficient's exponent.
    Runs on the samples whose scale flag is SCALED."""
    pid = tl.program_id(0).to(tl.int64)
    n = pid // tiles
    tile = pid % tiles
    if _runs_on(scale_ptr, n, SCALED):
        rows = (tile // tiles_k) * BLOCK_OWN + tl.arange(0, BLOCK_OWN)
        ks = (tile % tiles_k) * BLOCK_HW + tl.arange(0, BLOCK_HW)
        row_mask = rows < C_OWN
        k_mask = ks < HW
        if SCALED:
            e_other = tl.load(scale_ptr + n * 4 + 1 - WHICH)  # y's ey for x's gradient
            f1, f2 = _scale_factors(e_other, IS64)
        acc = tl.zeros((BLOCK_OWN, BLOCK_HW), ACC)
        for r0 in range(0, C_OTHER, BLOCK_R):
            rs = r0 + tl.arange(0, BLOCK_R)
            r_mask = rs < C_OTHER
            dz = tl.load(
                dz_ptr + n * sdz_n + rows[:, None] * sdz_own + rs[None, :] * sdz_other,
                mask=row_mask[:, None] & r_mask[None, :],
                other=0.0,
            )
            o = tl.load(
                other_ptr + n * so_n + rs[:, None] * so_c + ks[None, :] * so_k,
                mask=r_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            if SCALED:
                o = o.to(ACC) * f1 * f2
                acc = _dot(dz, o, acc, DOT, True, True, SCHEME, INTERPRET)
            elif SPLIT_OTHER:
                acc = _dot(dz, o.to(ACC), acc, DOT, True, True, SCHEME, INTERPRET)
            else:
                acc = _dot(dz, o, acc, DOT, True, False, SCHEME, INTERPRET)
        if SCALED:
            h = tl.load(scale_ptr + n * 4 + 2)
            acc = tm.ldexp(acc, 2 * h - e_other + tl.load(exp_ptr + n), IS64)
        mask = row_mask[:, None] & k_mask[None, :]
        tl.store(
            out_ptr + n * sout_n + rows[:, None] * sout_c + ks[None, :] * sout_k,
            acc.to(out_ptr.dtype.element_ty),
            mask=mask,
        )


# --------------------------------------------------------------------------- the op's kernels


def _flat(t: Tensor) -> Tensor:
    """(N, C, H, W) → (N, C, HW) in t's dtype: a view where the memory allows (channels_last
    included, as a transposed view), a copy otherwise."""
    N, C, H, W = t.shape
    if t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous():
        return t.permute(0, 2, 3, 1).reshape(N, H * W, C).transpose(1, 2)
    return t.reshape(N, C, H * W)


def _products(dtype: torch.dtype) -> dict:
    """The GEMM kernels' product constexprs: DOT by the inputs' dtype, and for float32 the
    scheme of PyTorch's fp32-matmul setting, read now (lse.scheme)."""
    dot = {torch.float64: DOT_FP64, torch.float32: DOT_FP32}.get(dtype, DOT_REDUCED)
    scheme = lse.scheme(dtype) if dtype == torch.float32 else lse.HALF.value
    return dict(DOT=dot, SCHEME=scheme, INTERPRET=interpreting())


def _scales(a: Tensor, b: Tensor, self_: bool, norm: Tensor | None, sqrt_eps: float, acc, config: Config) -> Tensor:
    """Each sample's (ex, ey, h, scaled) as (N, 4) int32 (for the backward, norm given: only the
    samples whose norm is negated are looked at)."""
    N = a.shape[0]
    W = 256 if acc == torch.float64 else 32
    rows, block = config.kwargs["BLOCK_ROWS"], config.kwargs["BLOCK"]
    only = norm is not None
    norm_arg = norm if only else a  # not read without ONLY_SCALED
    partials = []
    for t in (a,) if self_ else (a, b):
        chunks = blocks(t.shape[1], rows)
        partial = torch.empty(N, chunks, dtype=acc, device=t.device)
        max_abs_kernel[(N * chunks,)](
            t,
            norm_arg,
            partial,
            t.shape[1],
            t.shape[2],
            *t.stride(),
            chunks,
            ONLY_SCALED=only,
            ACC=acc_tl(acc),
            BLOCK_ROWS=rows,
            BLOCK=min(block, 64),
            num_warps=config.num_warps,
        )
        partials.append(partial)
    pa = partials[0]
    pb = pa if self_ else partials[1]
    # sqrt_eps·4^h must stay below 2^2W: h <= floor((2W - fe)/2), fe its frexp exponent.
    h_cap = (2 * W - math.frexp(sqrt_eps)[1]) // 2 if sqrt_eps > 0 else 1 << 20
    scale = torch.empty(N, 4, dtype=torch.int32, device=a.device)
    block_n, block_p = config.kwargs["BLOCK_N"], config.kwargs["BLOCK_P"]
    scales_kernel[(blocks(N, block_n),)](
        pa,
        pb,
        norm_arg,
        scale,
        N,
        pa.shape[1],
        pb.shape[1],
        int(sqrt_eps <= 2.0 ** (2 * W)),
        h_cap,
        SELF=self_,
        ONLY_SCALED=only,
        ACC=acc_tl(acc),
        IS64=acc == torch.float64,
        BLOCK_N=block_n,
        BLOCK_P=block_p,
        num_warps=config.num_warps,
    )
    return scale


def _scalars(sqrt_eps, l2_eps) -> tuple[float, float]:
    check_scalars("bilinear_pool", ("float", "sqrt_eps", sqrt_eps), ("float", "l2_eps", l2_eps))
    return float(sqrt_eps), float(l2_eps)


def forward(
    x: Tensor,
    y: Tensor | None,
    sqrt_eps,
    l2_eps,
    *,
    config: Config | None = None,
    elementwise_config: Config | None = None,
) -> tuple[Tensor, Tensor]:
    """torchkit::bilinear_pool's CUDA kernel (any device under the interpreter)."""
    sqrt_eps, l2_eps = _scalars(sqrt_eps, l2_eps)
    _check_inputs(x, y, sqrt_eps, l2_eps)
    config = config or FORWARD_CONFIGS[0]
    ew = elementwise_config or ELEMENTWISE_CONFIGS[0]
    self_ = y is None
    N, D = x.shape[:2]
    E = D if self_ else y.shape[1]
    HW = x.shape[2] * x.shape[3]
    acc = acc_dtype(x)
    out = torch.empty(N, D * E, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out, torch.zeros(N, dtype=acc, device=x.device)
    a = _flat(x)
    b = a if self_ else _flat(y)
    scale = _scales(a, b, self_, None, sqrt_eps, acc, ew)
    s = out if x.dtype == acc else torch.empty(N, D * E, dtype=acc, device=x.device)
    block = config.kwargs["BLOCK_C"]
    tiles_j = blocks(E, block)
    tiles = blocks(D, block) * tiles_j
    partial = torch.empty(N, tiles, dtype=acc, device=x.device)
    for scaled in (False, True):
        forward_kernel[(N * tiles,)](
            a,
            b,
            scale,
            s,
            partial,
            D,
            E,
            HW,
            *a.stride(),
            *b.stride(),
            tiles_j,
            tiles,
            float_bits(sqrt_eps),
            SELF=self_,
            SCALED=scaled,
            ACC=acc_tl(acc),
            IS64=acc == torch.float64,
            **_products(x.dtype),
            **config.launch,
        )
    norm = torch.empty(N, dtype=acc, device=x.device)
    inv = torch.empty(N, dtype=acc, device=x.device)
    block_n, block_p = ew.kwargs["BLOCK_N"], ew.kwargs["BLOCK_P"]
    norm_kernel[(blocks(N, block_n),)](
        partial,
        scale,
        norm,
        inv,
        N,
        tiles,
        float_bits(l2_eps),
        ACC=acc_tl(acc),
        IS64=acc == torch.float64,
        BLOCK_N=block_n,
        BLOCK_P=block_p,
        num_warps=ew.num_warps,
    )
    chunks = blocks(D * E, ew.kwargs["BLOCK"])
    normalise_kernel[(N * chunks,)](s, inv, out, D * E, chunks, BLOCK=ew.kwargs["BLOCK"], num_warps=ew.num_warps)
    return out, norm


def _check_backward(x: Tensor, grad: Tensor, out: Tensor, norm: Tensor, N: int, DE: int) -> None:
    """csrc/bilinear_pool.cpp's check_backward_inputs, same order and messages."""
    op = "bilinear_pool"
    shape = [N, DE]
    if list(grad.shape) != shape or list(out.shape) != shape:
        raise ValueError(
            f"{op}: backward: grad and out must have the output's shape {shape}, got {list(grad.shape)} and "
            f"{list(out.shape)}"
        )
    acc = acc_dtype(x)
    if norm.dim() != 1 or norm.shape[0] != N or norm.dtype != acc:
        raise ValueError(
            f"{op}: backward: norm must be (N,) = ({N},) of {dtype_name(acc)}, got {list(norm.shape)} of "
            f"{dtype_name(norm.dtype)}"
        )
    for name, t in (("grad", grad), ("out", out)):
        if t.dtype != x.dtype:
            raise TypeError(
                f"{op}: x and {name} must have the same dtype, got {dtype_name(x.dtype)} and {dtype_name(t.dtype)}"
            )
    check_same_device(op, x=x, grad=grad)
    check_same_device(op, x=x, out=out)
    check_same_device(op, x=x, norm=norm)


def backward(
    grad: Tensor,
    x: Tensor,
    y: Tensor | None,
    out: Tensor,
    norm: Tensor,
    sqrt_eps,
    l2_eps,
    output_mask,
    *,
    config: Config | None = None,
    elementwise_config: Config | None = None,
) -> tuple[Tensor, Tensor]:
    """torchkit::_bilinear_pool_backward's CUDA kernel."""
    sqrt_eps, l2_eps = _scalars(sqrt_eps, l2_eps)
    _check_inputs(x, y, sqrt_eps, l2_eps)
    self_ = y is None
    N, D = x.shape[:2]
    E = D if self_ else y.shape[1]
    HW = x.shape[2] * x.shape[3]
    _check_backward(x, grad, out, norm, N, D * E)
    config = config or GRAD_CONFIGS[0]
    ew = elementwise_config or ELEMENTWISE_CONFIGS[0]
    cl = _bilinear_channels_last(x, y)
    want = (bool(output_mask[0]), not self_ and bool(output_mask[1]))
    gx = _bilinear_grad_like(x, cl) if want[0] else x.new_empty(0)
    gy = _bilinear_grad_like(y, cl) if want[1] else x.new_empty(0)
    if not any(want) or N * D * E == 0:
        gx.zero_()
        gy.zero_()
        return gx, gy
    acc = acc_dtype(x)
    is64 = acc == torch.float64
    a = _flat(x)
    b = a if self_ else _flat(y)
    nrm = norm.contiguous()
    scale = _scales(a, b, self_, nrm, sqrt_eps, acc, ew)
    o = out.contiguous()
    block = ew.kwargs["BLOCK"]
    chunks = blocks(D * E, block)
    partial = torch.empty(N, chunks, dtype=acc, device=x.device)
    dot_kernel[(N * chunks,)](o, grad, partial, D * E, *grad.stride(), chunks, ACC=acc_tl(acc), BLOCK=block)
    dot = torch.empty(N, dtype=acc, device=x.device)
    coef = torch.empty(N, dtype=acc, device=x.device)
    coef_exp = torch.empty(N, dtype=torch.int32, device=x.device)
    block_n, block_p = ew.kwargs["BLOCK_N"], ew.kwargs["BLOCK_P"]
    coef_kernel[(blocks(N, block_n),)](
        partial,
        nrm,
        scale,
        dot,
        coef,
        coef_exp,
        N,
        HW,
        chunks,
        float_bits(l2_eps),
        ACC=acc_tl(acc),
        IS64=is64,
        BLOCK_N=block_n,
        BLOCK_P=block_p,
        num_warps=ew.num_warps,
    )
    dz = torch.empty(N, D, E, dtype=acc, device=x.device)
    zb = GRAD_Z_BLOCK
    tiles_j = blocks(E, zb)
    tiles = blocks(D, zb) * tiles_j
    grad_z_kernel[(N * tiles,)](
        o, grad, dot, coef, dz, D, E, *grad.stride(), tiles_j, tiles, SELF=self_, ACC=acc_tl(acc), BLOCK_C=zb
    )

    def gemm(which: int, other: Tensor, target: Tensor) -> None:
        own_c, other_c = (D, E) if which == 0 else (E, D)
        dz_strides = (D * E, E, 1) if which == 0 else (D * E, 1, E)
        dst = _flat(target)
        for scaled, conf in ((False, config), (True, SCALED_GRAD_CONFIG)):
            k = conf.kwargs
            tiles_k = blocks(HW, k["BLOCK_HW"])
            tiles = blocks(own_c, k["BLOCK_OWN"]) * tiles_k
            grad_kernel[(N * tiles,)](
                dz,
                other,
                scale,
                coef_exp,
                dst,
                own_c,
                other_c,
                HW,
                *dz_strides,
                *other.stride(),
                *dst.stride(),
                tiles_k,
                tiles,
                WHICH=which,
                SCALED=scaled,
                ACC=acc_tl(acc),
                IS64=is64,
                SPLIT_OTHER=x.dtype == torch.float16,
                **_products(x.dtype),
                **conf.launch,
            )

    if want[0]:
        gemm(0, b, gx)
    if want[1]:
        gemm(1, a, gy)
    return gx, gy


def compile_cases() -> list[CompileCase]:
    """Every kernel for tools/triton_check.py: the GEMM kernels in each configuration for float32
    and bfloat16 (the tensor-core path), float16 and float64 in the first; y = None and the
    scaled variants with the first."""
    cases = []
    for dtype, acc in (("fp32", "fp32"), ("bf16", "fp32"), ("fp16", "fp32"), ("fp64", "fp64")):
        torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}[
            dtype
        ]
        is64 = acc == "fp64"
        reduced = dtype in ("bf16", "fp16")
        every = dtype in ("fp32", "bf16")
        flags = dict(ACC=tl.float64 if is64 else tl.float32, IS64=is64)
        ints = dict.fromkeys(
            (
                "D",
                "E",
                "HW",
                "C",
                "N",
                "DE",
                "C_OWN",
                "C_OTHER",
                "chunks",
                "chunks_a",
                "chunks_b",
                "tiles",
                "tiles_j",
                "tiles_k",
                "EPS_INSIDE",
                "H_CAP",
            ),
            "i32",
        )
        strides = dict.fromkeys(
            (
                "s_n",
                "s_c",
                "s_k",
                "sa_n",
                "sa_c",
                "sa_k",
                "sb_n",
                "sb_c",
                "sb_k",
                "sg_n",
                "sg_k",
                "sdz_n",
                "sdz_own",
                "sdz_other",
                "so_n",
                "so_c",
                "so_k",
                "sout_n",
                "sout_c",
                "sout_k",
            ),
            "i32",
        )
        data = dict.fromkeys(("x_ptr", "a_ptr", "b_ptr", "o_ptr", "g_ptr", "other_ptr", "out_ptr"), "*" + dtype)
        accs = dict.fromkeys(
            ("norm_ptr", "partial_ptr", "pa_ptr", "pb_ptr", "inv_ptr", "dot_ptr", "coef_ptr", "dz_ptr"), "*" + acc
        )
        types = {
            **ints,
            **strides,
            **data,
            **accs,
            "s_ptr": "*" + (acc if reduced else dtype),
            "scale_ptr": "*i32",
            "exp_ptr": "*i32",
            "EPS_BITS": "i64",
            "L2_BITS": "i64",
        }
        # As the headline launch (N = 32, D = 512, 28 × 28: tools/gpu_model.py) specialises
        # them: its sizes and strides divisible by 16 (so that the loads vectorise and pipeline
        # as they do there), its unit strides the constant 1.
        ones = dict.fromkeys(("s_k", "sa_k", "sb_k", "sg_k", "sdz_other", "so_k", "sout_k"), 1)
        divisible = ("D", "E", "HW", "C", "N", "DE", "C_OWN", "C_OTHER", *(k for k in strides if k not in ones))

        def case(name, kernel, types, constexprs, configs, ones=ones, divisible=divisible, **kwargs):
            return CompileCase(name, kernel, types, {**constexprs, **ones}, configs, divisible=divisible, **kwargs)

        # The products: float32's by the default fp32-matmul setting's scheme (every
        # configuration), and by "high"'s and "medium"'s with the first.
        products = {**_products(torch_dtype), "INTERPRET": False}
        if dtype == "fp32":
            products["SCHEME"] = lse.TF32X3
        tensor_cores = not is64
        for self_, scaled in ((False, False), (True, False), (False, True)):
            plain = not self_ and not scaled
            cases.append(
                case(
                    f"bilinear_pool.forward {dtype}{' self' if self_ else ''}{' scaled' if scaled else ''}",
                    forward_kernel,
                    types,
                    dict(SELF=self_, SCALED=scaled, **products, **flags),
                    FORWARD_CONFIGS if every and plain else FORWARD_CONFIGS[:1],
                    tensor_cores=tensor_cores,
                )
            )
        for scaled in (False, True):
            cases.append(
                case(
                    f"bilinear_pool.grad {dtype}{' scaled' if scaled else ''}",
                    grad_kernel,
                    types,
                    dict(WHICH=0, SCALED=scaled, SPLIT_OTHER=dtype == "fp16", **products, **flags),
                    (SCALED_GRAD_CONFIG,) if scaled else (GRAD_CONFIGS if every else GRAD_CONFIGS[:1]),
                    tensor_cores=tensor_cores,
                )
            )
        if dtype == "fp32":
            for name, other in (("high", lse.TF32), ("medium", lse.HALF)):
                scheme = {**products, "SCHEME": other}
                cases.append(
                    case(
                        f"bilinear_pool.forward {dtype} {name}",
                        forward_kernel,
                        types,
                        dict(SELF=False, SCALED=False, **scheme, **flags),
                        FORWARD_CONFIGS[:1],
                        tensor_cores=True,
                    )
                )
                cases.append(
                    case(
                        f"bilinear_pool.grad {dtype} {name}",
                        grad_kernel,
                        types,
                        dict(WHICH=0, SCALED=False, SPLIT_OTHER=False, **scheme, **flags),
                        GRAD_CONFIGS[:1],
                        tensor_cores=True,
                    )
                )
        if dtype == "fp16":
            continue  # the other kernels do not depend on float16 against bfloat16
        block_c = GRAD_Z_BLOCK
        configs = ELEMENTWISE_CONFIGS if every else ELEMENTWISE_CONFIGS[:1]
        for kernel, constexprs, block_args in (
            (max_abs_kernel, dict(ONLY_SCALED=True, ACC=flags["ACC"]), ("BLOCK_ROWS", "BLOCK")),
            (scales_kernel, dict(SELF=False, ONLY_SCALED=True, **flags), ("BLOCK_N", "BLOCK_P")),
            (norm_kernel, flags, ("BLOCK_N", "BLOCK_P")),
            (normalise_kernel, {}, ("BLOCK",)),
            (dot_kernel, dict(ACC=flags["ACC"]), ("BLOCK",)),
            (coef_kernel, flags, ("BLOCK_N", "BLOCK_P")),
            (grad_z_kernel, dict(SELF=True, ACC=flags["ACC"], BLOCK_C=block_c), ()),
        ):
            chosen = tuple(
                Config(num_warps=c.num_warps, num_stages=c.num_stages, **{k: c.kwargs[k] for k in block_args})
                for c in configs
            )
            if kernel is max_abs_kernel:  # the wrapper caps its inner block at 64
                chosen = tuple(
                    Config(num_warps=c.num_warps, BLOCK_ROWS=c.kwargs["BLOCK_ROWS"], BLOCK=min(c.kwargs["BLOCK"], 64))
                    for c in chosen
                )
            if not block_args:
                chosen = (Config(num_warps=4),)
            cases.append(
                case(
                    f"bilinear_pool.{kernel.fn.__name__.removesuffix('_kernel')} {dtype}",
                    kernel,
                    {**types, "s_ptr": "*" + acc, "out_ptr": "*" + dtype},
                    constexprs,
                    chosen,
                )
            )
    return cases
