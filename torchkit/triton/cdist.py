"""cdist's Triton kernels: the op's CUDA kernel where torchkit.triton selects it.

The semantics are the CPU kernel's (csrc/cdist.h, csrc/cpu/cdist_cpu.cpp), computed in tiles;
besides the output and per-row statistics, the only arrays formed are the centred rows as the
products take them (O(rows·M), like the inputs):

- Prefix: each row's finiteness and largest finite magnitude (row_stats_kernel); per batch
  element the power-of-two exponent e that brings its largest finite magnitude into [1/2, 1)
  where it lies outside [2^-H, 2^H] (H = 32 for float32 accumulation, 256 for float64: past
  that |x|² and the products under- or overflow), else 0 (exponent_kernel, which also counts
  the finite rows); the mean of the finite rows of both sets after that scaling
  (column_sums_kernel, over chunks of rows, added by mean_kernel in a fixed order; a
  NaN or ±inf row would make every distance of the element non-finite); each row's squared
  norm after scaling and centring, and the centred, scaled rows as the tensor cores take them
  (operands_kernel), formed once rather than by every tile that reads them, under the CUDA
  precision contract (docs/ops.md): float32 by PyTorch's fp32-matmul setting, read at each
  call (the default: each value split into a TF32 pair hi + lo, three products hi·hi + hi·lo
  + lo·hi, as accurate as IEEE float32 products; "high": TF32; "medium": bfloat16; lse.py's
  schemes); float16 and bfloat16: each centred value split into two bfloat16 halves, three
  products with float32 accumulation, which keeps ~16 bits where the inputs have 8 or 11;
  float64 in float64. A small batch element (a loss's batch: FUSED_PREFIX_VALUES) takes all
  of it in one program of one launch (prefix_kernel), where the per-set kernels and the torch
  operations between them would launch some twenty times.
- Forward (forward_kernel): one output tile per program, multiplying the operands. The
  epilogue forms d² = |a|² + |b|² - 2a·b, clamps, takes the root (correctly rounded but for
  16-bit outputs) and multiplies by 2^e (2^2e squared) exactly. Entries where the expansion cancelled (d² <
  (|a|² + |b|²) / 16: near-duplicates), is NaN (a non-finite row) or may have underflowed are
  recomputed as Σ(a - b)² from the unscaled inputs, with the differences scaled by the power of
  two nearest their largest, so that a distance whose square leaves the type's range is still
  exact: by refine_kernel, over the tiles forward_kernel flagged (the GEMM kernel then carries
  none of that path's registers), deciding per entry from the output as the backward does.
  The diagonal of x2=None is exactly 0 (NaN for a non-finite row).
- Backward (grad_kernel, one launch per input): grad_x1 = rowsum(G')·x1 - G'·x2 and grad_x2 =
  colsum(G')·x2 - G'ᵀ·x1 over the centred, scaled rows (times 2^e for squared distances), with
  G' = grad / dist (2·grad squared; 0 at distance 0) formed tile by tile as the product takes
  it, never stored, and its sums along the way; the other rows split into slices across
  programs where the rows alone would not fill the GPU (each program owns its rows, features
  and slice, whose parts are added in order: deterministic, no atomics). The entries the
  forward recomputed directly take their gradient directly, G'·(a - b) from the unscaled
  inputs, and are left out of G'.

Kernels never index past what the wrapper checked; offsets are int64.
"""

from __future__ import annotations

import functools
import itertools

import torch
import triton
import triton.language as tl
from torch import Tensor

from torchkit.ops._common import acc_dtype, check_same_device, check_scalars, dtype_name
from torchkit.ops.cdist import check_distance_inputs
from torchkit.triton import _math as tm
from torchkit.triton._launch import CompileCase, Config, acc_tl, blocks, hot, interpreting
from torchkit.triton.pair_losses import lse

REFINE_RATIO = tl.constexpr(16.0)  # csrc/cdist.h's kRefineRatio

# Launch configurations. Each is run by the tests (every masking path) and compiled by
# tools/triton_check.py; `config` arguments pick one, the default being the first, float64's
# the last (lse._default: the first spills float64 values). The forward's default tile is
# 128 × 128: the operands it streams through L2, its bound at 8,192² × 128 (make gpu-model),
# are half a 64 × 64 tile's per output (the forward at 8,192² × 128 predicted 0.291 -> 0.220
# ms with the TF32 pair, 0.189 -> 0.151 with TF32, 0.175 -> 0.137 in bfloat16 against 128 ×
# 64); 256 × 128 spills 6 KB. Where its tiles would leave most SMs idle (a loss's batch: 256²
# is 4 of them), the default is the last, 64 × 64 (_forward_default).
FORWARD_CONFIGS = (
    Config(BLOCK_P=128, BLOCK_R=128, BLOCK_K=16, num_warps=8, num_stages=3),
    Config(BLOCK_P=32, BLOCK_R=32, BLOCK_K=16, num_warps=4, num_stages=2),
    Config(BLOCK_P=64, BLOCK_R=64, BLOCK_K=16, num_warps=4, num_stages=3),
)
# refine_kernel recomputes a flagged tile in REFINE_SUB × REFINE_SUB pieces.
REFINE_SUB = 32
# grad_kernel's: BLOCK_K is the widest block of features a program takes (narrower where M
# is: _grad_block); each block of features forms G' again. Its loop waits for memory once a
# step (grad and dist feed G' through arithmetic, not a product, so that Triton's pipelining
# takes only the operands' loads): 32 other rows a step, not 16, halve the waits (8,192² ×
# 128, TF32: 0.349 -> 0.178 ms per launch predicted), with no spills and one stage.
GRAD_CONFIGS = (
    Config(BLOCK_OWN=64, BLOCK_OTHER=32, BLOCK_K=128, num_warps=8, num_stages=1),
    Config(BLOCK_OWN=32, BLOCK_OTHER=16, BLOCK_K=16, num_warps=4, num_stages=2),
    Config(BLOCK_OWN=64, BLOCK_OTHER=16, BLOCK_K=128, num_warps=8, num_stages=1),
)
PREFIX_CONFIGS = (
    Config(BLOCK_ROWS=32, BLOCK_M=64, num_warps=4, num_stages=2),
    Config(BLOCK_ROWS=16, BLOCK_M=16, num_warps=2, num_stages=2),
)
# prefix_kernel's: one program per batch element walks its rows three times, so it takes
# large blocks (fewer round trips to memory one after another); the last is float64's (128 ×
# 128 spills 2 KB there).
FUSED_PREFIX_CONFIGS = (
    Config(BLOCK_ROWS=128, BLOCK_M=128, num_warps=16, num_stages=1),
    Config(BLOCK_ROWS=16, BLOCK_M=16, num_warps=2, num_stages=1),
    Config(BLOCK_ROWS=64, BLOCK_M=64, num_warps=8, num_stages=1),
)
# A batch element of at most this many values (both sets' rows times M) takes the fused prefix:
# P = R = 256, M = 128, a metric-learning batch, is 2^16.
FUSED_PREFIX_VALUES = 1 << 17
SUM_BLOCKS = tl.constexpr(2)  # column_sums_kernel's chunks: blocks of BLOCK_ROWS rows each
# exponent_kernel's rows and mean_kernel's chunks a step (on 8 warps): each step waits for its
# loads, so that they take a set of 8,192 rows (two sets' 256 chunks of 64 rows) in one.
STATS_BLOCK = 8192
MEAN_CHUNKS = 256


# --------------------------------------------------------------------------- shared pieces


@triton.jit
def _scale_in(e, IS64: tl.constexpr):
    """The two factors whose product is 2^-e (|e| may pass the normal exponents: a subnormal
    largest value has e = -148 in float32)."""
    h = (0 - e) // 2
    return tm.pow2(h, IS64), tm.pow2(0 - e - h, IS64)


