"""Per-rank verification and timing of the attention boundary, and the GEMM table.

Measuring follows design.md §9: every time is the median, over several graph
replays, of one call inside a CUDA graph of many back-to-back calls that
rotate through enough weight copies (> 2x L2 in all) that no call finds its
weights in L2; ranks are barriered before each replay; floors use the HBM
rate measured in the same run (a 1 GiB copy, read + write counted).

Correctness comes first: per row count, fused and unfused outputs must be
bit-identical, both must pass the chain's reference check, and every rank must
hold the same bits (SHA-256 of the outputs compared over the group).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import Progress

from decode_boundary.gemm import mxfp8_mm
from decode_boundary.gemm.linear import Mxfp8Linear
from decode_boundary.gemm.timing import copy_rate, graph_time_us, median_replay_us, rotated_copies
from decode_boundary.launch import RankContext
from decode_boundary.model.baseline import FP8_ROW_ALIGN, RowwiseFp8Linear, rowwise_fp8
from decode_boundary.model.chain import (
    BASELINE_RTOL,
    OUTPUT_NAMES,
    PATHS,
    AttentionBoundary,
    BoundaryOutputs,
    check_outputs,
    outputs_identical,
    run_simulated,
    simulated_boundaries,
)
from decode_boundary.model.config import BoundaryConfig
from decode_boundary.mxfp8.format import mxfp8_scale_bytes
from decode_boundary.mxfp8.quantize_kernel import quantize_mxfp8

# Timing constants (design.md §9), in one place.
L2_MULTIPLE = 2  # rotated weights exceed this many L2s
MIN_GRAPH_STEPS = 20  # calls per graph: dilutes the replay launch and rank skew
WARMUP_REPLAYS = 3
REPLAYS = 15


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


def mxfp8_weight_bytes(n: int, k: int) -> int:
    """Bytes a GEMM must read for an MXFP8 [N, K] weight: elements + swizzled scales."""
    return n * k + mxfp8_scale_bytes(n, k)


def boundary_weight_bytes(config: BoundaryConfig, tp: int) -> int:
    """MXFP8 weight bytes one rank reads per boundary (wo_a groups, wo_b, fused_wqa_wkv)."""
    groups = config.o_groups // tp
    return (
        groups * mxfp8_weight_bytes(*config.wo_a_shape())
        + mxfp8_weight_bytes(*config.wo_b_shape(tp))
        + mxfp8_weight_bytes(*config.fused_wqa_wkv_shape())
    )


def copies_for_cold_l2(weight_bytes: int, device: torch.device) -> int:
    """Weight copies to rotate through so that all of them exceed L2_MULTIPLE x L2."""
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(2, L2_MULTIPLE * l2 // weight_bytes + 1)


def _barrier(group: dist.ProcessGroup | None, device: torch.device) -> None:
    torch.cuda.synchronize(device)
    if group is not None:
        dist.barrier(group=group, device_ids=[device.index])
        torch.cuda.synchronize(device)


def step_time_us(steps: Sequence[Callable[[], object]], device: torch.device,
                 group: dist.ProcessGroup | None = None, min_calls: int = MIN_GRAPH_STEPS,
                 replays: int = REPLAYS) -> float:
    """Median µs of one call, from a CUDA graph of back-to-back calls.

    ``steps`` holds one callable per weight copy; the graph calls them
    round-robin, ``min_calls`` times or more, and is replayed ``replays`` times.
    Each is run once eagerly first so that nothing compiles or allocates lazily
    during capture. With a group, every rank must call this with the same steps
    (the graph holds collectives)."""
    # Warm up on a side stream, as CUDA-graph capture recommends (lazy workspaces,
    # NCCL communicators and Triton compiles all happen here, not under capture).
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for step in steps:
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    calls = len(steps) * -(-min_calls // len(steps))
    _barrier(group, device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            steps[i % len(steps)]()
    for _ in range(WARMUP_REPLAYS):
        graph.replay()
    return median_replay_us(graph, calls, replays, before=lambda: _barrier(group, device))


def _digest(out: BoundaryOutputs) -> str:
    h = hashlib.sha256()
    for name in OUTPUT_NAMES:
        h.update(getattr(out, name).detach().contiguous().view(torch.uint8).cpu().numpy())
    return h.hexdigest()


def _verdict(rows: int, paths_identical: bool, fused: BoundaryOutputs,
             unfused: BoundaryOutputs, ref: BoundaryOutputs, ranks_identical: bool) -> dict:
    """``{"rows", "ok", "failures", "ranks_identical"}`` of one row count."""
    failures = [] if paths_identical else ["fused and unfused outputs differ"]
    failures += [f"fused {f}" for f in check_outputs(fused, ref)]
    failures += [f"unfused {f}" for f in check_outputs(unfused, ref)]
    if not ranks_identical:
        failures.append("ranks hold different outputs")
    return {"rows": rows, "ok": not failures, "failures": failures,
            "ranks_identical": ranks_identical}


def verify_rows(ab: AttentionBoundary, rows: int, group: dist.ProcessGroup | None) -> dict:
    """Correctness of one row count: ``{"rows", "ok", "failures", "ranks_identical"}``.

    Must be called on every rank (it gathers the output digests)."""
    inputs = ab.make_inputs(rows, seed=rows)
    fused = ab.run(inputs, "fused")
    unfused = ab.run(inputs, "unfused")
    ref = ab.reference(inputs)
    strong = check_outputs(ab.run(inputs, "strong_baseline"), ref, BASELINE_RTOL)
    identical = True
    if group is not None:
        digests = [None] * dist.get_world_size(group)
        dist.all_gather_object(digests, _digest(fused), group=group)
        identical = len(set(digests)) == 1
    verdict = _verdict(rows, outputs_identical(fused, unfused), fused, unfused, ref, identical)
    verdict["failures"] += [f"strong_baseline {f}" for f in strong]
    verdict["ok"] = not verdict["failures"]
    return verdict


def verify_simulated(spec: BenchSpec, tp: int) -> dict:
    """``verify`` with ``tp`` ranks simulated in this process (the Triton
    interpreter on CPU): the same checks as :func:`verify_rows`, the partials
    of every rank feeding one reference. Returns rank 0's result shape."""
    ranks = simulated_boundaries(spec.config, tp, max(spec.rows), seed=spec.seed)
    checks = []
    for rows in spec.rows:
        inputs = [b.make_inputs(rows, seed=rows) for b in ranks]
        fused = run_simulated(ranks, inputs, "fused")
        unfused = run_simulated(ranks, inputs, "unfused")
        partials = [b.reference_partial(x) for b, x in zip(ranks, inputs, strict=True)]
        ref = ranks[0].reference(inputs[0], partials)
        paths_identical = all(outputs_identical(f, u) for f, u in zip(fused, unfused, strict=True))
        checks.append(_verdict(rows, paths_identical, fused[0], unfused[0], ref,
                               len({_digest(out) for out in fused}) == 1))
    return {"rank": 0, "device": "cpu", "transport": "simulated", "verify": checks}


