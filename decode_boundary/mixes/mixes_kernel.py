"""The next sublayer's mHC mixes as a kernel of their own, right after the
consumer (V4.1's collapse with the previous pre, many tokens; spec:
``reference.mhc_mixes_ref``; docs/DESIGN.md §5.1). The consumer's fused
mixes (:mod:`.consumer_mixes`) have every (token, chunk) program read its
columns of ``hc_fn``: M x 2 MB through L2 at H = 5120, which dominates the
step at M = 32-64. Here a program owns
``BLOCK_H`` columns of ``TOKENS`` tokens, so ``hc_fn`` is read once per
token group.

**Layout.** ``streams``: the consumer's ``residual_out`` BF16 ``[M, HC, H]``;
``hc_fn`` FP32 ``[(2 + HC) * HC, HC * H]``; the mix rows int64 ``[rows,
MIX_ROW]`` in the consumer's layout (``common.contract.mix_columns``: a share of
``SLOTS`` words per chunk, then chunk 0's sums). Grid: (column chunks, token
groups), chunks fastest. Program (c, g) holds ``hc_fn``'s columns of chunk c
(loaded before its grid wait: a weight, overlapping the consumer), then for
its tokens computes the chunk's (2 + HC) * HC dots on BF16 tensor cores and
the sum of squares, and stores them tagged into each token's row at ``c *
SLOTS`` — the consumer's shares, word for word. Then program (c, g) combines
token g * TOKENS + i for every i = c mod chunks: the consumer's
``combine_shares`` (bounded poll of the token's shares, one fixed sum, scalar
sigmoid / softmax / Sinkhorn).
``COOPERATIVE=False`` (the interpreter, whose programs run one by one): one
program per group walks every chunk, then combines every token.

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

**The dots.** residual_out is BF16; hc_fn's FP32 columns are split (before
the wait) into three BF16 parts, hi + mid + lo = the value exactly for 2^-110
<= |x| < 3.39e38 and 0 (``_split_bf16``; below, lo loses bits under BF16's
subnormals, <= 2^-134 absolute; above, hi overflows), so each product is
exact and only the tensor cores' FP32 accumulation rounds: three BF16 MMAs
per stream (an FP32 FMA dot took most of the kernel; ``tf32x3``, six TF32
MMAs a stream, loses 2 bits of hc_fn and was slower). Without ``USE_PTX``
(the interpreter, whose BF16 dot is wrong, or PTX switched off) the same
parts are multiplied as FP32 (as
BF16 values, exact in TF32 too). The dots are not the reference's summation
order: pre/post/comb match it within FP32 rounding, as the fused mixes do,
not bit for bit.

**The consumer's order** (``CONSUMER_ORDER``, batch-invariant mode): the
shares are computed token by token with the consumer's own device function
(``consumer_mixes.publish_mix_partials``: FP32 products, its sums over the
[SLOTS, BLOCK_H] tile) on hc_fn's FP32 columns, with ``BLOCK_H`` and the
warps of the consumer's batch-invariant tactic
(``consumer_tactics.INVARIANT_CONSUMER``), so each share is word for word
the one that consumer publishes with the mixes fused, and the combine is the
same function: a token's pre, post and comb then do not depend on which of
the two computed them, i.e. on the row count that picks one. FP32 FMA dots
are slower than the MMAs; the kernel runs on the side stream from
``MIXES_ASIDE_MIN_ROWS`` tokens, where it overlaps the next GEMM.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.compiled import load_module
from ..common.tagged_words import tag_word
from ..common.timeline import END, MARK1, MARK2, START, WAITED, launch_args, stamp, stamp_after
from .consumer_mixes import load_mix_weights, publish_mix_partials
from .mhc_combine import combine_shares

TOKENS = 16  # tokens per program: tl.dot's smallest M
# sm_90: 255 registers (hc_fn's parts held), no spills, 16 KB shared (64 x 4: 168, but
# twice the shares to poll)
MIXES_KERNEL_BLOCK_H, MIXES_KERNEL_WARPS = 128, 4


@triton.jit
def _split_bf16(fn, HC: tl.constexpr):
    """hc_fn's FP32 tiles as three BF16 tiles each, hi + mid + lo = the value
    exactly (8 + 8 + 8 significand bits; each remainder is exact in FP32): the
    dots' products with residual_out (BF16) are then exact on BF16 tensor
    cores. Flat tuple: stream t's parts at 3t .. 3t + 2, hi first."""
    parts = ()
    for t in tl.static_range(HC):
        hi = fn[t].to(tl.bfloat16)
        rest = fn[t] - hi.to(tl.float32)
        mid = rest.to(tl.bfloat16)
        parts = parts + (hi, mid, (rest - mid.to(tl.float32)).to(tl.bfloat16))
    return parts


