"""Where V4.1's next-mixes shares are computed, measured in the chain: by the
consumer's per-token programs (each reads its columns of hc_fn for its
token: M x 2 MB through L2), by the next GEMM's group programs (hc_fn once
per 16 tokens, on tensor cores; the consumer runs without the mixes), or by
the mixes kernel on the side stream (``mixes_aside=True``). One rank's fused
boundary, the one timer (CUDA graphs of back-to-back steps, rotated weight
copies, cold L2), timed A, B, C, A, B, C in one process. Every way's
residual_out must be the same bits, and every way must pass the reference and
the mixes' spec (the layer input may differ in its last bits: the consumer's
tactic differs with and without the mixes).

    PYTHONPATH=. python benchmarks/shares_where.py [--rows 1 2 4 8 16 32]
"""

from __future__ import annotations

import functools

import torch

from decode_boundary.bench.harness import one_gpu_ab, one_gpu_parser
from decode_boundary.boundary import consumer
from decode_boundary.model.chain import (
    AttentionBoundary,
    BoundaryInputs,
    BoundaryOutputs,
    check_mixes,
    check_outputs,
)

NEVER = 1 << 30


def step(ab: AttentionBoundary, inputs: BoundaryInputs, gemm_shares_from: int,
         aside: bool) -> BoundaryOutputs:
    """The fused step with the shares rule set for this call (and its capture)."""
    consumer.GEMM_SHARES_MIN_ROWS = gemm_shares_from
    return ab(inputs, fused=True, mixes_aside=aside)


def check(ab: AttentionBoundary, inputs: BoundaryInputs, outs: dict) -> list[str]:
    first = next(iter(outs.values()))
    failures = [f"{name}: residual_out differs" for name, out in outs.items()
                if not torch.equal(out.residual_out.view(torch.int16),
                                   first.residual_out.view(torch.int16))]
    ref = ab.reference(inputs)
    for name, out in outs.items():
        failures += [f"{name}: {f}" for f in check_outputs(out, ref) + check_mixes(out, ab)]
    return failures


def main() -> None:
    args = one_gpu_parser(__doc__.splitlines()[0]).parse_args()
    default = consumer.GEMM_SHARES_MIN_ROWS
    ways = {name: (lambda ab, inputs, f=f, aside=aside:
                   functools.partial(step, ab, inputs, f, aside))
            for name, f, aside in (("consumer", NEVER, False), ("next_gemm", 1, False),
                                   ("aside", NEVER, True))}
    try:
        print("wrote", one_gpu_ab(args, "shares_where", ways, check))
    finally:
        consumer.GEMM_SHARES_MIN_ROWS = default


if __name__ == "__main__":
    main()
