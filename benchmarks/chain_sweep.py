"""Tactics chosen inside the chain, not alone: for one rank's fused boundary
(grouped wo_a -> publishing wo_b -> consumer -> fused_wqa_wkv), each GEMM's
tactic, then the consumer's (``CONSUMER_SWEEP``: columns, warps, and whether
a program holds its hc_fn columns from before its grid wait), is swept while
the others keep theirs, and the whole boundary is timed
(the one timer: CUDA graphs of back-to-back steps, rotated weight copies, cold
L2). Layers are swept one after another, each keeping the best so far
(coordinate descent). A GEMM timed alone runs with the whole GPU to itself;
inside the chain its programs share the SMs with the kernel before it, which is
still running while they wait (PDL), so the winner can differ (the consumer's
hc_fn placement lost alone and won in the chain: benchmarks/NOTES.md "V4-family
mixes" item 10).

Where the descent chose something other than the tables, the tables and the
chosen combination are timed again, alternately, ``RETIME_ROUNDS`` times (one
sample each cannot separate choices within a run's ~0.4 µs spread). The chosen
tactics are checked (fused = unfused bit for bit, both against the reference)
and printed as TABLE entries.

    PYTHONPATH=. python benchmarks/chain_sweep.py [--tp-shapes 4] [--rows 1 8] [--consumer-only]
"""

from __future__ import annotations

import functools
import statistics

import torch

from decode_boundary.bench.harness import (
    one_gpu_boundary,
    one_gpu_parser,
    one_gpu_result,
    one_gpu_write,
)
from decode_boundary.boundary.consumer import ConsumerTactic, consumer_tactic, fuses_mixes
from decode_boundary.common.timing import graph_time_us
from decode_boundary.gemm.autotune import AUTOTUNER, cache_key
from decode_boundary.gemm.tactics import sweep_tactics, table_tactic
from decode_boundary.model.chain import AttentionBoundary
from decode_boundary.model.checks import check_outputs, outputs_identical

LAYERS = ("wo_b", "wo_a", "fused_wqa_wkv")  # swept in this order
# The consumer's candidates (columns, warps, hc_fn held from before the wait); with
# fused mixes a program takes >= 64 columns (consumer.MIX_MIN_BLOCK).
# hc_fn early only where the held columns fit (<= 128 registers per thread at hc = 4:
# columns / threads <= 1): 256 x 4 and 512 x 4 would spill.
CONSUMER_SWEEP = tuple(ConsumerTactic(cols, warps, True, early)
                       for cols, warps in ((64, 2), (64, 4), (128, 4), (128, 8), (256, 4),
                                           (256, 8), (512, 4))
                       for early in ((False, True) if cols <= 32 * warps else (False,)))
RETIME_ROUNDS = 3


def sweep_consumer(ab: AttentionBoundary, steps: list, rows: int, device: torch.device,
                   trials: list) -> dict:
    """The consumer's tactic for this M inside the chain (pinned on the
    all-reduce, then unpinned): the table's first, then (with the mixes fused)
    the same with the other PDL release point (``release_late``), then
    ``CONSUMER_SWEEP``."""
    c = ab.config
    fused = fuses_mixes(rows, c.hc_mult, c.collapse_pre)
    base = consumer_tactic(rows, c.hidden, c.collapse_pre if fused else None)
    timed = []
    # the table's tactic with the other release point (after the share, or at the wait)
    other_release = [base._replace(release_late=not base.release_late)] if fused else []
    candidates = [base, *other_release]
    candidates += [t for t in CONSUMER_SWEEP if t not in candidates]  # each timed once
    for tactic in candidates:
        if not fused and tactic.mix_weights_early:
            continue  # no mixes in the consumer: the flag changes nothing
        ab.all_reduce.tactic = tactic
        us = graph_time_us(steps, device)
        timed.append((us, tactic))
        trials.append({"layer": "consumer", "tactic": tactic._asdict(), "us": us})
        print(f"M={rows} {'consumer':14s} {tuple(tactic)} {us:7.2f} µs", flush=True)
    best_us, best = min(timed)
    ab.all_reduce.tactic = best
    return {"tactic": best._asdict(), "table": base._asdict(), "us": best_us,
            "table_us": timed[0][0]}


def sweep(ab: AttentionBoundary, views: list, rows: int, device: torch.device,
          layers: tuple = LAYERS) -> dict:
    inputs = ab.make_inputs(rows, seed=rows)
    steps = [functools.partial(v, inputs, fused=True) for v in views]
    chosen = {}
    trials = []
    for name in layers:
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
        chosen[name] = {"tactic": best._asdict(), "table": base._asdict(), "us": best_us,
                        "table_us": timed[0][0]}
    chosen["consumer"] = sweep_consumer(ab, steps, rows, device, trials)
    out = ab(inputs, fused=True)
    failures = [] if outputs_identical(out, ab(inputs, fused=False)) else ["fused != unfused"]
    failures += check_outputs(out, ab.reference(inputs))
    keys = [cache_key(getattr(ab, name), rows) for name in layers]
    pins = {key: AUTOTUNER.cache[key] for key in keys}
    retimed = _retime_against_tables(ab, steps, rows, device, pins, ab.all_reduce.tactic, chosen)
    _unpin(ab, rows)  # leave the tables in charge for the next M
    return {"rows": rows, "chosen": chosen, "trials": trials, "failures": failures,
            "retimed": retimed}


def _unpin(ab: AttentionBoundary, rows: int) -> None:
    for name in LAYERS:
        AUTOTUNER.cache.pop(cache_key(getattr(ab, name), rows), None)
    ab.all_reduce.tactic = None


def _retime_against_tables(ab, steps, rows, device, pins: dict, consumer: ConsumerTactic,
                           chosen: dict) -> dict | None:
    """The tables and the descent's combination timed alternately (None where the
    descent kept every table choice)."""
    if all(c["tactic"] == c["table"] for c in chosen.values()):
        return None
    times = {"tables": [], "chosen": []}
    for _ in range(RETIME_ROUNDS):
        _unpin(ab, rows)
        times["tables"].append(graph_time_us(steps, device))
        AUTOTUNER.cache.update(pins)
        ab.all_reduce.tactic = consumer
        times["chosen"].append(graph_time_us(steps, device))
    print(f"M={rows} retimed: tables {times['tables']} chosen {times['chosen']} µs (medians "
          f"{statistics.median(times['tables']):.2f} / {statistics.median(times['chosen']):.2f})",
          flush=True)
    return times


def main() -> None:
    parser = one_gpu_parser(__doc__.splitlines()[0])
    parser.add_argument("--consumer-only", action="store_true",
                        help="sweep only the consumer (the GEMMs keep their table tactics)")
    args = parser.parse_args()
    ab, views = one_gpu_boundary(args, seed=5)
    device = ab.device
    result = one_gpu_result("chain_sweep", args)
    layers = () if args.consumer_only else LAYERS
    result["sweeps"] = [sweep(ab, views, rows, device, layers) for rows in args.rows]
    ab.close()
    for s in result["sweeps"]:
        print(f"\nM = {s['rows']}: {'; '.join(s['failures']) or 'checks ok'}")
        for name, c in s["chosen"].items():
            print(f"  {name:14s} {tuple(c['tactic'].values())}: {c['us']:.2f} µs "
                  f"(table's {c['table_us']:.2f})")
        if s["retimed"]:
            print(f"  retimed, medians: tables {statistics.median(s['retimed']['tables']):.2f}, "
                  f"chosen {statistics.median(s['retimed']['chosen']):.2f} µs")
    print("wrote", one_gpu_write(result, args))


if __name__ == "__main__":
    main()
