"""Host side of the consumer kernel (:mod:`.consumer_kernel`): the tactic table,
the norm scratch geometry and the launcher :func:`consume`.

**What ``consume`` checks** (``ValueError`` before anything is launched):
dtype, shape, device and contiguity of every tensor the mode reads or writes
(the mailbox ``[STAGES, tp, capacity, H]`` with its stage words and status
word in Lamport mode, or the gathered ``[tp, M, H]``; residual, post, comb;
in the full mode pre, norm weight, the norm scratch and the status word, and
the MXFP8 output buffers, scales through ``check_scale_buffer``);
``1 <= M <= capacity``; a positive wait bound wherever something may wait; a
tactic of power-of-two columns (>= one MXFP8 group) and warps, never a
cooperative full-mode tactic in the interpreter (its programs run one by one
and cannot wait for each other).

**What the caller guarantees** (nothing here can check it): every rank
publishes exactly once per consume into stage NEXT (publish kernel, finalize
kernel or a publishing GEMM) and consumes once; the early inputs are complete
when the consumer may start (below); output and scratch buffers are not in
use by another kernel; ``generation`` and ``sumsq`` are zeroed together, at
allocation and after any timeout; the kernel variant is compiled before the
peers wait on this rank (``compile_only``, see
``BoundaryAllReduce.precompile``).

**Early inputs: read before the grid-dependency wait.** ``residual``,
``post``, ``comb``, ``pre`` and ``norm_weight`` (gamma) are loaded *before*
the consumer's ``gdc_wait`` (cooperative tactics, the GPU default), so that
their loads overlap the publisher; the mailbox (or the gathered partials),
the stage word, the scratch and every store come after the wait. With PDL the
consumer may start as soon as the kernel before it on the stream, its
*publisher* (publish kernel, finalize kernel or publishing GEMM; in the NCCL
transport the all-gather, which has no PDL: no overlap), releases its
dependents, i.e. while the publisher still runs. So the early inputs must
be complete before the publisher can start: produced by a kernel earlier in
stream order than the publisher, never by the publisher itself. Precisely,
they must not be written by any kernel of the window that may still run when
the consumer starts: the publish and finalize kernels release their
dependents only after their own grid wait (every earlier kernel is complete
by then), so there the window is the publisher alone; a GEMM of this package
releases them at its start, before its wait, so behind a publishing GEMM the
window also holds the kernel before it, and, while that is another GEMM of
this package (``wo_a`` before ``wo_b``), the one before that, and so on, up
to and including the first kernel that is not. A kernel launched without PDL
(any PyTorch op) is complete before its successor starts: it and everything
before it are outside. ``consume`` refuses (``ValueError``) what it can check
cheaply: an early input whose memory overlaps the partial (``partial=``), the
mailbox or gathered buffer, an MXFP8 output buffer, or the stage, status,
generation, sumsq or prenorm words (:func:`check_early_inputs`). With
``mixes``, ``hc_fn``, ``hc_scale`` and ``hc_base`` are held to the same rules
(and checked so): the consumer reads ``hc_fn`` before its wait where the
tactic says ``mix_weights_early`` (the tables' choice up to 8 tokens), the
rest after it, and the mixes kernel after it (beyond ``MIXES_FUSED_MAX_ROWS``)
loads ``hc_fn`` before its own, while the consumer may still run.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from numbers import Real
from typing import NamedTuple

import torch
import triton

from .. import env
from ..common.contract import (  # the mix row's geometry, re-exported
    MIX_MIN_BLOCK as MIX_MIN_BLOCK,
)
from ..common.contract import STAGES, MixesFinish, advance_mix_rows, current_stream_id
from ..common.contract import mix_columns as mix_columns
from ..common.contract import mix_slots as mix_slots
from ..common.contract import mix_totals_offset as mix_totals_offset
from ..common.timeline import launch_args
from ..mxfp8.format import check_scale_buffer, mxfp8_scale_bytes
from .consumer_kernel import (
    ABORT_BIT,
    FULL,
    NEXT_MIXES,
    NO_MIXES,
    NORM_TIMEOUT_BIT,
    PLAIN,
    RESIDUAL_ONLY,
    SAME_PRE,
    consumer_kernel,
)
from .mixes_kernel import MIXES_KERNEL_BLOCK_H, launch_next_mixes
from .publish_kernel import load_module

QUANT_GROUP = 32  # MXFP8 group: a chunk holds whole groups, so it is >= 32 columns
# Wait bound without %globaltimer, as spins: one spin takes ~1 us on a GPU and
# ~1 ms in the Triton interpreter.
SPINS_PER_SECOND = 1_000_000
INTERPRETER_SPINS_PER_SECOND = 1_000


class ConsumerTactic(NamedTuple):
    """Columns per program, warps, and whether the programs of a token share the
    RMSNorm through the tagged hand-off (``cooperative``) or one program per
    token walks the row chunk by chunk (only for the full mode; the others never
    need a whole row). ``mix_weights_early`` (fused mixes, cooperative): each
    program loads its hc_fn columns before its grid wait and holds them, as the
    GEMMs hold their weights; else after its slots are in. ``release_late``
    (fused mixes, cooperative): the kernel after it is released only once this
    program has stored its share, not right after the grid wait: that keeps the
    next GEMM's programs and weight stream out of the share and norm hand-off's
    round trips, but starts the stream later."""

    block_h: int
    warps: int
    cooperative: bool = True
    mix_weights_early: bool = False
    release_late: bool = False


# (largest M, tactic): the first entry whose M covers the step's tokens; chosen inside
# the decode chain (``decode-boundary tune``). Each line says why it wins there.
# Without the mixes in the consumer:
CONSUMER_TACTICS = (
    (8, ConsumerTactic(512, 4)),  # few tokens: fewest programs in each token's norm hand-off
    (16, ConsumerTactic(256, 2)),  # 9-16 tokens: twice the programs, to spread the rows
    (1 << 30, ConsumerTactic(512, 4)),  # more tokens: enough programs at 512 columns
)
# V4.1's next mixes fused in the consumer (every program needs its columns of hc_fn,
# FP32 (2 + hc) * hc rows):
MIXES_TACTICS = (
    (1, ConsumerTactic(128, 4, mix_weights_early=True, release_late=True)),  # held; late release
    (8, ConsumerTactic(128, 4, mix_weights_early=True)),  # hc_fn held before the grid wait
    (1 << 30, ConsumerTactic(256, 4)),  # hc_fn after the wait: held, it costs programs per SM
)
# V4's collapse (the same sublayer's pre: every program polls the shares, then a second
# norm round trip):
SAME_PRE_MIXES_TACTICS = (
    (1, ConsumerTactic(256, 8, mix_weights_early=True)),  # one token: 8 warps, hc_fn held
    (8, ConsumerTactic(128, 4, mix_weights_early=True)),  # hc_fn held before the grid wait
    (16, ConsumerTactic(128, 4, release_late=True)),  # the next GEMM waits for the shares
    (1 << 30, ConsumerTactic(256, 4)),  # beyond 16 tokens V4.1's choice
)
# Beyond this many tokens V4.1's next mixes come from the mixes kernel after the
# consumer (mixes_kernel.py: hc_fn read once per 16 tokens, not once per token): the
# crossover of the two in the chain.
MIXES_FUSED_MAX_ROWS = 32
# From this many tokens on, V4.1's mixes pay off the critical path: the mixes kernel on
# the all-reduce's side stream (BoundaryAllReduce(mixes_aside=True), the chain's
# mixes_aside="auto"); below it joining the side stream costs more than it hides.
MIXES_ASIDE_MIN_ROWS = 32


def consumer_tactic(m: int, hidden: int, mixes: str | None = None) -> ConsumerTactic:
    """The table's tactic for M tokens (``mixes``: the collapse of mixes fused in
    the consumer, ``MIXES_TACTICS`` for "previous", ``SAME_PRE_MIXES_TACTICS``
    for "same"; None: ``CONSUMER_TACTICS``); serial in the interpreter (which
    runs programs one after another, so they cannot wait for each other)."""
    table = {None: CONSUMER_TACTICS, "previous": MIXES_TACTICS,
             "same": SAME_PRE_MIXES_TACTICS}[mixes]
    tactic = next(t for limit, t in table if m <= limit)
    tactic = tactic._replace(block_h=min(tactic.block_h, triton.next_power_of_2(hidden)))
    if env.interpret_mode():
        tactic = tactic._replace(cooperative=False)
    return tactic


def fuses_mixes(m: int, hc: int, collapse: str) -> bool:
    """Whether the consumer computes the next mixes of M tokens itself; else
    the mixes kernel does, right after it. V4's collapse needs them inside the
    consumer; the mixes kernel's dot needs >= 16 slots, and it holds hc x 3
    BF16 parts of 128 x slots (hc = 2-4: 16 or 32 slots; hc = 8's 64 slots
    did not fit even as one FP32 tile per stream: 520 KB of shared memory)."""
    return collapse == "same" or m <= MIXES_FUSED_MAX_ROWS or not mixes_kernel_takes(hc)


def mixes_kernel_takes(hc: int) -> bool:
    """Whether the mixes kernel serves hc streams (:func:`fuses_mixes`)."""
    return 16 <= mix_slots(hc) <= 32


def sumsq_columns(hidden: int) -> int:
    """Row length of the per-token sum-of-squares scratch (one tagged word per
    32 columns, the finest chunk a tactic may use)."""
    return triton.cdiv(hidden, QUANT_GROUP)


def is_nonnegative_real(value) -> bool:
    """A finite real number >= 0 (not a bool): what an eps must be."""
    return not isinstance(value, bool) and isinstance(value, Real) and math.isfinite(value) \
        and value >= 0


# The mixes' hc_eps must be a normal FP32 number: every Sinkhorn sum is >= hc_eps and
# the combine normalises by its reciprocal (rcp.approx.ftz: a subnormal or zero sum
# would give inf and NaN where the reference's division stays finite).
MIN_HC_EPS = 2.0 ** -126


def is_hc_eps(value) -> bool:
    """A finite real number >= ``MIN_HC_EPS`` (not a bool): what hc_eps must be."""
    return is_nonnegative_real(value) and value >= MIN_HC_EPS


def is_positive_int(value) -> bool:
    """An int >= 1 (not a bool): a count of rounds."""
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


class MhcMixes(NamedTuple):
    """The next sublayer's mHC mix parameters and how the boundary uses them
    (docs/DESIGN.md §5.1; spec: ``reference.mhc_mixes_ref``, with the call's
    ``eps`` as its ``rms_eps``). ``hc_fn`` FP32 [(2 + hc) * hc, hc * H],
    ``hc_scale`` FP32 [3], ``hc_base`` FP32 [(2 + hc) * hc]. ``collapse``:
    "previous" (V4.1: collapse with the given pre, the new mixes are the next
    boundary's) or "same" (V4: collapse with the pre just computed)."""

    hc_fn: torch.Tensor
    hc_scale: torch.Tensor
    hc_base: torch.Tensor
    hc_eps: float
    sinkhorn_iters: int
    collapse: str = "previous"


COLLAPSES = {"previous": NEXT_MIXES, "same": SAME_PRE}


class WaitTimeout(NamedTuple):
    """A wait bound given as a timeout: ``consume`` converts it to the kernel's
    unit (:func:`wait_bound`) from the same ``env.use_ptx`` answer that picks
    its ``USE_PTX`` variant, at launch, so the two cannot disagree."""

    seconds: float


def wait_bound(timeout_s: float, device: torch.device) -> int:
    """``consume``'s ``wait_bound`` for a timeout: %globaltimer nanoseconds with
    PTX, spins without (decided now; a launch converts a :class:`WaitTimeout`
    itself, with the decision its kernel variant is chosen with)."""
    return _bound_units(timeout_s, env.use_ptx(device))


def _bound_units(timeout_s: float, ptx: bool) -> int:
    if ptx:
        return int(timeout_s * 1e9)
    rate = INTERPRETER_SPINS_PER_SECOND if env.interpret_mode() else SPINS_PER_SECOND
    return max(1, int(timeout_s * rate))


def status_error(status: int, tp: int, timeout_s: float) -> str | None:
    """What the status word reports (bit p: rank p never arrived, or with
    ``ABORT_BIT``: aborted the step; ``NORM_TIMEOUT_BIT``: the norm hand-off
    timed out), or None when clear."""
    missing = [p for p in range(tp) if status >> p & 1]
    if status & ABORT_BIT:
        return (f"rank(s) {missing} aborted this step (an input failed its checks there; a "
                "rank listed next to one may only have been slower than its abort); the "
                "outputs of this step are NaN; call reset(collective=True) on every rank")
    if missing:
        # A norm timeout next to a missing rank is its consequence (a program still
        # waiting for that rank published its partial late): name the rank.
        return (f"rank(s) {missing} did not publish within {timeout_s} s; call "
                "reset(collective=True) on every rank")
    if status & NORM_TIMEOUT_BIT:
        return (f"the programs of a token did not meet for the RMSNorm or the next mixes "
                f"within {timeout_s} s (cooperative tactic: were they co-resident? a serial "
                "consumer tactic needs no meeting); call reset(collective=True) on every rank")
    return None


def compile_inputs(m: int, hc: int, hidden: int, device: torch.device, residual_only: bool,
                   quantize: bool, collapse_pre: str | None = None) -> list[tuple[int, dict]]:
    """Every consumer variant an all-reduce so configured may launch for M = m, as
    (mode, inputs of its reduce call) with zero-filled stand-ins: what a
    compile-only launch of each needs (full calls carry ``mix_weights`` when
    ``collapse_pre`` is set, and no pre with "same")."""
    inputs = dict(residual=torch.zeros(m, hc, hidden, dtype=torch.bfloat16, device=device),
                  post=torch.zeros(m, hc, device=device),
                  comb=torch.zeros(m, hc, hc, device=device),
                  pre=torch.zeros(m, hc, device=device),
                  norm_weight=torch.zeros(hidden, dtype=torch.bfloat16, device=device), eps=0.0,
                  mxfp8_out=None)
    full = dict(inputs)
    if collapse_pre is not None:
        n = (2 + hc) * hc
        full.update(mix_weights=(torch.zeros(n, hc * hidden, device=device),
                                 torch.zeros(3, device=device), torch.zeros(n, device=device)))
        if collapse_pre == "same":
            full.update(pre=None)
    variants = [(PLAIN, {}), (FULL, full)]
    if residual_only:
        variants.append((RESIDUAL_ONLY, dict(inputs, pre=None, norm_weight=None)))
    if quantize and hidden % QUANT_GROUP == 0:
        mxfp8_out = (torch.empty(m, hidden, dtype=torch.float8_e4m3fn, device=device),
                     torch.empty(mxfp8_scale_bytes(m, hidden), dtype=torch.uint8, device=device))
        variants.append((FULL, dict(full, mxfp8_out=mxfp8_out)))
    return variants


def _need(t, name, dtype, shape, device):
    if t is None:
        raise ValueError(f"{name} is required here: expected {dtype} {list(shape)}")
    if t.dtype != dtype or tuple(t.shape) != tuple(shape) or t.device != device:
        raise ValueError(f"{name} must be {dtype} {list(shape)} on {device}, got {t.dtype} "
                         f"{list(t.shape)} on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_tactic(tactic: ConsumerTactic, hidden: int, mode: int, mixes: bool = False,
                  mixes_kernel: bool = False) -> None:
    """``mixes``: the consumer computes the next mixes; ``mixes_kernel``: the
    mixes kernel follows it (cooperative with the tactic, in its own chunks)."""
    block, warps, cooperative = tactic.block_h, tactic.warps, tactic.cooperative
    if block < QUANT_GROUP or block & (block - 1) or warps < 1 or warps & (warps - 1):
        raise ValueError(f"tactic {tactic}: columns per program must be a power of two "
                         f">= {QUANT_GROUP} and warps a power of two")
    if mixes and block < MIX_MIN_BLOCK:
        raise ValueError(f"tactic {tactic}: with mixes a program takes >= {MIX_MIN_BLOCK} "
                         "columns (one share of the mix row per chunk)")
    chunks = triton.cdiv(hidden, block)
    if mixes_kernel:
        chunks = max(chunks, triton.cdiv(hidden, MIXES_KERNEL_BLOCK_H))
    if mode == FULL and cooperative and chunks > 1 and env.interpret_mode():
        raise ValueError(f"tactic {tactic}: cooperative programs wait for each other, which "
                         "the interpreter (programs run one by one) cannot do")


EARLY_INPUTS = ("residual", "post", "comb", "pre", "norm_weight")  # read before the wait


def _check_mixes(mixes: MhcMixes, mode: int, pre, mix_words, m: int, hc: int, hidden: int,
                 device: torch.device) -> None:
    if not isinstance(mixes, MhcMixes):
        raise ValueError(f"mixes must be a consumer.MhcMixes, got {type(mixes).__name__}")
    if mixes.collapse not in COLLAPSES:
        raise ValueError(f"mixes.collapse must be one of {sorted(COLLAPSES)}, got "
                         f"{mixes.collapse!r}")
    if mode != FULL:
        raise ValueError("mixes need the full mode (norm_weight, and pre unless collapse='same')")
    if mixes.collapse == "same" and pre is not None:
        raise ValueError("mixes.collapse='same' collapses with the pre computed here: pass "
                         "pre=None")
    if hc & (hc - 1):
        raise ValueError(f"mixes need a power-of-two hc, got {hc}")
    n = (2 + hc) * hc
    _need(mixes.hc_fn, "hc_fn", torch.float32, (n, hc * hidden), device)
    _need(mixes.hc_scale, "hc_scale", torch.float32, (3,), device)
    _need(mixes.hc_base, "hc_base", torch.float32, (n,), device)
    if not is_positive_int(mixes.sinkhorn_iters):
        raise ValueError(f"mixes.sinkhorn_iters must be an int >= 1, got "
                         f"{mixes.sinkhorn_iters!r}")
    if not is_hc_eps(mixes.hc_eps):
        raise ValueError(f"mixes.hc_eps must be a finite real number >= 2**-126 (the smallest "
                         f"normal FP32), got {mixes.hc_eps!r}")
    rows = mix_words.shape[0] if isinstance(mix_words, torch.Tensor) else 0
    _need(mix_words, "mix_words scratch", torch.int64, (max(rows, m), mix_columns(hidden, hc)),
          device)


def _byte_span(t: torch.Tensor) -> tuple[int, int] | None:
    """[first, last + 1) byte addresses ``t`` may touch; None when it is empty."""
    if t.numel() == 0:
        return None
    start = t.data_ptr()
    if t.is_contiguous():
        return start, start + t.numel() * t.element_size()
    extent = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride(), strict=True))
    return start, start + extent * t.element_size()