@triton.jit
def _chunk_parts(hc_fn_ptr, chunk, HC: tl.constexpr, HIDDEN: tl.constexpr,
                 BLOCK_H: tl.constexpr, SLOTS: tl.constexpr):
    """Chunk ``chunk``'s columns of hc_fn, loaded and split (``_split_bf16``)."""
    cols = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
    return _split_bf16(load_mix_weights(hc_fn_ptr, cols, cols < HIDDEN, HC, HIDDEN, SLOTS), HC)


@triton.jit
def _store_consumer_shares(streams_ptr, mix_ptr, generation_ptr, fn, chunk, group, m_total,
                           HC: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr,
                           TOKENS: tl.constexpr, SLOTS: tl.constexpr, MIX_ROW: tl.constexpr):
    """``CONSUMER_ORDER``: chunk ``chunk``'s share of each live token of the
    group, token by token, by the consumer's own device function
    (``publish_mix_partials``: FP32 products, its sums) on the same [SLOTS,
    BLOCK_H] tiles and warps: word for word the share the consumer with
    fused mixes and this ``BLOCK_H`` publishes. ``fn``: the chunk's hc_fn
    columns in FP32 (``load_mix_weights``)."""
    cols = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < HIDDEN
    for i in range(TOKENS):
        m = group * TOKENS + i
        if m < m_total:
            streams = ()
            for t in tl.static_range(HC):
                streams = streams + (tl.load(streams_ptr + (m * HC + t).to(tl.int64) * HIDDEN
                                             + cols, mask=cmask, other=0.0),)
            publish_mix_partials(mix_ptr, fn, m, chunk, streams, tl.load(generation_ptr + m),
                                 HC, SLOTS, MIX_ROW)


@triton.jit
def _chunk_weights(hc_fn_ptr, chunk, HC: tl.constexpr, HIDDEN: tl.constexpr,
                   BLOCK_H: tl.constexpr, SLOTS: tl.constexpr, CONSUMER_ORDER: tl.constexpr):
    """Chunk ``chunk``'s hc_fn columns as the shares take them: FP32 tiles
    (``CONSUMER_ORDER``) or split into BF16 parts (``_chunk_parts``)."""
    if CONSUMER_ORDER:
        cols = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
        fn = load_mix_weights(hc_fn_ptr, cols, cols < HIDDEN, HC, HIDDEN, SLOTS)
    else:
        fn = _chunk_parts(hc_fn_ptr, chunk, HC, HIDDEN, BLOCK_H, SLOTS)
    return fn


@triton.jit
def _chunk_shares(streams_ptr, mix_ptr, generation_ptr, fn, chunk, group, m_total, tokens, live,
                  tags, HC: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr,
                  TOKENS: tl.constexpr, SLOTS: tl.constexpr, MIX_ROW: tl.constexpr,
                  USE_PTX: tl.constexpr, CONSUMER_ORDER: tl.constexpr):
    """Chunk ``chunk``'s shares of the group's live tokens, in the consumer's
    order or on tensor cores (``CONSUMER_ORDER``)."""
    if CONSUMER_ORDER:
        _store_consumer_shares(streams_ptr, mix_ptr, generation_ptr, fn, chunk, group, m_total,
                               HC, HIDDEN, BLOCK_H, TOKENS, SLOTS, MIX_ROW)
    else:
        _store_shares(streams_ptr, mix_ptr, fn, chunk, tokens, live, tags, HC, HIDDEN, BLOCK_H,
                      SLOTS, MIX_ROW, USE_PTX)


