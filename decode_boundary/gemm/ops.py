"""``torch.ops.decode_boundary.mxfp8_mm``: the public GEMM as a PyTorch custom
op with a fake implementation, so ``torch.compile`` treats it as one opaque
op and CUDA graphs capture it (design.md §10)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from decode_boundary.mxfp8.format import QuantizedActivation


@torch.library.custom_op("decode_boundary::mxfp8_mm", mutates_args=())
def mxfp8_mm_op(a_data: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor,
                weight_scale: torch.Tensor) -> torch.Tensor:
    """BF16 [M, N] = MXFP8 ``a_data`` [M, K] (swizzled ``a_scale``) @ ``weight``
    (column-major [K, N] e4m3 view, swizzled ``weight_scale``)."""
    from .api import mxfp8_mm

    layer = SimpleNamespace(weight=weight, weight_scale=weight_scale, bias=None)
    qa = QuantizedActivation(a_data, a_scale, torch.bfloat16, a_data.shape)
    return mxfp8_mm(layer, qa)


@mxfp8_mm_op.register_fake
def _(a_data, a_scale, weight, weight_scale):
    return a_data.new_empty((a_data.shape[0], weight.shape[1]), dtype=torch.bfloat16)
