"""The consumer kernel: wait for every rank's partial in this rank's mailbox,
reduce, and apply mHC, RMSNorm and MXFP8 quantization in the same kernel
(docs/DESIGN.md §5-6). The host side (tactics, checks, the launcher) is
:mod:`.consumer`.

**Layout.** Lamport mode: ``mailbox`` BF16 ``[STAGES, tp, capacity, H]``
(docs/CONTRACTS.md), the slot of rank r, token m at stage s being
``mailbox[s, r, m]``; ``LAMPORT=False`` reads an already gathered
``[tp, M, H]`` buffer (the NCCL fallback) with the same arithmetic. Grid:
(column chunks, tokens), chunks fastest so a token's programs are dispatched
together. Each program owns ``BLOCK_H`` columns of one token: it waits for
those columns of every rank's slot (one [BLOCK_H] vector per rank), sums them
in rank order, mixes the residual streams (one [BLOCK_H] vector per stream;
``post``/``comb``/``pre`` are scalars, so no step reduces across threads) and
writes ``residual_out`` for its columns, then re-arms the slots.

Modes (``MODE``): 0 = plain sum (``reduced`` only; the benchmark's baseline of
the fusion), 1 = residual-only (mHC mixing), 2 = full (mixing, collapse with
``pre``, RMSNorm, optional MXFP8).

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
  on the GPU, never faster there): one program per token walks its chunks
  twice, the first time keeping ``prenorm`` in a scratch row, the second time
  normalising it.

**The next sublayer's mixes** (``MIXES``, docs/DESIGN.md §5.1): the
device side is :mod:`decode_boundary.mixes.consumer_mixes` (its docstring gives the protocol);
``COMBINE=False`` computes and publishes the shares but leaves the combine
(pre, post, comb) to the next GEMM (``mixes.mhc_combine``).

The FP32 operation order is that of :mod:`.reference` (launch with
``enable_fp_fusion=False``): ``reduced`` and ``residual_out`` are bit-exact;
``layer_input`` may differ from the reference by 1 BF16 ulp (chunked
length-H sum of squares, approximate ``rsqrt`` on the GPU); its MXFP8 bytes
equal ``quantize_mxfp8_ref`` of the kernel's own ``layer_input``.

**Memory ordering: which loads are volatile, and why.**

* Mailbox slots: volatile (``ld.volatile``: not served from L1, so a peer's
  NVLink store becomes visible), polled until no element is the sentinel
  (``SENTINEL_BITS``); every element is checked because a peer's 16-byte
  store may land in pieces, and each element is its own flag, so no acquire
  is needed before using it. The gathered buffer (NCCL) is read plainly.
* ``sumsq`` polls and ``generation[m]``: volatile, for the same reason (other
  programs of the launch store them while this one waits).
* The status word, where a poll checks it: volatile (another program may have
  reported a failure with ``atomic_or`` meanwhile).
* The serial path's ``prenorm`` scratch: volatile reads of the program's own
  stores, which a ``debug_barrier`` orders before them.
* Residual, post, comb, pre, gamma: plain loads, issued *before* the grid
  dependency wait (so they overlap the publisher); with mixes hc_fn there too
  with ``MIX_WEIGHTS_EARLY``, else after it (plain loads, when the program's
  residual_out is in registers), hc_scale and
  hc_base where a program computes pre (chunk 0; with ``SAME_PRE`` every one).
* The mix row: volatile polls, as ``sumsq`` (with ``SAME_PRE`` by every program). The
  combining program's sums of the shares (``TOTALS_OFF``): plain loads of its
  own stores behind a ``debug_barrier`` (the CTA barrier orders them; plain
  loads stay in L1, where the serial path's prenorm readback above keeps its
  older volatile form).

**Stage words.** ACTIVE (``stage_ptr + STAGE_ACTIVE``) is read with a plain
load after the grid dependency wait: the publisher that set it has completed
its grid. Program (0, 0) stores NEXT (``stage_ptr + STAGE_NEXT``) = (ACTIVE +
1) % STAGES with a plain store; its reader is the next publish, a later
kernel on this GPU (kernel boundary). Re-arming the slots (sentinel stores) is
plain too: a peer writes this stage again only three boundaries later, after
our later publishes, which follow this kernel's completion in stream order.

**Norm hand-off.** Every program of a launch writes every unit of its chunk
with aligned 64-bit stores (tag and partial land together: a word is never
seen half written), so a word with this launch's tag holds this launch's
partial, and after a launch every unit of the token holds its tag. The tag is
``generation[m] + 1``: read (volatile) after the grid dependency wait, it was
advanced by the previous launch's chunk-0 program, which stores it only after
seeing every unit tagged, i.e. after every program of that launch has read the
old value; so no program ever mixes two generations. (After a norm timeout
chunk 0 advances it anyway; a program that had not started yet may then tag a
unit with the next launch's tag, which is why every timeout needs
``reset(collective=True)``, which zeroes generations and words together.) A
word from an older launch carries the previous tag (every launch rewrites the
whole row), so it is never taken for this one's, also when the 32-bit
generation wraps. The serial path uses the same words; its own stores precede
its reads through a ``debug_barrier``. The status word is set with
``atomic_or`` (several programs may time out together).

**What must not race.** The kernel that immediately precedes this one writes
none of residual, post, comb, pre, gamma, nor hc_fn with ``MIX_WEIGHTS_EARLY``
(they are loaded before the grid wait), and triggers its dependents only after
its own grid wait; no other kernel uses the outputs or the scratch (``sumsq``,
``generation``, ``prenorm``, the mix row) meanwhile; ``generation``, ``sumsq``
and the mix rows are only ever zeroed together; a peer never stores into the
stage being read (one publish per consume on every rank, see above).

**Failures** (docs/FAILURES.md). A slot element holding the abort poison
(``ABORT_BITS``, a rank that rejected its step) counts as written and is
flagged in the same per-column word as the sentinel test (bit 2), so a step
without one pays no extra reduction; a wait that met it sets ``ABORT_BIT``
and the rank's bit, one that gave up sets the missing ranks' bits, and either
makes the program's sums NaN (never finite with a rank's share missing). The
gathered path (NCCL) reports a gathered poison the same way; a norm hand-off
that times out yields a NaN total.

**Why it is CUDA-graph safe.** The stage is read and advanced on the device,
the generation words only ever move forward (on the device), the timeout and
status live in device memory; no host value changes between replays, and the
grid depends only on M, fixed per captured graph.
"""
from __future__ import annotations

