"""wo_a's output handed to wo_b as MXFP8 from wo_a's epilogue, measured in the
chain: the fused boundary with the handoff (``mxfp8_mm(wo_a, ..., mxfp8_out=True)``
where ``mxfp8_out_in_epilogue``) against the same fused boundary with wo_a
writing BF16, which wo_b quantizes in its prologue (up to
``PROLOGUE_MAX_ROWS`` rows) or the quantizer does first (above), for one
rank's boundary (the one timer: CUDA graphs of back-to-back steps, rotated
weight copies, cold L2; timed A, B, A, B in one process). Both ways must give
the same bits (the handoff's bytes are the quantizer's), and pass the
reference check.

    PYTHONPATH=. python benchmarks/handoff_ab.py [--rows 1 4 8 16 32 64]
"""

from __future__ import annotations

import functools

import torch

import decode_boundary.model.chain as chain
from decode_boundary.bench.harness import (
    one_gpu_ab,
    one_gpu_boundary,
    one_gpu_parser,
    one_gpu_result,
    one_gpu_row,
    one_gpu_write,
)
from decode_boundary.gemm import mxfp8_out_in_epilogue
from decode_boundary.model.chain import check_mixes, check_outputs, outputs_identical


def _with_handoff(on: bool, step):
    """``step`` run with the chain's handoff on or off (off: wo_a writes BF16)."""
    chain.mxfp8_out_in_epilogue = mxfp8_out_in_epilogue if on else (lambda layer, rows: False)
    try:
        return step()
    finally:
        chain.mxfp8_out_in_epilogue = mxfp8_out_in_epilogue


def main() -> None:
    args = one_gpu_parser(__doc__.splitlines()[0]).parse_args()
    ab, views = one_gpu_boundary(args, seed=5)
    device = ab.device
    result = one_gpu_result("handoff_ab", args)
    result["rows"] = []
    for rows in args.rows:
        inputs = ab.make_inputs(rows, seed=rows)
        ways = {way: [functools.partial(_with_handoff, way == "mxfp8",
                                        functools.partial(v, inputs, fused=True,
                                                          mixes_aside="auto"))
                      for v in views] for way in ("bf16", "mxfp8")}
        us = one_gpu_ab(ways, device, join=ab.join_mixes)
        outs = {}
        for way in ("bf16", "mxfp8"):
            outs[way] = _with_handoff(way == "mxfp8", functools.partial(
                ab, inputs, fused=True, mixes_aside="auto"))
            ab.join_mixes()
        torch.cuda.synchronize(device)
        failures = [] if outputs_identical(outs["bf16"], outs["mxfp8"]) else ["outputs differ"]
        ref = ab.reference(inputs)
        for way, out in outs.items():
            failures += [f"{way}: {f}" for f in check_outputs(out, ref) + check_mixes(out, ab)]
        one_gpu_row(result, rows, us, failures)
        result["rows"][-1]["handoff"] = mxfp8_out_in_epilogue(ab.wo_a, rows)
    ab.close()
    print("wrote", one_gpu_write(result, args))


if __name__ == "__main__":
    main()
