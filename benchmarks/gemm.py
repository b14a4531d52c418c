"""MXFP8 GEMM benchmark on one GPU (docs/DESIGN.md §8-9).

For each shape (grouped ``wo_a``: its two groups in one launch) and M: our
kernel with its selected tactic on MXFP8 input and on BF16 input (quantized
in the prologue), the best of a small tactic sweep, cuBLAS BF16 (grouped: one
``torch.bmm``), cuBLAS FP8 row-wise (``torch._scaled_mm``, per-row /
per-column FP32 scales; grouped: one call per group) and the floor = MXFP8
weight bytes / the copy rate measured in this run, and (``--inductor-rows``)
Inductor's max-autotune BF16 GEMM; then the three projections
fused_wqa_wkv -> wq_b -> wo_b chained back to back with and without PDL, with
the chain's floor. Every time is the median per call over CUDA-graph replays
of many back-to-back calls on rotated weight copies (> L2).

    PYTHONPATH=. python benchmarks/gemm.py [--quick] [--check] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import sys
from pathlib import Path

import torch
import triton

from decode_boundary.bench.gemm import (
    random_layer,
    time_cublas_bf16,
    time_cublas_fp8_rowwise,
    time_inductor_bf16,
    time_ours,
)
from decode_boundary.bench.report import git_commit, write_json
from decode_boundary.common.timing import copy_rate, graph_time_us, rotated_copies
from decode_boundary.gemm import launch_low_latency, selected_tactic
from decode_boundary.gemm.reference import check_mxfp8_mm
from decode_boundary.gemm.tactics import sweep_tactics
from decode_boundary.mxfp8.format import quantize_mxfp8_ref

SHAPES = {  # name: (N, K, groups)
    "wo_b": (5120, 2048, 1),
    "wq_b": (8192, 1280, 1),
    "fused_wqa_wkv": (1792, 5120, 1),
    "wo_a": (2048, 4096, 2),  # DSV4.1-Flash TP 4: 2 local groups of 1024 x 4096
    "v4pro_wo_b": (7168, 4096, 1),
}
CHAIN = ("fused_wqa_wkv", "wq_b", "wo_b")
ROWS = (1, 2, 4, 8, 16, 32, 48, 64)
QUICK_ROWS = (1, 8, 32, 64)
SWEEP_ROWS = (8, 32)  # a sweep per row class keeps the run (compiles) under 4 minutes
SWEEP_MAX = 4


def time_chain(layers, rows: int) -> float:
    """µs per chain of the three projections back to back (rotated copies)."""
    copies = [rotated_copies(layer) for layer in layers]
    count = min(len(c) for c in copies)
    ins = [quantize_mxfp8_ref(torch.randn(rows, layer.weight.shape[0], device="cuda"))
           for layer in layers]  # MXFP8 in: the consumer hands fused_wqa_wkv MXFP8
    outs = [torch.empty(rows, layer.weight.shape[1], dtype=torch.bfloat16, device="cuda")
            for layer in layers]

    def chain(i):
        for j, layer in enumerate(layers):
            launch_low_latency(copies[j][i], ins[j], outs[j], selected_tactic(layer, rows))

    return graph_time_us([functools.partial(chain, i) for i in range(count)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer M, no sweep")
    parser.add_argument("--check", action="store_true", help="verify every tactic before timing")
    parser.add_argument("--inductor-rows", type=int, nargs="*", default=[1, 16, 32, 64],
                        help="M that also time Inductor's max-autotune BF16 GEMM (one autotuned "
                             "compile per shape and M: slow)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    torch.manual_seed(0)
    rate = copy_rate() / 1e9  # GB/s
    results = []
    for name, (n, k, groups) in SHAPES.items():
        layer = random_layer(n, k, groups, torch.device("cuda"))
        weight_bytes = n * k + layer.weight_scale.numel()
        bf16 = layer.dequantized_weight().bfloat16().view(groups, n // groups, k)
        for rows in QUICK_ROWS if args.quick else ROWS:
            x = torch.randn(rows, groups * k, device="cuda").bfloat16()
            qa = quantize_mxfp8_ref(x)
            xg = x.view(rows, groups, k).transpose(0, 1)  # [G, M, K] for the bmm
            selected = selected_tactic(layer, rows)
            tactics = [selected]
            if not args.quick and rows in SWEEP_ROWS:
                tactics += [t for t in sweep_tactics(n, k, rows, groups)
                            if t != selected][:SWEEP_MAX - 1]
            timed = []
            for tactic in tactics:
                if args.check:
                    out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                    check_mxfp8_mm(launch_low_latency(layer, qa, out, tactic), qa, layer.weight,
                                   layer.weight_scale, groups)
                timed.append((time_ours(layer, qa, tactic), tactic))
            best_us, best = min(timed)
            bf16_tactic = selected  # one tactic for both input kinds
            row = dict(shape=name, n=n, k=k, groups=groups, rows=rows, ours_us=timed[0][0],
                       ours_tactic=selected._asdict(), best_us=best_us, best_tactic=best._asdict(),
                       ours_bf16_in_us=time_ours(layer, x, bf16_tactic),
                       ours_bf16_in_tactic=bf16_tactic._asdict(),
                       cublas_bf16_us=time_cublas_bf16(xg, bf16),
                       inductor_bf16_us=(time_inductor_bf16(xg, bf16)
                                         if rows in args.inductor_rows else None),
                       cublas_fp8_rowwise_us=time_cublas_fp8_rowwise(layer, xg),
                       floor_us=weight_bytes / (rate * 1e3))
            results.append(row)
            print(f"{name:14s} M={rows:2d} ours {row['ours_us']:6.2f} (bf16 in "
                  f"{row['ours_bf16_in_us']:6.2f}) best {best_us:6.2f} "
                  f"bf16 {row['cublas_bf16_us']:6.2f} inductor {row['inductor_bf16_us'] or 0:6.2f} "
                  f"fp8 {row['cublas_fp8_rowwise_us'] or 0:6.2f} "
                  f"floor {row['floor_us']:5.2f} us", flush=True)
    chains = []
    chain_layers = [random_layer(*SHAPES[name], torch.device("cuda")) for name in CHAIN]
    chain_floor = sum(lay.weight.numel() + lay.weight_scale.numel()
                      for lay in chain_layers) / (rate * 1e3)
    for rows in (1, 8, 32):
        entry = {"rows": rows, "floor_us": chain_floor}
        for pdl in (True, False):
            os.environ["DECODE_BOUNDARY_DISABLE_PDL"] = "0" if pdl else "1"
            entry["pdl_us" if pdl else "no_pdl_us"] = time_chain(chain_layers, rows)
        chains.append(entry)
    os.environ.pop("DECODE_BOUNDARY_DISABLE_PDL")
    gpu = torch.cuda.get_device_name()
    commit = git_commit()
    report = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, commit=commit,
                  command=" ".join([sys.executable, *sys.argv]), copy_rate_gbs=rate,
                  gemm=results, chain=dict(projections=CHAIN, results=chains))
    stamp = datetime.datetime.now().strftime("%Y-%m-%d")
    path = os.path.join(args.out, f"gemm-{gpu.replace(' ', '_')}-{stamp}.json")
    write_json(report, Path(path))
    print(f"\ncopy rate {rate:.0f} GB/s; {path}")
    print(f"{'shape':14s} {'M':>3s} {'ours':>7s} {'bf16 in':>7s} {'/floor':>7s} "
          f"{'fp8/ours':>8s} {'bf16/ours':>9s}  best tactic")
    for r in results:
        fp8 = r["cublas_fp8_rowwise_us"]
        print(f"{r['shape']:14s} {r['rows']:3d} {r['ours_us']:7.2f} {r['ours_bf16_in_us']:7.2f} "
              f"{r['ours_us'] / r['floor_us']:7.2f} {(fp8 or 0) / r['ours_us']:8.2f} "
              f"{r['cublas_bf16_us'] / r['ours_us']:9.2f}  {tuple(r['best_tactic'].values())}")
    for c in chains:
        print(f"chain {'+'.join(CHAIN)} M={c['rows']}: PDL {c['pdl_us']:.2f} us "
              f"({c['pdl_us'] / c['floor_us']:.2f}x its {c['floor_us']:.2f} us floor), "
              f"no PDL {c['no_pdl_us']:.2f} us")


if __name__ == "__main__":
    main()