@triton.jit
def _centred(x_ptr, rows, ks, row_mask, k_mask, stride_row, mean_ptr, f1, f2, ACC: tl.constexpr):
    """Rows `rows`, features `ks` of one batch element, scaled by f1·f2 = 2^-e and centred, in
    ACC; 0 in masked lanes (so that they add nothing to a product)."""
    mask = row_mask[:, None] & k_mask[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_row + ks[None, :], mask=mask, other=0.0).to(ACC)
    mu = tl.load(mean_ptr + ks, mask=k_mask, other=0.0)
    return tl.where(mask, x * f1 * f2 - mu[None, :], 0.0)


@triton.jit
def _split(x, SPLIT: tl.constexpr, SCHEME: tl.constexpr):
    """A tile of ACC values as the products take them, (hi, lo): for float16 and bfloat16 inputs
    (SPLIT) two bfloat16 halves (16 of float32's 24 bits; lo·lo, 2^-16 of the rest, is never
    taken); float32 by SCHEME (lse's: a TF32 pair, TF32, or bfloat16; lse._tf32: the tensor
    cores take a TF32 value exactly); float64 as it is. lo is hi where the scheme has none."""
    if SPLIT:
        hi = x.to(tl.bfloat16)
        lo = (x - hi.to(tl.float32)).to(tl.bfloat16)
    elif SCHEME == lse.TF32X3:
        hi = lse._tf32(x)
        lo = lse._tf32(x - hi)
    elif SCHEME == lse.TF32:
        hi = lse._tf32(x)
        lo = hi
    elif SCHEME == lse.HALF:
        hi = x.to(tl.bfloat16)
        lo = hi
    else:
        hi = x
        lo = x
    return hi, lo


@triton.jit
def _operand(hi_ptr, lo_ptr, offsets, mask, SPLIT: tl.constexpr, SCHEME: tl.constexpr):
    """A tile of operands_kernel's operands, (hi, lo), 0 in masked lanes, as stored (_mma
    upcasts bfloat16 under the interpreter: after every load of a step, as the GPU uses them)."""
    hi = tl.load(hi_ptr + offsets, mask=mask, other=0.0)
    lo = hi
    if SPLIT or SCHEME == lse.TF32X3:
        lo = tl.load(lo_ptr + offsets, mask=mask, other=0.0)
    return hi, lo


@triton.jit
def _mma(a_hi, a_lo, b_hi, b_lo, acc, SPLIT: tl.constexpr, SCHEME: tl.constexpr, INTERPRET: tl.constexpr):
    """acc + a·b (a: (n, k), b: (k, m)) on tensor cores (float64: in float64) from _split's
    halves: three products where there are two halves, the small ones first. bfloat16 halves
    are upcast under the interpreter, whose bfloat16 arithmetic works on the raw bits (their
    products are exact in float32: the GPU's products, summed in another order)."""
    if SPLIT:
        if INTERPRET:
            a_hi = a_hi.to(tl.float32)
            a_lo = a_lo.to(tl.float32)
            b_hi = b_hi.to(tl.float32)
            b_lo = b_lo.to(tl.float32)
        acc = tl.dot(a_lo, b_hi, acc, out_dtype=tl.float32)
        acc = tl.dot(a_hi, b_lo, acc, out_dtype=tl.float32)
        return tl.dot(a_hi, b_hi, acc, out_dtype=tl.float32)
    else:
        if INTERPRET:
            if SCHEME == lse.HALF:
                a_hi = a_hi.to(tl.float32)
                b_hi = b_hi.to(tl.float32)
        return lse._mma(a_hi, a_lo, b_hi, b_lo, acc, SCHEME)


@triton.jit
def _direct_sq(
    a_ptr, b_ptr, rows, cols, row_mask, col_mask, stride_a, stride_b, M, ACC: tl.constexpr, IS64: tl.constexpr
):
    """Σ(a - b)² for every pair of the tile from the unscaled rows, as m·2^E: t = the largest
    |a - b| (0, inf or NaN: returned as m with E = 0), else the differences times 2^-E/2,
    E/2 = frexp's exponent of t, so that no square over- or underflows (cpu::direct_sq_exact)."""
    t = tl.zeros((rows.shape[0], cols.shape[0]), ACC)
    for k in range(0, M):
        a = tl.load(a_ptr + rows * stride_a + k, mask=row_mask, other=0.0).to(ACC)
        b = tl.load(b_ptr + cols * stride_b + k, mask=col_mask, other=0.0).to(ACC)
        t = tl.maximum(t, tl.abs(a[:, None] - b[None, :]), propagate_nan=tl.PropagateNan.ALL)
    plain = (t == 0) | (t != t) | (t == float("inf"))
    half = tl.where(plain, 0, tm.ilogb(t, IS64) + 1)
    s = tl.zeros((rows.shape[0], cols.shape[0]), ACC)
    for k in range(0, M):
        a = tl.load(a_ptr + rows * stride_a + k, mask=row_mask, other=0.0).to(ACC)
        b = tl.load(b_ptr + cols * stride_b + k, mask=col_mask, other=0.0).to(ACC)
        q = tm.ldexp(a[:, None] - b[None, :], 0 - half, IS64)
        s += q * q
    return tl.where(plain, t, s), 2 * half


# --------------------------------------------------------------------------- prefix


@triton.jit
def _row_block_stats(x, rows, N, M, stride_row, ACC: tl.constexpr, BLOCK_M: tl.constexpr):
    """Of rows `rows` of one set (x: its batch element's first row): whether every value is
    finite (int32) and the largest finite magnitude (ACC), each (BLOCK_ROWS,)."""
    row_mask = rows < N
    finite = tl.full((rows.shape[0],), 1, tl.int32)
    largest = tl.zeros((rows.shape[0],), ACC)
    for k0 in range(0, M, BLOCK_M):
        ks = k0 + tl.arange(0, BLOCK_M)
        mask = row_mask[:, None] & (ks < M)[None, :]
        v = tl.load(x + rows[:, None] * stride_row + ks[None, :], mask=mask, other=0.0).to(ACC)
        ok = (v == v) & (tl.abs(v) != float("inf"))
        finite = finite & tl.min(tl.where(mask, ok.to(tl.int32), 1), axis=1)
        largest = tl.maximum(largest, tl.max(tl.where(ok & mask, tl.abs(v), 0.0), axis=1))
    return finite, largest


@triton.jit
def _column_block_sums(x, finite_ptr, rows, ks, N, stride_row, k_mask, f1, f2, ACC: tl.constexpr):
    """Of rows `rows` of one set, features `ks`: the sum over the finite rows of the values
    times f1·f2 = 2^-e, (BLOCK_M,), and how many rows are finite."""
    row_mask = rows < N
    keep = (tl.load(finite_ptr + rows, mask=row_mask, other=0) != 0) & row_mask
    mask = keep[:, None] & k_mask[None, :]
    v = tl.load(x + rows[:, None] * stride_row + ks[None, :], mask=mask, other=0.0).to(ACC)
    return tl.sum(tl.where(mask, v * f1 * f2, 0.0), axis=0), tl.sum(keep.to(tl.int32), axis=0)


