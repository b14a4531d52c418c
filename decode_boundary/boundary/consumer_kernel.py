"""Consume: wait for every rank's partial in this rank's mailbox, reduce, and
apply mHC, RMSNorm and MXFP8 quantization in the same kernel (design.md §5-6).

Grid: (column chunks, tokens), chunks fastest so a token's programs are
dispatched together. Each program owns ``BLOCK_H`` columns of one token: it
waits for those columns of every rank's slot (one [BLOCK_H] vector per rank),
sums them in rank order, mixes the residual streams (one [BLOCK_H] vector per
stream; ``post``/``comb``/``pre`` are scalars, so no step reduces across
threads) and writes ``residual_out`` for its columns, then re-arms the slots.

The RMSNorm needs the sum of squares of the whole row. Each program adds up
its own chunk's squares and publishes that one FP32 partial into the token's
row of ``sumsq`` (int64 words, one per 32-column unit: the chunk's first unit
holds the partial, its other units +0.0), each word tagged in its high half
with the token's generation + 1. The total is one fixed tree sum over the
row's units (the same bits in every program, on every rank). Two ways to meet
(``COOPERATIVE``):

* cooperative (GPU default): after publishing, a program polls the token's
  whole row until every unit carries this launch's tag (bounded; a timeout
  sets ``NORM_TIMEOUT_BIT`` in the status word instead of hanging), then
  normalises and quantizes its own chunk. One store and one poll, no atomics:
  the hand-off is a Lamport exchange like the mailbox's. This needs the
  programs of a token to be resident together: the grid is small (M x H /
  BLOCK_H programs), chunks are dispatched fastest, and a dependent kernel
  launches only after every program here has started.
* serial (the interpreter, which runs programs one after another; selectable
  on the GPU, never faster there): one program per token walks its chunks twice, the first time
  keeping ``prenorm`` in a scratch row, the second time normalising it.

Modes (``MODE``): 0 = plain sum (``reduced`` only; the benchmark's baseline of
the fusion), 1 = residual-only (mHC mixing), 2 = full (mixing, collapse with
``pre``, RMSNorm, optional MXFP8). ``LAMPORT=False`` reads an already gathered
[tp, M, H] buffer (the NCCL fallback) with the same arithmetic.

The FP32 operation order is that of :mod:`.reference` (launch with
``enable_fp_fusion=False``): ``reduced`` and ``residual_out`` are bit-exact;
``layer_input`` may differ from the reference by 1 BF16 ulp (chunked
length-H sum of squares, approximate ``rsqrt`` on the GPU); its MXFP8 bytes
equal ``quantize_mxfp8_ref`` of the kernel's own ``layer_input``.

**Memory consistency.** Mailbox slots are polled with volatile loads
(``ld.volatile``: not served from L1, so a peer's NVLink store becomes visible)
until no element is -0; every element is checked because a peer's 16-byte
store may land in pieces, and each element is its own flag, so no acquire is
needed before using it. ACTIVE is read with a plain load after the grid
dependency wait (the publisher's grid has completed). Re-arming the slots
(-0 stores) and advancing NEXT are plain stores: the next reader of either is
a later kernel on this GPU (kernel boundary), and a peer writes this stage
again only three boundaries later, after our later publishes, which follow this
kernel's completion in stream order.

Norm hand-off: every program of a launch writes every unit of its chunk with
aligned 64-bit stores (tag and partial land together: a word is never seen
half written), so a word with this launch's tag holds this launch's partial,
and after a launch every unit of the token holds its tag. The tag is
``generation[m] + 1``: read (volatile) after the grid dependency wait, it was
advanced by the previous launch's chunk-0 program, which stores it only after
seeing every unit tagged, i.e. after every program of that launch has read the
old value; so no program ever mixes two generations. (After a norm timeout
chunk 0 advances it anyway; a program that had not started yet may then tag a
unit with the next launch's tag, which is why every timeout needs
``reset(collective=True)``, which zeroes generations and words together.) A word from an older
launch carries the previous tag (every launch rewrites the whole row), so it
is never taken for this one's, also when the 32-bit generation wraps. Polls
are volatile (not served from L1). The serial path uses the same words; its
own stores precede its reads through a ``debug_barrier``. The status word is
set with ``atomic_or`` (several programs may time out together).

**What the caller must guarantee.** Every rank publishes exactly once per
consume into stage NEXT (publish kernel, finalize kernel or a publishing GEMM)
and consumes once; residual, post, comb, pre and gamma are not written by the
kernel that immediately precedes this one and that kernel triggers its
dependents only after its own grid wait (they are loaded before the grid
dependency wait); output and scratch buffers are not in use by another kernel;
the kernel is compiled before the peers wait on this rank (see
``BoundaryAllReduce.precompile``).

**Why it is CUDA-graph safe.** The stage is read and advanced on the device,
the generation words only ever move forward (on the device), the timeout and
status live in device memory; no host value changes between replays, and the
grid depends only on M, fixed per captured graph.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import env
from ..common.contract import SENTINEL_BITS, STAGES
from ..common.rounding import quantize_groups, swizzled_offset, to_bf16_rne, zero_scale_padding
from ..mxfp8.format import check_scale_buffer
from .publish_kernel import load_module

PLAIN, RESIDUAL_ONLY, FULL = 0, 1, 2  # MODE values (host side)
_PLAIN, _FULL = tl.constexpr(PLAIN), tl.constexpr(FULL)
SENTINEL = tl.constexpr(SENTINEL_BITS)  # the unwritten slot's -0.0 as int16
# Status bit of a norm hand-off that timed out (bits 0..tp-1 name missing ranks).
NORM_TIMEOUT_BIT = 1 << 30
_NORM_TIMEOUT_BIT = tl.constexpr(NORM_TIMEOUT_BIT)
QUANT_GROUP = 32  # MXFP8 group: a chunk holds whole groups, so it is >= 32 columns


class ConsumerTactic(NamedTuple):
    """Columns per program, warps, and whether the programs of a token share the
    RMSNorm through the tagged hand-off (``cooperative``) or one program per
    token walks the row chunk by chunk (only for the full mode; the others never
    need a whole row)."""

    block_h: int
    warps: int
    cooperative: bool = True


# (largest M, tactic), re-pinned from `benchmarks/allreduce.py --sweep`. Measured on
# 2 x H200, H = 5120, tagged norm hand-off (2026-11-29, results/allreduce-sweep-*-2017):
# M = 1 fastest at (512, 4) 4.03 us, M = 8 at (256, 2) / (512, 4) 4.18, M = 16 at (256, 2)
# 4.76 ((512, 4) 5.49), M = 32 at (512, 4) 6.10 ((1024, 4) 8.13), M = 64 at (512, 4) 12.02
# ((1024, 4) 12.69); serial tactics 11-14 us.
CONSUMER_TACTICS = (
    (8, ConsumerTactic(512, 4)),
    (16, ConsumerTactic(256, 2)),
    (1 << 30, ConsumerTactic(512, 4)),
)


@triton.jit
def _now(spins, like, USE_PTX: tl.constexpr):
    """Per element of ``like`` (int32): nanoseconds from ``%globaltimer`` on the
    GPU, read by the thread that holds the element; the spin count otherwise."""
    if USE_PTX:
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [like],
                                         dtype=tl.int64, is_pure=False, pack=1)
    return (like * 0 + spins).to(tl.int64)


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _poll_verdict(unwritten, start, spins, wait_bound, status_ptr, CHECK_STATUS: tl.constexpr,
                  USE_PTX: tl.constexpr):
    """One verdict per program for a spin loop: bit 0 = some element is still
    unwritten, bit 1 = give up (the bound has passed, or with ``CHECK_STATUS``
    another program already reported a failure). Threads read the timer and the
    status word at different moments, so their own answers can differ; a loop
    exit they disagreed on would leave warps in different iterations, pairing
    the barriers of different block reductions. Hence one OR-reduction over every
    thread's answer decides, and every thread gets the same value."""
    stop = (_now(spins, unwritten, USE_PTX) - start) > wait_bound
    if CHECK_STATUS:
        stop = stop | (tl.load(status_ptr + unwritten * 0, volatile=True) != 0)
    return tl.reduce(unwritten | tl.where(stop, 2, 0), 0, _bit_or)


