"""Per-rank verification and timing of the attention boundary: what
``decode-boundary bench`` / ``verify`` run on every rank.

Correctness comes first: per row count, fused and unfused outputs must be
bit-identical, both must pass the chain's reference check, every baseline
(``bench.paths.BASELINES``) must be close to it, and every rank must hold the same bits
(SHA-256 of the outputs compared over the group). Then every path of
``bench.paths.PATHS`` is timed with the one timer (``bench.timing``: CUDA
graphs of back-to-back calls on rotated weight copies, cold L2, ranks
barriered), with the floor at the HBM rate measured in the same run, and a
per-kernel breakdown (``bench.paths.STAGES``) at one M.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from decode_boundary.bench.launch import RankContext
from decode_boundary.bench.timing import copies_for_cold_l2, copy_rate, graph_time_us
from decode_boundary.model.chain import AttentionBoundary, BoundaryOutputs
from decode_boundary.model.checks import (
    MIX_NAMES,
    OUTPUT_NAMES,
    check_mixes,
    check_outputs,
    outputs_identical,
    run_simulated,
    simulated_boundaries,
)
from decode_boundary.model.config import MODELS, BoundaryConfig

from .baselines import baseline_mixes_atol, baseline_rtol, check_baseline, quiet_autotune
from .gemm import RECOMPILE_LIMIT, mxfp8_weight_bytes
from .mixes import time_mixes
from .paths import COMPILED, STAGE_STEPS, STAGES, Step, baselines_for, build, join_all, paths_for
from .report import DEFAULT_BASELINES, Stages, environment, new_result, progress, write_json

MIXES_MAX_ROWS = 16  # the mixes' targets are at M <= 16 (bench.mixes)


@dataclass(frozen=True)
class BenchSpec:
    """What every rank does: verify ``rows``, then (``time``) time every path."""

    config: BoundaryConfig
    rows: tuple[int, ...]
    time: bool
    seed: int = 0
    weights_dir: str | None = None
    tp_shapes: int | None = None  # per-rank shapes of this TP (default: the group's size)
    breakdown_rows: int | None = None  # M of the per-kernel breakdown (default: the first)
    baselines: tuple[str, ...] = DEFAULT_BASELINES  # names of BASELINES verified and timed


def boundary_weight_bytes(config: BoundaryConfig, tp: int) -> int:
    """MXFP8 weight bytes one rank reads per boundary (wo_a groups, wo_b, fused_wqa_wkv)."""
    groups = config.o_groups // tp
    return (
        groups * mxfp8_weight_bytes(*config.wo_a_shape())
        + mxfp8_weight_bytes(*config.wo_b_shape(tp))
        + mxfp8_weight_bytes(*config.fused_wqa_wkv_shape())
    )


def cold_copies(ab: AttentionBoundary) -> list[AttentionBoundary]:
    """``ab`` and copies of its weights (sharing its all-reduce), enough that a
    step on copy i finds none of copy i-1's weights in L2."""
    per_copy = boundary_weight_bytes(ab.config, ab.tp)
    return ab.weight_copies(copies_for_cold_l2(per_copy, ab.device))


def mix_weight_bytes(ab: AttentionBoundary) -> int:
    """Bytes of the next sublayer's mix parameters (hc_fn, hc_scale, hc_base)
    one boundary reads."""
    return sum(t.numel() * t.element_size() for t in ab.mix_weights)


def cold_copies_for_parts(ab: AttentionBoundary) -> list[AttentionBoundary]:
    """``ab`` and copies of its weights, enough that the smallest part timed
    alone is cold too, not only the whole step (:func:`cold_copies`, whose
    copies are the first of these): a stage of the breakdown or a mixes path
    reads one layer's weights or only hc_fn (1.97 MB at V4.1-Flash: ~64
    copies for 2 x a 60 MiB L2, where the whole step's 28.9 MB needs 5)."""
    c = ab.config
    smallest = min(mix_weight_bytes(ab), mxfp8_weight_bytes(*c.wo_a_shape()),
                   mxfp8_weight_bytes(*c.wo_b_shape(ab.tp)),
                   mxfp8_weight_bytes(*c.fused_wqa_wkv_shape()))
    whole = boundary_weight_bytes(c, ab.tp)
    return ab.weight_copies(max(copies_for_cold_l2(smallest, ab.device),
                                copies_for_cold_l2(whole, ab.device)))


