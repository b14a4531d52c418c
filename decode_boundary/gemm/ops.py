"""The GEMM as PyTorch custom ops with fake implementations, so
``torch.compile(fullgraph=True)`` treats each call as one opaque op (the
Triton launch, its workspace and tactic choice stay eager inside it) and CUDA
graphs capture the compiled step (docs/DESIGN.md §10). ``api.mxfp8_mm`` routes
through ``decode_boundary::mxfp8_mm`` while tracing; eagerly it launches
directly (no dispatcher overhead), the same code either way."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from decode_boundary.mxfp8.format import QuantizedActivation


@torch.library.custom_op("decode_boundary::mxfp8_mm", mutates_args=())
def mxfp8_mm_op(x: torch.Tensor, x_scale: torch.Tensor | None, weight: torch.Tensor,
                weight_scale: torch.Tensor, groups: int = 1,
                batch_invariant: bool = False, backend: str = "auto") -> torch.Tensor:
    """BF16 [M, N] = ``x`` [M, G*K] @ ``weight`` (column-major [K, N] e4m3 view,
    swizzled ``weight_scale``; ``groups`` > 1: grouped). ``x`` is MXFP8 data with
    its swizzled ``x_scale``, or a float tensor with ``x_scale`` None.
    ``batch_invariant``, ``backend``: the mode and the GEMM backend
    (``dispatch``) as resolved when the step was traced."""
    from .api import mxfp8_mm

    layer = SimpleNamespace(weight=weight, weight_scale=weight_scale, bias=None, groups=groups)
    a = x if x_scale is None else QuantizedActivation(x, x_scale, torch.bfloat16, x.shape)
    return mxfp8_mm(layer, a, batch_invariant=batch_invariant,
                    backend=backend).to(torch.bfloat16)


@mxfp8_mm_op.register_fake
def _(x, x_scale, weight, weight_scale, groups=1, batch_invariant=False, backend="auto"):
    return x.new_empty((x.shape[0], weight.shape[1]), dtype=torch.bfloat16)