@triton.jit
def _unwritten(slots, cmask, TP: tl.constexpr):
    """Per column: 1 where some rank's element is still -0 (one tuple entry per rank)."""
    hole = tl.zeros(cmask.shape, dtype=tl.int32)
    for r in tl.static_range(TP):
        bits = slots[r].to(tl.int16, bitcast=True)
        hole = hole | tl.where(cmask & (bits == SENTINEL), 1, 0)
    return hole


@triton.jit
def _load_slots(slot, cmask, row_stride, TP: tl.constexpr, VOLATILE: tl.constexpr):
    """Rank r's BF16 [BLOCK_H] slot at ``slot + r * row_stride``, as a tuple."""
    slots = ()
    for r in tl.static_range(TP):
        slots = slots + (tl.load(slot + r * row_stride, mask=cmask, other=0.0,
                                 volatile=VOLATILE),)
    return slots


@triton.jit
def _wait_slots(slot, cmask, row_stride, status_ptr, wait_bound,
                TP: tl.constexpr, USE_PTX: tl.constexpr):
    """Volatile loads of every rank's slot until no element is -0 or the bound
    passes (or another program already reported a failure); a rank still missing
    then sets its bit in the status word. Returns the slots (tuple of BF16)."""
    slots = _load_slots(slot, cmask, row_stride, TP, True)
    hole = _unwritten(slots, cmask, TP)
    pending = tl.max(hole) > 0
    if pending:
        spins = 0
        start = _now(spins, hole, USE_PTX)
        go = pending
        while go:
            slots = _load_slots(slot, cmask, row_stride, TP, True)
            spins += 1
            verdict = _poll_verdict(_unwritten(slots, cmask, TP), start, spins, wait_bound,
                                    status_ptr, True, USE_PTX)
            pending = (verdict & 1) != 0
            go = verdict == 1
        if pending:
            missing = 0
            for r in tl.static_range(TP):
                bits = slots[r].to(tl.int16, bitcast=True)
                gone = tl.max(tl.where(cmask & (bits == SENTINEL), 1, 0))
                missing = missing | (gone << r)
            tl.atomic_or(status_ptr, missing)
    return slots


