"""Exact power-of-two arithmetic for Triton kernels: what csrc/cpu/distance.h's times_pow2 and
std::frexp give the CPU kernels, from integer operations on the bits (neither libdevice's ldexp
nor frexp runs under Triton's interpreter).

Every function but f64 takes ``IS64`` (constexpr): float64 if true, float32 otherwise."""

import triton
import triton.language as tl


@triton.jit
def f64(bits):
    """A float64 passed as its int64 bits (Triton types a Python float argument as float32;
    _launch.float_bits gives the bits)."""
    return (bits + tl.zeros((), tl.int64)).to(tl.float64, bitcast=True)


@triton.jit
def pow2(E, IS64: tl.constexpr):
    """2^E, exactly, for an int32 E within the type's normal exponents ([-126, 127] in float32,
    [-1022, 1023] in float64)."""
    if IS64:
        return ((E.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)
    else:
        return ((E + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def ilogb(v, IS64: tl.constexpr):
    """floor(log2 |v|) as int32 for a finite non-zero v, subnormals included (undefined for 0,
    ±inf and NaN)."""
    if IS64:
        field = ((v.to(tl.int64, bitcast=True) >> 52) & 0x7FF).to(tl.int32)
        # A subnormal times 2^64 is normal: its exponent is read there.
        sub = (((v * 18446744073709551616.0).to(tl.int64, bitcast=True) >> 52) & 0x7FF).to(tl.int32)
        return tl.where(field == 0, sub - 1087, field - 1023)
    else:
        field = (v.to(tl.int32, bitcast=True) >> 23) & 0xFF
        sub = ((v * 18446744073709551616.0).to(tl.int32, bitcast=True) >> 23) & 0xFF
        return tl.where(field == 0, sub - 191, field - 127)


@triton.jit
def ldexp(v, E, IS64: tl.constexpr):
    """v·2^E rounded once, as C's ldexp: over- and underflow come out as a correctly rounded
    ±inf, subnormal or 0; 0, ±inf and NaN are returned as they are. E: int32, any value.

    The result's exponent r = ilogb(v) + E is reached in two steps: v is moved exactly to the
    exponent T = r clamped to the normal range (three factors, each a normal power of two, and
    every intermediate between v's exponent and T, so normal or, for a subnormal v moving up,
    exact), then multiplied by 2^(r - T): 1 where r is normal, an overflow to inf above, and
    below, the one rounding into the subnormals (clamped where the result rounds to 0 anyway)."""
    if IS64:
        MINE: tl.constexpr = -1022
        MAXE: tl.constexpr = 1023
        MANT: tl.constexpr = 52
    else:
        MINE: tl.constexpr = -126
        MAXE: tl.constexpr = 127
        MANT: tl.constexpr = 23
    special = (v == 0) | (v != v) | (tl.abs(v) == float("inf"))
    lg = tl.where(special, 0, ilogb(v, IS64))
    r = lg + tl.minimum(tl.maximum(E, -4 * MAXE), 4 * MAXE)  # past these v·2^E is 0 or inf anyway
    T = tl.minimum(tl.maximum(r, MINE), MAXE)
    a = T - lg
    a1 = a // 3
    a2 = (a - a1) // 2
    w = v * pow2(a1, IS64) * pow2(a2, IS64) * pow2(a - a1 - a2, IS64)
    w = w * pow2(tl.minimum(tl.maximum(r - T, -(MANT + 2)), MAXE), IS64)
    return tl.where(special, v, w)


@triton.jit
def sqrt_rn(v, IS64: tl.constexpr):
    """The correctly rounded square root (float32's tl.sqrt is an approximation on the GPU)."""
    if IS64:
        return tl.sqrt(v)
    else:
        return tl.sqrt_rn(v)


@triton.jit
def div_rn(a, b, IS64: tl.constexpr):
    """The correctly rounded quotient (float32's / is div.full on the GPU, within 2 ulp)."""
    if IS64:
        return a / b
    else:
        return tl.div_rn(a, b)


@triton.jit
def tiny_norms(M, IS64: tl.constexpr):
    """cpu::tiny_norms: 16·M·(smallest normal)/ε, below which a sum of two squared norms may
    have lost digits to underflow in the expansion (formed here: a float argument would reach a
    kernel as float32, where float64's value is 0)."""
    # M + 0.0 rather than M.to(): a launch passes M = 1 as a constant, which has no .to().
    if IS64:
        return (M + tl.zeros((), tl.float64)) * pow2(tl.full((), 4 - 970, tl.int32), IS64)
    else:
        return (M + tl.zeros((), tl.float32)) * pow2(tl.full((), 4 - 103, tl.int32), IS64)