def one_gpu_parser(description: str) -> argparse.ArgumentParser:
    """The options of a script that studies one rank's share of a TP-N boundary
    on this GPU: --model, --tp-shapes, --rows, --out."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="v4.1-flash", choices=sorted(MODELS))
    parser.add_argument("--tp-shapes", type=int, default=4)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--out", type=Path, default=Path("benchmarks") / "results")
    return parser


def one_gpu_result(kind: str, args: argparse.Namespace) -> dict:
    """The result dict (``report``'s schema) of such a script's run."""
    command = " ".join([Path(sys.executable).name, *sys.argv])
    return new_result(kind, command, environment(False, []),
                      {"model": args.model, "tp": 1, "tp_shapes": args.tp_shapes,
                       "rows": args.rows})


def one_gpu_write(result: dict, args: argparse.Namespace) -> Path:
    """Write such a script's result to ``args.out`` as
    ``<kind>-<model>-tp<N>-shapes.json``, a stable name each run overwrites (the
    JSON records its commit; git keeps the history); returns the path."""
    name = f"{result['kind']}-{args.model}-tp{args.tp_shapes}-shapes.json"
    return write_json(result, args.out / name)


def one_gpu_boundary(args: argparse.Namespace, seed: int) -> tuple[AttentionBoundary, list]:
    """(one rank's boundary of ``args`` on the current GPU, precompiled for
    ``args.rows`` — the all-reduce over a group of one —, its cold-L2 copies)."""
    device = torch.device("cuda", torch.cuda.current_device())
    ab = AttentionBoundary(MODELS[args.model], args.tp_shapes, 0, None, device, max(args.rows),
                           seed=seed)
    ab.precompile(args.rows)
    return ab, cold_copies(ab)


def _digest(out: BoundaryOutputs) -> str:
    h = hashlib.sha256()
    for name in OUTPUT_NAMES + MIX_NAMES:
        h.update(getattr(out, name).detach().contiguous().view(torch.uint8).cpu().numpy())
    return h.hexdigest()


def _verdict(ab: AttentionBoundary, rows: int, paths_identical: bool, fused: BoundaryOutputs,
             unfused: BoundaryOutputs, ref: BoundaryOutputs, ranks_identical: bool) -> dict:
    """``{"rows", "ok", "failures", "ranks_identical"}`` of one row count."""
    failures = [] if paths_identical else ["fused and unfused outputs differ"]
    failures += [f"fused {f}" for f in check_outputs(fused, ref)]
    failures += [f"fused {f}" for f in check_mixes(fused, ab)]
    failures += [f"unfused {f}" for f in check_outputs(unfused, ref)]
    if not ranks_identical:
        failures.append("ranks hold different outputs")
    return {"rows": rows, "ok": not failures, "failures": failures,
            "ranks_identical": ranks_identical}


def verify_rows(ab: AttentionBoundary, rows: int, group: dist.ProcessGroup | None,
                baselines: dict[str, Step] | None = None, stage: Stages | None = None,
                first_call_s: dict[str, dict[str, float]] | None = None) -> dict:
    """Correctness of one row count: ``{"rows", "ok", "failures", "ranks_identical"}``.
    ``baselines``: the steps of ``BASELINES`` for ``ab`` (built here if not
    given), each checked by ``baselines.check_baseline`` (its bar: ``baseline_rtol``).
    ``stage``: told as ours and each baseline begin (``report.progress``);
    ``first_call_s``: gets ``[name][str(rows)]``, the seconds of each
    baseline's call here, its first at this M: a compiled one's compile.

    Must be called on every rank (it gathers the output digests)."""
    stage = stage or (lambda label: None)
    stage(f"verifying M = {rows}: ours, fused and unfused")
    inputs = ab.make_inputs(rows, seed=rows)
    fused = ab(inputs, fused=True, mixes_aside="auto")  # as the bench times them (paths)
    unfused = ab(inputs, fused=False, mixes_aside="auto")
    ab.join_mixes()  # before anything reads them
    ref = ab.reference(inputs)
    if baselines is None:
        baselines = {name: build(name, ab) for name in baselines_for(ab)}
    baseline_failures = []
    for name, step in baselines.items():
        stage(f"verifying M = {rows}: {'compiling' if name in COMPILED else 'running'} "
              f"baseline {name}")
        start = time.perf_counter()
        out = step(inputs)
        join_all(ab, [step])()  # an aside user step's mixes, before they are read
        if ab.device.type == "cuda":
            torch.cuda.synchronize(ab.device)
        if first_call_s is not None:
            first_call_s.setdefault(name, {})[str(rows)] = time.perf_counter() - start
        baseline_failures += [f"{name} {f}" for f in check_baseline(
            out, ref, ab, baseline_rtol(name), baseline_mixes_atol(name))]
    identical = True
    if group is not None:
        digests = [None] * dist.get_world_size(group)
        dist.all_gather_object(digests, _digest(fused), group=group)
        identical = len(set(digests)) == 1
    verdict = _verdict(ab, rows, outputs_identical(fused, unfused), fused, unfused, ref,
                       identical)
    verdict["failures"] += baseline_failures + _invariant_failures(ab, inputs, ref)
    verdict["ok"] = not verdict["failures"]
    return verdict


def _invariant_failures(ab: AttentionBoundary, inputs, ref: BoundaryOutputs) -> list[str]:
    """The batch-invariant path (``fused_invariant``) against the reference, and
    its tokens against the same tokens alone (M = 1) and as the first half of
    the batch: every bit."""
    twin = ab.batch_invariant_twin()
    out = twin(inputs, fused=True, mixes_aside="auto")
    heads = [(m, twin(inputs.head(m), fused=True, mixes_aside="auto"))
             for m in sorted({1, max(1, inputs.rows // 2)})]
    twin.join_mixes()
    failures = [f"fused_invariant {f}" for f in check_outputs(out, ref) + check_mixes(out, ab)]
    failures += [f"fused_invariant: its first {m} token(s) differ from the same at M = {m}"
                 for m, head in heads if not outputs_identical(out.head(m), head)]
    return failures


def verify_simulated(spec: BenchSpec, tp: int) -> dict:
    """``verify`` with ``tp`` ranks simulated in this process (the Triton
    interpreter on CPU): the same checks as :func:`verify_rows`, the partials
    of every rank feeding one reference. Returns rank 0's result shape."""
    ranks = simulated_boundaries(spec.config, tp, max(spec.rows), seed=spec.seed)
    checks = []
    for rows in spec.rows:
        inputs = [b.make_inputs(rows, seed=rows) for b in ranks]
        fused = run_simulated(ranks, inputs, fused=True, mixes_aside="auto")
        unfused = run_simulated(ranks, inputs, fused=False, mixes_aside="auto")
        partials = [b.reference_partial(x) for b, x in zip(ranks, inputs, strict=True)]
        ref = ranks[0].reference(inputs[0], partials)
        paths_identical = all(outputs_identical(f, u) for f, u in zip(fused, unfused, strict=True))
        checks.append(_verdict(ranks[0], rows, paths_identical, fused[0], unfused[0], ref,
                               len({_digest(out) for out in fused}) == 1))
    return {"rank": 0, "device": "cpu", "transport": "simulated", "verify": checks}


def run_rank(ctx: RankContext, spec: BenchSpec) -> dict:
    """One rank's part of ``verify`` / ``bench``: verification of every row
    count, then (when all pass and ``spec.time``) timings of every path.

    Returns ``{"rank", "device", "transport", "verify": [...], "seconds": {...}}``
    plus, when timed, ``{"copy_rate_gbps", "floor_us", "weight_copies", "timings":
    [{"rows", "us": {path: µs}}]}``. ``seconds`` (wall clock): ``precompile`` (our
    kernels), ``first_call`` {baseline: {M: s}} (a compiled one's compile and
    autotuning at that M), ``verify`` (all of it, those included), and when timed
    ``timing`` {path: s, all M}, ``breakdown``, ``mixes``."""
    quiet_autotune()
    start = time.perf_counter()
    ab = AttentionBoundary(spec.config, spec.tp_shapes or ctx.world_size, ctx.rank, ctx.group,
                           ctx.device, max(spec.rows), seed=spec.seed,
                           weights_dir=spec.weights_dir)
    ab.precompile(spec.rows)
    ab.batch_invariant_twin().precompile(spec.rows)  # fused_invariant
    seconds = {"precompile": time.perf_counter() - start, "first_call": {}}
    names = baselines_for(ab, spec.baselines)
    paths = paths_for(ab, spec.baselines)
    total = len(spec.rows) * (1 + len(names) + (len(paths) if spec.time else 0)) \
        + (2 if spec.time else 0)
    # One graph per baseline and M (dynamic=False): past Dynamo's default recompile
    # limit (8 row counts) a fullgraph call would fail.
    limit = torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT)
    try:
        with limit, progress(ctx.rank == 0, total) as stage:
            baselines = {name: build(name, ab) for name in names}
            start = time.perf_counter()
            checks = [verify_rows(ab, rows, ctx.group, baselines, stage, seconds["first_call"])
                      for rows in spec.rows]
            seconds["verify"] = time.perf_counter() - start
            result = {"rank": ctx.rank, "device": str(ctx.device),
                      "transport": ab.all_reduce.transport, "verify": checks,
                      "seconds": seconds}
            if spec.time and all(c["ok"] for c in checks):
                result.update(_time_paths(ab, spec, ctx, stage, paths, baselines, seconds))
    finally:
        ab.close()
    return result