@triton.jit
def _load_inputs(residual_ptr, post_ptr, comb_ptr, pre_ptr, gamma_ptr, m, cols, cmask,
                 HC: tl.constexpr, HIDDEN: tl.constexpr, MODE: tl.constexpr):
    """Everything but the partials, as tuples: residual streams ([BLOCK_H] BF16
    each), post[t], comb[s, t] (flat s * HC + t), pre[t] (FP32 scalars), gamma."""
    res = ()
    post = ()
    comb = ()
    pre = ()
    gamma = tl.zeros(cols.shape, dtype=tl.bfloat16)
    if MODE != _PLAIN:
        for s in tl.static_range(HC):
            res = res + (tl.load(residual_ptr + (m * HC + s).to(tl.int64) * HIDDEN + cols,
                                 mask=cmask, other=0.0),)
            post = post + (tl.load(post_ptr + m * HC + s),)
        for i in tl.static_range(HC * HC):
            comb = comb + (tl.load(comb_ptr + m * HC * HC + i),)
    if MODE == _FULL:
        for t in tl.static_range(HC):
            pre = pre + (tl.load(pre_ptr + m * HC + t),)
        gamma = tl.load(gamma_ptr + cols, mask=cmask, other=0.0)
    return res, post, comb, pre, gamma