@contextlib.contextmanager
def _progress(show: bool, total: int) -> Iterator[Callable[[str], None]]:
    """A progress bar on stderr (stdout may carry JSON); ``advance(label)`` steps it."""
    if not show:
        yield lambda label: None
        return
    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("verifying", total=total)
        yield lambda label: bar.update(task, advance=1, description=label)


def run_rank(ctx: RankContext, spec: BenchSpec) -> dict:
    """One rank's part of ``verify`` / ``bench``: verification of every row
    count, then (when all pass and ``spec.time``) timings of every path.

    Returns ``{"rank", "device", "transport", "verify": [...]}`` plus, when timed,
    ``{"copy_rate_gbps", "floor_us", "weight_copies", "timings": [{"rows", "us": {path: µs}}]}``.
    """
    ab = AttentionBoundary(spec.config, spec.tp_shapes or ctx.world_size, ctx.rank, ctx.group,
                           ctx.device, max(spec.rows), seed=spec.seed,
                           weights_dir=spec.weights_dir)
    ab.precompile(spec.rows)
    total = len(spec.rows) * (1 + (len(PATHS) if spec.time else 0))
    try:
        with _progress(ctx.rank == 0, total) as advance:
            checks = []
            for rows in spec.rows:
                checks.append(verify_rows(ab, rows, ctx.group))
                advance(f"verified M={rows}")
            result = {"rank": ctx.rank, "device": str(ctx.device),
                      "transport": ab.all_reduce.transport, "verify": checks}
            if spec.time and all(c["ok"] for c in checks):
                result.update(_time_paths(ab, spec, ctx, advance))
    finally:
        ab.close()
    return result


