"""Reference MXFP8 GEMM and the numerics bar every kernel of this package meets.

``out[m, n] = bf16(sum_g scale_a[m, g] * scale_w[n, g] * sum_{k in g} a[m, k] * w[n, k])``
with FP32 accumulation: the spec the kernels implement. Within one 32-wide group
the products of two e4m3 values (4 significant bits each) are exact in FP32, so
the reference's only roundings are the FP32 sums and the final BF16 cast.

The bar (docs/DESIGN.md §7): every element within one BF16 ulp of the FP64
product of the dequantized operands plus ``1e-5 * sum_k |a_k * w_k|`` (room for
FP32 accumulation in any order).

Grouped layers (``groups`` G > 1, ``wo_a``): the weight [N, K] is the row-stack
of G weights [N/G, K]; the activation [M, G*K] holds group g in columns
[g*K, (g+1)*K); the output is the concatenation of the G products.
"""

from __future__ import annotations

import torch

from decode_boundary.mxfp8.format import (
    GROUP,
    QuantizedActivation,
    dequantize_mxfp8,
    exp2_int,
    unswizzle_scales,
)

REL_SUM_TOLERANCE = 1e-5  # x sum_k |a_k w_k|: FP32 accumulation error over K <= ~16k


def dequantize_weight(weight: torch.Tensor, weight_scale: torch.Tensor, dtype=torch.float64):
    """[N, K] values of a column-major [K, N] e4m3 ``weight`` view with its
    swizzled (N, K/32) ``weight_scale``, exact in FP32/FP64."""
    k, n = weight.shape
    storage = weight.t()
    qw = QuantizedActivation(storage.contiguous(), weight_scale, torch.float32, torch.Size((n, k)))
    return dequantize_mxfp8(qw, dtype)


def _by_group(t: torch.Tensor, rows: int, groups: int) -> torch.Tensor:
    """Activation-side [rows, G*X] -> [rows, G, 1, X] for a grouped einsum."""
    return t.reshape(rows, groups, 1, -1)


def mxfp8_mm_ref(a: QuantizedActivation, weight: torch.Tensor, weight_scale: torch.Tensor,
                 groups: int = 1):
    """BF16 ``a @ weight`` [*a.orig_shape[:-1], N] by the spec above (FP32 sums)."""
    rows, width = a.data.shape
    k, n = weight.shape
    if width != groups * k:
        raise ValueError(f"activation has K = {width}, weight takes {groups} x {k}")
    kg = k // GROUP
    av = a.data.float().view(rows, groups, kg, GROUP)
    wv = weight.t().float().reshape(groups, n // groups, kg, GROUP)
    # Exact products, FP32 sums of each 32-group.
    group_sums = torch.einsum("mgck,gnck->mgnc", av, wv).reshape(rows, n, kg)
    sa = exp2_int(unswizzle_scales(a.scale, rows, width).to(torch.int32))  # [M, G*kg] FP64
    sa = _by_group(sa, rows, groups).expand(rows, groups, n // groups, kg).reshape(rows, n, kg)
    sw = exp2_int(unswizzle_scales(weight_scale, n, k).to(torch.int32))  # [N, kg]
    # The scale product is a power of two: exact in FP64, then one FP32 rounding
    # only where it leaves FP32's range (extreme exponents).
    scaled = (group_sums.double() * sa * sw[None, :, :]).float()
    out = scaled.sum(dim=-1, dtype=torch.float32).to(torch.bfloat16)
    return out.view(*a.orig_shape[:-1], n)


def mxfp8_mm_exact(a: QuantizedActivation, weight: torch.Tensor, weight_scale: torch.Tensor,
                   groups: int = 1):
    """(FP64 product [rows, N], FP64 sum_k |a_k w_k| [rows, N]) of the dequantized operands."""
    rows, width = a.data.shape
    av = dequantize_mxfp8(a, torch.float64).reshape(rows, groups, width // groups)
    wv = dequantize_weight(weight, weight_scale)
    wv = wv.reshape(groups, -1, width // groups)  # [G, N/G, K]
    exact = torch.einsum("mgk,gnk->mgn", av, wv).reshape(rows, -1)
    abs_sum = torch.einsum("mgk,gnk->mgn", av.abs(), wv.abs()).reshape(rows, -1)
    return exact, abs_sum


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """BF16 ulp at FP64 values ``x`` (7 stored mantissa bits; the subnormal ulp below 2^-126)."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0**-126)))
    return torch.exp2(exponent - 7)


def check_mxfp8_mm(out: torch.Tensor, a: QuantizedActivation, weight, weight_scale,
                   groups: int = 1) -> None:
    """Raise AssertionError naming the worst element if ``out`` misses the bar."""
    exact, abs_sum = mxfp8_mm_exact(a, weight, weight_scale, groups)
    got = out.reshape(exact.shape).double().cpu()
    exact, abs_sum = exact.cpu(), abs_sum.cpu()
    bound = bf16_ulp(exact) + REL_SUM_TOLERANCE * abs_sum
    excess = (got - exact).abs() - bound
    if not bool((excess <= 0).all()):
        m, n = divmod(int(excess.argmax()), exact.shape[1])
        raise AssertionError(
            f"MXFP8 GEMM out[{m}, {n}] = {got[m, n].item()!r}, FP64 {exact[m, n].item()!r}, "
            f"bound {bound[m, n].item():.3g}; {int((excess > 0).sum())} elements out of bound"
        )
