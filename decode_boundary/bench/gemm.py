"""GEMM timings: our MXFP8 GEMM and the cuBLAS baselines a user could pick,
each over its own rotated weight copies with the one timer
(``bench.timing``), and the table ``decode-boundary gemm`` prints.
``decode-boundary gemm`` times through these.

A shape is (name, N, K) or (name, N, K, groups): a grouped layer (``wo_a``) of
``groups`` [N/groups, K] weights in one launch of ours, one ``torch.bmm`` of
cuBLAS BF16, one FP8 call per group.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from decode_boundary.bench.timing import (
    copies_for_cold_l2,
    copy_rate,
    graph_time_us,
    rotated_copies,
)
from decode_boundary.env import logger
from decode_boundary.gemm import dispatch, launch_low_latency, mxfp8_mm
from decode_boundary.gemm.linear import Mxfp8Linear
from decode_boundary.gemm.tactics import Tactic
from decode_boundary.mxfp8.format import QuantizedActivation, mxfp8_scale_bytes
from decode_boundary.mxfp8.quantize_kernel import quantize_mxfp8

from .baselines import FP8_ROW_ALIGN, RowwiseFp8Linear, rowwise_fp8


def mxfp8_weight_bytes(n: int, k: int) -> int:
    """Bytes a GEMM must read for an MXFP8 [N, K] weight: elements + swizzled scales."""
    return n * k + mxfp8_scale_bytes(n, k)


def time_ours(layer, a: torch.Tensor | QuantizedActivation, tactic: Tactic | None = None,
              copies: list | None = None, backend: str | None = None) -> float:
    """µs per call of our GEMM on ``a`` (BF16, or MXFP8): ``mxfp8_mm`` (its own
    tactic choice, on ``backend``: ``gemm.dispatch``) or, with ``tactic``, that
    tactic's launch of the Triton kernel."""
    copies = copies or rotated_copies(layer)
    if tactic is None:
        return graph_time_us([functools.partial(mxfp8_mm, c, a, backend=backend)
                              for c in copies])
    rows = a.shape[0] if isinstance(a, torch.Tensor) else a.rows
    out = torch.empty(rows, layer.weight.shape[1], dtype=torch.bfloat16,
                      device=layer.weight.device)
    return graph_time_us([functools.partial(launch_low_latency, c, a, out, tactic)
                          for c in copies])


def time_cublas_bf16(x_groups: torch.Tensor, weight: torch.Tensor) -> float:
    """µs per ``torch.bmm`` of ``x_groups`` [G, M, K] with BF16 ``weight``
    [G, N/G, K] (one group: a plain GEMM), over rotated copies of the weight."""
    count = copies_for_cold_l2(weight.numel() * weight.element_size(), weight.device)
    weights = [weight.clone() for _ in range(count)]
    return graph_time_us([functools.partial(torch.bmm, x_groups, w.transpose(1, 2))
                          for w in weights])


def time_inductor_bf16(x_groups: torch.Tensor, weight: torch.Tensor) -> float:
    """µs per ``x @ w.t()`` (grouped: ``torch.bmm``) compiled by Inductor with
    ``mode="max-autotune-no-cudagraphs"`` for this M (autotuned once, before
    timing): the GEMM a ``torch.compile`` user gets, over rotated weight copies."""
    count = copies_for_cold_l2(weight.numel() * weight.element_size(), weight.device)
    weights = [weight.clone() for _ in range(count)]
    mm = torch.compile(_bmm_t, mode="max-autotune-no-cudagraphs", dynamic=False,
                       fullgraph=True)
    # Every (shape, M) of a table is one more compile of the same function, which
    # Dynamo counts as a recompile: past its default limit (8) the fullgraph call
    # fails (a table's ninth did). Each is a graph of its own.
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        return graph_time_us([functools.partial(mm, x_groups, w) for w in weights])


# Shapes x row counts one process may time (the default table's 7 shapes x 8 rows).
RECOMPILE_LIMIT = 256


