"""A/B (temporary): the tensor-core tiles on MXFP8 input (each program dequantizes its
activation) against the same tactic on the activation already dequantized to BF16
(A_EXACT: exact MXFP8 values, no per-program dequantization), every tabled shape;
the two outputs must be bit-equal. cuBLAS BF16 beside them.

    PYTHONPATH=. python benchmarks/exact_act_ab.py [--out DIR] [--rows ...]
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import torch

from decode_boundary.bench.gemm import random_layer, time_cublas_bf16, time_ours
from decode_boundary.common.timing import graph_time_us, rotated_copies
from decode_boundary.gemm import launch_low_latency, tactics
from decode_boundary.gemm.launcher import _launch_config
from decode_boundary.gemm.mxfp8_gemm_kernel import mxfp8_gemm_kernel
from decode_boundary.gemm.reference import check_mxfp8_mm
from decode_boundary.mxfp8.format import dequantize_mxfp8
from decode_boundary.mxfp8.quantize_kernel import quantize_mxfp8

SHAPES = {"wo_b": (5120, 2048, 1), "wq_b": (8192, 1280, 1), "fused_wqa_wkv": (1792, 5120, 1),
          "wo_a": (2048, 4096, 2), "v4pro_wo_b": (7168, 4096, 1), "wo_b_tp2": (5120, 4096, 1)}


def launch_exact(layer, x_exact, out, tactic):
    grid, args, kwargs = _launch_config(layer, x_exact, out, tactic, None)
    mxfp8_gemm_kernel[grid](*args, **dict(kwargs, A_EXACT=True))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--rows", type=int, nargs="*", default=[32, 48, 64])
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
            exact = dequantize_mxfp8(qa, torch.bfloat16).reshape(m, groups * k).contiguous()
            tactic = tactics.default_tactic(n, k, m, groups)
            ref = launch_low_latency(layer, qa, torch.full((m, n), float("nan"),
                                     dtype=torch.bfloat16, device="cuda"), tactic)
            check_mxfp8_mm(ref, qa, layer.weight, layer.weight_scale, groups)
            got = launch_exact(layer, exact, torch.full((m, n), float("nan"),
                               dtype=torch.bfloat16, device="cuda"), tactic)
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            row = {"shape": name, "rows": m, "tactic": tactic._asdict(),
                   "bits_equal": bool(torch.equal(ref.view(torch.int16), got.view(torch.int16))),
                   "cublas_bf16": time_cublas_bf16(x.view(m, groups, k).transpose(0, 1), bf16)}
            for label in ("mxfp8", "exact", "mxfp8_2", "exact_2"):
                if label.startswith("mxfp8"):
                    row[label] = time_ours(layer, qa, tactic, copies)
                else:
                    row[label] = graph_time_us([functools.partial(launch_exact, c, exact, out,
                                                                  tactic) for c in copies])
            print(json.dumps(row), flush=True)
            rows_out.append(row)
    with open(os.path.join(args.out, "exact_act_ab.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "commit": os.environ.get("DECODE_BOUNDARY_COMMIT"),
                   "command": "python benchmarks/exact_act_ab.py", "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
