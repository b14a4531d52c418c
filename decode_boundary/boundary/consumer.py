"""Host side of the consumer kernel (:mod:`.consumer_kernel`): the tactic
choice, the norm scratch geometry, the status word's report and the launcher
:func:`consume`.

What it takes and checks: :mod:`.consumer_inputs`; its tactic tables:
:mod:`.consumer_tactics`.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton

from .. import env
from ..common.compiled import load_module
from ..common.contract import STAGES, mix_columns, mix_slots, mix_totals_offset
from ..common.timeline import launch_args
from ..mixes.handoff import MixesFinish
from ..mixes.mixes_kernel import launch_next_mixes
from ..mxfp8.format import check_scale_buffer, mxfp8_scale_bytes
from .consumer_inputs import (
    QUANT_GROUP,
    MhcMixes,
    WaitTimeout,
    check_early_inputs,
    check_mixes,
    check_tactic,
    need,
)
from .consumer_kernel import (
    ABORT_BIT,
    COLLAPSES,
    FULL,
    NO_MIXES,
    NORM_TIMEOUT_BIT,
    PLAIN,
    RESIDUAL_ONLY,
    consumer_kernel,
)
from .consumer_tactics import (
    ConsumerTactic,
    chosen_tactic,
    fuses_mixes,
    side_stream_possible,
)

# Wait bound without %globaltimer, as spins: the order of one spin on a GPU and in
# the Triton interpreter.
SPINS_PER_SECOND = 1_000_000
INTERPRETER_SPINS_PER_SECOND = 1_000


def sumsq_columns(hidden: int) -> int:
    """Row length of the per-token sum-of-squares scratch (one tagged word per
    32 columns, the finest chunk a tactic may use)."""
    return triton.cdiv(hidden, QUANT_GROUP)


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


def prepare_consume(
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
    partial: torch.Tensor | None = None,
    mixes: MhcMixes | None = None,
    mix_words: torch.Tensor | None = None,
    combine_mixes: bool = True,
    mixes_stream: torch.cuda.Stream | None = None,
    batch_invariant: bool = False,
) -> ConsumerLaunch:
    """Check every input of a consumer launch for ``m`` tokens and allocate its
    outputs; the :class:`ConsumerLaunch` returned launches it (its ``result``:
    a :class:`ConsumerResult`; with ``mixes`` its ``mixes``, the next
    sublayer's, computed from this ``residual_out``).

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
    mixes' collapse). ``mixes`` (full mode): :class:`MhcMixes`;
    with ``collapse="same"`` ``pre`` is None (the kernel collapses with the pre
    it computes); ``mix_words`` int64 [rows, ``mix_columns(H, hc)``] is then its
    per-token scratch, zeroed together with ``generation`` and ``sumsq``. The
    consumer computes the mixes itself where :func:`fuses_mixes` says so, else
    the mixes kernel (:mod:`decode_boundary.mixes.mixes_kernel`) does, launched right after it on
    the same stream (from the same checked inputs and scratch).
    ``combine_mixes=False`` (with ``mixes``): the result's ``finish``, a
    ``MixesFinish`` (the device arguments of ``decode_boundary.mixes.handoff``)
    where the consumer computed the shares but left their combine (pre, post
    and comb: then unwritten) to the kernel launched right after it, the next
    GEMM's extra programs, so the consumer's grid ends without the combine's
    serial tail; None where nothing is left: the mixes kernel finished them, or
    PTX is off on the GPU (``DECODE_BOUNDARY_DISABLE_PTX``: the combine's
    bits would then depend on the kernel's FMA contraction), so the consumer
    combined.
    ``mixes_stream`` (with ``mixes`` of the previous pre, V4.1, whose hc fits
    the mixes kernel: :func:`.consumer_tactics.side_stream_possible`): the consumer runs without the
    mixes and the mixes kernel runs on this stream, after everything the
    current stream has enqueued (this consumer included), without PDL (it
    releases nothing before it completes). Its pre, post and comb, and the
    scratch it reads (``generation``, ``mix_words``), belong to that stream
    until the caller makes its own stream wait for it (``BoundaryAllReduce``
    does before its next consumer and in ``join_mixes``): nothing may read
    the mixes, or launch the next consumer on the same scratch, before that.
    ``residual_out``, the mixes and the mix weights are recorded on the
    stream for the allocator. On a CPU device (the interpreter) the kernel runs inline.
    ``batch_invariant``: the default tactic is the mode's
    (``consumer_tactic(..., batch_invariant=True)``) and the mixes kernel
    computes its shares in the consumer's order (``CONSUMER_ORDER``), which
    needs the consumer's tactic to have the shape ``INVARIANT_CONSUMER``
    (else ``ValueError``): a token's outputs are then the same whichever
    kernel computes its mixes (docs/DESIGN.md §7.1).

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
    Nothing is launched here: ``BoundaryAllReduce`` runs the step's publish
    (or all-gather) between this and the launch, so that an input this rank
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
        need(mailbox, "mailbox", torch.bfloat16, (STAGES, tp, capacity, hidden), device)
        need(stage_state, "stage_state", torch.int32, (2,), device)
        need(status, "status", torch.int32, (1,), device)
    else:
        need(mailbox, "mailbox", torch.bfloat16, (tp, m, hidden), device)
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
        need(residual, "residual", torch.bfloat16, (m, hc, hidden), device)
        need(post, "post", torch.float32, (m, hc), device)
        need(comb, "comb", torch.float32, (m, hc, hc), device)
        out = torch.empty(m, hc, hidden, dtype=torch.bfloat16, device=device)
    if mixes_stream is not None and not (isinstance(mixes, MhcMixes) and mode == FULL and
                                         side_stream_possible(hc, mixes.collapse)):
        raise ValueError("mixes_stream needs the full mode with mixes of the previous pre "
                         f"(collapse 'previous') and 16 <= mix_slots(hc) <= 32, got hc = {hc}, "
                         f"collapse {getattr(mixes, 'collapse', None)!r}")
    fused = isinstance(mixes, MhcMixes) and mixes_stream is None and \
        fuses_mixes(m, hc, mixes.collapse)
    tactic = chosen_tactic(tactic, m, hidden, mixes.collapse if fused else None,
                           batch_invariant)
    check_tactic(tactic, hidden, mode, fused, isinstance(mixes, MhcMixes) and not fused)
    if not isinstance(combine_mixes, bool):
        raise ValueError(f"combine_mixes must be a bool, got {combine_mixes!r}")
    defer = not combine_mixes and fused and can_leave_combine(ptx, device)
    layer_input = None
    quant = mxfp8_out is not None
    same_pre = isinstance(mixes, MhcMixes) and mixes.collapse == "same"
    if mode == FULL:
        if not same_pre:
            need(pre, "pre", torch.float32, (m, hc), device)
        need(norm_weight, "norm_weight", torch.bfloat16, (hidden,), device)
        rows = generation.shape[0] if generation is not None else 0
        need(generation, "generation", torch.int32, (max(rows, m),), device)
        need(sumsq, "sumsq scratch", torch.int64, (rows, sumsq_columns(hidden)), device)
        if not tactic.cooperative:
            need(prenorm, "prenorm scratch", torch.bfloat16, (rows, hidden), device)
        # Serial or cooperative, the norm hand-off records its timeout, in either transport.
        need(status, "status", torch.int32, (1,), device)
        layer_input = torch.empty(m, hidden, dtype=torch.bfloat16, device=device)
        if quant:
            if hidden % 32:
                raise ValueError(f"MXFP8 output needs hidden % 32 == 0, got {hidden}")
            data, scale = mxfp8_out
            need(data, "mxfp8_out data", torch.float8_e4m3fn, (m, hidden), device)
            check_scale_buffer(scale, m, hidden, "mxfp8_out scale", device=device)
    elif quant:
        raise ValueError("mxfp8_out needs the layer input: pass pre and norm_weight")
    mixes_out = None
    if mixes is not None:
        check_mixes(mixes, mode, pre, mix_words, m, hc, hidden, device)
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
    if status is None:  # gathered plain / residual-only: the kernel's abort report needs a word
        status = torch.zeros(1, dtype=torch.int32, device=device)
    tensors = (
        mailbox, _given_or(stage_state, dummy), status, _given_or(generation, dummy),
        _given_or(sumsq, dummy), _given_or(prenorm, dummy), _given_or(residual, dummy),
        _given_or(post, dummy), _given_or(comb, dummy), _given_or(pre, dummy),
        _given_or(norm_weight, dummy), out,
        _given_or(layer_input, dummy), mxfp8_out[0] if quant else dummy,
        mxfp8_out[1] if quant else dummy,
        _given_or(fn, dummy), _given_or(scale, dummy), _given_or(base, dummy),
        _given_or(mix_words, dummy),
        *(mixes_out or (dummy,) * 3))
    scalars = (float(eps), float(mixes.hc_eps) if mixes is not None else 0.0, capacity,
               int(wait_bound), mixes.sinkhorn_iters - 1 if mixes is not None else 0)
    constants = dict(
        TP=tp, HC=hc, HIDDEN=hidden, BLOCK_H=tactic.block_h,
        UNITS_P2=triton.next_power_of_2(sumsq_columns(hidden)), MODE=int(mode), QUANT=quant,
        LAMPORT=lamport, COOPERATIVE=tactic.cooperative, USE_PTX=ptx,
        USE_PDL=pdl, num_warps=tactic.warps, enable_fp_fusion=False,
        launch_pdl=pdl, **_mix_constants(mixes if fused else None, hc, hidden, tactic),
        COMBINE=not defer)
    mixes_kernel = None
    if mixes is not None and not fused:
        mixes_kernel = functools.partial(
            launch_next_mixes, out, fn, scale, base, eps, mixes.hc_eps, mixes.sinkhorn_iters,
            generation, mix_words, status, wait_bound, mixes_out, _mix_row(hidden, hc),
            cooperative=tactic.cooperative, ptx=ptx, pdl=pdl and mixes_stream is None,
            consumer_order=batch_invariant)
    finish = mixes_finish(mixes, mix_words, generation, status, mixes_out, eps, wait_bound,
                          hidden, tactic, ptx) if defer else None
    return ConsumerLaunch(grid, tensors, scalars, constants, mixes_kernel, mixes_stream,
                          (out, *(mixes_out or ()), fn, scale, base),
                          ConsumerResult(out, layer_input, mixes_out, finish))


class ConsumerResult(NamedTuple):
    """What a consumer launch returns: ``residual_out`` (the plain sum [M, H]
    in plain mode, else [M, hc, H]); ``layer_input`` [M, H] (full mode, else
    None); ``mixes``, the next sublayer's (pre [M, hc], post [M, hc], comb [M,
    hc, hc]) FP32 (with mixes, else None; unwritten where ``finish`` is set);
    ``finish``, the ``MixesFinish`` of a combine left to the next kernel
    (``combine_mixes=False`` where it could be left, else None)."""

    residual_out: torch.Tensor
    layer_input: torch.Tensor | None
    mixes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    finish: MixesFinish | None


class ConsumerLaunch(NamedTuple):
    """A consumer launch whose every input passed :func:`prepare_consume`'s
    checks: :meth:`run` launches it (and the mixes kernel after it, where it
    computes them), :meth:`compile` compiles its variants, launching nothing."""

    grid: tuple[int, int]
    tensors: tuple  # the kernel's arguments before the timeline's
    scalars: tuple  # after them
    constants: dict
    mixes_kernel: functools.partial | None  # launch_next_mixes, its arguments bound
    mixes_stream: torch.cuda.Stream | str | None  # "inline": the mixes aside, off the GPU
    on_stream: tuple  # what the mixes kernel aside uses until it is joined
    result: ConsumerResult

    def compile(self) -> None:
        tensors, dummy = self.tensors, self.result.residual_out
        compiled = consumer_kernel.warmup(*tensors, dummy, 0, *self.scalars, TIMELINE=False,
                                          grid=self.grid, **self.constants)
        load_module(compiled)
        if self.mixes_kernel is not None:
            self.mixes_kernel(compile_only=True)

    def run(self) -> ConsumerResult:
        grid, out = self.grid, self.result
        stamps, first_slot, timeline = launch_args("consumer_kernel", grid[0] * grid[1],
                                                   out.residual_out.device, out.residual_out)
        consumer_kernel[grid](*self.tensors, stamps, first_slot, *self.scalars,
                              TIMELINE=timeline, **self.constants)
        if self.mixes_kernel is None:
            return out
        device, stream = out.residual_out.device, self.mixes_stream
        if stream is not None and device.type == "cuda":
            stream.wait_stream(torch.cuda.current_stream(device))
            for t in self.on_stream:  # for the allocator
                t.record_stream(stream)
            with torch.cuda.stream(stream):
                self.mixes_kernel()
        else:
            self.mixes_kernel()
        return out


def consume(mailbox: torch.Tensor, tp: int, m: int, *, compile_only: bool = False,
            **inputs) -> ConsumerResult:
    """Check and launch the consumer in one go (:func:`prepare_consume`, then
    its launch's ``run``); ``compile_only``: compile its variant, launch
    nothing (the outputs are then unwritten)."""
    launch = prepare_consume(mailbox, tp, m, **inputs)
    if not compile_only:
        return launch.run()
    launch.compile()
    return launch.result


def can_leave_combine(ptx: bool, device: torch.device) -> bool:
    """Whether a later kernel (the next GEMM) may combine the mixes a consumer
    launch left and get the consumer's bits: with PTX (``mixes.mhc_combine``'s
    docstring), or off the GPU (the interpreter contracts nothing)."""
    return ptx or device.type != "cuda"


def mixes_finish(mixes: MhcMixes, mix_words: torch.Tensor, generation: torch.Tensor,
                 status: torch.Tensor, outputs: tuple, eps: float, wait_bound: int,
                 hidden: int, tactic: ConsumerTactic, ptx: bool) -> MixesFinish:
    """The ``MixesFinish`` of a consumer launch with ``tactic`` (its chunks'
    shares) that left the combine, for ``outputs`` = (pre, post, comb)."""
    hc = outputs[0].shape[1]
    row = _mix_row(hidden, hc)
    return MixesFinish(mix_words, generation, status, mixes.hc_scale, mixes.hc_base, *outputs,
                       float(eps), float(mixes.hc_eps), mixes.sinkhorn_iters - 1,
                       int(wait_bound), hc, hidden, triton.cdiv(hidden, tactic.block_h),
                       row["SLOTS"], row["MIX_ROW"], row["TOTALS_OFF"], ptx)


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


def _given_or(t, default):
    """``t``, or ``default`` (a dummy pointer) where the argument was not given."""
    return default if t is None else t
