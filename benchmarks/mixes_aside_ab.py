"""The next mixes off the critical path, measured in the chain: V4.1's mixes
inside the step as today (the consumer's shares + the next GEMM's combine up to
``MIXES_FUSED_MAX_ROWS``, the mixes kernel after the consumer beyond) against
the mixes kernel on the all-reduce's side stream (``mixes_aside=True``: forked
after the consumer, joined by the next step's consumer; way ``aside_join_first``:
joined before the next step's first kernel instead, so the consumer keeps a
single, programmatic (PDL) edge from wo_b), for one rank's fused
boundary (the one timer: CUDA graphs of back-to-back steps, rotated weight
copies, cold L2; timed A, B, A, B in one process; each graph ends joined).
Both ways must give the same residual_out bits (the layer input and q may
differ in their last bits: the consumer without the mixes runs its own tactic,
another sum-of-squares order), the mixes must be within ``MIXES_ATOL`` of the
spec of their residual_out, and both must pass the reference check.

    PYTHONPATH=. python benchmarks/mixes_aside_ab.py [--rows 1 4 8 16 32 64]
"""

from __future__ import annotations

import functools

import torch

from decode_boundary.bench.harness import one_gpu_ab, one_gpu_parser
from decode_boundary.boundary.consumer import mixes_aside_ok
from decode_boundary.model.checks import check_mixes, check_outputs
from decode_boundary.model.config import MODELS


def check(ab, inputs, outs: dict) -> list[str]:
    inline = outs["inline"]
    ref = ab.reference(inputs)
    failures = []
    for name, out in outs.items():
        if not torch.equal(inline.residual_out.view(torch.int16),
                           out.residual_out.view(torch.int16)):
            failures.append(f"{name}: residual_out differs from inline")
        failures += [f"{name}: {f}" for f in check_outputs(out, ref) + check_mixes(out, ab)]
    return failures


def _join_first(ab, inputs):
    """A step that joins the previous step's pending mixes before its first kernel."""
    def step():
        ab.all_reduce.join_mixes()
        return ab(inputs, fused=True, mixes_aside=True)
    return step


def main() -> None:
    args = one_gpu_parser(__doc__.splitlines()[0]).parse_args()
    config = MODELS[args.model]
    if not mixes_aside_ok(config.hc_mult, config.collapse_pre):
        raise SystemExit(f"{args.model}: its mixes cannot run aside (V4's collapse needs them)")
    ways = {way: (lambda ab, inputs, aside=way == "aside":
                  functools.partial(ab, inputs, fused=True, mixes_aside=aside))
            for way in ("inline", "aside")}
    ways["aside_join_first"] = _join_first
    print("wrote", one_gpu_ab(args, "mixes_aside_ab", ways, check))


if __name__ == "__main__":
    main()