def _time_paths(ab: AttentionBoundary, spec: BenchSpec, ctx: RankContext, stage: Stages,
                paths: list[str], first: dict[str, Step], seconds: dict) -> dict:
    """Timings of ``paths`` (``first``: steps already built for ``ab``); adds
    ``timing``, ``breakdown`` and ``mixes`` to ``seconds``."""
    per_copy = boundary_weight_bytes(spec.config, ab.tp)
    # The whole step rotates over the first copies; a part timed alone over all of them.
    parts = cold_copies_for_parts(ab)
    views = parts[:copies_for_cold_l2(per_copy, ab.device)]
    # Every path built once per weight copy.
    steps = {path: [first.get(path) or build(path, views[0]),
                    *(build(path, v) for v in views[1:])] for path in paths}
    rate = copy_rate(ctx.device)
    timings = []
    seconds["timing"] = dict.fromkeys(steps, 0.0)
    for rows in spec.rows:
        inputs = ab.make_inputs(rows, seed=rows)
        us = {}
        for path, per_view in steps.items():
            stage(f"timing {path} at M = {rows}")
            start = time.perf_counter()
            us[path] = graph_time_us([functools.partial(s, inputs) for s in per_view],
                                     ctx.device, ctx.group, join=join_all(ab, per_view))
            seconds["timing"][path] += time.perf_counter() - start
        timings.append({"rows": rows, "us": us})
    breakdown_rows = spec.breakdown_rows or spec.rows[0]
    hop_us = 0.0
    if ctx.group is not None and dist.get_world_size(ctx.group) > 1:
        # One measured hop: our plain publish + consume of one token over the group.
        one = torch.randn(1, spec.config.hidden, device=ctx.device).bfloat16()
        hop_us = graph_time_us([functools.partial(ab.all_reduce.plain_sum, one)], ctx.device,
                               ctx.group)
    stage(f"timing the per-kernel breakdown at M = {breakdown_rows}")
    start = time.perf_counter()
    inputs = ab.make_inputs(breakdown_rows, seed=breakdown_rows)
    # A stage or a mixes path reads far fewer bytes than the whole step: rotated over the
    # step's copies alone, its weights (or hc_fn) would stay in L2. Ours rotate over
    # ``parts``; the baselines' stages reuse their steps (their BF16 weights are twice
    # ours: a stage's rotation over the step's copies already exceeds the L2).
    breakdown = {}
    for path, stages_of in STAGES.items():
        if path not in steps:  # a baseline --baselines left out
            continue
        if path in STAGE_STEPS:
            per_view = [stages_of(v, s, inputs) for v, s in zip(views, steps[path], strict=True)]
        else:
            per_view = [stages_of(v, None, inputs) for v in parts]
        breakdown[path] = {name: graph_time_us([stages[name] for stages in per_view],
                                               ctx.device, ctx.group)
                           for name in per_view[0]}
    seconds["breakdown"] = time.perf_counter() - start
    # The next sublayer's mixes both ways, in the same run (bench.mixes), at the M their
    # targets name (<= MIXES_MAX_ROWS: each M compiles the separate tail once more).
    mixes_rows = [m for m in spec.rows if m <= MIXES_MAX_ROWS] or spec.rows[:1]
    stage(f"timing the next mixes both ways at M = {', '.join(map(str, mixes_rows))} "
          "(compiles the separate tail per M)")
    start = time.perf_counter()
    mixes = time_mixes(parts, mixes_rows, ctx.device, ctx.group)
    seconds["mixes"] = time.perf_counter() - start
    return {
        "mixes": mixes,
        "copy_rate_gbps": rate / 1e9,
        # Every weight byte one rank reads (wo_a, wo_b, fused_wqa_wkv) at the copy rate,
        # plus one measured hop where there are peers.
        "floor_us": per_copy / rate * 1e6 + hop_us,
        "hop_us": hop_us,
        "weight_copies": len(views),
        "part_copies": len(parts),  # the breakdown's (ours) and the mixes paths' rotation
        "timings": timings,
        "breakdown": {"rows": breakdown_rows, **breakdown},
    }