def check_early_inputs(early: dict, later: dict) -> None:
    """Raise ValueError when a tensor of ``early`` (name -> tensor or None: what
    the consumer reads before its grid-dependency wait, ``EARLY_INPUTS``, and
    with mixes hc_fn, hc_scale and hc_base, held to the same rule)
    shares memory with one of ``later`` (name -> tensor or None: the partial,
    the mailbox, buffers the consumer writes), on one device. An early input is
    read while the publisher may still run (module docstring), so it must not
    be memory that the publisher, this consumer or its peers write."""
    spans = []
    for name, t in later.items():
        span = None if t is None else _byte_span(t)
        if span is not None:
            spans.append((name, t.device, span))
    for name, t in early.items():
        span = None if t is None else _byte_span(t)
        if span is None:
            continue
        for other, device, (lo, hi) in spans:
            if device == t.device and span[0] < hi and lo < span[1]:
                raise ValueError(
                    f"{name} overlaps {other} in memory: the consumer reads {name} before its "
                    "grid-dependency wait, while the publisher may still run, so it must be a "
                    f"buffer of its own, complete before the publisher starts, not {other} "
                    "(decode_boundary.boundary.consumer module docstring)")


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
    wait_bound: int | WaitTimeout = 0,
    lamport: bool = True,
    tactic: ConsumerTactic | None = None,
    compile_only: bool = False,
    partial: torch.Tensor | None = None,
    before_launch: Callable[[], object] | None = None,
    mixes: MhcMixes | None = None,
    mix_words: torch.Tensor | None = None,
    combine_mixes: bool = True,
    mixes_stream: torch.cuda.Stream | None = None,
) -> tuple:
    """Launch the consumer for ``m`` tokens. Returns (``reduced`` [M, H] in plain
    mode / ``residual_out`` [M, hc, H], ``layer_input`` [M, H] or None), and
    with ``mixes`` a third element: the next sublayer's (pre [M, hc], post
    [M, hc], comb [M, hc, hc]) FP32, computed from this ``residual_out``.

    ``mailbox``: BF16 [STAGES, tp, capacity, H] (Lamport) or [tp, M, H] (gathered).
    ``generation`` int32 [rows] and ``sumsq`` int64 [rows, ``sumsq_columns(H)``]
    (full mode; zeroed together at allocation and after any timeout, never one
    without the other; ``prenorm`` BF16 [rows, H] too for a serial tactic):
    per-token scratch, rows >= M. ``status`` int32 [1]: the mailbox's status
    word, also required in full mode with ``lamport=False`` (the norm hand-off
    records its timeout there). ``wait_bound``: nanoseconds with PTX
    (``%globaltimer``), spins without; > 0 whenever something may wait; a
    :class:`WaitTimeout` is converted here, with the kernel variant's own PTX
    decision. ``tactic``: default from ``consumer_tactic`` (by the fused
    mixes' collapse). ``compile_only``: compile this variant, launch nothing (the
    outputs are then unwritten). ``mixes`` (full mode): :class:`MhcMixes`;
    with ``collapse="same"`` ``pre`` is None (the kernel collapses with the pre
    it computes); ``mix_words`` int64 [rows, ``mix_columns(H, hc)``] is then its
    per-token scratch, zeroed together with ``generation`` and ``sumsq``. The
    consumer computes the mixes itself where :func:`fuses_mixes` says so, else
    the mixes kernel (:mod:`.mixes_kernel`) does, launched right after it on
    the same stream (from the same checked inputs and scratch).
    ``combine_mixes=False`` (with ``mixes``): a fourth element, a
    ``MixesFinish`` where the consumer computed the shares but left their
    combine (pre, post and comb: then unwritten) to the kernel launched right
    after it, ``mxfp8_mm(..., finish_mixes=...)``, so the consumer's grid ends
    without the combine's serial tail (benchmarks/NOTES.md "V4-family mixes"
    item 13); None where nothing is left: the mixes kernel finished them, or
    PTX is off on the GPU (``DECODE_BOUNDARY_DISABLE_PTX``: the combine's
    bits would then depend on the kernel's FMA contraction), so the consumer
    combined.
    ``mixes_stream`` (with ``mixes`` of the previous pre, V4.1, whose hc fits
    the mixes kernel: :func:`mixes_aside_ok`): the consumer runs without the
    mixes and the mixes kernel runs on this stream, after everything the
    current stream has enqueued (this consumer included), without PDL (it
    releases nothing before it completes). Its pre, post and comb, and the
    scratch it reads (``generation``, ``mix_words``), belong to that stream
    until the caller makes its own stream wait for it (``BoundaryAllReduce``
    does before its next consumer and in ``join_mixes``): nothing may read
    the mixes, or launch the next consumer on the same scratch, before that.
    ``residual_out``, the mixes and the mix weights are recorded on the
    stream for the allocator. On a CPU device (the interpreter) the kernel runs inline.

    Early inputs (module docstring): ``residual``, ``post``, ``comb``, ``pre``
    and ``norm_weight`` (and with ``mixes`` ``hc_fn``, early where the tactic
    says ``mix_weights_early``) are read before the kernel's grid-dependency wait, i.e.
    possibly while the publisher (the kernel before this one on the stream)
    still runs; they must be complete before the publisher can start, written
    by a kernel earlier in stream order than it, never by it. The mailbox (or
    gathered buffer) is read only after the wait. ``partial``: the tensor this
    rank published (``BoundaryAllReduce``'s ``x``), never read here, only
    checked: an early input that overlaps it, the mailbox, ``mxfp8_out`` or
    the stage, status and scratch words raises ``ValueError``.
    ``before_launch``: called once every check has passed, just before the
    consumer launches (not with ``compile_only``): ``BoundaryAllReduce`` runs
    the step's publish (or all-gather) there, so that an input this rank
    rejects has written nothing to a peer (docs/FAILURES.md).
    """
    device = mailbox.device
    hidden = mailbox.shape[-1]
    if mailbox.dtype != torch.bfloat16 or not mailbox.is_contiguous():
        raise ValueError(f"mailbox must be contiguous bf16, got {mailbox.dtype}")
    capacity = mailbox.shape[-2]
    ptx = env.use_ptx(device)  # one decision: the kernel variant and the wait bound's unit
    if isinstance(wait_bound, WaitTimeout):
        wait_bound = _bound_units(wait_bound.seconds, ptx)
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
    if mixes_stream is not None and not (isinstance(mixes, MhcMixes) and mode == FULL and
                                         mixes_aside_ok(hc, mixes.collapse)):
        raise ValueError("mixes_stream needs the full mode with mixes of the previous pre "
                         f"(collapse 'previous') and 16 <= mix_slots(hc) <= 32, got hc = {hc}, "
                         f"collapse {getattr(mixes, 'collapse', None)!r}")
    fused = isinstance(mixes, MhcMixes) and mixes_stream is None and \
        fuses_mixes(m, hc, mixes.collapse)
    tactic = ConsumerTactic(*(tactic or consumer_tactic(m, hidden,
                                                        mixes.collapse if fused else None)))
    _check_tactic(tactic, hidden, mode, fused, isinstance(mixes, MhcMixes) and not fused)
    if not isinstance(combine_mixes, bool):
        raise ValueError(f"combine_mixes must be a bool, got {combine_mixes!r}")
    defer = not combine_mixes and fused and can_leave_combine(ptx, device)
    layer_input = None
    quant = mxfp8_out is not None
    same_pre = isinstance(mixes, MhcMixes) and mixes.collapse == "same"
    if mode == FULL:
        if not same_pre:
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
    mixes_out = None
    if mixes is not None:
        _check_mixes(mixes, mode, pre, mix_words, m, hc, hidden, device)
        f32 = dict(dtype=torch.float32, device=device)
        mixes_out = (torch.empty(m, hc, **f32), torch.empty(m, hc, **f32),
                     torch.empty(m, hc, hc, **f32))
    fn, scale, base = (mixes.hc_fn, mixes.hc_scale, mixes.hc_base) if mixes is not None \
        else (None, None, None)
    if mode != PLAIN:
        check_early_inputs(
            dict(residual=residual, post=post, comb=comb, pre=pre, norm_weight=norm_weight,
                 hc_fn=fn, hc_scale=scale, hc_base=base),
            dict(partial=partial, mailbox=mailbox, stage_state=stage_state, status=status,
                 generation=generation, sumsq=sumsq, prenorm=prenorm,
                 mix_words=mix_words if mixes is not None else None,
                 mxfp8_out_data=mxfp8_out[0] if quant else None,
                 mxfp8_out_scale=mxfp8_out[1] if quant else None))
    serial = mode == FULL and not tactic.cooperative
    grid = (1 if serial else triton.cdiv(hidden, tactic.block_h), m)
    dummy = out  # stands in for pointers a mode does not touch
    pdl = ptx and env.use_pdl(device)
    kernel = consumer_kernel.warmup if compile_only else consumer_kernel[grid]
    kwargs = dict(grid=grid) if compile_only else {}
    stamps, first_slot, timeline = (dummy, 0, False) if compile_only else \
        launch_args("consumer_kernel", grid[0] * grid[1], device, dummy)
    if status is None:  # gathered plain / residual-only: the kernel's abort report needs a word
        status = torch.zeros(1, dtype=torch.int32, device=device)
    if before_launch is not None and not compile_only:
        before_launch()
    compiled = kernel(
        mailbox, _or(stage_state, dummy), _or(status, dummy), _or(generation, dummy),
        _or(sumsq, dummy), _or(prenorm, dummy), _or(residual, dummy),
        _or(post, dummy), _or(comb, dummy), _or(pre, dummy), _or(norm_weight, dummy), out,
        _or(layer_input, dummy), mxfp8_out[0] if quant else dummy,
        mxfp8_out[1] if quant else dummy,
        _or(fn, dummy), _or(scale, dummy), _or(base, dummy), _or(mix_words, dummy),
        *(mixes_out or (dummy,) * 3),
        stamps, first_slot, float(eps), float(mixes.hc_eps) if mixes is not None else 0.0,
        capacity, int(wait_bound), mixes.sinkhorn_iters - 1 if mixes is not None else 0,
        TP=tp, HC=hc, HIDDEN=hidden, BLOCK_H=tactic.block_h,
        UNITS_P2=triton.next_power_of_2(sumsq_columns(hidden)), MODE=mode, QUANT=quant,
        LAMPORT=lamport, COOPERATIVE=tactic.cooperative, USE_PTX=ptx,
        USE_PDL=pdl, TIMELINE=timeline, num_warps=tactic.warps, enable_fp_fusion=False,
        launch_pdl=pdl, **_mix_constants(mixes if fused else None, hc, hidden, tactic),
        COMBINE=not defer, **kwargs,
    )
    if compile_only:
        load_module(compiled)
    if mixes is not None and not fused:
        aside = mixes_stream is not None
        launch = functools.partial(
            launch_next_mixes, out, fn, scale, base, eps, mixes.hc_eps, mixes.sinkhorn_iters,
            generation, mix_words, status, wait_bound, mixes_out, _mix_row(hidden, hc),
            cooperative=tactic.cooperative, ptx=ptx, pdl=pdl and not aside,
            compile_only=compile_only)
        if aside and device.type == "cuda" and not compile_only:
            mixes_stream.wait_stream(torch.cuda.current_stream(device))
            for t in (out, *mixes_out, fn, scale, base):  # in use there until it is joined
                t.record_stream(mixes_stream)
            with torch.cuda.stream(mixes_stream):
                launch()
        else:
            launch()
    if mixes is None:
        return out, layer_input
    # This launch rewrote the mix rows: a finish of an earlier one is stale from now on.
    epoch = -1 if compile_only else advance_mix_rows(mix_words)
    if combine_mixes:
        return out, layer_input, mixes_out
    finish = mixes_finish(mixes, mix_words, generation, status, mixes_out, eps, wait_bound,
                          hidden, tactic, ptx, epoch) if defer else None
    return out, layer_input, mixes_out, finish


