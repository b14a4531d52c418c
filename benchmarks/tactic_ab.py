"""Pinned GEMM tactics against the tables, inside the chain: one rank's fused
boundary timed with the tables' tactics and with each set of pins, in
alternating rounds in one process (the one timer: CUDA graphs of back-to-back
steps, rotated weight copies, cold L2). Every way must keep fused = unfused
bit for bit and pass the reference check.

A pin is ``layer=block_n,rows_tile,split_k,num_warps,chunk_k`` (``,nocap``
after it: that tactic compiles without the launcher's register cap); ``--way``
takes one or more pins (several ``--way`` options: several ways). Steps run as
the bench's do (``mixes_aside="auto"``, each graph joined).

    PYTHONPATH=. python benchmarks/tactic_ab.py --rows 64 \
        --way fused_wqa_wkv=64,64,14,4,128 \
        --way fused_wqa_wkv=64,64,14,4,128 wo_a=64,64,8,4,256
"""

from __future__ import annotations

import functools

from decode_boundary.bench.harness import (
    one_gpu_boundary,
    one_gpu_parser,
    one_gpu_result,
    one_gpu_write,
)
from decode_boundary.common.timing import graph_time_us
from decode_boundary.gemm import launcher
from decode_boundary.gemm.autotune import AUTOTUNER, cache_key
from decode_boundary.gemm.tactics import Tactic
from decode_boundary.model.chain import check_outputs, outputs_identical

ROUNDS = 3


def parse_pin(text: str) -> tuple[str, Tactic, bool]:
    """(layer, tactic, whether it compiles without the register cap)."""
    layer, _, fields = text.partition("=")
    values = fields.split(",")
    uncapped = values[-1] == "nocap"
    values = [int(v) for v in values[:len(values) - uncapped]]
    if layer not in ("wo_a", "wo_b", "fused_wqa_wkv") or len(values) != len(Tactic._fields):
        raise ValueError(f"pin {text!r}: expected layer=" + ",".join(Tactic._fields)
                         + "[,nocap]")
    return layer, Tactic(*values), uncapped


_register_cap = launcher.register_cap
_uncapped: set[Tactic] = set()


def _cap(tactic, programs, device):
    return None if tactic in _uncapped else _register_cap(tactic, programs, device)


def main() -> None:
    parser = one_gpu_parser(__doc__.splitlines()[0])
    parser.add_argument("--way", nargs="+", action="append", required=True,
                        help="pins of one way (layer=block_n,rows_tile,split_k,warps,chunk_k)")
    args = parser.parse_args()
    launcher.register_cap = _cap
    ways = {"tables": []} | {" ".join(w): [parse_pin(p) for p in w] for w in args.way}
    ab, views = one_gpu_boundary(args, seed=5)
    result = one_gpu_result("tactic_ab", args)
    result["rows"] = []
    for rows in args.rows:
        inputs = ab.make_inputs(rows, seed=rows)
        steps = [functools.partial(v, inputs, fused=True, mixes_aside="auto") for v in views]
        keys = {name: cache_key(getattr(ab, name), rows) for name in ("wo_a", "wo_b",
                                                                      "fused_wqa_wkv")}

        def pin(pins, keys=keys):
            for key in keys.values():
                AUTOTUNER.cache.pop(key, None)
            _uncapped.clear()
            for name, tactic, uncapped in pins:
                AUTOTUNER.cache[keys[name]] = tactic
                if uncapped:
                    _uncapped.add(tactic)

        us, failures = {name: [] for name in ways}, []
        for _ in range(ROUNDS):
            for name, pins in ways.items():
                pin(pins)
                us[name].append(graph_time_us(steps, ab.device, join=ab.join_mixes))
        for name, pins in ways.items():
            pin(pins)
            out = ab(inputs, fused=True, mixes_aside="auto")
            unfused = ab(inputs, fused=False, mixes_aside="auto")
            ab.join_mixes()
            if not outputs_identical(out, unfused):
                failures.append(f"{name}: fused != unfused")
            failures += [f"{name}: {f}" for f in check_outputs(out, ab.reference(inputs))]
        pin([])
        result["rows"].append({"rows": rows, "us": us, "failures": failures})
        print(f"M={rows}: " + "; ".join(f"{k} {[round(x, 2) for x in v]}" for k, v in us.items())
              + f" µs; {'; '.join(failures) or 'bits equal, checks ok'}", flush=True)
    ab.close()
    print("wrote", one_gpu_write(result, args))


if __name__ == "__main__":
    main()
