# ruff: noqa: B023  (closures are called inside the loop iteration that defines them)
"""Kernel-structure experiment for the low-row MXFP8 GEMM (one H200).

Times, on the wo_b and fused_wqa_wkv shapes, the shipped kernel's best
tactics against a "group-dot" structure: one BF16 ``tl.dot`` per 32-wide K
group on the *unscaled* e4m3 weight (an exact upcast), the two power-of-two
scales applied to the FP32 group result, loads software-pipelined by Triton
(``num_stages``) instead of register double-buffering. Also a read-only
kernel over the same weight bytes (what streaming alone costs in this
structure). Each variant is checked against the FP64 bar before it is timed.

    PYTHONPATH=. python benchmarks/gemm_variants.py
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from decode_boundary.gemm import launch_low_latency
from decode_boundary.gemm.reference import check_mxfp8_mm
from decode_boundary.gemm.tactics import Tactic
from decode_boundary.gemm.timing import graph_time_us, rotated_copies
from decode_boundary.mxfp8.format import quantize_mxfp8_ref, unswizzle_scales
from decode_boundary.mxfp8.quantize_kernel import swizzled_offset


@triton.jit
def group_dot_kernel(w_ptr, ws_ptr, a_ptr, as_ptr, out_ptr, part_ptr, cnt_ptr, M,
                     N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, ROWS: tl.constexpr,
                     SPLIT: tl.constexpr, GPI: tl.constexpr, STAGES: tl.constexpr):
    G: tl.constexpr = K // 32
    K_TILES: tl.constexpr = (G + 3) // 4
    PER: tl.constexpr = G // SPLIT
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * BN + tl.arange(0, BN)
    rows = tl.arange(0, ROWS)
    rmask = rows < M
    e = tl.arange(0, 32)
    acc = tl.zeros((BN, ROWS), dtype=tl.float32)
    g0 = pid_k * PER
    for it in tl.range(0, PER // GPI, num_stages=STAGES):
        for j in tl.static_range(GPI):
            g = g0 + it * GPI + j
            w = tl.load(w_ptr + cols[:, None].to(tl.int64) * K + g * 32 + e[None, :])
            ws = tl.load(ws_ptr + cols * G + g)
            a = tl.load(a_ptr + rows[None, :] * K + g * 32 + e[:, None], mask=rmask[None, :],
                        other=0.0)
            sa = tl.load(as_ptr + swizzled_offset(rows, g, K_TILES), mask=rmask, other=0)
            d = tl.dot(w.to(tl.bfloat16), a.to(tl.bfloat16))
            fw = (ws.to(tl.int32) << 23).to(tl.float32, bitcast=True)
            fa = (sa.to(tl.int32) << 23).to(tl.float32, bitcast=True)
            acc += (d * fw[:, None]) * fa[None, :]
    out_off = rows[None, :] * N + cols[:, None]
    if SPLIT == 1:
        tl.store(out_ptr + out_off, acc.to(tl.bfloat16), mask=rmask[None, :])
    else:
        tile = tl.arange(0, ROWS)[None, :] * BN + tl.arange(0, BN)[:, None]
        parts = part_ptr + (pid_n * SPLIT).to(tl.int64) * (ROWS * BN)
        tl.store(parts + pid_k * (ROWS * BN) + tile, acc)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            tl.debug_barrier()
            total = tl.load(parts + tile, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT):
                total += tl.load(parts + s * (ROWS * BN) + tile, cache_modifier=".cg")
            tl.store(cnt_ptr + pid_n, 0)
            tl.store(out_ptr + out_off, total.to(tl.bfloat16), mask=rmask[None, :])


@triton.jit
def read_kernel(w_ptr, out_ptr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                SPLIT: tl.constexpr, STAGES: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * BN + tl.arange(0, BN)
    PER: tl.constexpr = K // BK // SPLIT
    acc = tl.zeros((BN, BK), dtype=tl.int32)
    for it in tl.range(0, PER, num_stages=STAGES):
        kb = pid_k * PER + it
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * K + kb * BK + tl.arange(0, BK)[None, :])
        acc ^= w.to(tl.int8, bitcast=True).to(tl.int32)
    tl.store(out_ptr + pid_n * 0 + pid_k, tl.sum(tl.sum(acc, 1), 0))


def main() -> None:
    torch.manual_seed(0)
    shapes = {"wo_b": (5120, 2048), "fused_wqa_wkv": (1792, 5120), "wq_b": (8192, 1280)}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda") * 0.02
        qw = quantize_mxfp8_ref(w)
        layer = type("L", (), {})()
        layer.weight, layer.weight_scale, layer.bias = qw.data.t(), qw.scale, None
        copies = rotated_copies(layer)
        for c in copies:  # the group kernel reads a row-major [N, K/32] copy of the scales
            c.ws_rows = unswizzle_scales(c.weight_scale, n, k).contiguous()
        floor_bytes = n * k * (1 + 1 / 32)
        best_read = min(
            graph_time_us(lambda i, bn=bn, bk=bk, s=s, st=st: read_kernel[(n // bn, s)](
                copies[i].weight.t(), sink, K=k, BN=bn, BK=bk, SPLIT=s, STAGES=st,
                num_warps=4), len(copies))
            for sink in [torch.zeros(64, dtype=torch.int32, device="cuda")]
            for bn, bk, s, st in [(64, 128, 4, 3), (128, 128, 2, 3), (64, 256, 2, 3)]
            if (k // bk) % s == 0
        )
        print(f"{name} N={n} K={k}: read-only {best_read:.2f} us "
              f"({floor_bytes / best_read / 1e3:.0f} GB/s)")
        for rows in (1, 8, 16):
            x = torch.randn(rows, k, device="cuda")
            qa = quantize_mxfp8_ref(x)
            out = torch.empty(rows, n, dtype=torch.bfloat16, device="cuda")
            results = []
            for tactic in [Tactic(64, 128, 16, 16, 4, True), Tactic(64, 256, 16, 8, 4, True),
                           Tactic(128, 128, 16, 8, 8, True)]:
                try:
                    launch_low_latency(layer, qa, out, tactic)
                    check_mxfp8_mm(out, qa, layer.weight, layer.weight_scale)
                    t = graph_time_us(lambda i, tc=tactic: launch_low_latency(copies[i], qa, out,
                                                                              tc), len(copies))
                    results.append((t, f"shipped {tuple(tactic)}"))
                except Exception as exc:  # noqa: BLE001
                    print("  shipped", tuple(tactic), "failed:", repr(exc)[:200])
            g = k // 32
            part = torch.empty(1 << 24, dtype=torch.float32, device="cuda")
            cnt = torch.zeros(4096, dtype=torch.int32, device="cuda")
            for bn, split, gpi, stages, warps in itertools.product(
                    (64, 128), (1, 2, 4, 8), (1, 2, 4), (3, 5), (4,)):
                if g % (split * gpi) or (n // bn) * split < 60 or (n // bn) * split > 700:
                    continue
                rt = 16

                def call(i, bn=bn, split=split, gpi=gpi, stages=stages, warps=warps):
                    c = copies[i]
                    group_dot_kernel[(n // bn, split)](
                        c.weight.t(), c.ws_rows, qa.data, qa.scale, out, part, cnt, rows,
                        N=n, K=k, BN=bn, ROWS=rt, SPLIT=split, GPI=gpi, STAGES=stages,
                        num_warps=warps)
                try:
                    out.fill_(float("nan"))
                    call(0)
                    torch.cuda.synchronize()
                    check_mxfp8_mm(out, qa, copies[0].weight, copies[0].weight_scale)
                    results.append((graph_time_us(call, len(copies)),
                                    f"group bn={bn} split={split} gpi={gpi} st={stages}"))
                except Exception as exc:  # noqa: BLE001
                    print("  group", bn, split, gpi, stages, "failed:", repr(exc)[:300])
            results.sort()
            print(f"  M={rows}: " + "; ".join(f"{t:.2f} {d}" for t, d in results[:6]))


if __name__ == "__main__":
    main()
