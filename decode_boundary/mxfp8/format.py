"""MXFP8: e4m3 elements with one UE8M0 scale per 32 consecutive K elements.

Byte-compatible with FlashInfer's ``mm_mxfp8`` operands (docs/DESIGN.md §4):

* elements: ``float8_e4m3fn`` [rows, K], K-contiguous;
* scales: one byte per (row, K/32 group), value ``2 ** (byte - 127)`` (0xFF is
  NaN and never produced here), stored 1-D in the **128x4 swizzled** layout
  with rows padded to 128 and K-groups padded to 4.

Scale of a group: ``amax / 448`` rounded *up* to a power of two (the biased
exponent of ``amax / 448`` in FP32, +1 if its mantissa is non-zero, clamped to
[0, 254]); elements: ``clamp(x / scale, -448, 448)`` rounded to nearest even.

Special inputs (what this module guarantees, kernel and reference alike):

* amax = 0: scale byte 0 (2^-127), all elements +0/-0 as the input's sign.
* values that saturate: anything past 448 * scale clamps to +-448 (0x7E/0xFE).
* subnormal amax / 448: rounds up to byte 1 (2^-126), as the rule says.
* NaN in a group: scale byte 254; the NaN elements become 0x7F (canonical
  e4m3 NaN, sign dropped); finite elements are divided by 2^127.
* +-Inf in a group: scale byte 254; Inf saturates to +-448; finite elements
  are divided by 2^127.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32  # K elements per scale byte
E4M3_MAX = 448.0
SCALE_ROW_TILE = 128  # rows of one swizzled scale tile
SCALE_COL_TILE = 4  # K-groups of one swizzled scale tile
E4M3_NAN = 0x7F


@dataclass(frozen=True)
class QuantizedActivation:
    """An MXFP8 tensor: e4m3 ``data`` [rows, K], 128x4-swizzled 1-D ``scale``
    bytes, and the dtype/shape it was quantized from (``orig_shape[-1] == K``)."""

    data: torch.Tensor
    scale: torch.Tensor
    orig_dtype: torch.dtype
    orig_shape: torch.Size

    @property
    def rows(self) -> int:
        return self.data.shape[0]


def scale_groups(k: int) -> int:
    """K/32 (K must be a multiple of 32)."""
    if k % GROUP:
        raise ValueError(f"K must be a multiple of {GROUP}, got {k}")
    return k // GROUP


def num_k_tiles(k: int) -> int:
    """Swizzled 4-group column tiles of a K-wide operand."""
    return -(-scale_groups(k) // SCALE_COL_TILE)


def mxfp8_scale_bytes(rows: int, k: int) -> int:
    """Bytes of the swizzled scale buffer of a [rows, K] operand (rows padded to
    128, K-groups padded to 4)."""
    padded_rows = -(-rows // SCALE_ROW_TILE) * SCALE_ROW_TILE
    return padded_rows * num_k_tiles(k) * SCALE_COL_TILE


def check_scale_buffer(scale: torch.Tensor, rows: int, k: int, name: str,
                       device: torch.device | None = None, exact: bool = False) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``scale`` can hold the 128x4
    swizzled scales of a [rows, K] operand: contiguous 1-D uint8 of at least
    (``exact``: exactly) ``mxfp8_scale_bytes(rows, k)`` bytes, on ``device``
    when given. Every MXFP8 operand's scale buffer is checked by this."""
    need = mxfp8_scale_bytes(rows, k)
    size_ok = scale.numel() == need if exact else scale.numel() >= need
    if scale.dtype != torch.uint8 or scale.ndim != 1 or not size_ok or \
            not scale.is_contiguous() or (device is not None and scale.device != device):
        where = f" on {device}" if device is not None else ""
        size = f"[{need}]" if exact else f"with at least {need} bytes"
        raise ValueError(
            f"{name} must be 1-D uint8 {size}, contiguous{where} (128x4 swizzled over "
            f"({rows}, {scale_groups(k)})), got {scale.dtype} {tuple(scale.shape)} on "
            f"{scale.device}")


