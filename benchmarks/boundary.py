"""The wo_b boundary on 2 GPUs, four ways, at the DSV4.1-Flash shapes.

Per M: (o) strong_baseline = cuBLAS BF16 ``wo_b`` + symm-mem one-shot / NCCL
all-reduce + mHC / RMSNorm compiled by torch.compile (bench/baselines.py); (i)
baseline = cuBLAS FP8 row-wise ``wo_b`` + NCCL all-reduce + the consumer's
math as eager torch ops; (ii) ours unfused = our MXFP8 GEMM + publish kernel +
fused consumer; (iii) ours fused = the publishing GEMM + consumer only. The
BF16 input of ``wo_b`` is prepared outside the timed region (ours quantize it
in the GEMM's prologue); our consumer quantizes the next input to MXFP8.
Median µs per boundary over CUDA-graph replays of back-to-back boundaries
on rotated weight copies (> 2x L2), ranks barriered; the floor = wo_b MXFP8
weight bytes / copy rate + the measured one-hop latency (our plain publish +
consume of one token).

    PYTHONPATH=. python benchmarks/boundary.py [--rows 1 2 4 8 16] [--tp 2]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import sys
from pathlib import Path

import torch

from decode_boundary.bench.gemm import mxfp8_weight_bytes
from decode_boundary.bench.harness import cold_copies
from decode_boundary.bench.paths import WO_B_BOUNDARY, build
from decode_boundary.bench.report import git_commit, write_json
from decode_boundary.common.timing import copy_rate, graph_time_us
from decode_boundary.launch import RankContext, launch
from decode_boundary.model.chain import AttentionBoundary
from decode_boundary.model.config import MODELS


def run_rank(ctx: RankContext, model: str, rows_list: list[int]) -> dict:
    config = MODELS[model]
    ab = AttentionBoundary(config, ctx.world_size, ctx.rank, ctx.group, ctx.device,
                           max(rows_list), seed=7)
    ab.precompile(rows_list)
    views = cold_copies(ab)
    rate = copy_rate(ctx.device)
    one = torch.randn(1, config.hidden, device=ctx.device).bfloat16()
    hop_us = graph_time_us([functools.partial(ab.all_reduce.plain_sum, one)], ctx.device,
                           ctx.group)
    k = config.wo_b_shape(ctx.world_size)[1]
    steps = {path: [build(path, v) for v in views] for path in WO_B_BOUNDARY}
    rows_out = []
    for rows in rows_list:
        inputs = ab.make_inputs(rows, seed=rows)
        o = torch.randn(rows, k, device=ctx.device).bfloat16()
        us = {path: graph_time_us([functools.partial(WO_B_BOUNDARY[path], v, step, o, inputs)
                                   for v, step in zip(views, steps[path], strict=True)],
                                  ctx.device, ctx.group)
              for path in WO_B_BOUNDARY}
        rows_out.append({"rows": rows, "us": us})
    floor = mxfp8_weight_bytes(*config.wo_b_shape(ctx.world_size)) / rate * 1e6 + hop_us
    ab.close()
    return {"copy_rate_gbps": rate / 1e9, "one_hop_us": hop_us, "floor_us": floor,
            "weight_copies": len(views), "rows": rows_out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="v4.1-flash", choices=sorted(MODELS))
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    result = launch(run_rank, args.tp, (args.model, args.rows), timeout_s=540)[0]
    commit = git_commit()
    gpu = torch.cuda.get_device_name(0)
    import triton

    result.update(gpu=gpu, torch=torch.__version__, triton=triton.__version__, commit=commit,
                  command=" ".join([os.path.basename(sys.executable), *sys.argv]),
                  model=args.model, tp=args.tp)
    print(f"{args.model} tp={args.tp}: wo_b {MODELS[args.model].wo_b_shape(args.tp)}, "
          f"copy {result['copy_rate_gbps']:.0f} GB/s, one hop {result['one_hop_us']:.2f} us, "
          f"floor {result['floor_us']:.2f} us")
    print(f"{'M':>3} {'strong':>9} {'baseline':>9} {'unfused':>9} {'fused':>9} "
          f"{'strong/fused':>13} {'fused/unfused':>14} {'fused/floor':>12}")
    for row in result["rows"]:
        us = row["us"]
        print(f"{row['rows']:>3} {us['strong_baseline']:>9.2f} {us['baseline']:>9.2f} "
              f"{us['unfused']:>9.2f} {us['fused']:>9.2f} "
              f"{us['strong_baseline'] / us['fused']:>13.2f} "
              f"{us['fused'] / us['unfused']:>14.2f} {us['fused'] / result['floor_us']:>12.2f}")
    name = f"boundary-{gpu.replace(' ', '_')}-{datetime.date.today()}.json"
    print("wrote", write_json(result, Path(args.out) / name))


if __name__ == "__main__":
    main()
