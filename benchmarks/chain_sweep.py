"""Tactics chosen inside the chain, not alone: for one rank's fused boundary
(grouped wo_a -> publishing wo_b -> consumer -> fused_wqa_wkv), each GEMM's
tactic is swept while the others keep theirs, and the whole boundary is timed
(the one timer: CUDA graphs of back-to-back steps, rotated weight copies, cold
L2). Layers are swept one after another, each keeping the best so far
(coordinate descent). A GEMM timed alone runs with the whole GPU to itself;
inside the chain its programs share the SMs with the kernel before it, which is
still running while they wait (PDL), so the winner can differ.

The chosen tactics are checked (fused = unfused bit for bit, both against the
reference) and printed as TABLE entries.

    PYTHONPATH=. python benchmarks/chain_sweep.py [--tp-shapes 4] [--rows 1 8]
"""

from __future__ import annotations

import functools

import torch

from decode_boundary.bench.harness import (
    one_gpu_boundary,
    one_gpu_parser,
    one_gpu_result,
    one_gpu_write,
)
from decode_boundary.common.timing import graph_time_us
from decode_boundary.gemm.autotune import AUTOTUNER, cache_key
from decode_boundary.gemm.tactics import sweep_tactics, table_tactic
from decode_boundary.model.chain import (
    AttentionBoundary,
    check_outputs,
    outputs_identical,
)

LAYERS = ("wo_b", "wo_a", "fused_wqa_wkv")  # swept in this order


def sweep(ab: AttentionBoundary, views: list, rows: int, device: torch.device) -> dict:
    inputs = ab.make_inputs(rows, seed=rows)
    steps = [functools.partial(v, inputs, fused=True) for v in views]
    chosen = {}
    trials = []
    for name in LAYERS:
        layer = getattr(ab, name)
        n, k, groups, bucket = key = cache_key(layer, rows)
        base = table_tactic(n, k, rows, groups) or sweep_tactics(n, k, rows, groups)[0]
        timed = []
        for tactic in [base, *(t for t in sweep_tactics(n, k, rows, groups) if t != base)]:
            AUTOTUNER.cache[key] = tactic
            us = graph_time_us(steps, device)
            timed.append((us, tactic))
            trials.append({"layer": name, "tactic": tactic._asdict(), "us": us})
            print(f"M={rows} {name:14s} {tuple(tactic)} {us:7.2f} µs", flush=True)
        best_us, best = min(timed)
        AUTOTUNER.cache[key] = best
        chosen[name] = {"tactic": best._asdict(), "us": best_us, "table_us": timed[0][0]}
    out = ab(inputs, fused=True)
    failures = [] if outputs_identical(out, ab(inputs, fused=False)) else ["fused != unfused"]
    failures += check_outputs(out, ab.reference(inputs))
    for name in LAYERS:  # leave the table in charge for the next M
        AUTOTUNER.cache.pop(cache_key(getattr(ab, name), rows), None)
    return {"rows": rows, "chosen": chosen, "trials": trials, "failures": failures}


def main() -> None:
    args = one_gpu_parser(__doc__.splitlines()[0]).parse_args()
    ab, views = one_gpu_boundary(args, seed=5)
    device = ab.device
    result = one_gpu_result("chain_sweep", args)
    result["sweeps"] = [sweep(ab, views, rows, device) for rows in args.rows]
    ab.close()
    for s in result["sweeps"]:
        print(f"\nM = {s['rows']}: {'; '.join(s['failures']) or 'checks ok'}")
        for name, c in s["chosen"].items():
            print(f"  {name:14s} {tuple(c['tactic'].values())}: {c['us']:.2f} µs "
                  f"(table's {c['table_us']:.2f})")
    print("wrote", one_gpu_write(result, args))


if __name__ == "__main__":
    main()
