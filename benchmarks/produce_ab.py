"""How the fused chain's producer side (wo_a -> wo_b -> the mailbox) is best
run, measured in the chain, two ways of one choice at a time (``--compare``):

* ``handoff``: wo_a's output handed to wo_b as MXFP8 from wo_a's epilogue
  (``mxfp8_mm(wo_a, ..., mxfp8_out=True)`` where ``mxfp8_out_in_epilogue``)
  against wo_a writing BF16, which wo_b quantizes in its prologue (up to
  ``PROLOGUE_MAX_ROWS`` rows) or the quantizer does first (above);
* ``publish``: wo_b publishing from its epilogue (``PublishingMxfp8Linear``,
  at every row count up to the capacity, past ``PUBLISH_EPILOGUE_MAX_ROWS`` too)
  against the plain wo_b and the publish kernel.

One rank's fused boundary (the one timer: CUDA graphs of back-to-back steps,
rotated weight copies, cold L2; timed A, B, A, B in one process). Both ways
must give the same bits and pass the reference check.

    PYTHONPATH=. python benchmarks/produce_ab.py --compare handoff [--rows 4 8 16 32 64]
"""

from __future__ import annotations

import functools

import decode_boundary.model.chain as chain
import decode_boundary.publishing_linear as publishing_linear
from decode_boundary.bench.harness import one_gpu_ab, one_gpu_parser
from decode_boundary.model.checks import check_mixes, check_outputs, outputs_identical
from decode_boundary.publishing_linear import PublishingMxfp8Linear

WAYS = {"handoff": ("bf16", "mxfp8"), "publish": ("kernel", "epilogue")}


def _run_way(ab, way: str, step):
    """``step`` with the choice ``way`` made (the first way of each pair is the
    one the chain does not take by itself)."""
    handoff, supports = chain.mxfp8_out_in_epilogue, PublishingMxfp8Linear.supports
    cut = publishing_linear.PUBLISH_EPILOGUE_MAX_ROWS
    if way == "bf16":
        chain.mxfp8_out_in_epilogue = lambda layer, rows: False
    elif way == "kernel":
        ab.publisher.supports = lambda layer, rows: False
    elif way == "epilogue":
        publishing_linear.PUBLISH_EPILOGUE_MAX_ROWS = ab.all_reduce.capacity
    try:
        return step()
    finally:
        chain.mxfp8_out_in_epilogue = handoff
        publishing_linear.PUBLISH_EPILOGUE_MAX_ROWS = cut
        ab.publisher.__dict__.pop("supports", None)
        assert ab.publisher.supports.__func__ is supports


def check(ab, inputs, outs: dict) -> list[str]:
    first, second = outs.values()
    failures = [] if outputs_identical(first, second) else ["outputs differ"]
    ref = ab.reference(inputs)
    for way, out in outs.items():
        failures += [f"{way}: {f}" for f in check_outputs(out, ref) + check_mixes(out, ab)]
    return failures


def main() -> None:
    parser = one_gpu_parser(__doc__.splitlines()[0])
    parser.add_argument("--compare", choices=sorted(WAYS), required=True)
    args = parser.parse_args()
    ways = {way: (lambda ab, inputs, way=way: functools.partial(
        _run_way, ab, way, functools.partial(ab, inputs, fused=True, mixes_aside="auto")))
        for way in WAYS[args.compare]}
    print("wrote", one_gpu_ab(args, f"produce_ab_{args.compare}", ways, check))


if __name__ == "__main__":
    main()
