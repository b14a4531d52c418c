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
    Matches ``quantize_mxfp8_ref`` bit for bit: the exponent comes from the
    bits of the group's maximum (:func:`_scale_exponent`: the reference's rule
    without its division), every multiply below is by an exact power of two
    (normal in FP32), so the only rounding is the final round-to-nearest-even
    cast, as in the reference. One integer maximum per group, over the bits of
    |x| (a NaN's bits sort above every number's), finds both the scale and a
    NaN. ``HARDWARE`` (GPU only): that cast is ``cvt.rn.satfinite.e4m3x2.f32``
    (one instruction per two elements, the same round-to-nearest-even,
    saturating at +-448 as the reference's clamp, NaN kept) instead of the
    integer rounding the interpreter needs.
    """
    # |x| as bits (sign cleared) order like the values, and every NaN pattern sorts above
    # inf: one integer maximum per group gives both the scale and a NaN.
    amax_bits = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2)
    exponent = _scale_exponent(amax_bits)
    # 1/scale = 2^(127 - e). Split so both factors stay normal FP32: for e > 200
    # pre-scale by 2^-63 (2^-127 itself would be subnormal, which FTZ may flush).
    big = exponent > 200
    pre = tl.where(big, 2.0**-63, 1.0)
    rest = (127 - exponent + tl.where(big, 63, 0) + 127) << 23
    recip = rest.to(tl.float32, bitcast=True)
    scaled = (x * pre[:, :, None]) * recip[:, :, None]
    if HARDWARE:
        # cvt.rn.satfinite: out-of-range values saturate to +-448 and NaN stays NaN, as
        # the clamp below and the reference do.
        return scaled.to(tl.float8e4nv), exponent
    isnan = x != x
    clamped = tl.minimum(tl.maximum(scaled, -448.0), 448.0)
    code = e4m3_rne_bits(clamped)
    # min/max drop NaN: put the canonical e4m3 NaN back where the input had one.
    code = tl.where(isnan, 0x7F, code)
    return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True), exponent


@triton.jit
def _scale_exponent(bits):
    """UE8M0 exponent (int32) of a group whose maximum |x| has the FP32 bit
    pattern ``bits`` (sign clear): the biased exponent of RN(amax / 448), one
    more if that quotient is not a power of two, at most 254 (inf and NaN give
    254) — the reference's rule — without the division (equal to it for every
    FP32 pattern: tests/gemm/test_rounding.py)."""
    biased = (bits >> 23) & 0xFF
    fraction = bits & 0x7FFFFF
    # Normal amax = 1.f * 2^(b-127): amax / 448 = (1.f / 1.75) * 2^(b-135), which rounds
    # to a power of two only at 1.f = 1.75 exactly; above, its exponent is one more.
    normal = tl.maximum(biased - 8 + (fraction > 0x600000).to(tl.int32), 1)
    # Subnormal amax = f * 2^-149: the quotient is 0 (exponent 0) up to f = 224 (a tie
    # at 2^-150 rounds to even, 0), else a subnormal or 2^-126 (exponent 1).
    tiny = (fraction > 224).to(tl.int32)
    return tl.where(biased == 255, 254, tl.where(biased == 0, tiny, normal))


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
