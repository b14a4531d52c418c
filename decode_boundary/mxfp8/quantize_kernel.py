"""MXFP8 quantization in Triton: a [rows, K] tensor -> e4m3 data + 128x4-swizzled scales.

Contract: ``x`` is contiguous [rows, K] (any float dtype), K % 32 == 0; ``data``
is contiguous e4m3 [rows, K]; ``scale`` is a 1-D uint8 buffer of at least
``mxfp8_scale_bytes(rows, K)`` bytes, all of which are written: the scales of
real rows / groups, and 0 in the padding (rows up to a multiple of 128, groups
up to a multiple of 4), so a caller's buffer ends up byte-equal to a fresh one. The bytes equal
:func:`decode_boundary.mxfp8.format.quantize_mxfp8_ref` exactly, including the
NaN/Inf rules documented there.

The rounding itself (``quantize_groups``, ``swizzled_offset``) lives in
``decode_boundary.common.rounding``, shared with the boundary consumer (which
quantizes the next layer's input in its epilogue) and the GEMM's prologue.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from decode_boundary.common.rounding import quantize_groups, swizzled_offset

from .format import (
    QuantizedActivation,
    check_scale_buffer,
    mxfp8_scale_bytes,
    num_k_tiles,
    scale_groups,
)


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
    # The grid covers the padded scale tile too: padding rows / groups get 0.
    real = (r[:, None] < rows) & (g[None, :] < GROUPS)
    padded = (r[:, None] < tl.cdiv(rows, 128) * 128) & (g[None, :] < K_TILES * 4)
    s_off = swizzled_offset(r[:, None], g[None, :], K_TILES)
    tl.store(scale_ptr + s_off, tl.where(real, exponent, 0).to(tl.uint8), mask=padded)


def quantize_mxfp8(
    x: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> QuantizedActivation:
    """MXFP8 of ``x`` [..., K] (Triton). ``out`` = caller-given (data, scale)
    buffers: e4m3 [rows, K] contiguous and >= mxfp8_scale_bytes(rows, K) uint8.
    Under torch.compile: the custom op ``decode_boundary::quantize_mxfp8``
    (``quantize_mxfp8_out`` with caller buffers, declared mutated)."""
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating tensor, got {x.dtype}")
    if torch.compiler.is_compiling():
        flat = x.reshape(-1, x.shape[-1])
        if out is None:
            data, scale = torch.ops.decode_boundary.quantize_mxfp8(flat)
        else:
            data, scale = out
            torch.ops.decode_boundary.quantize_mxfp8_out(flat, data, scale)
        return QuantizedActivation(data, scale, x.dtype, x.shape)
    return _quantize_eager(x, out)


def _quantize_eager(x: torch.Tensor, out) -> QuantizedActivation:
    k = x.shape[-1]
    groups = scale_groups(k)
    flat = x.reshape(-1, k)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    rows = flat.shape[0]
    if out is None:
        data = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
        scale = torch.empty(mxfp8_scale_bytes(rows, k), dtype=torch.uint8, device=x.device)
    else:
        data, scale = out
        if data.dtype != torch.float8_e4m3fn or tuple(data.shape) != (rows, k):
            raise ValueError(
                f"out data must be float8_e4m3fn [{rows}, {k}], got {data.dtype} "
                f"{tuple(data.shape)}"
            )
        check_scale_buffer(scale, rows, k, "out scale")
        if not data.is_contiguous():
            raise ValueError("out data must be contiguous")
    block_rows, block_groups = 4, 16
    # Over the padded scale tile (rows to 128, groups to 4): its padding is written too.
    grid = (triton.cdiv(-(-rows // 128) * 128, block_rows),
            triton.cdiv(num_k_tiles(k) * 4, block_groups))
    if rows:
        quantize_mxfp8_kernel[grid](flat, data, scale, rows, K=k, BLOCK_ROWS=block_rows,
                                    BLOCK_GROUPS=block_groups)
    assert num_k_tiles(k) * 4 >= groups
    return QuantizedActivation(data, scale, x.dtype, x.shape)


@torch.library.custom_op("decode_boundary::quantize_mxfp8", mutates_args=())
def _quantize_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    qa = _quantize_eager(x, None)
    return qa.data, qa.scale


@_quantize_op.register_fake
def _(x):
    rows, k = x.shape
    return (x.new_empty((rows, k), dtype=torch.float8_e4m3fn),
            x.new_empty((mxfp8_scale_bytes(rows, k),), dtype=torch.uint8))


@torch.library.custom_op("decode_boundary::quantize_mxfp8_out", mutates_args=("data", "scale"))
def _quantize_out_op(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> None:
    _quantize_eager(x, (data, scale))