from enum import IntEnum, StrEnum

import triton
import triton.language as tl

from ..common.contract import ABORT_BITS, SENTINEL_BITS, STAGE_ACTIVE, STAGE_NEXT, STAGES
from ..common.rounding import quantize_groups, swizzled_offset, to_bf16_rne, zero_scale_padding
from ..common.tagged_words import NORM_TIMEOUT_BIT as NORM_TIMEOUT_BIT  # a status bit, re-exported
from ..common.tagged_words import (
    bit_or,
    f32_nan,
    gave_up,
    probe_partials,
    spin,
    tag_word,
    untag,
)
from ..common.timeline import END, MARK1, MARK2, START, WAITED, stamp
from ..mixes.consumer_mixes import NEXT_MIXES as NEXT_MIXES  # the MIXES values, re-exported
from ..mixes.consumer_mixes import NO_MIXES as NO_MIXES
from ..mixes.consumer_mixes import SAME_PRE as SAME_PRE
from ..mixes.consumer_mixes import load_mix_weights, publish_mix_partials
from ..mixes.mhc_combine import (
    combine_comb,
    combine_pre_post,
    combine_shares,
    no_logits,
    pre_from_shares,
)


class Mode(IntEnum):
    """``MODE``: what a consumer launch computes (module docstring)."""

    PLAIN = 0  # the rank-ordered sum alone (the fusion's baseline)
    RESIDUAL_ONLY = 1  # mHC mixing: residual_out
    FULL = 2  # mixing, collapse, RMSNorm, optional MXFP8: residual_out and layer_input


