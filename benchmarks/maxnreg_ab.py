# ruff: noqa: B023  (closures are called inside the loop iteration that defines them)
"""Does a register cap buy mid-M GEMMs a resident program per SM? (one GPU)

sm_90 compiles of the table's 48-64-row tactics (benchmarks/NOTES.md attempt 16)
put grouped wo_a and V4-Pro wo_b at 175 registers per thread: two programs of
128 threads per SM, where 168 would allow three (V4-Pro wo_b at 64 rows: 896
programs in 3.39 waves instead of 2.26). This script times each table tactic
as compiled and compiled with Triton's ``maxnreg`` option (``--caps``), A B A B
in one process (cold L2: rotated weight copies, CUDA graph, medians), prints the
registers / spills ptxas reported for each, checks the capped output equals the
uncapped one bit for bit, and times cuBLAS BF16 beside them. Writes JSON.

    PYTHONPATH=. python benchmarks/maxnreg_ab.py [--rows 32 48 64] [--caps 168]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from gemm_sweep import SHAPES as GEMM_SWEEP_SHAPES

import decode_boundary.gemm.launcher as launcher
from decode_boundary.bench.gemm import random_layer, time_cublas_bf16, time_ours
from decode_boundary.bench.report import environment, git_commit, new_result, write_json
from decode_boundary.common.timing import rotated_copies
from decode_boundary.gemm.mxfp8_gemm_kernel import mxfp8_gemm_kernel
from decode_boundary.gemm.tactics import table_tactic
from decode_boundary.mxfp8.quantize_kernel import quantize_mxfp8

# The sweep's shapes, V4-Flash wo_b aside (benchmarks/ is the script's directory, on sys.path).
SHAPES = {name: shape for name, shape in GEMM_SWEEP_SHAPES.items() if name != "v4flash_wo_b"}

_config = launcher._launch_config
_cap: list[int | None] = [None]


def _capped_config(*args, **kwargs):
    grid, pos, kw = _config(*args, **kwargs)
    kw = {key: value for key, value in kw.items() if key != "maxnreg"}  # the launcher's own cap
    if _cap[0] is not None:
        kw = dict(kw, maxnreg=_cap[0])
    return grid, pos, kw


def _compiled(layer, a, tactic, cap):
    """(registers, spills, output) of one direct launch under ``cap``."""
    _cap[0] = cap
    out = torch.full((a.rows, layer.weight.shape[1]), float("nan"), dtype=torch.bfloat16,
                     device=a.data.device)
    grid, pos, kw = launcher._launch_config(layer, a, out, tactic, None)
    kernel = mxfp8_gemm_kernel[grid](*pos, **kw)
    torch.cuda.synchronize()
    return kernel.n_regs, kernel.n_spills, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 48, 64])
    parser.add_argument("--caps", type=int, nargs="+", default=[168])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--out", type=Path, default=Path("benchmarks") / "results")
    args = parser.parse_args()
    launcher._launch_config = _capped_config
    device = torch.device("cuda")
    result = new_result("maxnreg_ab", " ".join([Path(sys.executable).name, *sys.argv]),
                        environment(False, []), {"rows": args.rows, "caps": args.caps})
    result["timings"] = []
    torch.manual_seed(0)
    for name in args.shapes.split(","):
        n, k, groups = SHAPES[name]
        layer = random_layer(n, k, groups, device)
        copies = rotated_copies(layer)
        w_bf16 = layer.dequantized_weight().bfloat16().view(groups, n // groups, k)
        for rows in args.rows:
            tactic = table_tactic(n, k, rows, groups)
            x = torch.randn(rows, groups * k, device=device).bfloat16()
            a = quantize_mxfp8(x)
            ways = [None, *args.caps]
            compiled = {cap: _compiled(layer, a, tactic, cap) for cap in ways}
            base = compiled[None][2]
            us = {str(cap): [] for cap in ways}
            for _ in range(2):
                for cap in ways:
                    _cap[0] = cap
                    us[str(cap)].append(time_ours(layer, a, tactic, copies))
            _cap[0] = None
            cublas = time_cublas_bf16(x.view(rows, groups, k).transpose(0, 1), w_bf16)
            row = {"shape": name, "n": n, "k": k, "groups": groups, "rows": rows,
                   "tactic": tactic._asdict(), "us": us, "cublas_bf16_us": cublas,
                   "regs": {str(c): compiled[c][0] for c in ways},
                   "spills": {str(c): compiled[c][1] for c in ways},
                   "bits_equal": {str(c): bool(torch.equal(compiled[c][2], base)) for c in ways}}
            result["timings"].append(row)
            print(f"{name} M={rows} {tuple(tactic)}: "
                  + " | ".join(f"cap {c}: {compiled[c][0]} regs, {compiled[c][1]} spills, "
                               f"{us[str(c)]} µs, bits {'=' if row['bits_equal'][str(c)] else '!='}"
                               for c in ways)
                  + f" | cuBLAS BF16 {cublas:.2f}", flush=True)
    path = write_json(result, args.out / f"maxnreg_ab-{git_commit() or 'nocommit'}.json")
    print(path)


if __name__ == "__main__":
    main()