@triton.jit
def _store_shares(streams_ptr, mix_ptr, fn, chunk, tokens, live, tags, HC: tl.constexpr,
                  HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr, SLOTS: tl.constexpr,
                  MIX_ROW: tl.constexpr, USE_PTX: tl.constexpr):
    """Chunk ``chunk``'s share of every live token's mixes, tagged into its
    row: the dots, then the sum of squares (word (2 + HC) * HC), then +0.0.
    ``fn``: the chunk's hc_fn tiles as 3 * HC BF16 parts (``_chunk_parts``)."""
    NMIX: tl.constexpr = (2 + HC) * HC
    cols = chunk * BLOCK_H + tl.arange(0, BLOCK_H)[None, :]
    rows = tokens[:, None]
    acc = tl.zeros((rows.shape[0], SLOTS), dtype=tl.float32)
    squares = tl.zeros((rows.shape[0],), dtype=tl.float32)
    for t in tl.static_range(HC):
        s = tl.load(streams_ptr + (rows * HC + t).to(tl.int64) * HIDDEN + cols,
                    mask=live[:, None] & (cols < HIDDEN), other=0.0)
        for part in tl.static_range(3):  # the smallest first
            if USE_PTX:
                acc = tl.dot(s, tl.trans(fn[t * 3 + 2 - part]), acc)
            else:  # the interpreter's BF16 dot is wrong: FP32 operands
                acc = tl.dot(s.to(tl.float32), tl.trans(fn[t * 3 + 2 - part].to(tl.float32)),
                             acc, input_precision="tf32")  # BF16 values: exact in TF32
        wide = s.to(tl.float32)
        squares = squares + tl.sum(wide * wide, axis=1)
    j = tl.arange(0, SLOTS)[None, :]
    part = tl.where(j < NMIX, acc, tl.where(j == NMIX, squares[:, None], 0.0))
    tl.store(mix_ptr + rows * MIX_ROW + chunk * SLOTS + j, tag_word(part, tags[:, None]),
             mask=live[:, None])


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
    TIMELINE: tl.constexpr, CONSUMER_ORDER: tl.constexpr = False,
):
    CHUNKS: tl.constexpr = (HIDDEN + BLOCK_H - 1) // BLOCK_H
    chunk = tl.program_id(0)  # always 0 without COOPERATIVE: the program walks the chunks
    group = tl.program_id(1)
    slot = stamp_base + group * tl.num_programs(0) + chunk  # common.timeline (a diagnostic)
    stamp(stamp_ptr, slot, START, TIMELINE)
    if COOPERATIVE:  # a weight: its loads overlap the consumer
        fn = _chunk_weights(hc_fn_ptr, chunk, HC, HIDDEN, BLOCK_H, SLOTS, CONSUMER_ORDER)
        if TIMELINE:  # mark2: hc_fn's columns in
            last = tl.sum(fn[len(fn) - 1].to(tl.float32), axis=None).to(tl.int32)
            stamp_after(stamp_ptr, slot, MARK2, last, TIMELINE)
    if USE_PDL:
        # Released before the wait, so the next GEMM's weight stream still overlaps the
        # consumer (as behind the consumer alone); it reads nothing of ours before its
        # own wait, and every consumer program is resident before we start.
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    stamp(stamp_ptr, slot, WAITED, TIMELINE)
    tokens = group * TOKENS + tl.arange(0, TOKENS)
    live = tokens < m_total
    tags = tl.load(generation_ptr + tokens, mask=live, other=0)
    if COOPERATIVE:
        _chunk_shares(streams_ptr, mix_ptr, generation_ptr, fn, chunk, group, m_total, tokens,
                      live, tags, HC, HIDDEN, BLOCK_H, TOKENS, SLOTS, MIX_ROW, USE_PTX,
                      CONSUMER_ORDER)
        first, step = chunk, CHUNKS
        stamp(stamp_ptr, slot, MARK1, TIMELINE)  # mark1: the shares stored
    else:
        for c in range(CHUNKS):
            _chunk_shares(streams_ptr, mix_ptr, generation_ptr,
                          _chunk_weights(hc_fn_ptr, c, HC, HIDDEN, BLOCK_H, SLOTS, CONSUMER_ORDER),
                          c, group, m_total, tokens, live, tags, HC, HIDDEN, BLOCK_H, TOKENS,
                          SLOTS, MIX_ROW, USE_PTX, CONSUMER_ORDER)
        tl.debug_barrier()  # this program's stores precede its polls below
        first, step = tl.full((), 0, tl.int32), 1
    i = first
    while i < TOKENS:
        m = group * TOKENS + i
        if m < m_total:
            combine_shares(mix_ptr, status_ptr, hc_scale_ptr, hc_base_ptr, pre_out_ptr,
                           post_out_ptr, comb_out_ptr, m, tl.load(generation_ptr + m), eps,
                           hc_eps, sinkhorn_rounds, wait_bound, HC, HIDDEN, CHUNKS, CHUNKS_P2,
                           SLOTS, MIX_ROW, TOTALS_OFF, USE_PTX)
        i += step
    stamp(stamp_ptr, slot, END, TIMELINE)


