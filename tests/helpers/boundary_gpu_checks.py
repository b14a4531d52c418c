"""Per-rank checks of ``BoundaryAllReduce`` on real GPUs, run by
``tests/boundary/test_boundary_multigpu.py`` through :func:`decode_boundary.bench.launch.launch`
(one process per GPU; importable so ``spawn`` can pickle them).

Every rank draws the same inputs (one seed for all ranks, all partials), so it
can compute the reference itself; outputs are also all-gathered and compared
across ranks bit for bit.
"""

from __future__ import annotations

import random
import time

import torch
import torch.distributed as dist
from consumer_checks import consumer_mismatches

from decode_boundary.bench.launch import RankContext
from decode_boundary.boundary.all_reduce import BoundaryAllReduce
from decode_boundary.boundary.reference import consumer_ref, moe_finalize_ref, reduce_ref
from decode_boundary.mxfp8.format import mxfp8_scale_bytes, quantize_mxfp8_ref

HC, TOP_K, EPS, CAPACITY = 4, 6, 1e-6, 64


def _inputs(m, tp, hidden, gen, device):
    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    return dict(
        xs=randn(tp, m, hidden).bfloat16(),
        residual=randn(m, HC, hidden).bfloat16(),
        post=torch.rand(m, HC, generator=gen, device=device) * 2,
        comb=torch.rand(m, HC, HC, generator=gen, device=device),
        pre=torch.rand(m, HC, generator=gen, device=device),
        gamma=(1 + 0.1 * randn(hidden)).bfloat16(),
    )


def _mxfp8_buffers(m, hidden, device):
    data = torch.empty(m, hidden, dtype=torch.float8_e4m3fn, device=device)
    return data, torch.zeros(mxfp8_scale_bytes(m, hidden), dtype=torch.uint8, device=device)


def _mismatches(outs, d, partials, quantize, residual_only):
    """Mismatch count (a device tensor: no sync) of one call's outputs."""
    res_out, layer, q = outs
    pre = None if residual_only else d["pre"]
    ref_res, ref_layer, _ = consumer_ref(list(partials), d["residual"], d["post"], d["comb"],
                                         pre, d["gamma"], EPS)
    bad = consumer_mismatches(res_out, None if residual_only else layer, ref_res, ref_layer)
    if quantize:
        want = quantize_mxfp8_ref(layer)
        bad = bad + (q[0].view(torch.uint8) != want.data.view(torch.uint8)).sum()
        bad = bad + (q[1] != want.scale).sum()
    return bad


def _same_on_all_ranks(t, group):
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, t.contiguous(), group=group)
    return all(torch.equal(e.view(torch.uint8), everyone[0].view(torch.uint8)) for e in everyone)


def check_variants(ctx: RankContext, transport: str, hidden: int) -> dict:
    """Full, residual-only, MXFP8, finalize and plain sum vs the reference;
    outputs bit-identical across ranks. Returns {variant: mismatches}."""
    ar = BoundaryAllReduce(hidden, HC, CAPACITY, TOP_K, ctx.group, quantize_layer_input=True,
                           device=ctx.device, transport=transport)
    gen = torch.Generator(device=ctx.device).manual_seed(1234)
    result = {}
    for m in (1, 5, 16, CAPACITY):
        d = _inputs(m, ctx.world_size, hidden, gen, ctx.device)
        x = d["xs"][ctx.rank].contiguous()
        args = dict(residual=d["residual"], post=d["post"], comb=d["comb"])
        for variant in ("full", "residual_only", "mxfp8"):
            q = _mxfp8_buffers(m, hidden, ctx.device) if variant == "mxfp8" else None
            pre = None if variant == "residual_only" else d["pre"]
            res_out, layer, *_ = ar(x.clone(), **args, pre=pre, norm_weight=d["gamma"],
                                    norm_eps=EPS, mxfp8_out=q)
            bad = _mismatches((res_out, layer, q), d, d["xs"], q is not None, pre is None)
            same = _same_on_all_ranks(res_out, ctx.group) and (
                layer is None or _same_on_all_ranks(layer, ctx.group))
            result[f"{variant} M={m}"] = (int(bad), same)
        plain = ar.plain_sum(x)
        result[f"plain M={m}"] = (int((plain.view(torch.int16)
                                       != reduce_ref(list(d["xs"])).view(torch.int16)).sum()),
                                  _same_on_all_ranks(plain, ctx.group))
        rows = 3 * m
        moe = [(torch.randn(rows, hidden, generator=gen, device=ctx.device).bfloat16(),
                torch.rand(m, TOP_K, generator=gen, device=ctx.device),
                torch.randint(-1, rows, (m, TOP_K), generator=gen, device=ctx.device,
                              dtype=torch.int32),
                torch.randn(m, hidden, generator=gen, device=ctx.device).bfloat16())
               for _ in range(ctx.world_size)]
        q = _mxfp8_buffers(m, hidden, ctx.device)
        res_out, layer, *_ = ar.finalize(*moe[ctx.rank], **args, pre=d["pre"],
                                         norm_weight=d["gamma"], norm_eps=EPS, mxfp8_out=q)
        partials = [moe_finalize_ref(*a) for a in moe]
        bad = _mismatches((res_out, layer, q), d, partials, True, False)
        result[f"finalize M={m}"] = (int(bad), _same_on_all_ranks(res_out, ctx.group))
    ar.check()
    ar.close()
    return result