def swizzled_scale_offset(m: torch.Tensor | int, kb: torch.Tensor | int, k: int):
    """Offset of scale (row ``m``, group ``kb``) in the 128x4 swizzled buffer.

    Works elementwise on integer tensors or plain ints. The 128-row tile is
    stored as 32 rows of 16 bytes, each holding rows m, m+32, m+64, m+96 times
    4 groups, which is the layout tcgen05 / FlashInfer read as ``F8_128x4``.
    """
    tiles = num_k_tiles(k)
    return (
        (m // 128) * tiles * 512
        + (kb // 4) * 512
        + (m % 32) * 16
        + ((m % 128) // 32) * 4
        + kb % 4
    )


def _offset_grid(rows: int, k: int, device: torch.device) -> torch.Tensor:
    m = torch.arange(rows, device=device, dtype=torch.int64)[:, None]
    kb = torch.arange(scale_groups(k), device=device, dtype=torch.int64)[None, :]
    return swizzled_scale_offset(m, kb, k)


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """[rows, K/32] uint8 scales -> 1-D 128x4-swizzled buffer (padding zeroed)."""
    if scales.dtype != torch.uint8 or scales.ndim != 2:
        raise ValueError(f"scales must be a 2-D uint8 tensor, got {scales.dtype} {scales.ndim}-D")
    rows, groups = scales.shape
    k = groups * GROUP
    out = torch.zeros(mxfp8_scale_bytes(rows, k), dtype=torch.uint8, device=scales.device)
    out[_offset_grid(rows, k, scales.device).reshape(-1)] = scales.reshape(-1)
    return out


def unswizzle_scales(swizzled: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales`: the [rows, K/32] uint8 scales."""
    check_scale_buffer(swizzled, rows, k, "swizzled scales")
    return swizzled[_offset_grid(rows, k, swizzled.device)]


def scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """UE8M0 byte (as int32) of groups with FP32 absolute maxima ``amax``:
    the biased exponent of amax/448, +1 if the mantissa is non-zero, in [0, 254]."""
    bits = (amax.float() / E4M3_MAX).view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return exponent.clamp(0, 254)


def exp2_int(exponent: torch.Tensor) -> torch.Tensor:
    """2 ** (exponent - 127) in FP64 (exact for every UE8M0 byte 0..254)."""
    return torch.exp2(exponent.double() - 127.0)


def quantize_mxfp8_ref(x: torch.Tensor) -> QuantizedActivation:
    """Pure-torch MXFP8 quantization of ``x`` [..., K] along its last dim (the spec)."""
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating tensor, got {x.dtype}")
    k = x.shape[-1]
    groups = scale_groups(k)
    rows_x = x.reshape(-1, k).float()
    rows = rows_x.shape[0]
    grouped = rows_x.view(rows, groups, GROUP)
    amax = grouped.abs().amax(dim=-1)  # NaN propagates: a NaN group gets byte 254
    exponent = scale_exponent(amax)
    # Dividing by a power of two is exact in FP64; the one rounding is the cast.
    scaled = (grouped.double() / exp2_int(exponent)[..., None]).float()
    clamped = torch.where(scaled.isnan(), scaled, scaled.clamp(-E4M3_MAX, E4M3_MAX))
    data = clamped.to(torch.float8_e4m3fn).view(torch.uint8)
    data = torch.where(clamped.isnan(), torch.full_like(data, E4M3_NAN), data)
    return QuantizedActivation(
        data.view(torch.float8_e4m3fn).view(rows, k),
        swizzle_scales(exponent.to(torch.uint8)),
        x.dtype,
        x.shape,
    )


def dequantize_mxfp8(qa: QuantizedActivation, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Elements times their group scales, in ``dtype`` (exact in FP32/FP64), in
    the activation's original shape."""
    rows, k = qa.data.shape
    scales = unswizzle_scales(qa.scale, rows, k)
    values = qa.data.double().view(rows, -1, GROUP) * exp2_int(scales.to(torch.int32))[..., None]
    return values.view(qa.orig_shape).to(dtype)


def check_quantized(qa: QuantizedActivation, name: str = "x") -> None:
    """Raise a clear ValueError if ``qa`` breaks the MXFP8 layout contract."""
    data, scale = qa.data, qa.scale
    if data.dtype != torch.float8_e4m3fn or data.ndim != 2:
        raise ValueError(f"{name}.data must be 2-D float8_e4m3fn, got {data.dtype} {data.ndim}-D")
    if not data.is_contiguous():
        raise ValueError(f"{name}.data must be contiguous")
    rows, k = data.shape
    if k % GROUP:
        raise ValueError(f"{name}: K must be a multiple of {GROUP}, got {k}")
    check_scale_buffer(scale, rows, k, f"{name}.scale", device=data.device)