@triton.jit
def _reduce_mix(slots, res, post, comb, pre, out_ptr, m, cols, cmask,
                TP: tl.constexpr, HC: tl.constexpr, HIDDEN: tl.constexpr, MODE: tl.constexpr):
    """reduced (plain mode: stored) or residual_out (stored) and, in the full
    mode, the BF16-rounded prenorm as FP32, in the reference's operation order."""
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for r in tl.static_range(TP):
        acc = acc + slots[r].to(tl.float32)
    reduced = to_bf16_rne(acc)
    prenorm = tl.zeros(cols.shape, dtype=tl.float32)
    if MODE == _PLAIN:
        tl.store(out_ptr + m.to(tl.int64) * HIDDEN + cols, reduced, mask=cmask)
    else:
        # mixed[t] = reduced * post[t] + sum_s residual[s] * comb[s, t], s in order.
        for t in tl.static_range(HC):
            mix = reduced.to(tl.float32) * post[t]
            for s in tl.static_range(HC):
                mix = mix + res[s].to(tl.float32) * comb[s * HC + t]
            mixed = to_bf16_rne(mix)
            tl.store(out_ptr + (m * HC + t).to(tl.int64) * HIDDEN + cols, mixed, mask=cmask)
            if MODE == _FULL:
                prenorm = prenorm + mixed.to(tl.float32) * pre[t]
        prenorm = to_bf16_rne(prenorm).to(tl.float32)
    return prenorm


@triton.jit
def _publish_partial(sumsq_ptr, m, chunk, partial, tag, UNITS: tl.constexpr,
                     BLOCK_H: tl.constexpr):
    """Write this chunk's units of token m's row, tagged: the first unit holds
    ``partial``, the others +0.0 (so every launch rewrites the whole row,
    whatever its tactic). One aligned 64-bit store per unit: tag and value
    land together."""
    PER_CHUNK: tl.constexpr = BLOCK_H // 32
    k = tl.arange(0, PER_CHUNK)
    units = chunk * PER_CHUNK + k
    value = tl.where(k == 0, partial, 0.0).to(tl.int32, bitcast=True)
    word = (tag.to(tl.int64) << 32) | (value.to(tl.int64) & 0xFFFFFFFF)
    tl.store(sumsq_ptr + m * UNITS + units, word, mask=units < UNITS)