def check_graph_replays(ctx: RankContext, replays: int, hidden: int) -> dict:
    """CUDA graphs (one per M) that draw fresh inputs on the device, run the
    fused all-reduce and compare with the torch reference on the device,
    accumulating a mismatch counter; replayed in a random M order shared by all
    ranks. Returns {"replays", "mismatches", "graphs"}."""
    ar = BoundaryAllReduce(hidden, HC, CAPACITY, TOP_K, ctx.group, quantize_layer_input=True,
                           device=ctx.device)
    sizes = (1, 2, 3, 8, 16, 33, CAPACITY)
    ar.precompile(sizes)
    mismatches = torch.zeros((), dtype=torch.int64, device=ctx.device)
    gen = torch.Generator(device=ctx.device).manual_seed(99)  # same stream on every rank
    graphs = {}
    stream = torch.cuda.Stream(ctx.device)
    stream.wait_stream(torch.cuda.current_stream(ctx.device))
    with torch.cuda.stream(stream):
        for m in sizes:
            def body(m=m):
                d = _inputs(m, ctx.world_size, hidden, gen, ctx.device)
                q = _mxfp8_buffers(m, hidden, ctx.device)
                res_out, layer, *_ = ar(d["xs"][ctx.rank].contiguous(), residual=d["residual"],
                                        post=d["post"], comb=d["comb"], pre=d["pre"],
                                        norm_weight=d["gamma"], norm_eps=EPS, mxfp8_out=q)
                mismatches.add_(_mismatches((res_out, layer, q), d, d["xs"], True, False))

            body()  # warm-up compiles outside the capture
            torch.cuda.synchronize(ctx.device)
            graph = torch.cuda.CUDAGraph()
            graph.register_generator_state(gen)
            with torch.cuda.graph(graph, stream=stream):
                body()
            graphs[m] = graph
    torch.cuda.current_stream(ctx.device).wait_stream(stream)
    torch.cuda.synchronize(ctx.device)
    order = random.Random(7).choices(sizes, k=replays)
    dist.barrier(group=ctx.group)
    for i, m in enumerate(order):
        graphs[m].replay()
        if i % 1000 == 999:
            ar.check()
    torch.cuda.synchronize(ctx.device)
    ar.check()
    out = {"replays": replays, "mismatches": int(mismatches), "graphs": len(graphs)}
    ar.close()
    return out


def check_skipped_step(ctx: RankContext, timeout_s: float, hidden: int) -> dict:
    """Rank 1 skips a step, twice: a plain sum, then a full step (mHC, RMSNorm,
    MXFP8). Each time rank 0 must raise within the bound naming rank 1 alone
    (its own rows arrived, and the norm hand-off still met), then both
    ``reset(collective=True)`` and a plain and a full step are exact again."""
    ar = BoundaryAllReduce(hidden, HC, CAPACITY, TOP_K, ctx.group, device=ctx.device,
                           wait_timeout_s=timeout_s, transport="mailbox",
                           quantize_layer_input=True, residual_only=False)
    ar.precompile(4)  # collective: otherwise rank 1's first call would compile after the skip
    gen = torch.Generator(device=ctx.device).manual_seed(5)
    d = _inputs(4, ctx.world_size, hidden, gen, ctx.device)
    x = d["xs"][ctx.rank].contiguous()
    steps = {
        "plain": lambda: ar.plain_sum(x),
        "full": lambda: ar(x, residual=d["residual"], post=d["post"], comb=d["comb"],
                           pre=d["pre"], norm_weight=d["gamma"], norm_eps=EPS,
                           mxfp8_out=_mxfp8_buffers(4, hidden, ctx.device)),
    }
    out = {}
    for name, step in steps.items():
        if ctx.rank != 1:
            start = time.monotonic()
            try:
                step()
                out[f"raised_{name}"] = ""
            except RuntimeError as e:
                out[f"raised_{name}"] = str(e)
            out[f"seconds_{name}"] = time.monotonic() - start
        ar.reset(collective=True)
        try:  # both kinds of step again: the mailbox and the norm scratch were re-armed
            plain = ar.plain_sum(x)
            q = _mxfp8_buffers(4, hidden, ctx.device)
            full = ar(x, residual=d["residual"], post=d["post"], comb=d["comb"], pre=d["pre"],
                      norm_weight=d["gamma"], norm_eps=EPS, mxfp8_out=q)
            out[f"exact_after_reset_{name}"] = torch.equal(
                plain.view(torch.int16), reduce_ref(list(d["xs"])).view(torch.int16)) and (
                int(_mismatches((full.residual_out, full.layer_input, q), d, d["xs"], True,
                                False)) == 0)
        except RuntimeError as e:  # a post-reset timeout comes back as data, not a dead rank
            out[f"exact_after_reset_{name}"] = False
            out[f"after_reset_error_{name}"] = str(e)
    ar.close()
    return out
