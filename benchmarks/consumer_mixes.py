"""The consumer alone with and without the next sublayer's mixes (one rank,
the all-reduce over a group of one, DSV4.1-Flash's H = 5120, hc = 4): publish
+ consume per call, CUDA-graph replays over rotated hc_fn copies (cold L2),
both collapses fused at every M, V4.1's also from our mixes kernel after
the consumer (``mixes.mixes_kernel``; the two set
``consumer.MIXES_FUSED_MAX_ROWS``), and the separate mixes a user would run
(``torch.compile`` of ``mhc_mixes_ref``) on the same residual_out. A quick
look at the consumer's share of the mixes' cost; ``decode-boundary bench`` times them inside the
chain (``bench.mixes``). ``--sweep`` also times every tactic of
``SWEEP_TACTICS`` of the fused mixes, each checked first: pre/post/comb
against the reference of its own residual_out, and (collapse "previous")
residual_out and layer_input bit-equal to the consumer without mixes.
``--timeline`` stamps the consumer -> mixes kernel graph
(``common.timeline``): when each kernel's programs start, pass the grid wait
(mixes kernel: mark2 = hc_fn in, mark1 = shares stored) and end.

    PYTHONPATH=. python benchmarks/consumer_mixes.py [--rows 1 16] [--sweep] [--timeline]
        [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch

from decode_boundary.bench.mixes import fused_mixes_up_to
from decode_boundary.bench.report import environment, git_commit, new_result, write_json
from decode_boundary.boundary import consumer
from decode_boundary.boundary.all_reduce import BoundaryAllReduce
from decode_boundary.common import timeline
from decode_boundary.common.timing import graph_time_us
from decode_boundary.mixes.reference import mhc_mixes_ref
from decode_boundary.mxfp8.format import mxfp8_scale_bytes

H, HC, COPIES, EPS, HC_EPS, ITERS = 5120, 4, 8, 1e-6, 1e-6, 20
# (columns, warps), hc_fn loaded after the wait: alone, where its placement does not
# show; benchmarks/chain_sweep.py decides mix_weights_early inside the chain.
SWEEP_TACTICS = ((64, 2), (64, 4), (128, 4), (256, 4), (128, 8), (256, 8))
TIMELINE_STEPS = 24  # graph steps stamped by --timeline (as benchmarks/timeline.py)
MIXES_ATOL = 1e-5  # tests/test_consumer_mixes.py justifies it


def _call(ars: dict, step: tuple, collapse: str | None, weights: tuple | None = None):
    """publish + consume of ``step`` on the all-reduce of ``collapse``."""
    x, residual, post, comb, pre, gamma, q = step
    extra = {} if collapse is None else dict(mix_weights=weights)
    return ars[collapse](x, residual=residual, post=post, comb=comb,
                         pre=None if collapse == "same" else pre, norm_weight=gamma,
                         norm_eps=EPS, mxfp8_out=q, **extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--timeline", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    dev = torch.device("cuda")
    cap = max(args.rows)
    n = (2 + HC) * HC
    g = torch.Generator().manual_seed(0)
    copies = [tuple(t.to(dev) for t in (torch.randn(n, HC * H, generator=g) * 0.02,
                                         torch.rand(3, generator=g) + 0.5,
                                         torch.randn(n, generator=g) * 0.5))
              for _ in range(COPIES)]  # 2 MB each: 16 MB, more than L2 keeps between uses
    ars = {c: BoundaryAllReduce(H, HC, cap, 2, device=dev, quantize_layer_input=True,
                                residual_only=True, collapse_pre=c)
           for c in (None, "previous", "same")}
    for ar in ars.values():
        ar.precompile(args.rows)
    separate = torch.compile(mhc_mixes_ref, dynamic=False, fullgraph=True)
    result = new_result("consumer_mixes", " ".join(["benchmarks/consumer_mixes.py"]),
                        environment(False, []), {"hidden": H, "hc": HC, "rows": args.rows})
    result["timings"] = []
    for m in args.rows:
        x = torch.randn(m, H, device=dev).bfloat16()
        residual = torch.randn(m, HC, H, device=dev).bfloat16()
        post, comb, pre = (torch.rand(m, HC, device=dev), torch.rand(m, HC, HC, device=dev),
                           torch.rand(m, HC, device=dev))
        gamma = torch.ones(H, device=dev).bfloat16()
        q = (torch.empty(m, H, dtype=torch.float8_e4m3fn, device=dev),
             torch.empty(mxfp8_scale_bytes(m, H), dtype=torch.uint8, device=dev))
        step = (x, residual, post, comb, pre, gamma, q)
        us = {"consumer": graph_time_us([functools.partial(_call, ars, step, None)], dev)}
        # V4.1's mixes fused at this M too (beyond MIXES_FUSED_MAX_ROWS the chain
        # takes the mixes kernel), and from our mixes kernel after the consumer.
        with fused_mixes_up_to(1 << 30):
            for c in ("previous", "same"):
                wrong = _check(ars, step, copies[0], c)
                if wrong:
                    print(f"M = {m}: the fused mixes ({c}) are WRONG: {wrong}")
                us[f"consumer_mixes_{c}"] = None if wrong else graph_time_us(
                    [functools.partial(_call, ars, step, c, w) for w in copies], dev)
        row = {"rows": m, "us": us}
        with fused_mixes_up_to(0):
            wrong = _check(ars, step, copies[0], "previous")
            then_kernel = [functools.partial(_call, ars, step, "previous", w) for w in copies]
            us["consumer_then_mixes_kernel"] = None if wrong else graph_time_us(then_kernel, dev)
            if args.timeline and not wrong:
                row["timeline"] = _timeline(then_kernel, dev)
        if wrong:
            print(f"M = {m}: the mixes kernel is WRONG: {wrong}")
        res_out = _call(ars, step, None)[0]
        us["separate_mixes"] = graph_time_us(
            [functools.partial(separate, res_out, *w, EPS, HC_EPS, ITERS) for w in copies], dev)
        if args.sweep:
            with fused_mixes_up_to(1 << 30):
                row["sweep"] = _sweep(ars, step, copies)
        result["timings"].append(row)
        print(f"M = {m}: " + ", ".join(f"{k} {v:.2f} µs" for k, v in us.items()
                                      if v is not None))
        for name, times in row.get("timeline", {}).items():
            print(f"  {name:18s} " + " ".join(f"{f} {times[f]:.2f}" for f in timeline.FIELDS))
    name = f"consumer_mixes-{git_commit() or 'nocommit'}.json"
    print("wrote", write_json(result, args.out / name))


def _check(ars: dict, step: tuple, weights: tuple, collapse: str) -> str | None:
    """What is wrong with the fused mixes of this variant, or None."""
    plain = [t.clone() for t in _call(ars, step, None)]
    res_out, layer, (pre, post, comb) = _call(ars, step, collapse, weights)
    want = mhc_mixes_ref(res_out, *weights, EPS, HC_EPS, ITERS)
    for name, got, ref in zip(("pre", "post", "comb"), (pre, post, comb), want, strict=True):
        if not torch.allclose(got, ref, rtol=0, atol=MIXES_ATOL):
            return f"{name} off by {(got - ref).abs().max().item():.3g}"
    if collapse == "previous" and not (torch.equal(res_out.view(torch.int16),
                                                   plain[0].view(torch.int16))
                                       and torch.equal(layer.view(torch.int16),
                                                       plain[1].view(torch.int16))):
        return "residual_out / layer_input differ from the consumer without mixes"
    return None


def _timeline(steps: list, device: torch.device) -> dict:
    """Per stamped kernel of each step (the consumer, the mixes kernel; publish
    has no stamps): ``timeline.stamped_steps``' medians, from the consumer's
    first start."""
    calls = len(steps) * -(-TIMELINE_STEPS // len(steps))
    return {k["kernel"]: k for k in timeline.stamped_steps(steps, device, calls)["kernels"]}


def _sweep(ars: dict, step: tuple, copies: list) -> list:
    """Every tactic of the fused mixes, checked, then timed."""
    rows, tactics = [], (consumer.MIXES_TACTICS, consumer.SAME_PRE_MIXES_TACTICS)
    m = step[0].shape[0]
    try:
        for block_h, warps in SWEEP_TACTICS:
            only = ((1 << 30, consumer.ConsumerTactic(block_h, warps)),)
            consumer.MIXES_TACTICS = consumer.SAME_PRE_MIXES_TACTICS = only
            entry = {"block_h": block_h, "warps": warps}
            for c in ("previous", "same"):
                wrong = _check(ars, step, copies[0], c)
                entry[f"{c}_error"] = wrong
                entry[f"{c}_us"] = None if wrong else graph_time_us(
                    [functools.partial(_call, ars, step, c, w) for w in copies], step[0].device)
            rows.append(entry)
            print(f"  M = {m} {block_h} x {warps}: "
                  + ", ".join(f"{c} {entry[c + '_us']:.2f} µs" if entry[c + "_us"]
                              else f"{c} WRONG {entry[c + '_error']}"
                              for c in ("previous", "same")))
    finally:
        consumer.MIXES_TACTICS, consumer.SAME_PRE_MIXES_TACTICS = tactics
    return rows


if __name__ == "__main__":
    main()