@triton.jit
def _wait_partials(sumsq_ptr, status_ptr, m, tag, wait_bound, UNITS: tl.constexpr,
                   UNITS_P2: tl.constexpr, USE_PTX: tl.constexpr):
    """Poll token m's row (volatile) until every unit carries ``tag`` or the
    bound passes (then ``NORM_TIMEOUT_BIT``); returns the row's sum of squares,
    one fixed tree over the units."""
    units = tl.arange(0, UNITS_P2)
    live = units < UNITS
    row = sumsq_ptr + m * UNITS + units
    words = tl.load(row, mask=live, other=0, volatile=True)
    old = tl.where(live & ((words >> 32).to(tl.int32) != tag), 1, 0)
    stale = tl.max(old) > 0
    if stale:
        spins = 0
        start = _now(spins, old, USE_PTX)
        go = stale
        while go:
            words = tl.load(row, mask=live, other=0, volatile=True)
            spins += 1
            old = tl.where(live & ((words >> 32).to(tl.int32) != tag), 1, 0)
            verdict = _poll_verdict(old, start, spins, wait_bound, status_ptr, False, USE_PTX)
            stale = (verdict & 1) != 0
            go = verdict == 1
        if stale:
            tl.atomic_or(status_ptr, _NORM_TIMEOUT_BIT)
    partials = (words & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
    return tl.sum(partials, axis=0)


@triton.jit
def _norm_chunk(prenorm, gamma, total, eps, layer_ptr, qdata_ptr, qscale_ptr, m, chunk, cols,
                cmask, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr, QUANT: tl.constexpr):
    """layer_input = bf16((prenorm * rsqrt(total / H + eps)) * gamma) for this
    chunk, and its MXFP8 groups (whole groups: BLOCK_H % 32 == 0)."""
    rstd = tl.math.rsqrt(total / HIDDEN + eps)
    y = to_bf16_rne((prenorm * rstd) * gamma.to(tl.float32))
    row_off = m.to(tl.int64) * HIDDEN
    tl.store(layer_ptr + row_off + cols, y, mask=cmask)
    if QUANT:
        GROUPS: tl.constexpr = BLOCK_H // 32
        K_TILES: tl.constexpr = (HIDDEN // 32 + 3) // 4
        q, exponent = quantize_groups(tl.reshape(y.to(tl.float32), (1, GROUPS, 32)))
        tl.store(qdata_ptr + row_off + cols, tl.reshape(q, (BLOCK_H,)), mask=cmask)
        groups = chunk * GROUPS + tl.arange(0, GROUPS)
        tl.store(qscale_ptr + swizzled_offset(m, groups, K_TILES),
                 tl.reshape(exponent, (GROUPS,)).to(tl.uint8), mask=groups < HIDDEN // 32)
        zero_scale_padding(qscale_ptr, m, tl.num_programs(1), groups, chunk == 0, HIDDEN // 32)


@triton.jit
def _consume_chunk(mailbox_ptr, status_ptr, out_ptr, slot_row, row_stride, wait_bound,
                   res, post, comb, pre, m, cols, cmask,
                   TP: tl.constexpr, HC: tl.constexpr, HIDDEN: tl.constexpr, MODE: tl.constexpr,
                   LAMPORT: tl.constexpr, USE_PTX: tl.constexpr):
    """Wait for (Lamport) or read (gathered) every rank's slot of these columns,
    re-arm it, reduce and mix; returns the prenorm (full mode)."""
    slot = mailbox_ptr + slot_row + cols
    if LAMPORT:
        slots = _wait_slots(slot, cmask, row_stride, status_ptr, wait_bound, TP, USE_PTX)
        # Re-arm the consumed slots; the values are in registers now.
        for r in tl.static_range(TP):
            tl.store(slot + r * row_stride,
                     tl.full(cols.shape, SENTINEL, tl.int16).to(tl.bfloat16, bitcast=True),
                     mask=cmask)
    else:
        slots = _load_slots(slot, cmask, row_stride, TP, False)
    return _reduce_mix(slots, res, post, comb, pre, out_ptr, m, cols, cmask, TP, HC, HIDDEN, MODE)


# capacity is the gathered buffer's M in NCCL mode: unspecialized, so M = 1 does
# not turn it into a Python int.
@triton.jit(do_not_specialize=["capacity"])
def consumer_kernel(
    mailbox_ptr, stage_ptr, status_ptr, generation_ptr, sumsq_ptr, prenorm_ptr,
    residual_ptr, post_ptr, comb_ptr, pre_ptr, gamma_ptr,
    out_ptr, layer_ptr, qdata_ptr, qscale_ptr,
    eps, capacity, wait_bound,
    TP: tl.constexpr, HC: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr,
    UNITS_P2: tl.constexpr, MODE: tl.constexpr, QUANT: tl.constexpr, LAMPORT: tl.constexpr,
    COOPERATIVE: tl.constexpr, USE_PTX: tl.constexpr, USE_PDL: tl.constexpr,
):
    CHUNKS: tl.constexpr = (HIDDEN + BLOCK_H - 1) // BLOCK_H
    UNITS: tl.constexpr = (HIDDEN + 31) // 32  # sumsq row: one word per 32 columns
    SERIAL: tl.constexpr = (MODE == _FULL) and (not COOPERATIVE)
    chunk = tl.program_id(0)  # always 0 when SERIAL: the program walks the row
    m = tl.program_id(1)
    offs = tl.arange(0, BLOCK_H)
    cols = chunk * BLOCK_H + offs
    cmask = cols < HIDDEN
    if not SERIAL:
        # Inputs that earlier kernels produced: load them while the publisher runs.
        res, post, comb, pre, gamma = _load_inputs(residual_ptr, post_ptr, comb_ptr, pre_ptr,
                                                   gamma_ptr, m, cols, cmask, HC, HIDDEN, MODE)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    stage = tl.full((), 0, tl.int32)  # a tensor in both modes (the NCCL path has no stage)
    if LAMPORT:
        stage = tl.load(stage_ptr + 1)
        if (m == 0) & (chunk == 0):
            tl.store(stage_ptr, (stage + 1) % STAGES)  # read by the next publish, after our grid
    # Slot of rank r, token m: mailbox[stage, r, m] (Lamport) or gathered[r, m].
    row_stride = capacity.to(tl.int64) * HIDDEN
    slot_row = (stage * TP).to(tl.int64) * row_stride + m.to(tl.int64) * HIDDEN
    row_off = m.to(tl.int64) * HIDDEN
    tag = tl.full((), 0, tl.int32)
    if MODE == _FULL:
        # After the grid wait: the previous launch advanced it (see the docstring).
        tag = tl.load(generation_ptr + m, volatile=True) + 1
    if SERIAL:
        for c in range(CHUNKS):
            cols = c * BLOCK_H + offs
            cmask = cols < HIDDEN
            res, post, comb, pre, gamma = _load_inputs(residual_ptr, post_ptr, comb_ptr, pre_ptr,
                                                       gamma_ptr, m, cols, cmask, HC, HIDDEN, MODE)
            prenorm = _consume_chunk(mailbox_ptr, status_ptr, out_ptr, slot_row, row_stride,
                                     wait_bound, res, post, comb, pre, m, cols, cmask,
                                     TP, HC, HIDDEN, MODE, LAMPORT, USE_PTX)
            _publish_partial(sumsq_ptr, m, c, tl.sum(prenorm * prenorm, axis=0), tag, UNITS,
                             BLOCK_H)
            tl.store(prenorm_ptr + row_off + cols, prenorm.to(tl.bfloat16), mask=cmask)
        tl.debug_barrier()  # this program's scratch stores precede its reads below
        total = _wait_partials(sumsq_ptr, status_ptr, m, tag, wait_bound, UNITS, UNITS_P2,
                               USE_PTX)
        tl.store(generation_ptr + m, tag)
        for c in range(CHUNKS):
            cols = c * BLOCK_H + offs
            cmask = cols < HIDDEN
            prenorm = tl.load(prenorm_ptr + row_off + cols, mask=cmask, other=0.0,
                              volatile=True).to(tl.float32)
            gamma = tl.load(gamma_ptr + cols, mask=cmask, other=0.0)
            _norm_chunk(prenorm, gamma, total, eps, layer_ptr, qdata_ptr, qscale_ptr, m, c,
                        cols, cmask, HIDDEN, BLOCK_H, QUANT)
    else:
        prenorm = _consume_chunk(mailbox_ptr, status_ptr, out_ptr, slot_row, row_stride,
                                 wait_bound, res, post, comb, pre, m, cols, cmask,
                                 TP, HC, HIDDEN, MODE, LAMPORT, USE_PTX)
        if MODE == _FULL:
            _publish_partial(sumsq_ptr, m, chunk, tl.sum(prenorm * prenorm, axis=0), tag, UNITS,
                             BLOCK_H)
            total = _wait_partials(sumsq_ptr, status_ptr, m, tag, wait_bound, UNITS, UNITS_P2,
                                   USE_PTX)
            if chunk == 0:  # every program has read the old generation: it tagged with it
                tl.store(generation_ptr + m, tag)
            _norm_chunk(prenorm, gamma, total, eps, layer_ptr, qdata_ptr, qscale_ptr, m, chunk,
                        cols, cmask, HIDDEN, BLOCK_H, QUANT)


def consumer_tactic(m: int, hidden: int) -> ConsumerTactic:
    """The table's tactic for M tokens; serial in the interpreter (which runs
    programs one after another, so they cannot wait for each other)."""
    tactic = next(t for limit, t in CONSUMER_TACTICS if m <= limit)
    tactic = tactic._replace(block_h=min(tactic.block_h, triton.next_power_of_2(hidden)))
    if env.interpret_mode():
        tactic = tactic._replace(cooperative=False)
    return tactic


def sumsq_columns(hidden: int) -> int:
    """Row length of the per-token sum-of-squares scratch (one tagged word per
    32 columns, the finest chunk a tactic may use)."""
    return triton.cdiv(hidden, QUANT_GROUP)


def _need(t, name, dtype, shape, device):
    if t is None:
        raise ValueError(f"{name} is required here: expected {dtype} {list(shape)}")
    if t.dtype != dtype or tuple(t.shape) != tuple(shape) or t.device != device:
        raise ValueError(f"{name} must be {dtype} {list(shape)} on {device}, got {t.dtype} "
                         f"{list(t.shape)} on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_tactic(tactic: ConsumerTactic, hidden: int, mode: int) -> None:
    block, warps, cooperative = tactic
    if block < QUANT_GROUP or block & (block - 1) or warps < 1 or warps & (warps - 1):
        raise ValueError(f"tactic {tactic}: columns per program must be a power of two "
                         f">= {QUANT_GROUP} and warps a power of two")
    chunks = triton.cdiv(hidden, block)
    if mode == FULL and cooperative and chunks > 1 and env.interpret_mode():
        raise ValueError(f"tactic {tactic}: cooperative programs wait for each other, which "
                         "the interpreter (programs run one by one) cannot do")


def consume(
    mailbox: torch.Tensor,
    tp: int,
    m: int,
    *,
    mode: int,
    stage_state: torch.Tensor | None = None,
    status: torch.Tensor | None = None,
    generation: torch.Tensor | None = None,
    sumsq: torch.Tensor | None = None,
    prenorm: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    post: torch.Tensor | None = None,
    comb: torch.Tensor | None = None,
    pre: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    mxfp8_out: tuple[torch.Tensor, torch.Tensor] | None = None,
    wait_bound: int = 0,
    lamport: bool = True,
    tactic: ConsumerTactic | None = None,
    compile_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the consumer for ``m`` tokens. Returns (``reduced`` [M, H] in plain
    mode / ``residual_out`` [M, hc, H], ``layer_input`` [M, H] or None).

    ``mailbox``: BF16 [3, tp, capacity, H] (Lamport) or [tp, M, H] (gathered).
    ``generation`` int32 [rows] and ``sumsq`` int64 [rows, ``sumsq_columns(H)``]
    (full mode; zeroed together at allocation and after any timeout, never one
    without the other; ``prenorm`` BF16 [rows, H] too for a serial tactic):
    per-token scratch, rows >= M. ``status`` int32 [1]: the mailbox's status
    word, also required in full mode with ``lamport=False`` (the norm hand-off
    records its timeout there). ``wait_bound``: nanoseconds with PTX
    (``%globaltimer``), spins without; > 0 whenever something may wait. ``tactic``: default from
    ``CONSUMER_TACTICS``. ``compile_only``: compile this variant, launch nothing
    (the outputs are then unwritten).
    """
    device = mailbox.device
    hidden = mailbox.shape[-1]
    if mailbox.dtype != torch.bfloat16 or not mailbox.is_contiguous():
        raise ValueError(f"mailbox must be contiguous bf16, got {mailbox.dtype}")
    capacity = mailbox.shape[-2]
    if lamport:
        _need(mailbox, "mailbox", torch.bfloat16, (STAGES, tp, capacity, hidden), device)
        _need(stage_state, "stage_state", torch.int32, (2,), device)
        _need(status, "status", torch.int32, (1,), device)
    else:
        _need(mailbox, "mailbox", torch.bfloat16, (tp, m, hidden), device)
    if not 0 < m <= capacity:
        raise ValueError(f"M = {m} must be in [1, capacity = {capacity}]")
    if (lamport or mode == FULL) and wait_bound <= 0:
        raise ValueError(f"wait_bound must be > 0 (ns with PTX, spins without), got {wait_bound}")
    tactic = ConsumerTactic(*(tactic or consumer_tactic(m, hidden)))
    _check_tactic(tactic, hidden, mode)
    if mode == PLAIN:
        out = torch.empty(m, hidden, dtype=torch.bfloat16, device=device)
        hc = 1
    else:
        if residual is None or residual.ndim != 3:
            raise ValueError(f"residual must be bf16 [{m}, hc, {hidden}]")
        hc = residual.shape[1]
        _need(residual, "residual", torch.bfloat16, (m, hc, hidden), device)
        _need(post, "post", torch.float32, (m, hc), device)
        _need(comb, "comb", torch.float32, (m, hc, hc), device)
        out = torch.empty(m, hc, hidden, dtype=torch.bfloat16, device=device)
    layer_input = None
    quant = mxfp8_out is not None
    if mode == FULL:
        _need(pre, "pre", torch.float32, (m, hc), device)
        _need(norm_weight, "norm_weight", torch.bfloat16, (hidden,), device)
        rows = generation.shape[0] if generation is not None else 0
        _need(generation, "generation", torch.int32, (max(rows, m),), device)
        _need(sumsq, "sumsq scratch", torch.int64, (rows, sumsq_columns(hidden)), device)
        if not tactic.cooperative:
            _need(prenorm, "prenorm scratch", torch.bfloat16, (rows, hidden), device)
        # Serial or cooperative, the norm hand-off records its timeout, in either transport.
        _need(status, "status", torch.int32, (1,), device)
        layer_input = torch.empty(m, hidden, dtype=torch.bfloat16, device=device)
        if quant:
            if hidden % 32:
                raise ValueError(f"MXFP8 output needs hidden % 32 == 0, got {hidden}")
            data, scale = mxfp8_out
            _need(data, "mxfp8_out data", torch.float8_e4m3fn, (m, hidden), device)
            check_scale_buffer(scale, m, hidden, "mxfp8_out scale", device=device)
    elif quant:
        raise ValueError("mxfp8_out needs the layer input: pass pre and norm_weight")
    serial = mode == FULL and not tactic.cooperative
    grid = (1 if serial else triton.cdiv(hidden, tactic.block_h), m)
    dummy = out  # stands in for pointers a mode does not touch
    pdl = env.use_pdl(device)
    kernel = consumer_kernel.warmup if compile_only else consumer_kernel[grid]
    kwargs = dict(grid=grid) if compile_only else {}
    compiled = kernel(
        mailbox, _or(stage_state, dummy), _or(status, dummy), _or(generation, dummy),
        _or(sumsq, dummy), _or(prenorm, dummy), _or(residual, dummy),
        _or(post, dummy), _or(comb, dummy), _or(pre, dummy), _or(norm_weight, dummy), out,
        _or(layer_input, dummy), mxfp8_out[0] if quant else dummy,
        mxfp8_out[1] if quant else dummy, float(eps), capacity, int(wait_bound),
        TP=tp, HC=hc, HIDDEN=hidden, BLOCK_H=tactic.block_h,
        UNITS_P2=triton.next_power_of_2(sumsq_columns(hidden)), MODE=mode, QUANT=quant,
        LAMPORT=lamport, COOPERATIVE=tactic.cooperative, USE_PTX=env.use_ptx(device),
        USE_PDL=pdl, num_warps=tactic.warps, enable_fp_fusion=False, launch_pdl=pdl, **kwargs,
    )
    if compile_only:
        load_module(compiled)
    return out, layer_input


def _or(t, default):
    return default if t is None else t