# A member by its value, by dict lookup: Dynamo (torch 2.11) cannot trace Mode(value)
# inside a compiled step.
MODES = {m.value: m for m in Mode}


PLAIN, RESIDUAL_ONLY, FULL = Mode.PLAIN, Mode.RESIDUAL_ONLY, Mode.FULL


class Collapse(StrEnum):
    """Which pre the layer input collapses with where the consumer also
    computes the next sublayer's mixes (docs/DESIGN.md §5.1); its ``MIXES``
    value is ``COLLAPSES[collapse]``."""

    V4_1 = "previous"  # the given pre; the mixes computed here are the next boundary's
    V4 = "same"  # the pre computed here from this residual_out (calls pass pre=None)


COLLAPSES = {Collapse.V4_1: NEXT_MIXES, Collapse.V4: SAME_PRE}
_PLAIN, _FULL = tl.constexpr(int(PLAIN)), tl.constexpr(int(FULL))
_NO_MIXES, _NEXT_MIXES, _SAME_PRE = (tl.constexpr(NO_MIXES), tl.constexpr(NEXT_MIXES),
                                     tl.constexpr(SAME_PRE))
SENTINEL = tl.constexpr(SENTINEL_BITS)  # an unwritten slot element, as int16 bits
_STAGES = tl.constexpr(STAGES)
_NEXT, _ACTIVE = tl.constexpr(STAGE_NEXT), tl.constexpr(STAGE_ACTIVE)  # stage_state indices
# Status bit of an aborted step (the sign bit): set with bit p of every rank p
# whose slot held the abort poison (ABORT_BITS). A wait that gives up or meets
# the poison yields NaN sums.
ABORT_BIT = -(1 << 31)
_ABORT_BIT = tl.constexpr(ABORT_BIT)
_ABORT = tl.constexpr(ABORT_BITS)
_NAN = tl.constexpr(0x7FC0)  # BF16 quiet NaN bits


@triton.jit
def _unwritten(slots, cmask, TP: tl.constexpr):
    """Per column: bit 0 where some rank's element is still the sentinel, bit 2
    where one is the abort poison (one tuple entry per rank)."""
    hole = tl.zeros(cmask.shape, dtype=tl.int32)
    for r in tl.static_range(TP):
        bits = slots[r].to(tl.int16, bitcast=True)
        hole = hole | tl.where(cmask & (bits == SENTINEL), 1, 0) | \
            tl.where(cmask & (bits == _ABORT), 4, 0)
    return hole


@triton.jit
def _aborted_ranks(slots, cmask, TP: tl.constexpr):
    """Bit r of every rank r whose slot holds the abort poison in some column
    (one OR-reduction)."""
    code = tl.zeros(cmask.shape, dtype=tl.int32)
    for r in tl.static_range(TP):
        bits = slots[r].to(tl.int16, bitcast=True)
        code = code | (tl.where(cmask & (bits == _ABORT), 1, 0) << r)
    return tl.reduce(code, 0, bit_or)


@triton.jit
def _load_slots(slot, cmask, row_stride, TP: tl.constexpr, VOLATILE: tl.constexpr):
    """Rank r's BF16 [BLOCK_H] slot at ``slot + r * row_stride``, as a tuple."""
    slots = ()
    for r in tl.static_range(TP):
        slots = slots + (tl.load(slot + r * row_stride, mask=cmask, other=0.0,
                                 volatile=VOLATILE),)
    return slots


@triton.jit
def _probe_slots(slot, cmask, row_stride, TP: tl.constexpr):
    """One volatile poll of every rank's slot: (the slots, per column 1 where
    one is still unwritten)."""
    slots = _load_slots(slot, cmask, row_stride, TP, True)
    return slots, _unwritten(slots, cmask, TP)


