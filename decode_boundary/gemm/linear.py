"""``Mxfp8Linear``: an MXFP8 weight in the layout the GEMMs (ours and FlashInfer's
``mm_mxfp8``) read, built from a float weight or a DeepSeek V4.1 checkpoint.

Layout contract (docs/DESIGN.md §4):

* ``weight``: e4m3 stored [N, K] K-contiguous, exposed as its column-major [K, N]
  view, so ``k, n = layer.weight.shape`` and ``layer.weight.t()`` is contiguous;
* ``weight_scale``: 1-D uint8, the UE8M0 scales of the (N, K/32) groups in the
  128x4 swizzled layout (rows padded to 128, K-groups padded to 4);
* ``bias`` is None: none of the boundary's projections has one;
* ``groups`` (default 1): a *grouped* linear (``wo_a``) holds G weights
  [N/G, K] stacked into one [N, K] and maps an input [..., G*K] (group g in
  columns [g*K, (g+1)*K)) to the concatenation of the G outputs, in one GEMM.

DeepSeek V4.1 checkpoints store e4m3 weights with one UE8M0 scale per [32, 32]
block. Every 1x32 group of a row lies inside one block, so the MXFP8 scale of
(n, kb) is the block's scale byte and the conversion loses nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from decode_boundary.mxfp8.format import (
    GROUP,
    QuantizedActivation,
    check_scale_buffer,
    dequantize_mxfp8,
    quantize_mxfp8_ref,
    swizzle_scales,
    unswizzle_scales,
)

from .api import mxfp8_mm

BLOCK = 32  # rows and columns of one checkpoint scale block
INDEX_FILE = "model.safetensors.index.json"
SCALE_SUFFIXES = (".scale", ".weight_scale_inv")


def _check_fp8_weight(weight_fp8: torch.Tensor) -> tuple[int, int]:
    """(N, K) of an e4m3 [N, K] weight with K % 32 == 0, else a ValueError."""
    if weight_fp8.dtype != torch.float8_e4m3fn or weight_fp8.ndim != 2:
        raise ValueError(
            f"weight_fp8 must be float8_e4m3fn [N, K], got {weight_fp8.dtype} "
            f"{tuple(weight_fp8.shape)}"
        )
    n, k = weight_fp8.shape
    if k % GROUP:
        raise ValueError(f"weight_fp8 [N, K]: K must be a multiple of {GROUP}, got {k}")
    return n, k


class Mxfp8Linear(nn.Module):
    """out = x @ W^T with an MXFP8 weight W [N, K] and no bias.

    ``forward`` is :func:`decode_boundary.gemm.mxfp8_mm`; ``x`` is a BF16
    tensor [..., K] or a :class:`QuantizedActivation` of one.
    """

    def __init__(self, weight_fp8: torch.Tensor, weight_scale: torch.Tensor) -> None:
        """``weight_fp8``: e4m3 [N, K] (K % 32 == 0); ``weight_scale``: its 1-D uint8
        128x4-swizzled scale bytes (``mxfp8_scale_bytes(N, K)`` of them)."""
        super().__init__()
        n, k = _check_fp8_weight(weight_fp8)
        check_scale_buffer(weight_scale, n, k, "weight_scale", device=weight_fp8.device,
                           exact=True)
        self.in_features, self.out_features = k, n
        self.groups = 1
        # The [K, N] view of K-contiguous storage: strides (1, K).
        self.register_buffer("weight", weight_fp8.contiguous().t())
        self.register_buffer("weight_scale", weight_scale.contiguous())
        self.register_parameter("bias", None)

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Mxfp8Linear:
        """Quantize a float weight [N, K] (bf16/fp16/fp32) per 1x32 group along K."""
        if weight.dtype not in (torch.bfloat16, torch.float16, torch.float32) or weight.ndim != 2:
            raise ValueError(
                f"weight must be a bf16/fp16/fp32 [N, K] tensor, got {weight.dtype} "
                f"{tuple(weight.shape)}"
            )
        qa = quantize_mxfp8_ref(weight)
        return cls(qa.data, qa.scale)

    @classmethod
    def from_block_scaled(cls, weight_fp8: torch.Tensor, block_scale: torch.Tensor) -> Mxfp8Linear:
        """From a DeepSeek V4.1 weight: e4m3 [N, K] and UE8M0 scales
        [ceil(N/32), ceil(K/32)] (uint8 or ``torch.float8_e8m0fnu``), one per [32, 32]
        block. Lossless: the scale of (n, kb) is ``block_scale[n // 32, kb]``."""
        n, k = _check_fp8_weight(weight_fp8)
        want = (-(-n // BLOCK), -(-k // BLOCK))
        if block_scale.dtype == torch.float8_e8m0fnu:
            block_scale = block_scale.view(torch.uint8)
        if block_scale.dtype != torch.uint8 or tuple(block_scale.shape) != want:
            raise ValueError(
                f"block_scale must be UE8M0 (uint8 or float8_e8m0fnu) {list(want)} for a "
                f"[{n}, {k}] weight, got {block_scale.dtype} {tuple(block_scale.shape)}"
            )
        if bool((block_scale == 0xFF).any()):
            raise ValueError("block_scale holds 0xFF, the UE8M0 NaN encoding")
        scales = block_scale.to(weight_fp8.device).repeat_interleave(BLOCK, dim=0)[:n]
        return cls(weight_fp8, swizzle_scales(scales.contiguous()))

    @classmethod
    def grouped(cls, linears: list[Mxfp8Linear]) -> Mxfp8Linear:
        """One grouped linear of G same-shape linears (module docstring): input
        [..., G*K], output the concatenation of their outputs."""
        if not linears or any(lin.weight.shape != linears[0].weight.shape or
                              lin.groups != 1 for lin in linears):
            raise ValueError("linears must be a non-empty list of ungrouped Mxfp8Linear "
                             "of one shape")
        k, n = linears[0].weight.shape
        storage = torch.cat([lin.weight.t() for lin in linears])
        scales = torch.cat([unswizzle_scales(lin.weight_scale, n, k) for lin in linears])
        out = cls(storage, swizzle_scales(scales))
        out.groups = len(linears)
        out.in_features = len(linears) * k
        return out

    def group(self, g: int) -> Mxfp8Linear:
        """Group ``g`` of a grouped linear as a linear of its own (a copy)."""
        if not 0 <= g < self.groups:
            raise ValueError(f"group {g} outside [0, {self.groups})")
        k, n = self.weight.shape
        rows = n // self.groups
        storage = self.weight.t()[g * rows:(g + 1) * rows]
        scales = unswizzle_scales(self.weight_scale, n, k)[g * rows:(g + 1) * rows]
        return Mxfp8Linear(storage.clone(), swizzle_scales(scales.contiguous()))

    def quantized_weight(self) -> QuantizedActivation:
        """The weight as an MXFP8 record over [N, K] (no copy)."""
        w = self.weight.t()
        return QuantizedActivation(w, self.weight_scale, torch.float32, w.shape)

    def dequantized_weight(self) -> torch.Tensor:
        """W [N, K] in FP32 (exact: e4m3 times a power of two)."""
        return dequantize_mxfp8(self.quantized_weight(), torch.float32)

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        return mxfp8_mm(self, x)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"groups={self.groups}, bias=False")


def ue8m0_bytes(scale: torch.Tensor, name: str = "scale") -> torch.Tensor:
    """UE8M0 bytes of checkpoint scales: uint8 / ``float8_e8m0fnu`` as they are,
    floats (DeepSeek's ``weight_scale_inv``) as exponents of exact powers of two
    in [2^-127, 2^127]; anything else is a ValueError."""
    if scale.dtype == torch.uint8:
        return scale
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8)
    if not scale.is_floating_point():
        raise ValueError(f"{name} must be UE8M0 or float powers of two, got {scale.dtype}")
    mantissa, exponent = torch.frexp(scale.double())
    # frexp: scale = mantissa * 2^exponent, mantissa in [0.5, 1) for positive finite values.
    byte = exponent - 1 + 127
    ok = (mantissa == 0.5) & (byte >= 0) & (byte <= 254)
    if not bool(ok.all()):
        bad = scale.reshape(-1)[~ok.reshape(-1)][0].item()
        raise ValueError(
            f"{name} must hold powers of two in [2^-127, 2^127] to convert to UE8M0 "
            f"without loss, found {bad!r}"
        )
    return byte.to(torch.uint8)


def _tensor_files(path: Path, names: list[str]) -> dict[str, Path]:
    """Which file holds each of ``names`` (those found): ``path`` itself, or in a
    directory the index's ``weight_map``, or else every ``*.safetensors`` in it."""
    if path.is_file():
        files = [path]
    elif (path / INDEX_FILE).is_file():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        return {n: path / weight_map[n] for n in names if n in weight_map}
    elif path.is_dir():
        files = sorted(path.glob("*.safetensors"))
    else:
        raise ValueError(f"path_or_dir {str(path)!r} is neither a file nor a directory")
    found = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            keys = set(f.keys())
        found.update({n: file for n in names if n in keys and n not in found})
    return found


def _shard(part: slice | None, size: int, what: str) -> tuple[int, int]:
    """(start, stop) of a tensor-parallel shard along a dim of ``size``: whole
    [32, 32] blocks, so the shard's block scales are a slice of the checkpoint's."""
    if part is None:
        return 0, size
    start, stop, step = part.indices(size)
    if step != 1 or start >= stop or start % BLOCK or (stop % BLOCK and stop != size):
        raise ValueError(
            f"{what} must be a non-empty slice of [0, {size}) with step 1, starting at a "
            f"multiple of {BLOCK} and ending at one or at {size}; got {part}"
        )
    return start, stop


def load_linear(
    path_or_dir: str | os.PathLike,
    name: str,
    device: str | torch.device = "cpu",
    rows: slice | None = None,
    cols: slice | None = None,
) -> Mxfp8Linear:
    """Load ``<name>.weight`` (e4m3 [N, K]) and its [32, 32] block scale
    (``<name>.scale`` or ``<name>.weight_scale_inv``; UE8M0 or float powers of two)
    from a safetensors file or a (sharded) checkpoint directory.

    ``rows`` / ``cols`` select a tensor-parallel shard of N / K (whole 32-blocks);
    only the shard is read from disk.
    """
    path = Path(path_or_dir)
    weight_name = f"{name}.weight"
    scale_names = [name + suffix for suffix in SCALE_SUFFIXES]
    files = _tensor_files(path, [weight_name, *scale_names])
    if weight_name not in files:
        raise ValueError(f"no tensor {weight_name!r} in {str(path)!r}")
    scale_name = next((s for s in scale_names if s in files), None)
    if scale_name is None:
        raise ValueError(f"no block scale for {name!r} in {str(path)!r}: looked for {scale_names}")
    with safe_open(files[weight_name], framework="pt", device=str(device)) as f:
        weight_slice = f.get_slice(weight_name)
        shape = weight_slice.get_shape()
        if len(shape) != 2:
            raise ValueError(f"{weight_name} must be [N, K], got shape {shape}")
        r0, r1 = _shard(rows, shape[0], "rows")
        c0, c1 = _shard(cols, shape[1], "cols")
        weight = weight_slice[r0:r1, c0:c1]
    with safe_open(files[scale_name], framework="pt", device=str(device)) as f:
        scale_slice = f.get_slice(scale_name)
        want = [-(-shape[0] // BLOCK), -(-shape[1] // BLOCK)]
        if scale_slice.get_shape() != want:
            raise ValueError(
                f"{scale_name} must be {want} for a {shape} weight, got {scale_slice.get_shape()}"
            )
        scale = scale_slice[r0 // BLOCK : -(-r1 // BLOCK), c0 // BLOCK : -(-c1 // BLOCK)]
    return Mxfp8Linear.from_block_scaled(weight, ue8m0_bytes(scale, scale_name))
