"""The next sublayer's mHC mixes as a kernel of their own, right after the
consumer (V4.1's collapse with the previous pre, many tokens; spec:
``reference.mhc_mixes_ref``; docs/DESIGN.md §5.1). The consumer's fused
mixes (:mod:`.consumer_mixes`) have every (token, chunk) program read its
columns of ``hc_fn``: M x 2 MB through L2 at H = 5120, which at M = 32-64
cost the chain 14-21 µs (benchmarks/NOTES.md). Here a program owns
``BLOCK_H`` columns of ``TOKENS`` tokens, so ``hc_fn`` is read once per
token group.

**Layout.** A program is a *group program* of :mod:`..common.mhc_shares`
(``BLOCK_H`` = ``SHARE_BLOCK_H`` columns of ``SHARE_TOKENS`` tokens; its
docstring gives the layout, the dots and the order of shares and combine).
Grid: (column chunks, token groups), chunks fastest; the program holds its
chunk's hc_fn (loaded and split before its grid wait: a weight, overlapping
the consumer). ``COOPERATIVE=False`` (the interpreter): one program per group.

**Tags and ordering.** A token's tag is ``generation[m]`` as the consumer
left it: read with a plain load after the grid wait (the consumer has
completed its grid), it is the tag of this step, which no earlier launch
used for that token's row (each consumer launch advances it by one, and a
mixes launch follows exactly one), so a share with the tag is this launch's.
Nothing here advances it. Only after the full mode's consumer: the
residual-only one leaves the generation alone (``consume`` never pairs
them).

**PDL.** The kernel releases its dependents *before* its grid wait, so the
GEMM after it starts its weight stream while the consumer still runs, as it
would behind the consumer alone; that GEMM reads nothing of this kernel's
before its own wait, and every consumer program is resident before this
kernel starts (it launches once they all released it).

**What must not race.** The kernel before this one is the consumer that
wrote ``streams`` and ``generation``; no other kernel uses the mix rows or
the outputs meanwhile. The mix rows are zeroed only with the generations.

**The dots** (``common.mhc_shares``): exact products of BF16 parts on
tensor cores, FP32 accumulation; pre/post/comb match the reference within
FP32 rounding, as the fused mixes do, not bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.mhc_shares import (
    SHARE_BLOCK_H,
    SHARE_TOKENS,
    SHARE_WARPS,
    chunk_parts,
    group_combine,
    group_shares,
)
from ..common.timeline import END, MARK1, MARK2, START, WAITED, launch_args, stamp, stamp_after
from .publish_kernel import load_module


# m_total and stamp_base unspecialized: one compiled variant serves every M and slot
# (precompile and graph capture key the variant without them; M = 1 or a multiple of
# 16 must not recompile).
@triton.jit(do_not_specialize=["m_total", "stamp_base"])
def next_mixes_kernel(
    streams_ptr, hc_fn_ptr, hc_scale_ptr, hc_base_ptr, generation_ptr, mix_ptr, status_ptr,
    pre_out_ptr, post_out_ptr, comb_out_ptr, stamp_ptr, stamp_base, m_total, eps, hc_eps,
    sinkhorn_rounds, wait_bound, HC: tl.constexpr, HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr, TOKENS: tl.constexpr, SLOTS: tl.constexpr, MIX_ROW: tl.constexpr,
    TOTALS_OFF: tl.constexpr, CHUNKS_P2: tl.constexpr,
    COOPERATIVE: tl.constexpr, USE_PTX: tl.constexpr, USE_PDL: tl.constexpr,
    TIMELINE: tl.constexpr,
):
    chunk = tl.program_id(0)  # always 0 without COOPERATIVE: the program walks the chunks
    group = tl.program_id(1)
    slot = stamp_base + group * tl.num_programs(0) + chunk  # common.timeline (a diagnostic)
    stamp(stamp_ptr, slot, START, TIMELINE)
    fn = ()
    if COOPERATIVE:  # a weight: its loads overlap the consumer
        fn = chunk_parts(hc_fn_ptr, chunk, HC, HIDDEN, BLOCK_H, SLOTS)
        if TIMELINE:  # mark2: hc_fn's columns in
            last = tl.sum(fn[3 * HC - 1].to(tl.float32), axis=None).to(tl.int32)
            stamp_after(stamp_ptr, slot, MARK2, last, TIMELINE)
    if USE_PDL:
        # Released before the wait, so the next GEMM's weight stream still overlaps the
        # consumer (as behind the consumer alone); it reads nothing of ours before its
        # own wait, and every consumer program is resident before we start.
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    stamp(stamp_ptr, slot, WAITED, TIMELINE)
    first, step = group_shares(streams_ptr, hc_fn_ptr, generation_ptr, mix_ptr, fn, chunk, group,
                               m_total, HC, HIDDEN, BLOCK_H, TOKENS, SLOTS, MIX_ROW, COOPERATIVE,
                               COOPERATIVE, USE_PTX)
    stamp(stamp_ptr, slot, MARK1, TIMELINE)  # mark1: the shares stored
    group_combine(generation_ptr, mix_ptr, status_ptr, hc_scale_ptr, hc_base_ptr, pre_out_ptr,
                  post_out_ptr, comb_out_ptr, group, first, step, m_total, eps, hc_eps,
                  sinkhorn_rounds, wait_bound, HC, HIDDEN, BLOCK_H, TOKENS, SLOTS, MIX_ROW,
                  TOTALS_OFF, CHUNKS_P2, USE_PTX)
    stamp(stamp_ptr, slot, END, TIMELINE)


def launch_next_mixes(streams: torch.Tensor, hc_fn: torch.Tensor, hc_scale: torch.Tensor,
                      hc_base: torch.Tensor, eps: float, hc_eps: float, sinkhorn_iters: int,
                      generation: torch.Tensor, mix_words: torch.Tensor, status: torch.Tensor,
                      wait_bound: int, outputs: tuple, row: dict, *, cooperative: bool,
                      ptx: bool, pdl: bool, compile_only: bool = False) -> None:
    """Launch the kernel on tensors ``consume`` has checked (it is the only
    caller): ``outputs`` = (pre [M, hc], post [M, hc], comb [M, hc, hc]) FP32,
    written; ``row``: the mix row's geometry as constexprs (SLOTS, MIX_ROW,
    TOTALS_OFF; ``consumer._mix_row``)."""
    m, hc, hidden = streams.shape
    chunks = triton.cdiv(hidden, SHARE_BLOCK_H)
    grid = (chunks if cooperative else 1, triton.cdiv(m, SHARE_TOKENS))
    kernel = next_mixes_kernel.warmup if compile_only else next_mixes_kernel[grid]
    stamps, stamp_base, timeline = (status, 0, False) if compile_only else \
        launch_args("next_mixes_kernel", grid[0] * grid[1], streams.device, status)
    compiled = kernel(
        streams, hc_fn, hc_scale, hc_base, generation, mix_words, status, *outputs, stamps,
        stamp_base, m,
        float(eps), float(hc_eps), sinkhorn_iters - 1, int(wait_bound),
        HC=hc, HIDDEN=hidden, BLOCK_H=SHARE_BLOCK_H, TOKENS=SHARE_TOKENS, **row,
        CHUNKS_P2=triton.next_power_of_2(chunks), COOPERATIVE=cooperative, USE_PTX=ptx,
        USE_PDL=pdl, TIMELINE=timeline, num_warps=SHARE_WARPS, enable_fp_fusion=False,
        launch_pdl=pdl,
        **(dict(grid=grid) if compile_only else {}))
    if compile_only:
        load_module(compiled)
