"""Pure-torch references of the boundary consumer and the MoE finalize
(docs/DESIGN.md §5), and of the consumer with the next mixes (the mixes' own:
``decode_boundary.mixes.reference``, §5.1).

These fix the rounding points *and* the FP32 operation order the Triton kernels
follow, so the kernels can be compared bit for bit where the spec promises bits.
No fused multiply-add anywhere: every product is rounded to FP32 before it is
added (the kernels are compiled with ``enable_fp_fusion=False`` for this).

Consumer, per token m and column c (all arithmetic FP32 unless said otherwise):

1. ``acc = +0; acc += x_r`` for r = 0..tp-1; ``reduced = bf16(acc)``.
   Starting from +0 makes a partial's -0 irrelevant, which is what the mailbox
   needs (publishers turn -0, the "not yet written" sentinel, into +0).
2. for each target t: ``acc = reduced * post[t]``; then ``acc += residual[s] * comb[s, t]``
   for s = 0..hc-1; ``residual_out[t] = bf16(acc)``.
3. unless residual-only: ``acc = +0; acc += float(mixed_t) * pre[t]`` for t = 0..hc-1;
   ``prenorm = bf16(acc)``; ``ms = sum_c(prenorm^2) / H``; ``r = rsqrt(ms + eps)``;
   ``layer_input = bf16((prenorm * r) * gamma)``.
   The length-H sum and the rsqrt are the only steps whose order/rounding a kernel
   cannot reproduce exactly (tree reduction, approximate rsqrt on the GPU): a
   kernel's ``layer_input`` may differ by 1 BF16 ulp there.
4. optionally MXFP8 of ``layer_input`` (:func:`quantize_mxfp8_ref`).
"""

from __future__ import annotations

import torch

from ..mixes.reference import mhc_mixes_ref
from ..mxfp8.format import QuantizedActivation, quantize_mxfp8_ref


def reduce_ref(partials: list[torch.Tensor]) -> torch.Tensor:
    """``bf16(+0 + x_0 + x_1 + ...)`` in FP32, rank order (docs/DESIGN.md §5 step 1)."""
    if not partials:
        raise ValueError("partials must hold one [M, H] tensor per rank, got none")
    acc = torch.zeros(partials[0].shape, dtype=torch.float32, device=partials[0].device)
    for x in partials:
        acc = acc + x.float()
    return acc.to(torch.bfloat16)


def _check_consumer_inputs(partials, residual, post, comb, pre, norm_weight):
    m, h = partials[0].shape
    for r, x in enumerate(partials):
        if x.dtype != torch.bfloat16 or tuple(x.shape) != (m, h):
            raise ValueError(f"partials[{r}] must be bf16 [{m}, {h}], got {x.dtype} "
                             f"{tuple(x.shape)}")
    if residual.dtype != torch.bfloat16 or residual.ndim != 3 or residual.shape[::2] != (m, h):
        raise ValueError(f"residual must be bf16 [{m}, hc, {h}], got {residual.dtype} "
                         f"{tuple(residual.shape)}")
    hc = residual.shape[1]
    if post.dtype != torch.float32 or tuple(post.shape) != (m, hc):
        raise ValueError(f"post must be float32 [{m}, {hc}], got {post.dtype} {tuple(post.shape)}")
    if comb.dtype != torch.float32 or tuple(comb.shape) != (m, hc, hc):
        raise ValueError(f"comb must be float32 [{m}, {hc}, {hc}], got {comb.dtype} "
                         f"{tuple(comb.shape)}")
    if pre is not None:
        if pre.dtype != torch.float32 or tuple(pre.shape) != (m, hc):
            raise ValueError(f"pre must be float32 [{m}, {hc}], got {pre.dtype} {tuple(pre.shape)}")
        if (norm_weight is None or norm_weight.dtype != torch.bfloat16
                or tuple(norm_weight.shape) != (h,)):
            raise ValueError(f"norm_weight must be bf16 [{h}] when pre is given")


