"""Where the time of one rank's fused boundary goes, per kernel, inside the chain.

Every program of the GEMMs and the consumer stamps ``%globaltimer`` when it
starts, when it has passed its grid-dependency wait and when it ends, and
marks inside (stamped by ``decode_boundary.common.timeline``, read by
``bench.timeline``; mark1: the GEMM's products
done, the consumer's slots in and residual_out stored; mark2: the GEMM's weight
slice in, the consumer's token's RMSNorm partials met). The fused boundary
(grouped wo_a -> publishing wo_b -> consumer -> fused_wqa_wkv) runs as a CUDA graph of many
back-to-back steps on rotated weight copies (cold L2), with PDL, like the
bench; per kernel the table gives, relative to the step's first program start
and as medians over the steps in the middle of the graph: the first and last
program start, the median and last pass of the grid wait, the median and last
end. The same graph without stamps is timed too (the stamps' own cost).

    PYTHONPATH=. python benchmarks/timeline.py [--tp-shapes 4] [--rows 1 8]
        [--fused-mixes-up-to N] [--sinkhorn-iters N]

``--sinkhorn-iters`` is a diagnostic: the chain timed with another number of
comb's Sinkhorn rounds than the model's (other mixes; what the rounds cost on
the combine's path).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from decode_boundary.bench import timeline
from decode_boundary.bench.harness import (
    one_gpu_boundary,
    one_gpu_parser,
    one_gpu_result,
    one_gpu_write,
)
from decode_boundary.bench.mixes import fused_mixes_up_to
from decode_boundary.bench.timing import graph_time_us
from decode_boundary.boundary import consumer_tactics
from decode_boundary.model.chain import AttentionBoundary
from decode_boundary.model.config import MODELS

STEPS = 24  # steps in the graph; the first and last few are left out of the medians


def profile(ab: AttentionBoundary, views: list, rows: int, device: torch.device) -> dict:
    inputs = ab.make_inputs(rows, seed=rows)
    steps = [functools.partial(v, inputs, fused=True) for v in views]
    plain_us = graph_time_us(steps, device)
    stamped = timeline.stamped_steps(steps, device, len(steps) * -(-STEPS // len(steps)))
    return {"rows": rows, "graph_us_per_step": plain_us, "stamped_step_us": stamped["step_us"],
            "kernels": stamped["kernels"]}


def main() -> None:
    parser = one_gpu_parser(__doc__.splitlines()[0])
    parser.add_argument("--fused-mixes-up-to", type=int,
                        default=consumer_tactics.MIXES_FUSED_MAX_ROWS,
                        help="V4.1's next mixes fused in the consumer up to this many tokens, "
                             "from the mixes kernel beyond (default: the library's)")
    parser.add_argument("--sinkhorn-iters", type=int, default=None,
                        help="a diagnostic: comb's Sinkhorn rounds instead of the model's")
    args = parser.parse_args()
    if args.sinkhorn_iters is not None:
        MODELS[args.model] = dataclasses.replace(MODELS[args.model],
                                                 hc_sinkhorn_iters=args.sinkhorn_iters)
    with fused_mixes_up_to(args.fused_mixes_up_to):
        ab, views = one_gpu_boundary(args, seed=3)
        device = ab.device
        result = one_gpu_result("timeline", args)
        result["profiles"] = [profile(ab, views, rows, device) for rows in args.rows]
        ab.close()
    for p in result["profiles"]:
        print(f"\nM = {p['rows']}: {p['graph_us_per_step']:.2f} µs per step in a graph "
              f"(stamped: {p['stamped_step_us']:.2f}); µs from the step's first program start")
        print(f"{'kernel':28s} {'progs':>5s} " + " ".join(f"{f:>13s}" for f in timeline.FIELDS))
        for k in p["kernels"]:
            print(f"{k['kernel']:28s} {k['programs']:5d} "
                  + " ".join(f"{k[f]:13.2f}" for f in timeline.FIELDS))
    print("wrote", one_gpu_write(result, args))


if __name__ == "__main__":
    main()