@triton.jit
def _wait_slots(slot, cmask, row_stride, status_ptr, wait_bound,
                TP: tl.constexpr, USE_PTX: tl.constexpr):
    """Volatile loads of every rank's slot until no element is the sentinel or
    the bound passes (or another program already reported a failure); a rank
    still missing then sets its bit in the status word, a rank whose slot holds
    the abort poison its abort bit. Returns the slots (tuple of BF16), the
    first one NaN after either (so the sums are NaN, never finite and wrong)."""
    slots, flags = spin(_probe_slots, slot, cmask, row_stride, status_ptr, wait_bound, TP,
                         True, USE_PTX)
    if (flags & 1) != 0:
        missing = 0
        for r in tl.static_range(TP):
            bits = slots[r].to(tl.int16, bitcast=True)
            gone = tl.max(tl.where(cmask & (bits == SENTINEL), 1, 0))
            missing = missing | (gone << r)
        tl.atomic_or(status_ptr, missing)
    if (flags & 4) != 0:
        tl.atomic_or(status_ptr, _aborted_ranks(slots, cmask, TP) | _ABORT_BIT)
    nan = tl.full(cmask.shape, _NAN, tl.int16).to(tl.bfloat16, bitcast=True)
    out = (tl.where((flags & 5) != 0, nan, slots[0]),)
    for r in tl.static_range(1, TP):
        out = out + (slots[r],)
    return out


@triton.jit
def _load_inputs(residual_ptr, post_ptr, comb_ptr, pre_ptr, gamma_ptr, m, cols, cmask,
                 HC: tl.constexpr, HIDDEN: tl.constexpr, MODE: tl.constexpr,
                 MIXES: tl.constexpr):
    """Everything but the partials, as tuples: residual streams ([BLOCK_H] BF16
    each), post[t], comb[s, t] (flat s * HC + t), pre[t] (FP32 scalars; none
    with ``SAME_PRE``: computed here), gamma."""
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
        if MIXES != _SAME_PRE:
            for t in tl.static_range(HC):
                pre = pre + (tl.load(pre_ptr + m * HC + t),)
        gamma = tl.load(gamma_ptr + cols, mask=cmask, other=0.0)
    return res, post, comb, pre, gamma


@triton.jit
def _reduce_mix(slots, res, post, comb, pre, out_ptr, m, cols, cmask,
                TP: tl.constexpr, HC: tl.constexpr, HIDDEN: tl.constexpr, MODE: tl.constexpr,
                COLLAPSE: tl.constexpr):
    """reduced (plain mode: stored) or residual_out (stored; also returned, one
    BF16 [BLOCK_H] per stream) and, with ``COLLAPSE`` (the full mode with a
    given pre), the BF16-rounded prenorm as FP32, in the reference's order."""
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for r in tl.static_range(TP):
        acc = acc + slots[r].to(tl.float32)
    reduced = to_bf16_rne(acc)
    prenorm = tl.zeros(cols.shape, dtype=tl.float32)
    streams = ()
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
            streams = streams + (mixed,)
        if COLLAPSE:
            prenorm = _collapse(streams, pre, HC)
    return streams, prenorm


@triton.jit
def _collapse(streams, pre, HC: tl.constexpr):
    """prenorm = bf16(+0 + sum_t float(residual_out[t]) * pre[t]), t in order,
    as FP32 (``pre``: a tuple of FP32 scalars)."""
    prenorm = tl.zeros(streams[0].shape, dtype=tl.float32)
    for t in tl.static_range(HC):
        prenorm = prenorm + streams[t].to(tl.float32) * pre[t]
    return to_bf16_rne(prenorm).to(tl.float32)


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
    tl.store(sumsq_ptr + m * UNITS + units, tag_word(tl.where(k == 0, partial, 0.0), tag),
             mask=units < UNITS)