def _bmm_t(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.bmm(x, w.transpose(1, 2))


def time_cublas_fp8_rowwise(layer, x_groups: torch.Tensor) -> float | None:
    """µs per cuBLAS FP8 row-wise product (``torch._scaled_mm``, per-row /
    per-column FP32 scales, rows padded to 16; one call per group) of
    ``x_groups`` [G, M, K] with ``layer``'s re-quantized weight; None where
    cuBLASLt refuses the shape."""
    groups = getattr(layer, "groups", 1)
    rows = x_groups.shape[1]
    x8, s8 = zip(*[rowwise_fp8(torch.nn.functional.pad(x_groups[g],
                                                       (0, 0, 0, -rows % FP8_ROW_ALIGN)))
                   for g in range(groups)], strict=True)
    per_copy = layer.weight.numel()
    count = copies_for_cold_l2(per_copy, layer.weight.device)
    fp8 = [[RowwiseFp8Linear(layer.group(g)) for g in range(groups)]
           for _ in range(count)]

    def call(linears):
        for g, lin in enumerate(linears):
            torch._scaled_mm(x8[g], lin.weight_t, scale_a=s8[g], scale_b=lin.scale_t,
                             out_dtype=torch.bfloat16)

    try:
        return graph_time_us([functools.partial(call, linears) for linears in fp8])
    except RuntimeError as err:
        logger.warning("cuBLAS FP8 row-wise unavailable for %s x %s, M = %d: %s",
                       layer.weight.shape[1], layer.weight.shape[0], rows, err)
        return None


def random_layer(n: int, k: int, groups: int, device: torch.device) -> Mxfp8Linear:
    """A (grouped) MXFP8 layer of random weights, [N, K] in all."""
    return Mxfp8Linear.grouped([
        Mxfp8Linear.from_float(torch.randn(n // groups, k, device=device).mul_(0.02).bfloat16())
        for _ in range(groups)])


def cancelling(n: int, k: int, rows: int, groups: int = 1, device: torch.device | str = "cpu",
               generator: torch.Generator | None = None) -> tuple[Mxfp8Linear, torch.Tensor]:
    """A (grouped) MXFP8 layer [N, K] in all and BF16 rows [rows, groups * K]
    whose products cancel: in each group, K-group 0 and the one half K later
    carry the same large values with opposite weights, so the FP32 sum's bits
    depend on where the large terms meet the small ones. MXFP8 products of
    ordinary data have so few bits that their FP32 sums are often exact, and
    then every summation order gives the same bits: a check of a row's bits
    against another order needs data like this to be able to fail."""
    if k < 64 or k % 64:
        raise ValueError(f"k must be a positive multiple of 64, got {k}")
    half = k // 2
    linears, columns = [], []
    for _ in range(groups):
        w = torch.randn(n // groups, k, generator=generator, device=device)
        w[:, half:half + 32] = -w[:, :32]
        x = torch.randn(rows, k, generator=generator, device=device)
        x[:, :32] = x[:, half:half + 32] = \
            torch.randn(rows, 32, generator=generator, device=device) * 2.0 ** 14
        linears.append(Mxfp8Linear.from_float(w.bfloat16()))
        columns.append(x)
    return Mxfp8Linear.grouped(linears), torch.cat(columns, dim=1).bfloat16()


# Row counts that also time Inductor's max-autotune BF16 GEMM (one autotuned compile
# per shape and M: slow), the rows where the GEMM targets compare with it.
INDUCTOR_ROWS = (1, 16, 32, 64)


def gemm_table(shapes: Sequence[tuple], rows: Sequence[int], device: torch.device,
               stage=lambda label: None) -> dict:
    """Per (shape, rows): our MXFP8 GEMM on MXFP8 input (``ours``: what
    ``mxfp8_mm`` selects; ``cute``: the CuTe DSL kernel forced, where it can run
    on ``device``, else None), cuBLAS BF16, Inductor BF16 (at ``INDUCTOR_ROWS``,
    else None) and cuBLAS FP8 row-wise (GEMM only: activations quantized
    beforehand), in µs, and the floor; with the CuTe kernel, each of its
    variants' compile seconds (``cute_compile_seconds``). Returns
    ``{"copy_rate_gbps", "gemms": [{"name", "n", "k", "groups", "rows",
    "floor_us", "us"}]}``. ``stage(label)``: called as each (shape, M) begins
    (``report.progress``)."""
    rate = copy_rate(device)
    entries = []
    cute = dispatch.cute_refusal(torch.device(device)) is None
    for name, n, k, *rest in shapes:
        groups = rest[0] if rest else 1
        layer = random_layer(n, k, groups, device)
        ours = rotated_copies(layer)
        bf16 = layer.dequantized_weight().bfloat16().view(groups, n // groups, k)
        for m in rows:
            stage(f"timing {name} at M = {m}"
                  + (" (Inductor autotunes its BF16 GEMM)" if m in INDUCTOR_ROWS else ""))
            x = torch.randn(m, groups * k, device=device).bfloat16()
            xg = x.view(m, groups, k).transpose(0, 1)  # [G, M, K] for the bmm
            qa = quantize_mxfp8(x)
            us = {"ours": time_ours(layer, qa, copies=ours),
                  "cute": time_ours(layer, qa, copies=ours, backend="cute") if cute else None,
                  "cublas_bf16": time_cublas_bf16(xg, bf16),
                  "inductor_bf16": (time_inductor_bf16(xg, bf16) if m in INDUCTOR_ROWS
                                    else None),
                  "cublas_fp8_rowwise": time_cublas_fp8_rowwise(layer, xg)}
            entries.append({"name": name, "n": n, "k": k, "groups": groups, "rows": m,
                            "floor_us": mxfp8_weight_bytes(n, k) / rate * 1e6, "us": us})
    result = {"copy_rate_gbps": rate / 1e9, "gemms": entries}
    if cute:  # one compile per (shape, tactic), every M: what each cost this process
        from decode_boundary.gemm.hopper import launcher as cute_launcher

        result["cute_compile_seconds"] = {
            f"{n}x{k}x{g} {tuple(t)}": round(seconds, 3)
            for (n, k, g, t, _), seconds in cute_launcher.COMPILE_SECONDS.items()}
    return result
