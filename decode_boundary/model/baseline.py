"""What a user has today, for the benchmarks: cuBLAS FP8 row-wise GEMMs
(``torch._scaled_mm``), an NCCL all-reduce, and mHC / RMSNorm / MXFP8 as plain
torch ops.

Not bit-compatible with our path (row-wise FP8 is another quantization); it is a
speed baseline, checked only for being close to the reference.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from decode_boundary.boundary.reference import consumer_ref
from decode_boundary.mxfp8.format import E4M3_MAX

FP8_ROW_ALIGN = 16  # cuBLASLt FP8 needs every dimension a multiple of 16


def rowwise_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantization: (data [R, K], FP32 scale [R, 1])."""
    amax = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    scale = amax / E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


class RowwiseFp8Linear:
    """cuBLAS FP8 row-wise GEMM of an ``Mxfp8Linear``'s weight (re-quantized per
    output row from the dequantized MXFP8 weight)."""

    def __init__(self, linear) -> None:
        weight = linear.dequantized_weight()  # [N, K] FP32
        data, scale = rowwise_fp8(weight)
        self.weight_t = data.t()  # column-major [K, N], as _scaled_mm wants its B operand
        self.scale_t = scale.t().contiguous()  # [1, N]
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        padded = -(-rows // FP8_ROW_ALIGN) * FP8_ROW_ALIGN
        if padded != rows:
            x = torch.nn.functional.pad(x, (0, 0, 0, padded - rows))
        data, scale = rowwise_fp8(x)
        out = torch._scaled_mm(
            data, self.weight_t, scale_a=scale, scale_b=self.scale_t, out_dtype=torch.bfloat16
        )
        return out[:rows]


def all_reduce_then_mhc(partial, residual, post, comb, pre, norm_weight, eps, group, quantize):
    """NCCL all-reduce of the BF16 partial, then the consumer's math as torch ops.

    NCCL's BF16 sum order is its own, so ``reduced`` may differ from ours in the
    last bit; the rest follows design.md §5.
    """
    reduced = partial.clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(reduced, group=group)
    return consumer_ref([reduced], residual, post, comb, pre, norm_weight, eps, quantize=quantize)
