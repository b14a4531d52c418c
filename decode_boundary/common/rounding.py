"""Device helpers every kernel family shares (the layer between the formats
and the kernels): the FP32 -> BF16 rounding of every kernel, MXFP8 group
quantization bit for bit as ``mxfp8.format.quantize_mxfp8_ref``, and the
128x4 scale swizzle (``mxfp8/format.py``)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def to_bf16_rne(x, HARDWARE: tl.constexpr = False):
    """FP32 -> BF16, round to nearest even (subnormals kept).

    ``HARDWARE``: ``cvt.rn.bf16.f32`` (a NaN becomes the canonical 0x7FFF).
    Otherwise the rounding is done on the bits, because the Triton interpreter's
    cast truncates: the same bits on the GPU and in the interpreter for every
    finite value, and a NaN stays a quiet NaN with its sign and top payload bits.
    """
    if HARDWARE:
        return x.to(tl.bfloat16)
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, (bits >> 16) | 0x40, rounded)
    return rounded.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def swizzled_offset(m, kb, k_tiles):
    """128x4 swizzled byte offset of scale (row m, group kb); see format.py."""
    tile = (m // 128) * k_tiles * 512 + (kb // 4) * 512
    return tile + (m % 32) * 16 + ((m % 128) // 32) * 4 + kb % 4


@triton.jit
def quantize_groups(x, HARDWARE: tl.constexpr = False):
    """Quantize FP32 ``x`` [R, G, 32] per group of 32 along the last axis.

    Returns (e4m3 elements [R, G, 32], UE8M0 exponent bytes [R, G] as int32).
    Matches ``quantize_mxfp8_ref`` bit for bit: every multiply below is by an
    exact power of two (normal in FP32), so the only rounding is the final
    round-to-nearest-even cast, as in the reference. ``HARDWARE`` (GPU only):
    that cast is ``cvt.rn.satfinite.e4m3x2.f32`` (one instruction per two
    elements, the same round-to-nearest-even on the clamped value) instead of
    the integer rounding the interpreter needs; a NaN element may then keep its
    sign (0xFF), which only the GEMM prologue uses (a NaN either way).
    """
    absx = tl.abs(x)
    isnan = x != x
    amax = tl.max(absx, axis=2)
    has_nan = tl.max(isnan.to(tl.int32), axis=2) > 0
    # IEEE division here: amax/448 is the spec's rounding point (not amax * (1/448)).
    bits = tl.div_rn(amax, 448.0).to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    exponent = tl.where(has_nan, 254, tl.minimum(exponent, 254))
    # 1/scale = 2^(127 - e). Split so both factors stay normal FP32: for e > 200
    # pre-scale by 2^-63 (2^-127 itself would be subnormal, which FTZ may flush).
    big = exponent > 200
    pre = tl.where(big, 2.0**-63, 1.0)
    rest = (127 - exponent + tl.where(big, 63, 0) + 127) << 23
    recip = rest.to(tl.float32, bitcast=True)
    scaled = (x * pre[:, :, None]) * recip[:, :, None]
    clamped = tl.minimum(tl.maximum(scaled, -448.0), 448.0)
    if HARDWARE:
        return tl.where(isnan, x, clamped).to(tl.float8e4nv), exponent
    code = e4m3_rne_bits(clamped)
    # min/max drop NaN: put the canonical e4m3 NaN back where the input had one.
    code = tl.where(isnan, 0x7F, code)
    return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True), exponent


@triton.jit
def e4m3_rne_bits(v):
    """e4m3fn bit pattern (int32) of FP32 ``v`` with |v| <= 448, rounded to
    nearest even.

    Done in integer arithmetic rather than ``.to(tl.float8e4nv)`` because the
    Triton interpreter's cast neither rounds to even nor carries a rounded-up
    mantissa into the exponent; this way CPU CI and the GPU run the same
    arithmetic and produce the reference's bytes.
    """
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a = tl.abs(v)
    # Subnormals (|v| < 2^-6) are integer multiples of 2^-9: adding 2^23 rounds
    # to an integer with the FPU's round-to-nearest-even; 8 encodes 2^-6 itself.
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    # Normals: drop 20 of FP32's 23 mantissa bits with RNE; a carry moves into
    # the exponent field by itself. Rebias 127 -> 7: subtract 120 << 3.
    abits = a.to(tl.int32, bitcast=True)
    rounded = (abits + 0x7FFFF + ((abits >> 20) & 1)) >> 20
    normal = rounded - 960
    code = tl.where(a < 0.015625, sub, normal)
    return code | (sign << 7)


@triton.jit
def zero_scale_padding(scale_ptr, m, rows, groups, tail, K_GROUPS: tl.constexpr):
    """Write 0 into the padding of a swizzled scale buffer of ``rows`` rows
    that token ``m``'s program owns: the padding rows m + rows, m + 2 rows, ...
    below the next multiple of 128 (at most 127 of them), at ``groups`` (this
    program's real groups), and with ``tail`` the padding groups K_GROUPS ..
    (multiple of 4) of row m and of those rows. The programs of all tokens
    together cover the padding exactly once, as ``quantize_mxfp8`` writes it."""
    K_TILES: tl.constexpr = (K_GROUPS + 3) // 4
    j = tl.arange(0, 128)
    row = m + rows * j  # j = 0: the token's own row; j >= 1: padding rows
    padding_row = (j > 0) & (row < tl.cdiv(rows, 128) * 128)
    tl.store(scale_ptr + swizzled_offset(row[:, None], groups[None, :], K_TILES),
             tl.zeros((128, groups.shape[0]), dtype=tl.uint8),
             mask=padding_row[:, None] & (groups[None, :] < K_GROUPS))
    if K_GROUPS % 4 != 0:
        extra = K_GROUPS + tl.arange(0, 4)
        live = ((j == 0) | padding_row)[:, None] & (tail & (extra < K_TILES * 4))[None, :]
        tl.store(scale_ptr + swizzled_offset(row[:, None], extra[None, :], K_TILES),
                 tl.zeros((128, 4), dtype=tl.uint8), mask=live)