@triton.jit
def _operand_rows(
    x,
    mean,
    norms_ptr,
    hi_ptr,
    lo_ptr,
    rows,
    N,
    M,
    stride_row,
    f1,
    f2,
    ACC: tl.constexpr,
    SPLIT: tl.constexpr,
    SCHEME: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Rows `rows` of one set scaled, centred and stored as the products take them (_split:
    hi and lo, (rows, M) contiguous from hi_ptr and lo_ptr; a non-finite value stays one, so
    that its products are NaN where the forward recomputes them directly and the gradients it
    reaches NaN, as the CPU kernel's), and their squared norms Σ_k c² in ACC at norms_ptr."""
    row_mask = rows < N
    total = tl.zeros((rows.shape[0],), ACC)
    for k0 in range(0, M, BLOCK_M):
        ks = k0 + tl.arange(0, BLOCK_M)
        k_mask = ks < M
        c = _centred(x, rows, ks, row_mask, k_mask, stride_row, mean, f1, f2, ACC)
        total += tl.sum(c * c, axis=1)
        hi, lo = _split(c, SPLIT, SCHEME)
        offsets = rows[:, None] * M + ks[None, :]
        mask = row_mask[:, None] & k_mask[None, :]
        tl.store(hi_ptr + offsets, hi.to(hi_ptr.dtype.element_ty), mask=mask)
        if SPLIT or SCHEME == lse.TF32X3:
            tl.store(lo_ptr + offsets, lo.to(lo_ptr.dtype.element_ty), mask=mask)
    tl.store(norms_ptr + rows, total, mask=row_mask)


@triton.jit
def _exponent(top, IS64: tl.constexpr):
    """The power-of-two exponent e that brings the largest finite magnitude `top` into
    [1/2, 1) where it lies outside [2^-H, 2^H] (H = 256 for float64, 32 otherwise; frexp's),
    else 0."""
    if IS64:
        H: tl.constexpr = 256
    else:
        H: tl.constexpr = 32
    outside = (top > tm.pow2(tl.full((), H, tl.int32), IS64)) | (
        (top < tm.pow2(tl.full((), -H, tl.int32), IS64)) & (top > 0)
    )
    return tl.where(outside, tm.ilogb(tl.where(outside, top, 1.0), IS64) + 1, 0)


@triton.jit
def row_stats_kernel(
    x_ptr,
    finite_ptr,
    largest_ptr,
    N,
    M,
    stride_batch,
    stride_row,
    tiles,
    ACC: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Per row of a (B, N, M) set: whether every value is finite (int8) and the largest finite
    magnitude (ACC), into (B, N) arrays."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // tiles
    rows = (pid % tiles) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    finite, largest = _row_block_stats(x_ptr + b * stride_batch, rows, N, M, stride_row, ACC, BLOCK_M)
    tl.store(finite_ptr + b * N + rows, finite.to(tl.int8), mask=rows < N)
    tl.store(largest_ptr + b * N + rows, largest, mask=rows < N)


@triton.jit
def column_sums_kernel(
    x_ptr,
    finite_ptr,
    exp_ptr,
    sums_ptr,
    N,
    M,
    stride_batch,
    stride_row,
    chunks,
    first_chunk,
    all_chunks,
    ACC: tl.constexpr,
    IS64: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Per (batch element and chunk of SUM_BLOCKS blocks of rows, block of features): the sum
    over the chunk's finite rows of the rows times 2^-e, added in row order, into
    sums[b, first_chunk + chunk] of (B, all_chunks, M). The chunks spread a set's rows across
    programs (one program per block of features would take every row in turn: a long chain of
    loads on a handful of SMs); the caller adds them in chunk order."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // chunks
    chunk = pid % chunks
    ks = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    k_mask = ks < M
    f1, f2 = _scale_in(tl.load(exp_ptr + b), IS64)
    total = tl.zeros((BLOCK_M,), ACC)
    for step in range(SUM_BLOCKS):
        rows = (chunk * SUM_BLOCKS + step) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        part, _ = _column_block_sums(
            x_ptr + b * stride_batch, finite_ptr + b * N, rows, ks, N, stride_row, k_mask, f1, f2, ACC
        )
        total += part
    tl.store(sums_ptr + (b * all_chunks + first_chunk + chunk) * M + ks, total, mask=k_mask)


@triton.jit
def exponent_kernel(
    largest1_ptr,
    largest2_ptr,
    finite1_ptr,
    finite2_ptr,
    exp_ptr,
    count_ptr,
    N1,
    N2,
    TWO: tl.constexpr,
    ACC: tl.constexpr,
    IS64: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    """Per batch element (a program each), from row_stats_kernel's arrays of its sets: the
    exponent of their largest finite magnitude (_exponent) and the number of their finite rows
    (int32, the mean's divisor)."""
    b = tl.program_id(0).to(tl.int64)
    top = tl.zeros((BLOCK_ROWS,), ACC)
    count = tl.zeros((BLOCK_ROWS,), tl.int32)
    for r0 in range(0, N1, BLOCK_ROWS):
        rows = r0 + tl.arange(0, BLOCK_ROWS)
        top = tl.maximum(top, tl.load(largest1_ptr + b * N1 + rows, mask=rows < N1, other=0.0))
        count += tl.load(finite1_ptr + b * N1 + rows, mask=rows < N1, other=0).to(tl.int32)
    if TWO:
        for r0 in range(0, N2, BLOCK_ROWS):
            rows = r0 + tl.arange(0, BLOCK_ROWS)
            top = tl.maximum(top, tl.load(largest2_ptr + b * N2 + rows, mask=rows < N2, other=0.0))
            count += tl.load(finite2_ptr + b * N2 + rows, mask=rows < N2, other=0).to(tl.int32)
    tl.store(exp_ptr + b, _exponent(tl.max(top, axis=0), IS64))
    tl.store(count_ptr + b, tl.sum(count, axis=0))


@triton.jit
def mean_kernel(
    sums_ptr,
    count_ptr,
    mean_ptr,
    M,
    all_chunks,
    ACC: tl.constexpr,
    IS64: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Per batch element and block of features: the finite rows' mean, column_sums_kernel's
    chunks (B, all_chunks, M) added BLOCK_C at a time in a fixed order, over their count."""
    b = tl.program_id(0).to(tl.int64)
    ks = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    k_mask = ks < M
    total = tl.zeros((BLOCK_M,), ACC)
    for c0 in range(0, all_chunks, BLOCK_C):
        cs = c0 + tl.arange(0, BLOCK_C)
        mask = (cs < all_chunks)[:, None] & k_mask[None, :]
        total += tl.sum(tl.load(sums_ptr + (b * all_chunks + cs[:, None]) * M + ks[None, :], mask=mask, other=0.0), 0)
    count = tl.maximum(tl.load(count_ptr + b), 1).to(ACC)
    tl.store(mean_ptr + b * M + ks, tm.div_rn(total, count, IS64), mask=k_mask)


@triton.jit
def operands_kernel(
    x_ptr,
    exp_ptr,
    mean_ptr,
    norms_ptr,
    hi_ptr,
    lo_ptr,
    N,
    M,
    stride_batch,
    stride_row,
    tiles,
    ACC: tl.constexpr,
    IS64: tl.constexpr,
    SPLIT: tl.constexpr,
    SCHEME: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """The scaled, centred rows of a (B, N, M) set as the products take them, (B, N, M)
    contiguous, and their squared norms (_operand_rows). Formed once, rather than by every
    tile that reads a row."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // tiles
    rows = (pid % tiles) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    f1, f2 = _scale_in(tl.load(exp_ptr + b), IS64)
    _operand_rows(
        x_ptr + b * stride_batch, mean_ptr + b * M, norms_ptr + b * N, hi_ptr + b * N * M, lo_ptr + b * N * M,
        rows, N, M, stride_row, f1, f2, ACC, SPLIT, SCHEME, BLOCK_M,
    )  # fmt: skip


@triton.jit
def prefix_kernel(
    x1_ptr,
    x2_ptr,
    finite1_ptr,
    finite2_ptr,
    exp_ptr,
    mean_ptr,
    n1_ptr,
    n2_ptr,
    hi1_ptr,
    lo1_ptr,
    hi2_ptr,
    lo2_ptr,
    N1,
    N2,
    M,
    s1b,
    s1r,
    s2b,
    s2r,
    TWO: tl.constexpr,
    ACC: tl.constexpr,
    IS64: tl.constexpr,
    SPLIT: tl.constexpr,
    SCHEME: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """The whole prefix of one batch element (of one or TWO sets) in one program, for small
    problems, where the other kernels' launches (three per set, with the torch operations
    between them) would cost more than their work: the rows' finiteness (into finite*_ptr,
    (B, N) int8) and the largest finite magnitude, the exponent (exp_ptr), the mean of the
    finite rows after scaling (mean_ptr, (B, M), summed in row order), then the operands and
    norms as operands_kernel's. Each phase reads what the previous one stored, after a barrier."""
    b = tl.program_id(0).to(tl.int64)
    x1, finite1, n1 = x1_ptr + b * s1b, finite1_ptr + b * N1, n1_ptr + b * N1
    x2, finite2, n2 = x2_ptr + b * s2b, finite2_ptr + b * N2, n2_ptr + b * N2
    top = _set_stats(x1, finite1, N1, M, s1r, ACC, BLOCK_ROWS, BLOCK_M)
    if TWO:
        top = tl.maximum(top, _set_stats(x2, finite2, N2, M, s2r, ACC, BLOCK_ROWS, BLOCK_M))
    e = _exponent(top, IS64)
    tl.store(exp_ptr + b, e)
    f1, f2 = _scale_in(e, IS64)
    tl.debug_barrier()  # the finiteness stored above, read by other threads below
    for k0 in range(0, M, BLOCK_M):
        ks = k0 + tl.arange(0, BLOCK_M)
        total, count = _set_sums(x1, finite1, ks, N1, M, s1r, f1, f2, ACC, BLOCK_ROWS)
        if TWO:
            more, n = _set_sums(x2, finite2, ks, N2, M, s2r, f1, f2, ACC, BLOCK_ROWS)
            total += more
            count += n
        tl.store(mean_ptr + b * M + ks, tm.div_rn(total, tl.maximum(count, 1).to(ACC), IS64), mask=ks < M)
    tl.debug_barrier()  # the mean stored above, read by other threads below
    mean = mean_ptr + b * M
    for r0 in range(0, N1, BLOCK_ROWS):
        rows = r0 + tl.arange(0, BLOCK_ROWS)
        _operand_rows(
            x1, mean, n1, hi1_ptr + b * N1 * M, lo1_ptr + b * N1 * M, rows, N1, M, s1r, f1, f2, ACC, SPLIT, SCHEME,
            BLOCK_M,
        )  # fmt: skip
    if TWO:
        for r0 in range(0, N2, BLOCK_ROWS):
            rows = r0 + tl.arange(0, BLOCK_ROWS)
            _operand_rows(
                x2, mean, n2, hi2_ptr + b * N2 * M, lo2_ptr + b * N2 * M, rows, N2, M, s2r, f1, f2, ACC, SPLIT,
                SCHEME, BLOCK_M,
            )  # fmt: skip


@triton.jit
def _set_stats(x, finite_ptr, N, M, stride_row, ACC: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_M: tl.constexpr):
    """prefix_kernel's first phase for one set: each row's finiteness stored (int8), and the
    largest finite magnitude returned."""
    top = tl.zeros((), ACC)
    for r0 in range(0, N, BLOCK_ROWS):
        rows = r0 + tl.arange(0, BLOCK_ROWS)
        finite, largest = _row_block_stats(x, rows, N, M, stride_row, ACC, BLOCK_M)
        tl.store(finite_ptr + rows, finite.to(tl.int8), mask=rows < N)
        top = tl.maximum(top, tl.max(largest))
    return top


@triton.jit
def _set_sums(x, finite_ptr, ks, N, M, stride_row, f1, f2, ACC: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """prefix_kernel's second phase for one set: the sum over its finite rows, in row order, of
    features `ks` times 2^-e, and how many rows are finite."""
    total = tl.zeros((ks.shape[0],), ACC)
    count = tl.zeros((), tl.int32)
    for r0 in range(0, N, BLOCK_ROWS):
        rows = r0 + tl.arange(0, BLOCK_ROWS)
        part, n = _column_block_sums(x, finite_ptr, rows, ks, N, stride_row, ks < M, f1, f2, ACC)
        total += part
        count += n
    return total, count


# --------------------------------------------------------------------------- forward


@triton.jit
def _zero_diagonal(na, rows, cols):
    """x2=None: where a finite row meets itself (its distance is exactly 0; a non-finite row's
    is Σ(a - a)² = NaN, recomputed)."""
    finite_row = (na == na) & (na != float("inf"))
    return (rows[:, None] == cols[None, :]) & finite_row[:, None]


@hot()
@triton.jit
def forward_kernel(
    a_hi_ptr,
    a_lo_ptr,
    b_hi_ptr,
    b_lo_ptr,
    n1_ptr,
    n2_ptr,
    exp_ptr,
    out_ptr,
    flag_ptr,
    P,
    R,
    M,
    tiles_r,
    tiles,
    SELF: tl.constexpr,
    SQUARED: tl.constexpr,
    ACC: tl.constexpr,
    IS64: tl.constexpr,
    SPLIT: tl.constexpr,
    SCHEME: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One output tile from the expansion over operands_kernel's operands; flag[tile] = 1 where
    an entry of it is to be recomputed (refine_kernel), so that this kernel carries none of
    that path's registers."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // tiles
    tile = pid % tiles
    tiny_norms = tm.tiny_norms(M, IS64)
    rows = (tile // tiles_r) * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = (tile % tiles_r) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < P
    col_mask = cols < R
    e = tl.load(exp_ptr + b)
    acc = tl.zeros((BLOCK_P, BLOCK_R), ACC)
    for k0 in range(0, M, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < M
        a_offsets = (b * P + rows[:, None]) * M + ks[None, :]
        a_hi, a_lo = _operand(a_hi_ptr, a_lo_ptr, a_offsets, row_mask[:, None] & k_mask[None, :], SPLIT, SCHEME)
        b_offsets = (b * R + cols[None, :]) * M + ks[:, None]  # (BLOCK_K, BLOCK_R): bᵀ as loaded
        b_hi, b_lo = _operand(b_hi_ptr, b_lo_ptr, b_offsets, k_mask[:, None] & col_mask[None, :], SPLIT, SCHEME)
        acc = _mma(a_hi, a_lo, b_hi, b_lo, acc, SPLIT, SCHEME, INTERPRET)

    na = tl.load(n1_ptr + b * P + rows, mask=row_mask, other=0.0)
    nb = tl.load(n2_ptr + b * R + cols, mask=col_mask, other=0.0)
    norms = na[:, None] + nb[None, :]
    d2 = norms - 2.0 * acc
    # The tile is flagged where an entry's expansion cancelled (d2·RATIO < norms; d2·RATIO is
    # exact, so the rounded difference has the comparison's sign) or is NaN: the sum of
    # min(difference, 0), NaN kept, is then negative or NaN, and 0 otherwise. Two operations an
    # entry, where comparing each entry took ten. Masked lanes need no mask: their operands and
    # norms load as 0 (a difference of 0 or 15·norm), or NaN only beside a valid NaN entry. A
    # squared norm below tiny_norms is decided per row and column: the smallest norms of the tile
    # are the smallest valid row's plus the smallest valid column's.
    short = d2 * REFINE_RATIO - norms
    if SELF:
        short = tl.where(_zero_diagonal(na, rows, cols), 0.0, short)
    cancelled = tl.sum(tl.minimum(short, 0.0, propagate_nan=tl.PropagateNan.ALL))
    smallest = tl.min(tl.where(row_mask, na, float("inf"))) + tl.min(tl.where(col_mask, nb, float("inf")))
    refine = ~(cancelled >= 0) | ~(smallest >= tiny_norms)
    value = tl.maximum(d2, 0.0, propagate_nan=tl.PropagateNan.ALL)  # NaN kept: refine_kernel sees it
    if not SQUARED:
        if out_ptr.dtype.element_ty.primitive_bitwidth == 16:
            # Rounded to 16 bits next: the approximate root (one MUFU operation, a float32 ulp
            # or so) rounds as the correctly rounded one but within its error of a halfway
            # point (then a 16-bit ulp apart); the correctly rounded root is ~30 operations.
            # (A subnormal d2 is never rounded here: the tile is flagged, d2·RATIO < norms.)
            value = tl.sqrt(value)
        else:
            value = tm.sqrt_rn(value, IS64)
    if e != 0:
        value = tm.ldexp(value, e if not SQUARED else 2 * e, IS64)
    if SELF:
        value = tl.where(_zero_diagonal(na, rows, cols), 0.0, value)
    out = out_ptr + (b * P + rows[:, None]) * R + cols[None, :]
    tl.store(out, value.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])
    tl.store(flag_ptr + pid, refine.to(tl.int8))


@triton.jit
def refine_kernel(
    x1_ptr,
    x2_ptr,
    n1_ptr,
    n2_ptr,
    exp_ptr,
    out_ptr,
    flag_ptr,
    P,
    R,
    M,
    s1b,
    s1p,
    s2b,
    s2r,
    tiles_r,
    tiles,
    SELF: tl.constexpr,
    SQUARED: tl.constexpr,
    ACC: tl.constexpr,
    IS64: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SUB: tl.constexpr,
):
    """For each tile forward_kernel flagged, in SUB × SUB pieces: the entries whose distance
    (from the output, as the backward decides) shows that the expansion cancelled, is NaN or
    infinite, or may have underflowed, recomputed directly (_direct_sq) from the unscaled
    inputs."""
    pid = tl.program_id(0).to(tl.int64)
    if tl.load(flag_ptr + pid) != 0:
        b = pid // tiles
        tile = pid % tiles
        tiny = tm.tiny_norms(M, IS64)
        e = tl.load(exp_ptr + b)
        for i0 in range(0, BLOCK_P, SUB):
            rows = (tile // tiles_r) * BLOCK_P + i0 + tl.arange(0, SUB)
            row_mask = rows < P
            na = tl.load(n1_ptr + b * P + rows, mask=row_mask, other=0.0)
            for j0 in range(0, BLOCK_R, SUB):
                cols = (tile % tiles_r) * BLOCK_R + j0 + tl.arange(0, SUB)
                col_mask = cols < R
                valid = row_mask[:, None] & col_mask[None, :]
                out = out_ptr + (b * P + rows[:, None]) * R + cols[None, :]
                d = tl.load(out, mask=valid, other=0.0).to(ACC)
                nb = tl.load(n2_ptr + b * R + cols, mask=col_mask, other=0.0)
                norms = na[:, None] + nb[None, :]
                if SQUARED:
                    d2 = tm.ldexp(d, -2 * e, IS64)
                else:
                    ds = tm.ldexp(d, 0 - e, IS64)
                    d2 = ds * ds
                # An infinite output too: an expansion that cancelled can come out large enough
                # that times 2^e it overflows (rows scaled down far beside much larger ones).
                refine = ~(d2 * REFINE_RATIO >= norms) | ~(norms >= tiny) | (d == float("inf"))
                refine = refine & valid
                if SELF:
                    refine = refine & ~_zero_diagonal(na, rows, cols)
                if tl.max(refine.to(tl.int32)) > 0:
                    m, E = _direct_sq(
                        x1_ptr + b * s1b, x2_ptr + b * s2b, rows, cols, row_mask, col_mask, s1p, s2r, M, ACC, IS64
                    )
                    if SQUARED:
                        direct = tm.ldexp(m, E, IS64)
                    else:
                        direct = tm.ldexp(tm.sqrt_rn(m, IS64), E // 2, IS64)
                    tl.store(out, direct.to(out_ptr.dtype.element_ty), mask=refine)


# --------------------------------------------------------------------------- backward


@hot()
@triton.jit
def grad_kernel(
    grad_ptr,
    dist_ptr,
    own_ptr,
    other_ptr,
    n_own_ptr,
    n_other_ptr,
    hi_ptr,
    lo_ptr,
    mean_ptr,
    exp_ptr,
    out_ptr,
    N_OWN,
    N_OTHER,
    M,
    s_own_b,
    s_own_r,
    s_other_b,
    s_other_r,
    sg_b,
    sg_own,
    sg_other,
    sd_b,
    sd_own,
    sd_other,
    tiles_k,
    tiles,
    chunk,
    SQUARED: tl.constexpr,
    ACC: tl.constexpr,
    IS64: tl.constexpr,
    SPLIT: tl.constexpr,
    SCHEME: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_OWN: tl.constexpr,
    BLOCK_OTHER: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One (BLOCK_OWN × BLOCK_K) tile of an input's gradient: x1's (`own` x1's rows, grad and
    dist as they are) or x2's (`own` x2's rows, grad and dist transposed through the strides),
    the part of it from the slice of `chunk` other rows program_id(1) takes, into out[slice]
    (the caller adds the slices' parts in order). Across the slice, a block at a time: G' =
    grad / dist (2·grad squared; 0 at distance 0), the entries the forward recomputed directly
    taken out (decided as the forward did, from the output; where a squared output
    overflowed, from the rows); G''s row sums; G'·other by the forward's products (_mma) over
    the other rows' operands (operands_kernel's); and the direct entries' gradient
    Σ g·((own - other) / d) (d = 1 and 2·grad squared) from the unscaled inputs. out =
    s·(rowsum(G')·own - G'·other) + direct over the slice, s = 2^e for squared distances of a
    scaled element, else 1 (a power of two: the slices' parts add up to the whole's)."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // tiles
    tile = pid % tiles
    rows = (tile // tiles_k) * BLOCK_OWN + tl.arange(0, BLOCK_OWN)
    k0 = (tile % tiles_k) * BLOCK_K
    ks = k0 + tl.arange(0, BLOCK_K)
    row_mask = rows < N_OWN
    k_mask = ks < M
    tiny = tm.tiny_norms(M, IS64)
    e = tl.load(exp_ptr + b)
    f1, f2 = _scale_in(e, IS64)
    mean = mean_ptr + b * M
    n_own = tl.load(n_own_ptr + b * N_OWN + rows, mask=row_mask, other=0.0)
    own = own_ptr + b * s_own_b
    other = other_ptr + b * s_other_b
    acc = tl.zeros((BLOCK_OWN, BLOCK_K), ACC)
    total = tl.zeros((BLOCK_OWN,), ACC)
    first = tl.program_id(1).to(tl.int64) * chunk
    for c0 in range(first, tl.minimum(first + chunk, N_OTHER), BLOCK_OTHER):
        cols = (c0 + tl.arange(0, BLOCK_OTHER)).to(tl.int64)
        col_mask = cols < N_OTHER
        valid = row_mask[:, None] & col_mask[None, :]
        # Every load of the step issued before any is used: one round trip to memory a step.
        g = tl.load(grad_ptr + b * sg_b + rows[:, None] * sg_own + cols[None, :] * sg_other, mask=valid, other=0.0)
        d = tl.load(dist_ptr + b * sd_b + rows[:, None] * sd_own + cols[None, :] * sd_other, mask=valid, other=1.0)
        n_other = tl.load(n_other_ptr + b * N_OTHER + cols, mask=col_mask, other=0.0)
        offsets = (b * N_OTHER + cols[:, None]) * M + ks[None, :]
        c_hi, c_lo = _operand(hi_ptr, lo_ptr, offsets, col_mask[:, None] & k_mask[None, :], SPLIT, SCHEME)
        g = g.to(ACC)
        d = d.to(ACC)
        norms = n_own[:, None] + n_other[None, :]
        # The forward's refinement test on d² in the scaled rows' units, from the output; where
        # a squared output overflowed, from the rows themselves.
        # ldexp only for a scaled element: ordinary data pays nothing for it.
        if SQUARED:
            ds2 = d
            if e != 0:
                ds2 = tm.ldexp(d, -2 * e, IS64)
            if tl.max(((d == float("inf")) & valid).to(tl.int32)) > 0:
                m, E = _direct_sq(own, other, rows, cols, row_mask, col_mask, s_own_r, s_other_r, M, ACC, IS64)
                ds2 = tl.where(d == float("inf"), tm.ldexp(m, E - 2 * e, IS64), ds2)
            v = 2.0 * g
        else:
            ds = d
            if e != 0:
                ds = tm.ldexp(d, 0 - e, IS64)
            ds2 = ds * ds
            v = tl.where(ds == 0, 0.0, tm.div_rn(g, tl.where(ds == 0, 1.0, ds), IS64))
        refined = ((ds2 * REFINE_RATIO < norms) | (norms < tiny)) & valid
        v = tl.where(refined | ~valid, 0.0, v)
        total += tl.sum(v, axis=1)
        v_hi, v_lo = _split(v, SPLIT, SCHEME)
        acc = _mma(v_hi, v_lo, c_hi, c_lo, acc, SPLIT, SCHEME, INTERPRET)
        # Direct entries (rare: near-duplicates, non-finite rows): none at d = 0.
        if SQUARED:
            take = refined
        else:
            take = refined & (d != 0)
        if tl.max(take.to(tl.int32)) > 0:
            if SQUARED:
                gd = tl.where(take, 2.0 * g, 0.0)
                dd = tl.full(g.shape, 1.0, ACC)
            else:
                gd = tl.where(take, g, 0.0)
                dd = tl.where(take, d, 1.0)
            for k in range(k0, tl.minimum(k0 + BLOCK_K, M)):
                a = tl.load(own + rows * s_own_r + k, mask=row_mask, other=0.0).to(ACC)
                x = tl.load(other + cols * s_other_r + k, mask=col_mask, other=0.0).to(ACC)
                term = tl.sum(tl.where(take, gd * tm.div_rn(a[:, None] - x[None, :], dd, IS64), 0.0), axis=1)
                if SQUARED:
                    if e != 0:  # into the scaled rows' units, which the epilogue leaves: exact
                        term = tm.ldexp(term, 0 - e, IS64)
                # Subtracted from G'·other (out = s·(rowsum·own - acc)): no accumulator of
                # its own held across the loop for what is rare.
                acc -= tl.where(ks[None, :] == k, term[:, None], 0.0)
    value = total[:, None] * _centred(own, rows, ks, row_mask, k_mask, s_own_r, mean, f1, f2, ACC) - acc
    if SQUARED:
        if e != 0:
            value = tm.ldexp(value, e, IS64)
    mask = row_mask[:, None] & k_mask[None, :]
    batches = tl.num_programs(0) // tiles
    part = out_ptr + tl.program_id(1).to(tl.int64) * batches * N_OWN * M
    tl.store(part + (b * N_OWN + rows[:, None]) * M + ks[None, :], value, mask=mask)


# --------------------------------------------------------------------------- the op's kernels


def _batched(x: Tensor, batch: tuple, B: int) -> Tensor:
    """(*B_i, rows, M) → (B, rows, M) with unit feature stride: a view where the layout allows,
    a copy in the input's own dtype otherwise (broadcast batch dimensions, a strided last one)."""
    x = x.expand(*batch, *x.shape[-2:]).reshape(B, *x.shape[-2:])
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


class _Centring:
    """The prefix: per batch element the exponent (int32, (B,)) and the mean (ACC, (B, M));
    per row the squared norm of the scaled, centred row, and per set those rows as the
    products (_products' constexprs) take them, (hi, lo). `fused`: by prefix_kernel, one
    launch (None: where a batch element holds at most FUSED_PREFIX_VALUES values), else by
    row_stats_kernel, column_sums_kernel and operands_kernel per set, exponent_kernel and
    mean_kernel between them: no torch operation of their own, each of which would be a launch
    (19 of them, 0.07 ms on an H200 by make gpu-model); `config` from FUSED_PREFIX_CONFIGS or
    PREFIX_CONFIGS to match."""

    def __init__(
        self, sets: list[Tensor], B: int, M: int, acc: torch.dtype, products: dict, config: Config | None, fused=None
    ):
        if fused is None:
            fused = sum(x.shape[1] for x in sets) * M <= FUSED_PREFIX_VALUES
        config = config or (lse._default(FUSED_PREFIX_CONFIGS, acc) if fused else PREFIX_CONFIGS[0])
        is64 = acc == torch.float64
        # The operands: bfloat16 halves or a TF32 pair of float32 (two arrays), one array of
        # TF32, bfloat16 or float64 values otherwise.
        split, scheme = products["SPLIT"], products["SCHEME"]
        operand = torch.bfloat16 if split or scheme == lse.HALF.value else acc
        device = sets[0].device
        self.norms = [torch.empty(B, x.shape[1], dtype=acc, device=device) for x in sets]
        self.operands = []
        for x in sets:
            hi = torch.empty(B, x.shape[1], M, dtype=operand, device=device)
            self.operands.append((hi, torch.empty_like(hi) if split or scheme == lse.TF32X3.value else hi))
        finite = [torch.empty(B, x.shape[1], dtype=torch.int8, device=device) for x in sets]
        if fused:
            self.exponents = torch.empty(B, dtype=torch.int32, device=device)
            self.mean = torch.empty(B, M, dtype=acc, device=device)
            a, c = sets[0], sets[-1]
            prefix_kernel[(B,)](
                a, c, finite[0], finite[-1], self.exponents, self.mean, self.norms[0], self.norms[-1],
                *self.operands[0], *self.operands[-1], a.shape[1], c.shape[1], M,
                a.stride(0), a.stride(1), c.stride(0), c.stride(1),
                TWO=len(sets) == 2, ACC=acc_tl(acc), IS64=is64, SPLIT=split, SCHEME=scheme, **config.launch,
            )  # fmt: skip
            return
        rows = config.kwargs["BLOCK_ROWS"]
        largest = [torch.empty(B, x.shape[1], dtype=acc, device=device) for x in sets]
        for x, fin, big in zip(sets, finite, largest, strict=True):
            N = x.shape[1]
            tiles = blocks(N, rows)
            row_stats_kernel[(B * tiles,)](
                x, fin, big, N, M, x.stride(0), x.stride(1), tiles, ACC=acc_tl(acc), **config.launch
            )
        self.exponents = torch.empty(B, dtype=torch.int32, device=device)
        count = torch.empty(B, dtype=torch.int32, device=device)
        exponent_kernel[(B,)](
            largest[0], largest[-1], finite[0], finite[-1], self.exponents, count, sets[0].shape[1], sets[-1].shape[1],
            TWO=len(sets) == 2, ACC=acc_tl(acc), IS64=is64, BLOCK_ROWS=STATS_BLOCK, num_warps=8,
        )  # fmt: skip
        # Every set's chunks in one (B, chunks, M) array, added in chunk order.
        chunk = SUM_BLOCKS * rows
        chunks = [blocks(x.shape[1], chunk) for x in sets]
        part = torch.empty(B, sum(chunks), M, dtype=acc, device=device)
        first = 0
        for x, fin, n in zip(sets, finite, chunks, strict=True):
            column_sums_kernel[(B * n, blocks(M, config.kwargs["BLOCK_M"]))](
                x,
                fin,
                self.exponents,
                part,
                x.shape[1],
                M,
                x.stride(0),
                x.stride(1),
                n,
                first,
                part.shape[1],
                ACC=acc_tl(acc),
                IS64=is64,
                **config.launch,
            )
            first += n
        self.mean = torch.empty(B, M, dtype=acc, device=device)
        mean_kernel[(B, blocks(M, config.kwargs["BLOCK_M"]))](
            part, count, self.mean, M, part.shape[1], ACC=acc_tl(acc), IS64=is64, BLOCK_C=MEAN_CHUNKS,
            BLOCK_M=config.kwargs["BLOCK_M"], num_warps=8,
        )  # fmt: skip
        for x, n, (hi, lo) in zip(sets, self.norms, self.operands, strict=True):
            N = x.shape[1]
            tiles = blocks(N, rows)
            operands_kernel[(B * tiles,)](
                x,
                self.exponents,
                self.mean,
                n,
                hi,
                lo,
                N,
                M,
                x.stride(0),
                x.stride(1),
                tiles,
                ACC=acc_tl(acc),
                IS64=is64,
                SPLIT=split,
                SCHEME=scheme,
                **config.launch,
            )


def _problem(x1: Tensor, x2: Tensor | None):
    batch = tuple(x1.shape[:-2]) if x2 is None else tuple(torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2]))
    B = 1
    for s in batch:
        B *= s
    return batch, B


def _products(x: Tensor) -> dict:
    """The products' constexprs (_mma): SPLIT for float16 and bfloat16 inputs; else the scheme
    of float32 inputs by PyTorch's fp32-matmul setting, read now (lse.scheme), or float64's."""
    split = x.dtype in (torch.float16, torch.bfloat16)
    scheme = lse.HALF.value if split else lse.scheme(acc_dtype(x))
    return dict(SPLIT=split, SCHEME=scheme, INTERPRET=interpreting())


def _forward_default(acc: torch.dtype, B: int, P: int, R: int) -> Config:
    """forward_kernel's default configuration: the first, or the last (64 × 64) for float64
    and where the first's tiles number fewer than the SMs (lse.FILL / 2), which its smaller
    tiles then spread over."""
    first = FORWARD_CONFIGS[0].kwargs
    if acc == torch.float64 or B * blocks(P, first["BLOCK_P"]) * blocks(R, first["BLOCK_R"]) < lse.FILL // 2:
        return FORWARD_CONFIGS[-1]
    return FORWARD_CONFIGS[0]


def forward(
    x1: Tensor,
    x2: Tensor | None,
    squared,
    *,
    config: Config | None = None,
    prefix_config: Config | None = None,
    fused_prefix: bool | None = None,
) -> Tensor:
    """torchkit::cdist's CUDA kernel (any device under the interpreter). `prefix_config` and
    `fused_prefix`: the prefix's (_Centring)."""
    check_scalars("cdist", ("bool", "squared", squared))
    check_distance_inputs("cdist", "x1", x1, "x2", x2)
    batch, B = _problem(x1, x2)
    P, M = x1.shape[-2], x1.shape[-1]
    R = P if x2 is None else x2.shape[-2]
    config = config or _forward_default(acc_dtype(x1), B, P, R)
    out = torch.empty(B, P, R, dtype=x1.dtype, device=x1.device)
    if out.numel() > 0:
        acc = acc_dtype(x1)
        a = _batched(x1, batch, B)
        c = a if x2 is None else _batched(x2, batch, B)
        products = _products(x1)
        pre = _Centring([a] if x2 is None else [a, c], B, M, acc, products, prefix_config, fused_prefix)
        n1 = pre.norms[0]
        n2 = n1 if x2 is None else pre.norms[1]
        k = config.kwargs
        tiles_r = blocks(R, k["BLOCK_R"])
        tiles = blocks(P, k["BLOCK_P"]) * tiles_r
        flags = torch.empty(B * tiles, dtype=torch.int8, device=x1.device)
        variant = dict(SELF=x2 is None, SQUARED=bool(squared), ACC=acc_tl(acc), IS64=acc == torch.float64)
        forward_kernel[(B * tiles,)](
            *pre.operands[0],
            *pre.operands[-1],
            n1,
            n2,
            pre.exponents,
            out,
            flags,
            P,
            R,
            M,
            tiles_r,
            tiles,
            **variant,
            **products,
            **config.launch,
        )
        common = (P, R, M, a.stride(0), a.stride(1), c.stride(0), c.stride(1), tiles_r, tiles)
        refine_kernel[(B * tiles,)](
            a,
            c,
            n1,
            n2,
            pre.exponents,
            out,
            flags,
            *common,
            **variant,
            BLOCK_P=k["BLOCK_P"],
            BLOCK_R=k["BLOCK_R"],
            SUB=REFINE_SUB,
            num_warps=4,
        )
    return out.view(*batch, P, R)


def _check_backward(x1: Tensor, x2: Tensor | None, grad: Tensor, dist: Tensor, shape: tuple) -> None:
    """csrc/cdist.cpp's check_backward_inputs, same order and messages."""
    if tuple(dist.shape) != shape or tuple(grad.shape) != shape:
        raise ValueError(
            f"cdist: backward: grad and dist must have the output's shape {list(shape)}, got "
            f"{list(grad.shape)} and {list(dist.shape)}"
        )
    for name, t in (("grad", grad), ("dist", dist)):
        if t.dtype != x1.dtype:
            raise TypeError(
                f"cdist: x1 and {name} must have the same dtype, got {dtype_name(x1.dtype)} and {dtype_name(t.dtype)}"
            )
    check_same_device("cdist", x1=x1, grad=grad, dist=dist)


def _grad_block(M: int, config: Config) -> int:
    """grad_kernel's block of features: the configuration's, or the power of two (at least 16,
    tl.dot's smallest) that holds M where that is narrower."""
    return min(config.kwargs["BLOCK_K"], max(16, triton.next_power_of_2(M)))


def backward(
    grad: Tensor,
    x1: Tensor,
    x2: Tensor | None,
    dist: Tensor,
    squared,
    output_mask,
    *,
    config: Config | None = None,
    prefix_config: Config | None = None,
    fused_prefix: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """torchkit::_cdist_backward's CUDA kernel."""
    check_scalars("cdist", ("bool", "squared", squared))
    check_distance_inputs("cdist", "x1", x1, "x2", x2)
    batch, B = _problem(x1, x2)
    P, M = x1.shape[-2], x1.shape[-1]
    R = P if x2 is None else x2.shape[-2]
    _check_backward(x1, x2, grad, dist, (*batch, P, R))
    self_ = x2 is None
    want1 = bool(output_mask[0])
    want2 = want1 if self_ else bool(output_mask[1])
    acc = acc_dtype(x1)
    g1 = g2 = None
    if (want1 or want2) and B * P * R * M > 0:
        a = _batched(x1, batch, B)
        c = a if self_ else _batched(x2, batch, B)
        products = _products(x1)
        pre = _Centring([a] if self_ else [a, c], B, M, acc, products, prefix_config, fused_prefix)
        n1 = pre.norms[0]
        n2 = n1 if self_ else pre.norms[1]
        g = grad.expand(*batch, P, R).reshape(B, P, R)
        d = dist.reshape(B, P, R)
        config = config or lse._default(GRAD_CONFIGS, acc)
        block_k = _grad_block(M, config)
        launch = {**config.launch, "BLOCK_K": block_k}
        flags = dict(SQUARED=bool(squared), ACC=acc_tl(acc), IS64=acc == torch.float64, **products)

        def gradient(own, other, n_own, n_other, operands, N_own, N_other, transposed):
            sg = (g.stride(0), g.stride(2), g.stride(1)) if transposed else g.stride()
            sd = (d.stride(0), d.stride(2), d.stride(1)) if transposed else d.stride()
            tiles_k = blocks(M, block_k)
            tiles = blocks(N_own, config.kwargs["BLOCK_OWN"]) * tiles_k
            # The other rows split into slices until the programs fill the GPU (lse.FILL).
            slices, chunk = lse._slices(B * tiles, N_other, config.kwargs["BLOCK_OTHER"])
            out = torch.empty(slices, B, N_own, M, dtype=acc, device=x1.device)
            grad_kernel[(B * tiles, slices)](
                g,
                d,
                own,
                other,
                n_own,
                n_other,
                *operands,
                pre.mean,
                pre.exponents,
                out,
                N_own,
                N_other,
                M,
                own.stride(0),
                own.stride(1),
                other.stride(0),
                other.stride(1),
                *sg,
                *sd,
                tiles_k,
                tiles,
                chunk,
                **flags,
                **launch,
            )
            return out[0] if slices == 1 else out.sum(0)

        if want1:
            g1 = gradient(a, c, n1, n2, pre.operands[-1], P, R, False)
        if want2:
            g2 = gradient(c, a, n2, n1, pre.operands[0], R, P, True)
    elif want1 or want2:
        g1 = torch.zeros(B, P, M, dtype=acc, device=x1.device) if want1 else None
        g2 = torch.zeros(B, R, M, dtype=acc, device=x1.device) if want2 else None

    def to_input(gr: Tensor, x: Tensor) -> Tensor:
        return gr.view(*batch, x.shape[-2], M).sum_to_size(x.shape).to(x.dtype)

    empty = x1.new_empty(0)
    if self_:
        total = g1 if g2 is None else (g2 if g1 is None else g1 + g2)
        return (to_input(total, x1) if total is not None else empty), empty
    return (to_input(g1, x1) if g1 is not None else empty), (to_input(g2, x2) if g2 is not None else empty)


def compile_cases() -> list[CompileCase]:
    """Every kernel for tools/triton_check.py: each configuration in float32, the tensor-core
    path of float16 and bfloat16, and float64 with its default configuration; the SELF and
    SQUARED branches and the other float32 products with the defaults (_forward_default)."""
    cases = []
    for dtype, acc in (("fp32", "fp32"), ("bf16", "fp32"), ("fp16", "fp32"), ("fp64", "fp64")):
        is64 = acc == "fp64"
        # The default configurations (_forward_default, lse._default).
        forward_defaults = (FORWARD_CONFIGS[-1],) if is64 else (FORWARD_CONFIGS[0], FORWARD_CONFIGS[-1])
        default = -1 if is64 else 0
        split = dtype in ("bf16", "fp16")
        every = dtype in ("fp32", "bf16")
        flags = dict(ACC=tl.float64 if is64 else tl.float32, IS64=is64)
        ints = dict.fromkeys(
            (
                "P",
                "R",
                "M",
                "N",
                "N1",
                "N2",
                "N_OWN",
                "N_OTHER",
                "tiles",
                "tiles_r",
                "tiles_k",
                "chunk",
                "chunks",
                "first_chunk",
                "all_chunks",
            ),
            "i32",
        )
        strides = dict.fromkeys(
            (
                "s1b",
                "s1p",
                "s1r",
                "s2b",
                "s2r",
                "stride_batch",
                "stride_row",
                "s_own_b",
                "s_own_r",
                "s_other_b",
                "s_other_r",
                "sg_b",
                "sg_own",
                "sg_other",
                "sd_b",
                "sd_own",
                "sd_other",
            ),
            "i32",
        )
        data = dict.fromkeys(
            ("x_ptr", "x1_ptr", "x2_ptr", "own_ptr", "other_ptr", "out_ptr", "grad_ptr", "dist_ptr"), "*" + dtype
        )
        accs = dict.fromkeys(
            (
                "mean_ptr",
                "n1_ptr",
                "n2_ptr",
                "largest_ptr",
                "sums_ptr",
                "norms_ptr",
                "n_own_ptr",
                "n_other_ptr",
            ),
            "*" + acc,
        )
        # The products: float32's by each fp32-matmul setting (the default's with every
        # configuration), the split halves', float64's; operands_kernel's arrays by them.
        scheme = lse.HALF if split else lse.FP64 if is64 else lse.TF32X3
        products = dict(SPLIT=split, SCHEME=scheme, INTERPRET=False)

        def operands(scheme, split=split, acc=acc):
            kind = "*bf16" if split or scheme is lse.HALF else "*" + acc
            return dict.fromkeys(("a_hi_ptr", "a_lo_ptr", "b_hi_ptr", "b_lo_ptr", "hi_ptr", "lo_ptr"), kind)

        types = {**ints, **strides, **data, **accs, "exp_ptr": "*i32", "finite_ptr": "*i8", "flag_ptr": "*i8"}
        # As the headline launch (B = 1, P = R = 8,192, M = 128: tools/gpu_model.py) specialises
        # them: its ints and strides divisible by 16 (so that the operand loads vectorise and
        # pipeline as they do there), but the backward's unit strides and single feature block.
        ones = dict(sg_other=1, sd_other=1, tiles_k=1)
        case = functools.partial(CompileCase, divisible=tuple(k for k in (*ints, *strides) if k not in ones))
        types.update(operands(scheme))
        for variant in ((False, False), (True, True)) if dtype == "fp32" else ((False, False),):
            self_, squared = variant
            cases.append(
                case(
                    f"cdist.forward {dtype}{' self squared' if self_ else ''}",
                    forward_kernel,
                    types,
                    dict(SELF=self_, SQUARED=squared, **products, **flags),
                    FORWARD_CONFIGS if every and not self_ else forward_defaults,
                    tensor_cores=not is64,
                )
            )
        if dtype == "fp32":
            for name, other in (("high", lse.TF32), ("medium", lse.HALF)):
                cases.append(
                    case(
                        f"cdist.forward {dtype} {name}",
                        forward_kernel,
                        {**types, **operands(other)},
                        dict(SELF=False, SQUARED=False, **{**products, "SCHEME": other}, **flags),
                        forward_defaults,
                        tensor_cores=True,
                    )
                )
        for (self_, squared), block in itertools.product(((False, False), (True, True)), forward_defaults):
            block = block.kwargs
            cases.append(
                case(
                    f"cdist.refine {dtype}{' self squared' if self_ else ''} {block['BLOCK_P']}x{block['BLOCK_R']}",
                    refine_kernel,
                    types,
                    dict(
                        SELF=self_,
                        SQUARED=squared,
                        BLOCK_P=block["BLOCK_P"],
                        BLOCK_R=block["BLOCK_R"],
                        SUB=REFINE_SUB,
                        **flags,
                    ),
                    (Config(num_warps=4),),
                )
            )
        if split and dtype == "fp16":
            continue  # the prefix and the backward do not depend on float16 against bfloat16
        backward_types = {**types, "out_ptr": "*" + acc}
        for squared in (False, True) if not is64 else (False,):
            cases.append(
                case(
                    f"cdist.grad {dtype}{' squared' if squared else ''}",
                    grad_kernel,
                    backward_types,
                    dict(SQUARED=squared, **products, **flags, **ones),
                    GRAD_CONFIGS if every else (GRAD_CONFIGS[default],),
                    tensor_cores=not is64,
                )
            )
        if dtype == "fp32":
            for name, other in (("high", lse.TF32), ("medium", lse.HALF)):
                cases.append(
                    case(
                        f"cdist.grad {dtype} {name}",
                        grad_kernel,
                        {**backward_types, **operands(other)},
                        dict(SQUARED=False, **{**products, "SCHEME": other}, **flags, **ones),
                        GRAD_CONFIGS[:1],
                        tensor_cores=True,
                    )
                )
        for kernel, extra in (
            (row_stats_kernel, {}),
            (column_sums_kernel, {"IS64": is64}),
            (operands_kernel, {"IS64": is64, "SPLIT": split, "SCHEME": scheme}),
        ):
            cases.append(
                case(
                    f"cdist.{kernel.fn.__name__.removesuffix('_kernel')} {dtype}",
                    kernel,
                    types,
                    {"ACC": flags["ACC"], **extra},
                    PREFIX_CONFIGS if every else PREFIX_CONFIGS[:1],
                )
            )
        between = {**types, "largest1_ptr": "*" + acc, "largest2_ptr": "*" + acc, "finite1_ptr": "*i8",
                   "finite2_ptr": "*i8", "count_ptr": "*i32", "sums_ptr": "*" + acc, "all_chunks": "i32"}  # fmt: skip
        cases.append(
            case(
                f"cdist.exponent {dtype}",
                exponent_kernel,
                between,
                dict(TWO=True, BLOCK_ROWS=STATS_BLOCK, **flags),
                (Config(num_warps=8),),
            )
        )
        cases.append(
            case(
                f"cdist.mean {dtype}",
                mean_kernel,
                between,
                dict(BLOCK_C=MEAN_CHUNKS, BLOCK_M=PREFIX_CONFIGS[0].kwargs["BLOCK_M"], **flags),
                (Config(num_warps=8),),
            )
        )
        for two in (True, False):
            cases.append(
                case(
                    f"cdist.prefix {dtype}{'' if two else ' self'}",
                    prefix_kernel,
                    {**types, "finite1_ptr": "*i8", "finite2_ptr": "*i8"}
                    | {f"{h}{i}_ptr": types["hi_ptr"] for h in ("hi", "lo") for i in (1, 2)},
                    dict(TWO=two, **flags, SPLIT=split, SCHEME=scheme),
                    FUSED_PREFIX_CONFIGS if every and two else (FUSED_PREFIX_CONFIGS[-1 if is64 else 0],),
                )
            )
    return cases