def launch_next_mixes(streams: torch.Tensor, hc_fn: torch.Tensor, hc_scale: torch.Tensor,
                      hc_base: torch.Tensor, eps: float, hc_eps: float, sinkhorn_iters: int,
                      generation: torch.Tensor, mix_words: torch.Tensor, status: torch.Tensor,
                      wait_bound: int, outputs: tuple, row: dict, *, cooperative: bool,
                      ptx: bool, pdl: bool, consumer_order: bool = False,
                      compile_only: bool = False) -> None:
    """Launch the kernel on tensors ``consume`` has checked (it is the only
    caller): ``outputs`` = (pre [M, hc], post [M, hc], comb [M, hc, hc]) FP32,
    written; ``row``: the mix row's geometry as constexprs (SLOTS, MIX_ROW,
    TOTALS_OFF; ``consumer._mix_row``); ``consumer_order``: the shares as the
    consumer computes them (module docstring, batch-invariant mode)."""
    m, hc, hidden = streams.shape
    chunks = triton.cdiv(hidden, MIXES_KERNEL_BLOCK_H)
    grid = (chunks if cooperative else 1, triton.cdiv(m, TOKENS))
    kernel = next_mixes_kernel.warmup if compile_only else next_mixes_kernel[grid]
    stamps, stamp_base, timeline = (status, 0, False) if compile_only else \
        launch_args("next_mixes_kernel", grid[0] * grid[1], streams.device, status)
    compiled = kernel(
        streams, hc_fn, hc_scale, hc_base, generation, mix_words, status, *outputs, stamps,
        stamp_base, m,
        float(eps), float(hc_eps), sinkhorn_iters - 1, int(wait_bound),
        HC=hc, HIDDEN=hidden, BLOCK_H=MIXES_KERNEL_BLOCK_H, TOKENS=TOKENS, **row,
        CHUNKS_P2=triton.next_power_of_2(chunks), COOPERATIVE=cooperative, USE_PTX=ptx,
        USE_PDL=pdl, TIMELINE=timeline, CONSUMER_ORDER=consumer_order,
        num_warps=MIXES_KERNEL_WARPS, enable_fp_fusion=False,
        launch_pdl=pdl,
        **(dict(grid=grid) if compile_only else {}))
    if compile_only:
        load_module(compiled)