@triton.jit
def _wait_partials(sumsq_ptr, status_ptr, m, tag, wait_bound, UNITS: tl.constexpr,
                   UNITS_P2: tl.constexpr, USE_PTX: tl.constexpr):
    """Poll token m's row (volatile) until every unit carries ``tag`` or the
    bound passes (then ``NORM_TIMEOUT_BIT`` and a NaN total); returns the row's
    sum of squares, one fixed tree over the units."""
    units = tl.arange(0, UNITS_P2)
    words, flags = spin(probe_partials, sumsq_ptr + m * UNITS + units, units < UNITS, tag,
                         status_ptr, wait_bound, 0, False, USE_PTX)
    stale = gave_up(flags, status_ptr)
    return tl.where(stale, f32_nan(), tl.sum(untag(words), axis=0))


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
                   COLLAPSE: tl.constexpr, LAMPORT: tl.constexpr, USE_PTX: tl.constexpr):
    """Wait for (Lamport) or read (gathered) every rank's slot of these columns,
    re-arm it (sentinel stores), reduce and mix; returns (residual_out per
    stream, the prenorm with ``COLLAPSE``)."""
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
        aborted = _aborted_ranks(slots, cmask, TP)  # a gathered abort poison (NCCL path)
        if aborted != 0:
            tl.atomic_or(status_ptr, aborted | _ABORT_BIT)
    return _reduce_mix(slots, res, post, comb, pre, out_ptr, m, cols, cmask, TP, HC, HIDDEN, MODE,
                       COLLAPSE)


