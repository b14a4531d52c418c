"""Per-rank checks of the whole boundary chain on real GPUs, run by
``tests/model/test_chain_multigpu.py`` through :func:`decode_boundary.bench.launch.launch`
(importable so ``spawn`` can pickle them).

The fused path (``wo_b`` publishing from its epilogue) and the unfused one
(plain GEMM, publish kernel) run on the same inputs inside one CUDA graph per
M, several layers in a row (each layer's ``residual_out`` feeds the next);
every replay draws fresh inputs on the device and adds the number of
differing bits (GEMM partial, residual_out, layer_input, q) to a device
counter, so replays are checked without a host sync.
"""

from __future__ import annotations

import random

import torch
import torch.distributed as dist

from decode_boundary.bench.harness import verify_rows
from decode_boundary.bench.launch import RankContext
from decode_boundary.model.chain import AttentionBoundary, BoundaryInputs
from decode_boundary.model.checks import MIX_NAMES, OUTPUT_NAMES
from decode_boundary.model.config import MODELS

GRAPH_ROWS = (1, 2, 5, 8, 16)  # 16: above the publishing GEMM's rows, the fallback path
LAYERS = 2


def _bits_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.view(torch.int16) != b.view(torch.int16)).sum()


def _draw_inputs(ab: AttentionBoundary, rows: int, residual: torch.Tensor | None) -> BoundaryInputs:
    """Fresh inputs from the default CUDA generator (graph-safe: its offsets
    advance per replay). Every rank draws every rank's attention output in the
    same order, so the replicated tensors agree and each rank keeps its own."""
    c, tp, device = ab.config, ab.tp, ab.device
    attn = torch.randn(tp, rows, c.attn_width(tp), device=device).bfloat16()
    if residual is None:
        residual = torch.randn(rows, c.hc_mult, c.hidden, device=device).bfloat16()
    post = 2 * torch.rand(rows, c.hc_mult, device=device)
    comb = torch.rand(rows, c.hc_mult, c.hc_mult, device=device)
    comb = comb / comb.sum(dim=1, keepdim=True)
    pre = torch.rand(rows, c.hc_mult, device=device)
    return BoundaryInputs(attn[ab.rank], residual, post, comb, pre)


def _layers_step(layers: list[AttentionBoundary], rows: int, mismatches: torch.Tensor):
    """One decode step through ``layers``: fused and unfused on the same
    inputs, differences counted; returns the last layer's fused outputs."""
    residual = None
    for ab in layers:
        inputs = _draw_inputs(ab, rows, residual)
        partial_fused = ab.produce(inputs, fused=True)
        fused = ab.consume(inputs, partial_fused)
        partial_plain = ab.produce(inputs, fused=False)
        plain = ab.consume(inputs, partial_plain)
        mismatches.add_(_bits_differ(partial_fused, partial_plain))
        for name in OUTPUT_NAMES + MIX_NAMES:  # the next mixes too (FP32: as 2 x 16 bits)
            mismatches.add_(_bits_differ(getattr(fused, name), getattr(plain, name)))
        residual = fused.residual_out
    return fused


def check_chain(ctx: RankContext, model: str, replays: int) -> dict:
    """Reference checks outside graphs, then ``replays`` graph replays in a
    random M order shared by all ranks. Returns counts for the test to assert."""
    config = MODELS[model]
    first = AttentionBoundary(config, ctx.world_size, ctx.rank, ctx.group, ctx.device,
                              capacity=max(GRAPH_ROWS), seed=11)
    first.precompile(sorted({*GRAPH_ROWS, 1, 8, 16}))
    layers = first.weight_copies(LAYERS)
    result = {"verify": [verify_rows(first, rows, ctx.group) for rows in (1, 8, 16)]}
    torch.manual_seed(1234)  # the same device random stream on every rank
    mismatches = torch.zeros((), dtype=torch.int64, device=ctx.device)
    graphs, last = {}, {}
    stream = torch.cuda.Stream(ctx.device)
    stream.wait_stream(torch.cuda.current_stream(ctx.device))
    with torch.cuda.stream(stream):
        for rows in GRAPH_ROWS:
            _layers_step(layers, rows, mismatches)  # compiles and allocates outside capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                last[rows] = _layers_step(layers, rows, mismatches)
            graphs[rows] = graph
    torch.cuda.current_stream(ctx.device).wait_stream(stream)
    torch.cuda.synchronize(ctx.device)
    mismatches.zero_()
    order = random.Random(5).choices(GRAPH_ROWS, k=replays)
    dist.barrier(group=ctx.group)
    for i, rows in enumerate(order):
        graphs[rows].replay()
        if i % 1000 == 999:
            first.all_reduce.check()
    torch.cuda.synchronize(ctx.device)
    first.all_reduce.check()
    digests = []
    for rows in GRAPH_ROWS:
        out = last[rows]
        digests.append(tuple(int(getattr(out, n).view(torch.int16).float().sum().item())
                             for n in OUTPUT_NAMES + MIX_NAMES))
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, digests, group=ctx.group)
    result.update(replays=replays, mismatches=int(mismatches.item()),
                  ranks_identical=all(d == everyone[0] for d in everyone))
    first.close()
    return result
