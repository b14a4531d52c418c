"""A/B (temporary): the GEMM's L1 prefetch of the activation slice (A_PREFETCH) off / on,
same process, every tabled shape at 48 / 64 rows, each output checked against the
reference bar and the two bit-compared; cuBLAS BF16 beside them.

    PYTHONPATH=. python benchmarks/prefetch_ab.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from decode_boundary.bench.gemm import random_layer, time_cublas_bf16, time_ours
from decode_boundary.bench.report import git_commit
from decode_boundary.common.timing import rotated_copies
from decode_boundary.gemm import launch_low_latency, tactics
from decode_boundary.gemm.reference import check_mxfp8_mm
from decode_boundary.mxfp8.quantize_kernel import quantize_mxfp8

SHAPES = {"wo_b": (5120, 2048, 1), "wq_b": (8192, 1280, 1), "fused_wqa_wkv": (1792, 5120, 1),
          "wo_a": (2048, 4096, 2), "v4pro_wo_b": (7168, 4096, 1), "wo_b_tp2": (5120, 4096, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--rows", type=int, nargs="*", default=[48, 64])
    args = parser.parse_args()
    torch.manual_seed(0)
    rows_out = []
    for name, (n, k, groups) in SHAPES.items():
        layer = random_layer(n, k, groups, torch.device("cuda"))
        copies = rotated_copies(layer)
        bf16 = layer.dequantized_weight().bfloat16().view(groups, n // groups, k)
        for m in args.rows:
            x = torch.randn(m, groups * k, device="cuda").bfloat16()
            qa = quantize_mxfp8(x)
            tactic = tactics.default_tactic(n, k, m, groups)
            row = {"shape": name, "rows": m, "tactic": tactic._asdict(),
                   "cublas_bf16": time_cublas_bf16(x.view(m, groups, k).transpose(0, 1), bf16)}
            outs = {}
            for label, on in (("off", False), ("on", True), ("off2", False), ("on2", True)):
                tactics.PREFETCH_ACTIVATION = on
                out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                launch_low_latency(layer, qa, out, tactic)
                check_mxfp8_mm(out, qa, layer.weight, layer.weight_scale, groups)
                outs[label] = out
                row[label] = time_ours(layer, qa, tactic, copies)
            row["bits_equal"] = bool(torch.equal(outs["off"].view(torch.int16),
                                                 outs["on"].view(torch.int16)))
            print(json.dumps(row), flush=True)
            rows_out.append(row)
    tactics.PREFETCH_ACTIVATION = True
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "commit": git_commit(), "command": "python benchmarks/prefetch_ab.py"}
    with open(os.path.join(args.out, f"prefetch_ab-{meta['commit']}.json"), "w") as f:
        json.dump({**meta, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
