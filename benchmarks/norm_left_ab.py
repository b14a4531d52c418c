"""The chain with the consumer's RMSNorm left to fused_wqa_wkv (``leave_norm``)
against the consumer normalising itself, in one process, alternating.

Both ways run the fused boundary as a CUDA graph of steps on rotated weight
copies (cold L2), like the bench; ``consumer.NORM_LEFT_MAX_ROWS`` is set to
0 (the consumer normalises) or to the library's value between rounds. Every
row count's outputs are compared both ways first (bit for bit). Optionally
the per-kernel stamps (``common.timeline``) of both ways.

    PYTHONPATH=. python benchmarks/norm_left_ab.py [--tp-shapes 4] [--rows 1 4 8 16]
        [--rounds 2] [--stamps]
"""

from __future__ import annotations

import functools

from decode_boundary.bench.harness import (
    one_gpu_boundary,
    one_gpu_parser,
    one_gpu_result,
    one_gpu_write,
)
from decode_boundary.boundary import consumer
from decode_boundary.common import timeline
from decode_boundary.common.timing import graph_time_us
from decode_boundary.model.chain import outputs_identical

STEPS = 24


def main() -> None:
    parser = one_gpu_parser(__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--stamps", action="store_true")
    args = parser.parse_args()
    library = consumer.NORM_LEFT_MAX_ROWS
    ab, views = one_gpu_boundary(args, seed=3)
    device = ab.device
    result = one_gpu_result("norm_left_ab", args)
    ways = {"consumer_norm": 0, "norm_left": library}
    rows_out = []
    for rows in args.rows:
        inputs = ab.make_inputs(rows, seed=rows)
        outs = {}
        for way, limit in ways.items():
            consumer.NORM_LEFT_MAX_ROWS = limit
            outs[way] = ab(inputs, fused=True)
        entry = {"rows": rows, "identical": outputs_identical(*outs.values()),
                 "us": {way: [] for way in ways}}
        steps = [functools.partial(v, inputs, fused=True) for v in views]
        for _ in range(args.rounds):
            for way, limit in ways.items():
                consumer.NORM_LEFT_MAX_ROWS = limit
                entry["us"][way].append(graph_time_us(steps, device))
        if args.stamps:
            entry["stamps"] = {}
            for way, limit in ways.items():
                consumer.NORM_LEFT_MAX_ROWS = limit
                stamped = timeline.stamped_steps(steps, device,
                                                 len(steps) * -(-STEPS // len(steps)))
                entry["stamps"][way] = stamped
        consumer.NORM_LEFT_MAX_ROWS = library
        rows_out.append(entry)
        print(f"M = {rows}: identical {entry['identical']}; "
              + "; ".join(f"{way} " + " / ".join(f"{u:.2f}" for u in us)
                          for way, us in entry["us"].items()) + " µs per step", flush=True)
        for way, stamped in entry.get("stamps", {}).items():
            print(f"  {way}: stamped step {stamped['step_us']:.2f} µs")
            for k in stamped["kernels"]:
                print(f"    {k['kernel']:28s} {k['programs']:5d} "
                      + " ".join(f"{k[f]:8.2f}" for f in timeline.FIELDS))
    ab.close()
    result["rows_ab"] = rows_out
    print("wrote", one_gpu_write(result, args))


if __name__ == "__main__":
    main()
