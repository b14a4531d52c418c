"""Where the next mixes are combined, measured in the chain: at the consumer's
end (``combine_mixes=True``: the next GEMM's grid wait waits for chunk 0's
serial combine) or by M extra programs of the next GEMM (``combine_mixes=False``
+ ``mxfp8_mm(..., finish_mixes=...)``, what ``AttentionBoundary`` runs), for
one rank's fused boundary (the one timer: CUDA graphs of back-to-back steps,
rotated weight copies, cold L2; timed A, B, A, B in one process). Both ways
must give the same bits, and those must pass the reference check.

    PYTHONPATH=. python benchmarks/combine_where.py [--model v4-flash] [--rows 1 8]
"""

from __future__ import annotations

import functools

from decode_boundary.bench.harness import one_gpu_ab, one_gpu_parser
from decode_boundary.gemm import mxfp8_mm
from decode_boundary.model.chain import AttentionBoundary, BoundaryInputs, BoundaryOutputs
from decode_boundary.model.checks import check_outputs, outputs_identical


def combined_by_consumer(ab: AttentionBoundary, inputs: BoundaryInputs) -> BoundaryOutputs:
    """The fused step with the combine at the consumer's end."""
    residual_out, layer_input, next_in, mixes = ab.reduce(inputs, ab.produce(inputs, True))
    return BoundaryOutputs(residual_out, layer_input, mxfp8_mm(ab.fused_wqa_wkv, next_in),
                           *mixes)


def check(ab: AttentionBoundary, inputs: BoundaryInputs, outs: dict) -> list[str]:
    failures = [] if outputs_identical(outs["consumer"], outs["next_gemm"]) \
        else ["the two ways differ"]
    return failures + check_outputs(outs["next_gemm"], ab.reference(inputs))


def main() -> None:
    args = one_gpu_parser(__doc__.splitlines()[0]).parse_args()
    ways = {"consumer": lambda ab, inputs: functools.partial(combined_by_consumer, ab, inputs),
            "next_gemm": lambda ab, inputs: functools.partial(ab, inputs, fused=True)}
    print("wrote", one_gpu_ab(args, "combine_where", ways, check))


if __name__ == "__main__":
    main()
