"""MXFP8 quantization in Triton: a [rows, K] tensor -> e4m3 data + 128x4-swizzled scales.

Contract: ``x`` is contiguous [rows, K] (any float dtype), K % 32 == 0; ``data``
is contiguous e4m3 [rows, K]; ``scale`` is a 1-D uint8 buffer of at least
``mxfp8_scale_bytes(rows, K)`` bytes. Only the scale bytes of real rows/groups
are written (padding keeps what the caller put there). The bytes equal
:func:`decode_boundary.mxfp8.format.quantize_mxfp8_ref` exactly, including the
NaN/Inf rules documented there.

``quantize_groups`` and ``swizzled_offset`` are device functions shared with the
boundary consumer, which quantizes the next layer's input in its epilogue;
``to_bf16_rne`` is the FP32 -> BF16 rounding every kernel of the package uses.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .format import QuantizedActivation, mxfp8_scale_bytes, num_k_tiles, scale_groups


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
def quantize_mxfp8_kernel(
    x_ptr,
    data_ptr,
    scale_ptr,
    rows,
    K: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    GROUPS: tl.constexpr = K // 32
    K_TILES: tl.constexpr = (GROUPS + 3) // 4
    pid_r = tl.program_id(0)
    pid_g = tl.program_id(1)
    r = pid_r * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    g = pid_g * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS)
    e = tl.arange(0, 32)
    col = g[None, :, None] * 32 + e[None, None, :]
    mask = (r[:, None, None] < rows) & (g[None, :, None] < GROUPS)
    offs = r[:, None, None].to(tl.int64) * K + col
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    q, exponent = quantize_groups(x)
    tl.store(data_ptr + offs, q, mask=mask)
    s_off = swizzled_offset(r[:, None], g[None, :], K_TILES)
    s_mask = (r[:, None] < rows) & (g[None, :] < GROUPS)
    tl.store(scale_ptr + s_off, exponent.to(tl.uint8), mask=s_mask)


def quantize_mxfp8(
    x: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> QuantizedActivation:
    """MXFP8 of ``x`` [..., K] (Triton). ``out`` = caller-given (data, scale)
    buffers: e4m3 [rows, K] contiguous and >= mxfp8_scale_bytes(rows, K) uint8."""
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating tensor, got {x.dtype}")
    k = x.shape[-1]
    groups = scale_groups(k)
    flat = x.reshape(-1, k)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    rows = flat.shape[0]
    if out is None:
        data = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
        scale = torch.zeros(mxfp8_scale_bytes(rows, k), dtype=torch.uint8, device=x.device)
    else:
        data, scale = out
        if data.dtype != torch.float8_e4m3fn or tuple(data.shape) != (rows, k):
            raise ValueError(
                f"out data must be float8_e4m3fn [{rows}, {k}], got {data.dtype} "
                f"{tuple(data.shape)}"
            )
        need = mxfp8_scale_bytes(rows, k)
        if scale.dtype != torch.uint8 or scale.ndim != 1 or scale.numel() < need:
            raise ValueError(f"out scale must be 1-D uint8 with >= {need} bytes")
        if not (data.is_contiguous() and scale.is_contiguous()):
            raise ValueError("out buffers must be contiguous")
    block_rows, block_groups = 4, 16
    grid = (triton.cdiv(rows, block_rows), triton.cdiv(groups, block_groups))
    if rows:
        quantize_mxfp8_kernel[grid](flat, data, scale, rows, K=k, BLOCK_ROWS=block_rows,
                                    BLOCK_GROUPS=block_groups)
    assert num_k_tiles(k) * 4 >= groups
    return QuantizedActivation(data, scale, x.dtype, x.shape)
