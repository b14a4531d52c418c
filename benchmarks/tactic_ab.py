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

from decode_boundary.bench.harness import one_gpu_ab, one_gpu_parser
from decode_boundary.gemm import launcher
from decode_boundary.gemm.autotune import AUTOTUNER, cache_key
from decode_boundary.gemm.tactics import Tactic
from decode_boundary.model.checks import check_outputs, outputs_identical

ROUNDS = 3
LAYERS = ("wo_a", "wo_b", "fused_wqa_wkv")


def parse_pin(text: str) -> tuple[str, Tactic, bool]:
    """(layer, tactic, whether it compiles without the register cap)."""
    layer, _, fields = text.partition("=")
    values = fields.split(",")
    uncapped = values[-1] == "nocap"
    values = [int(v) for v in values[:len(values) - uncapped]]
    if layer not in LAYERS or len(values) != len(Tactic._fields):
        raise ValueError(f"pin {text!r}: expected layer=" + ",".join(Tactic._fields)
                         + "[,nocap]")
    return layer, Tactic(*values), uncapped


_register_cap = launcher.register_cap
_uncapped: set[Tactic] = set()


def _cap(tactic, programs, device):
    return None if tactic in _uncapped else _register_cap(tactic, programs, device)


def pinned(ab, inputs, pins: list, fused: bool = True):
    """One step of ``ab`` with ``pins`` in the autotuner's cache (the rest of
    the layers at the tables' tactics), the tables back in charge after it."""
    keys = {name: cache_key(getattr(ab, name), inputs.rows) for name in LAYERS}
    for name, tactic, uncapped in pins:
        AUTOTUNER.cache[keys[name]] = tactic
        if uncapped:
            _uncapped.add(tactic)
    try:
        return ab(inputs, fused=fused, mixes_aside="auto")
    finally:
        for key in keys.values():
            AUTOTUNER.cache.pop(key, None)
        _uncapped.clear()


def main() -> None:
    parser = one_gpu_parser(__doc__.splitlines()[0])
    parser.add_argument("--way", nargs="+", action="append", required=True,
                        help="pins of one way (layer=block_n,rows_tile,split_k,warps,chunk_k)")
    args = parser.parse_args()
    launcher.register_cap = _cap
    pins = {"tables": []} | {" ".join(w): [parse_pin(p) for p in w] for w in args.way}
    ways = {name: (lambda ab, inputs, p=p: functools.partial(pinned, ab, inputs, p))
            for name, p in pins.items()}

    def check(ab, inputs, outs: dict) -> list[str]:
        """Per way: fused = unfused under its pins, and within the reference."""
        failures = []
        for name, out in outs.items():
            unfused = pinned(ab, inputs, pins[name], fused=False)
            ab.join_mixes()
            if not outputs_identical(out, unfused):
                failures.append(f"{name}: fused != unfused")
            failures += [f"{name}: {f}" for f in check_outputs(out, ab.reference(inputs))]
        return failures

    print("wrote", one_gpu_ab(args, "tactic_ab", ways, check, rounds=ROUNDS))


if __name__ == "__main__":
    main()