def _time_paths(ab: AttentionBoundary, spec: BenchSpec, ctx: RankContext,
                advance: Callable[[str], None]) -> dict:
    per_copy = boundary_weight_bytes(spec.config, ab.tp)
    views = ab.weight_copies(copies_for_cold_l2(per_copy, ctx.device))
    rate = copy_rate(ctx.device)
    timings = []
    for rows in spec.rows:
        inputs = ab.make_inputs(rows, seed=rows)
        us = {}
        for path in PATHS:
            steps = [functools.partial(v.run, inputs, path) for v in views]
            us[path] = step_time_us(steps, ctx.device, ctx.group)
            advance(f"timed {path} M={rows}")
        timings.append({"rows": rows, "us": us})
    breakdown_rows = spec.breakdown_rows or spec.rows[0]
    hop_us = 0.0
    if ctx.group is not None and dist.get_world_size(ctx.group) > 1:
        # One measured hop: our plain publish + consume of one token over the group.
        one = torch.randn(1, spec.config.hidden, device=ctx.device).bfloat16()
        hop_us = step_time_us([functools.partial(ab.all_reduce.plain_sum, one)], ctx.device,
                              ctx.group)
    return {
        "copy_rate_gbps": rate / 1e9,
        # Every weight byte one rank reads (wo_a, wo_b, fused_wqa_wkv) at the copy rate,
        # plus one measured hop where there are peers.
        "floor_us": per_copy / rate * 1e6 + hop_us,
        "hop_us": hop_us,
        "weight_copies": len(views),
        "timings": timings,
        "breakdown": {"rows": breakdown_rows,
                      **_time_stages(views, ab.make_inputs(breakdown_rows, seed=breakdown_rows),
                                     ctx)},
    }


def _stages(ab: AttentionBoundary, inputs) -> dict[str, dict[str, Callable[[], object]]]:
    """Each kernel (or library call) of the fused path and of the strong
    baseline alone, as a callable, in chain order."""
    c = ab.config
    o = mxfp8_mm(ab.wo_a, inputs.attn_out)
    partial = mxfp8_mm(ab.wo_b, o)
    _, _, next_in = ab.reduce(inputs, partial)
    strong = ab.strong_baseline
    o_bf16 = strong.project_wo_a(inputs.attn_out)
    reduced = o_bf16 @ strong.wo_b.t()
    _, layer_input = strong.mhc(reduced, inputs.residual, inputs.post, inputs.comb, inputs.pre,
                                ab.norm_weight, c.eps)
    return {
        "fused": {
            "wo_a (grouped, BF16 in)": lambda: mxfp8_mm(ab.wo_a, inputs.attn_out),
            "wo_b (BF16 in)": lambda: mxfp8_mm(ab.wo_b, o),
            "publish + consumer (all-reduce, mHC, RMSNorm, MXFP8)":
                lambda: ab.reduce(inputs, partial),
            "fused_wqa_wkv (MXFP8 in)": lambda: mxfp8_mm(ab.fused_wqa_wkv, next_in),
        },
        "strong_baseline": {
            "wo_a (bmm)": lambda: strong.project_wo_a(inputs.attn_out),
            "wo_b (mm)": lambda: o_bf16 @ strong.wo_b.t(),
            f"all-reduce ({strong.transport})": lambda: strong.all_reduce(reduced),
            "mHC + RMSNorm (torch.compile)": lambda: strong.mhc(
                reduced, inputs.residual, inputs.post, inputs.comb, inputs.pre,
                ab.norm_weight, c.eps),
            "fused_wqa_wkv (mm)": lambda: layer_input @ strong.fused_wqa_wkv.t(),
        },
    }