def consumer_ref(
    partials: list[torch.Tensor],
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    pre: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    eps: float,
    quantize: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, QuantizedActivation | None]:
    """The consumer of docs/DESIGN.md §5 in the module docstring's operation order.

    Shapes: partials tp x [M, H] bf16, residual [M, hc, H] bf16, post [M, hc]
    f32, comb [M, hc, hc] f32 indexed [source, target], pre [M, hc] f32 or None
    (residual-only), norm_weight [H] bf16. Returns (residual_out [M, hc, H]
    bf16, layer_input [M, H] bf16 or None, its MXFP8 or None).
    """
    if not partials:
        raise ValueError("partials must hold one [M, H] tensor per rank, got none")
    _check_consumer_inputs(partials, residual, post, comb, pre, norm_weight)
    if quantize and pre is None:
        raise ValueError("quantize needs the layer input, i.e. pre and norm_weight")
    reduced = reduce_ref(partials).float()
    hc = residual.shape[1]
    res = residual.float()
    mixed = []
    for t in range(hc):
        acc = reduced * post[:, t, None]
        for s in range(hc):
            acc = acc + res[:, s] * comb[:, s, t, None]
        mixed.append(acc.to(torch.bfloat16))
    residual_out = torch.stack(mixed, dim=1)
    if pre is None:
        return residual_out, None, None
    return residual_out, *collapse_norm_ref(residual_out, pre, norm_weight, eps, quantize)


def collapse_norm_ref(residual_out: torch.Tensor, pre: torch.Tensor, norm_weight: torch.Tensor,
                      eps: float, quantize: bool = False
                      ) -> tuple[torch.Tensor, QuantizedActivation | None]:
    """Steps 3-4 of the module docstring from ``residual_out`` [M, hc, H] bf16:
    (layer_input [M, H] bf16, its MXFP8 or None). With a pre computed from
    ``residual_out`` itself this is V4's collapse (docs/DESIGN.md §5.1)."""
    acc = torch.zeros(residual_out[:, 0].shape, dtype=torch.float32, device=residual_out.device)
    for t in range(residual_out.shape[1]):
        acc = acc + residual_out[:, t].float() * pre[:, t, None]
    prenorm = acc.to(torch.bfloat16).float()
    h = prenorm.shape[-1]
    mean_sq = (prenorm * prenorm).sum(dim=-1, keepdim=True) / h
    rstd = torch.rsqrt(mean_sq + eps)
    layer_input = ((prenorm * rstd) * norm_weight.float()).to(torch.bfloat16)
    return layer_input, quantize_mxfp8_ref(layer_input) if quantize else None


def moe_finalize_ref(
    gemm2_permuted: torch.Tensor,
    expert_weights: torch.Tensor,
    expanded_idx_to_permuted_idx: torch.Tensor,
    shared_output: torch.Tensor,
) -> torch.Tensor:
    """This rank's MoE partial: ``bf16(+0 + sum_k w[m, k] * g[idx[m, k]] + shared[m])``.

    FP32, k in order 0..top_k-1, each product rounded before it is added; an
    index of -1 means the expert lives on another rank and contributes nothing.
    ``gemm2_permuted`` [P, H] bf16, ``expert_weights`` [M, top_k] f32 or bf16,
    ``expanded_idx_to_permuted_idx`` [M, top_k] int32/int64, ``shared_output``
    [M, H] bf16.
    """
    m, top_k = expert_weights.shape
    idx = expanded_idx_to_permuted_idx
    if tuple(idx.shape) != (m, top_k):
        raise ValueError(f"expanded_idx_to_permuted_idx must be [{m}, {top_k}], got "
                         f"{tuple(idx.shape)}")
    if idx.numel() and int(idx.max()) >= gemm2_permuted.shape[0]:
        raise ValueError("expanded_idx_to_permuted_idx points past gemm2_permuted")
    acc = torch.zeros(m, gemm2_permuted.shape[1], dtype=torch.float32, device=shared_output.device)
    weights = expert_weights.float()
    for k in range(top_k):
        present = idx[:, k] >= 0
        rows = gemm2_permuted[idx[:, k].clamp(min=0).long()].float()
        acc = torch.where(present[:, None], acc + weights[:, k, None] * rows, acc)
    acc = acc + shared_output.float()
    return acc.to(torch.bfloat16)


def consumer_mixes_ref(
    partials: list[torch.Tensor],
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    pre: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    mix_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    hc_eps: float,
    sinkhorn_iters: int,
    quantize: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, QuantizedActivation | None, tuple]:
    """The consumer with the next sublayer's mixes (docs/DESIGN.md §5.1):
    residual_out as :func:`consumer_ref`, its mixes (:func:`mhc_mixes_ref`,
    ``eps`` as their RMS eps), then the collapse and norm with ``pre`` (V4.1)
    or, ``pre=None``, with the new pre (V4). Returns (residual_out,
    layer_input, its MXFP8 or None, (pre, post, comb))."""
    residual_out, _, _ = consumer_ref(partials, residual, post, comb, None, None, eps)
    mixes = mhc_mixes_ref(residual_out, *mix_weights, eps, hc_eps, sinkhorn_iters)
    layer_input, quantized = collapse_norm_ref(residual_out, mixes[0] if pre is None else pre,
                                               norm_weight, eps, quantize)
    return residual_out, layer_input, quantized, mixes