def mixes_aside_ok(hc: int, collapse: str | None) -> bool:
    """Whether the next mixes of a consumer call may run on a side stream (the
    mixes kernel): only with the previous pre (V4's collapse needs them inside
    the consumer) and an hc the mixes kernel takes."""
    return collapse == "previous" and mixes_kernel_takes(hc)


def can_leave_combine(ptx: bool, device: torch.device) -> bool:
    """Whether a later kernel (the next GEMM) may combine the mixes a consumer
    launch left and get the consumer's bits: with PTX (``common.mhc_combine``'s
    docstring), or off the GPU (the interpreter contracts nothing)."""
    return ptx or device.type != "cuda"


def mixes_finish(mixes: MhcMixes, mix_words: torch.Tensor, generation: torch.Tensor,
                 status: torch.Tensor, outputs: tuple, eps: float, wait_bound: int,
                 hidden: int, tactic: ConsumerTactic, ptx: bool, epoch: int = -1) -> MixesFinish:
    """The ``MixesFinish`` of a consumer launch with ``tactic`` (its chunks'
    shares) that left the combine, for ``outputs`` = (pre, post, comb);
    ``epoch``: that launch's (``common.contract.advance_mix_rows``), -1 for a
    finish made only to compile the finishing variant."""
    hc = outputs[0].shape[1]
    row = _mix_row(hidden, hc)
    return MixesFinish(mix_words, generation, status, mixes.hc_scale, mixes.hc_base, *outputs,
                       float(eps), float(mixes.hc_eps), mixes.sinkhorn_iters - 1,
                       int(wait_bound), hc, hidden, triton.cdiv(hidden, tactic.block_h),
                       row["SLOTS"], row["MIX_ROW"], row["TOTALS_OFF"], ptx, [False], epoch,
                       current_stream_id(mix_words.device))