# capacity is the gathered buffer's M in NCCL mode: unspecialized, so M = 1 does
# not turn it into a Python int.
@triton.jit(do_not_specialize=["capacity", "stamp_base"])
def consumer_kernel(
    mailbox_ptr, stage_ptr, status_ptr, generation_ptr, sumsq_ptr, prenorm_ptr,
    residual_ptr, post_ptr, comb_ptr, pre_ptr, gamma_ptr,
    out_ptr, layer_ptr, qdata_ptr, qscale_ptr,
    hc_fn_ptr, hc_scale_ptr, hc_base_ptr, mix_ptr, pre_out_ptr, post_out_ptr, comb_out_ptr,
    stamp_ptr, stamp_base,
    eps, hc_eps, capacity, wait_bound, sinkhorn_rounds,
    TP: tl.constexpr, HC: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr,
    UNITS_P2: tl.constexpr, MODE: tl.constexpr, QUANT: tl.constexpr, LAMPORT: tl.constexpr,
    COOPERATIVE: tl.constexpr, USE_PTX: tl.constexpr, USE_PDL: tl.constexpr,
    MIXES: tl.constexpr = 0, SLOTS: tl.constexpr = 1, MIX_ROW: tl.constexpr = 1,
    TOTALS_OFF: tl.constexpr = 0, CHUNKS_P2: tl.constexpr = 1,
    MIX_WEIGHTS_EARLY: tl.constexpr = False, COMBINE: tl.constexpr = True,
    TIMELINE: tl.constexpr = False, RELEASE_LATE: tl.constexpr = False,
):
    CHUNKS: tl.constexpr = (HIDDEN + BLOCK_H - 1) // BLOCK_H
    UNITS: tl.constexpr = (HIDDEN + 31) // 32  # sumsq row: one word per 32 columns
    SERIAL: tl.constexpr = (MODE == _FULL) and (not COOPERATIVE)
    # The collapse with a given pre happens with the mixing; with SAME_PRE after the mixes.
    COLLAPSE: tl.constexpr = (MODE == _FULL) and (MIXES != _SAME_PRE)
    chunk = tl.program_id(0)  # always 0 when SERIAL: the program walks the row
    m = tl.program_id(1)
    slot = stamp_base + m * tl.num_programs(0) + chunk  # common.timeline (a diagnostic)
    stamp(stamp_ptr, slot, START, TIMELINE)
    offs = tl.arange(0, BLOCK_H)
    cols = chunk * BLOCK_H + offs
    cmask = cols < HIDDEN
    if not SERIAL:
        # Inputs that earlier kernels produced: load them while the publisher runs.
        res, post, comb, pre, gamma = _load_inputs(residual_ptr, post_ptr, comb_ptr, pre_ptr,
                                                   gamma_ptr, m, cols, cmask, HC, HIDDEN, MODE,
                                                   MIXES)
        if (MIXES != _NO_MIXES) and MIX_WEIGHTS_EARLY:
            # A weight, like the GEMMs': in flight while the publisher runs, not queued
            # behind the next GEMM's weight stream after the wait (consumer.py's tables).
            fn = load_mix_weights(hc_fn_ptr, cols, cmask, HC, HIDDEN, SLOTS)
    if USE_PDL:
        # Released here: the dependent GEMM's weight stream then overlaps this kernel's
        # body; released before the wait or after the norm hand-off, the same bytes only
        # moved the contention. With RELEASE_LATE (the fused mixes' tactic at some M)
        # after this program's share instead: the stream then does not contend with the
        # share's work.
        tl.extra.cuda.gdc_wait()
        if not RELEASE_LATE:
            tl.extra.cuda.gdc_launch_dependents()
    stamp(stamp_ptr, slot, WAITED, TIMELINE)
    stage = tl.full((), 0, tl.int32)  # a tensor in both modes (the NCCL path has no stage)
    if LAMPORT:
        stage = tl.load(stage_ptr + _ACTIVE)
        if (m == 0) & (chunk == 0):
            # Read by the next publish, after our grid.
            tl.store(stage_ptr + _NEXT, (stage + 1) % _STAGES)
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
                                                       gamma_ptr, m, cols, cmask, HC, HIDDEN, MODE,
                                                       MIXES)
            streams, prenorm = _consume_chunk(mailbox_ptr, status_ptr, out_ptr, slot_row,
                                              row_stride, wait_bound, res, post, comb, pre, m,
                                              cols, cmask, TP, HC, HIDDEN, MODE, COLLAPSE,
                                              LAMPORT, USE_PTX)
            if MIXES != _NO_MIXES:
                publish_mix_partials(mix_ptr,
                                      load_mix_weights(hc_fn_ptr, cols, cmask, HC, HIDDEN, SLOTS),
                                      m, c, streams, tag, HC, SLOTS, MIX_ROW)
            if COLLAPSE:
                _publish_partial(sumsq_ptr, m, c, tl.sum(prenorm * prenorm, axis=0), tag, UNITS,
                                 BLOCK_H)
                tl.store(prenorm_ptr + row_off + cols, prenorm.to(tl.bfloat16), mask=cmask)
        tl.debug_barrier()  # this program's scratch stores precede its reads below
        if (MIXES != _NO_MIXES) and COMBINE:
            new_pre = combine_shares(mix_ptr, status_ptr, hc_scale_ptr, hc_base_ptr, pre_out_ptr,
                                     post_out_ptr, comb_out_ptr, m, tag, eps, hc_eps,
                                     sinkhorn_rounds, wait_bound, HC, HIDDEN, CHUNKS, CHUNKS_P2,
                                     SLOTS, MIX_ROW, TOTALS_OFF, USE_PTX)
        elif MIXES == _SAME_PRE:  # the combine is the next kernel's: the pre alone, here
            new_pre = pre_from_shares(mix_ptr, status_ptr, hc_scale_ptr, hc_base_ptr, m, tag,
                                       eps, hc_eps, wait_bound, HC, HIDDEN, CHUNKS, CHUNKS_P2,
                                       SLOTS, MIX_ROW, USE_PTX)
        if MIXES == _SAME_PRE:
            pre = new_pre
            for c in range(CHUNKS):
                cols = c * BLOCK_H + offs
                cmask = cols < HIDDEN
                streams = ()
                for t in tl.static_range(HC):  # residual_out, this program's own stores
                    streams = streams + (tl.load(
                        out_ptr + (m * HC + t).to(tl.int64) * HIDDEN + cols, mask=cmask,
                        other=0.0, volatile=True),)
                prenorm = _collapse(streams, pre, HC)
                _publish_partial(sumsq_ptr, m, c, tl.sum(prenorm * prenorm, axis=0), tag,
                                 UNITS, BLOCK_H)
                tl.store(prenorm_ptr + row_off + cols, prenorm.to(tl.bfloat16), mask=cmask)
            tl.debug_barrier()
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
        streams, prenorm = _consume_chunk(mailbox_ptr, status_ptr, out_ptr, slot_row, row_stride,
                                          wait_bound, res, post, comb, pre, m, cols, cmask,
                                          TP, HC, HIDDEN, MODE, COLLAPSE, LAMPORT, USE_PTX)
        stamp(stamp_ptr, slot, MARK1, TIMELINE)  # slots in, residual_out stored
        if COLLAPSE:
            # The norm partial first: the token's hand-off, on every program's critical
            # path, need not wait for this program's hc_fn loads and dots below.
            _publish_partial(sumsq_ptr, m, chunk, tl.sum(prenorm * prenorm, axis=0), tag, UNITS,
                             BLOCK_H)
        if MIXES != _NO_MIXES:
            # Every program's share before any program waits for it: chunk 0 sums them
            # (one fixed order).
            if not MIX_WEIGHTS_EARLY:
                fn = load_mix_weights(hc_fn_ptr, cols, cmask, HC, HIDDEN, SLOTS)
            publish_mix_partials(mix_ptr, fn, m, chunk, streams, tag, HC, SLOTS, MIX_ROW)
        if USE_PDL and RELEASE_LATE:
            tl.extra.cuda.gdc_launch_dependents()
        if MIXES == _SAME_PRE:  # the collapse needs the new pre: every program computes it
            if (chunk == 0) & COMBINE:  # comb's Sinkhorn waits until its partial is out
                new_pre, logits = combine_pre_post(
                    mix_ptr, status_ptr, hc_scale_ptr, hc_base_ptr, pre_out_ptr, post_out_ptr, m,
                    tag, eps, hc_eps, wait_bound, HC, HIDDEN, CHUNKS, CHUNKS_P2, SLOTS, MIX_ROW,
                    TOTALS_OFF, USE_PTX)
            else:
                new_pre = pre_from_shares(mix_ptr, status_ptr, hc_scale_ptr, hc_base_ptr, m,
                                           tag, eps, hc_eps, wait_bound, HC, HIDDEN, CHUNKS,
                                           CHUNKS_P2, SLOTS, MIX_ROW, USE_PTX)
                logits = no_logits(HC)
            prenorm = _collapse(streams, new_pre, HC)
            _publish_partial(sumsq_ptr, m, chunk, tl.sum(prenorm * prenorm, axis=0), tag, UNITS,
                             BLOCK_H)
            if (chunk == 0) & COMBINE:
                # comb's softmax and Sinkhorn rounds while the token's other partials
                # arrive: nobody in this launch needs comb, and the hand-off needs only
                # this program's partial, already out (after the norm they would be the
                # kernel's tail).
                combine_comb(logits, comb_out_ptr, m, hc_eps, sinkhorn_rounds, HC, USE_PTX)
        if MODE == _FULL:
            total = _wait_partials(sumsq_ptr, status_ptr, m, tag, wait_bound, UNITS, UNITS_P2,
                                   USE_PTX)
            stamp(stamp_ptr, slot, MARK2, TIMELINE)  # the token's partials met
            if chunk == 0:  # every program has read the old generation: it tagged with it
                tl.store(generation_ptr + m, tag)
            _norm_chunk(prenorm, gamma, total, eps, layer_ptr, qdata_ptr, qscale_ptr, m, chunk,
                        cols, cmask, HIDDEN, BLOCK_H, QUANT)
        if (MIXES == _NEXT_MIXES) and COMBINE:  # noqa: SIM102 (a constexpr test: pruned)
            if chunk == 0:  # nobody here waits for the next mixes: after the norm
                combine_shares(mix_ptr, status_ptr, hc_scale_ptr, hc_base_ptr, pre_out_ptr,
                               post_out_ptr, comb_out_ptr, m, tag, eps, hc_eps, sinkhorn_rounds,
                               wait_bound, HC, HIDDEN, CHUNKS, CHUNKS_P2, SLOTS, MIX_ROW,
                               TOTALS_OFF, USE_PTX)
    stamp(stamp_ptr, slot, END, TIMELINE)