def _time_stages(views: list[AttentionBoundary], inputs, ctx: RankContext) -> dict:
    """µs of each stage of :func:`_stages` timed alone (weights rotated over
    ``views``), per path. The fused path's wo_b is timed without its publishing
    epilogue (a publish needs its consumer), and publish + consume together."""
    per_view = [_stages(v, inputs) for v in views]
    out = {}
    for path, stages in per_view[0].items():
        out[path] = {name: step_time_us([s[path][name] for s in per_view], ctx.device, ctx.group)
                     for name in stages}
    return out


def gemm_table(shapes: Sequence[tuple], rows: Sequence[int], device: torch.device) -> dict:
    """Per (shape, rows): our MXFP8 GEMM, cuBLAS BF16 and cuBLAS FP8 row-wise
    (GEMM only: activations quantized beforehand), in µs, and the floor. A shape
    is (name, N, K) or (name, N, K, groups): a grouped layer (wo_a) of ``groups``
    [N/groups, K] weights in one launch of ours, one bmm of cuBLAS BF16, one
    FP8 call per group. Timed with the GEMM module's graph timer on weight
    copies exceeding L2_MULTIPLE x L2.

    Returns ``{"copy_rate_gbps", "gemms": [{"name", "n", "k", "groups", "rows", "floor_us",
    "us"}]}``."""
    rate = copy_rate(device)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    entries = []
    with _progress(True, len(shapes) * len(rows)) as advance:
        for name, n, k, *rest in shapes:
            groups = rest[0] if rest else 1
            layer = Mxfp8Linear.grouped([
                Mxfp8Linear.from_float(torch.randn(n // groups, k, device=device)
                                       .mul_(0.02).bfloat16()) for _ in range(groups)])
            ours = rotated_copies(layer, min_bytes=L2_MULTIPLE * l2)
            copies = len(ours)
            bf16 = [layer.dequantized_weight().bfloat16().view(groups, n // groups, k)
                    for _ in range(copies)]
            fp8 = [[RowwiseFp8Linear(layer.group(g)) for g in range(groups)]
                   for _ in range(copies)]
            for m in rows:
                us = _gemm_times(ours, bf16, fp8, m, k, groups, device)
                entries.append({"name": name, "n": n, "k": k, "groups": groups, "rows": m,
                                "floor_us": mxfp8_weight_bytes(n, k) / rate * 1e6, "us": us})
                advance(f"{name} M={m}")
    return {"copy_rate_gbps": rate / 1e9, "gemms": entries}


def _gemm_times(ours: list, bf16: list, fp8: list, m: int, k: int, groups: int,
                device: torch.device) -> dict:
    """µs per call of the three GEMMs on M random rows, each over its own weight copies."""
    x = torch.randn(m, groups * k, device=device).bfloat16()
    qx = quantize_mxfp8(x)
    xg = x.view(m, groups, k).transpose(0, 1)  # [G, M, K] for the bmm
    x8, s8 = zip(*[rowwise_fp8(torch.nn.functional.pad(xg[g], (0, 0, 0, -m % FP8_ROW_ALIGN)))
                   for g in range(groups)], strict=True)

    def fp8_call(i):
        for g, lin in enumerate(fp8[i]):
            torch._scaled_mm(x8[g], lin.weight_t, scale_a=s8[g], scale_b=lin.scale_t,
                             out_dtype=torch.bfloat16)

    return {
        "ours": graph_time_us(lambda i: mxfp8_mm(ours[i], qx), len(ours)),
        "cublas_bf16": graph_time_us(lambda i: torch.bmm(xg, bf16[i].transpose(1, 2)),
                                     len(bf16)),
        "cublas_fp8_rowwise": graph_time_us(fp8_call, len(fp8)),
    }