def _mix_row(hidden: int, hc: int) -> dict:
    """The mix row's geometry as the kernels' constexprs (both read the same rows)."""
    return dict(SLOTS=mix_slots(hc), MIX_ROW=mix_columns(hidden, hc),
                TOTALS_OFF=mix_totals_offset(hidden, hc))


def _mix_constants(mixes: MhcMixes | None, hc: int, hidden: int,
                   tactic: ConsumerTactic) -> dict:
    """The consumer kernel's MIXES constexprs (defaults without mixes)."""
    if mixes is None:
        return dict(MIXES=NO_MIXES)
    return dict(MIXES=COLLAPSES[mixes.collapse], **_mix_row(hidden, hc),
                CHUNKS_P2=triton.next_power_of_2(triton.cdiv(hidden, tactic.block_h)),
                MIX_WEIGHTS_EARLY=holds_mix_weights(tactic, hc),
                RELEASE_LATE=tactic.release_late and tactic.cooperative)


def holds_mix_weights(tactic: ConsumerTactic, hc: int) -> bool:
    """Whether the consumer's programs hold their hc_fn columns from before the
    grid wait: the tactic asks for it, programs are cooperative, and the tile
    is at most hc = 4's (32 slots x hc streams x ``block_h``, 128 registers per
    thread at 128 x 4, measured without spills; hc = 8's 128 slots would spill)."""
    return tactic.mix_weights_early and tactic.cooperative and mix_slots(hc) * hc <= 128


def _or(t, default):
    return default if t is None else t
