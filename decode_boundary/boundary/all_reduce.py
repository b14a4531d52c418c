"""``BoundaryAllReduce``: the Lamport all-reduce of a tensor-parallel decode
boundary, fused with mHC mixing, RMSNorm and MXFP8 quantization (docs/DESIGN.md
§5-6).

One call = publish kernel (this rank's partial into every peer's mailbox) +
consumer kernel (wait, rank-ordered sum, mHC, norm, quantize, re-arm). A
producer that publishes itself (the publishing ``wo_b`` GEMM, the MoE
finalize) calls :meth:`mark_published`; the next call with that tensor then
launches only the consumer. The transport (peer mailboxes or an NCCL
all-gather) is chosen at construction (:mod:`.transport`).

Bounded waits: a consumer gives up after ``wait_timeout_s`` and records the
ranks that never arrived in a device status word. Outside CUDA-graph capture
every call reads that word (one device sync per call, acceptable only there)
and raises ``RuntimeError`` naming the ranks; under capture nothing is read
(no host sync may happen), so graph users call :meth:`check` after replays.
After such an error, every rank calls ``reset(collective=True)``.

Failures (docs/FAILURES.md): every input of a step is checked before anything
of it reaches a peer or the stage words; a rejected one *aborts* the step
(:meth:`BoundaryAllReduce.abort_step`: the abort poison goes where this rank's partial
would have gone, so the peers' outputs are NaN and their status names this rank), then
raises ``ValueError``. A rank whose step failed refuses further steps until
``reset(collective=True)``. Blocking host waits are bounded by
``host_timeout_s`` (:mod:`.host_wait`).

torch.compile: under tracing the launches go through the custom ops of
:mod:`.ops`; the host rules stay Python here and are traced with the step.
The collaborators, each owned by the instance and reading its public
attributes: :mod:`.launches` (the kernels, eager paths, variants),
:mod:`.step_guard` (step state, aborts, barriers, compiled variants),
:mod:`.mixes_in_flight` (mixes left unfinished), :mod:`.rejection` (checks).

Compiling: the first use of a kernel variant is collective (:mod:`.step_guard`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import env
from ..common.contract import PublishTarget, mix_columns
from ..mixes.handoff import MixRows, NextMixes
from . import host_wait, ops
from .consumer import mixes_aside_ok, status_error
from .consumer_inputs import WaitTimeout, is_hc_eps
from .consumer_kernel import FULL, NORM_TIMEOUT_BIT, PLAIN, RESIDUAL_ONLY
from .consumer_tactics import ConsumerTactic
from .finalize_kernel import check_finalize_inputs
from .launches import Launches
from .mailbox import Mailbox, simulated_mailboxes
from .mixes_in_flight import MixesInFlight
from .rejection import (
    check_partial,
    construction_problems,
)
from .result import BoundaryResult as BoundaryResult  # the call's result type
from .step_guard import StepGuard
from .transport import exchange, open_transport

# The int32 status word gives rank p bit p and NORM_TIMEOUT_BIT (bit 30) to the
# norm hand-off: ranks 0..29 have a bit of their own, so 30 ranks at most.
MAX_TP = NORM_TIMEOUT_BIT.bit_length() - 1
_TP_ERROR = ("BoundaryAllReduce supports at most {max} ranks, got tp = {tp}: the int32 status "
             "word gives rank p bit p, and bit {max} reports a norm hand-off timeout")
# What every rank of a group must construct with the same value (compared at
# construction; the mailbox dtype is fixed, compared against version skew).
MAILBOX_DTYPE = torch.bfloat16
# Mailboxes of peer-reachable transports closed without a barrier: a peer may
# still store into them, so their memory is kept until the process exits.
_RETIRED: list[Mailbox] = []
# Host waits (docs/FAILURES.md): the floor of the default host_timeout_s (compile
# barriers wait step_guard.COMPILE_TIMEOUT_S: ranks JIT-compile at different speeds).
HOST_TIMEOUT_MIN_S = 60.0


class BoundaryAllReduce:
    """All-reduce of [M, hidden] BF16 partials over ``group`` with the mHC consumer.

    ``capacity``: the largest M of any call (mailbox slots per rank).
    ``residual_only``: allow ``pre=None`` calls. ``quantize_layer_input``: allow
    ``mxfp8_out``. ``transport``: "mailbox" (peer stores), "nccl" (all-gather +
    the same consumer; identical results), or "auto" (mailbox where every rank
    reaches every other's memory). ``group=None``: a single rank. ``tactic``:
    pin the consumer tactic for every M (benchmark sweeps; default: the table).

    ``collapse_pre``: the consumer also computes the next sublayer's mHC mixes
    from the ``residual_out`` it produces (docs/DESIGN.md §5.1), given that
    sublayer's ``mix_weights`` on every full call, which then returns them as
    the result's ``mixes``: None (no mixes), "previous" (V4.1: the collapse keeps the
    given ``pre``; the mixes are the next boundary's) or "same" (V4: the
    collapse uses the pre just computed; calls pass ``pre=None``).
    ``hc_eps`` and ``hc_sinkhorn_iters`` are the model's; the mixes' RMS eps is
    the call's ``norm_eps`` (one ``rms_norm_eps`` in the V4 family's configs).
    """

    #: Seconds every blocking host call of this instance waits for its peers at
    #: most (reset's barriers and device syncs, the gather transport's all-gather
    #: over gloo, an aborted step's all-gather) before it raises RuntimeError
    #: naming the ranks that did not arrive (docs/FAILURES.md). None:
    #: max(HOST_TIMEOUT_MIN_S, 10 * wait_timeout_s). Settable per instance.
    host_timeout_s: float | None = None
    #: Seconds a peer's liveness mark may stay unchanged before a host wait names
    #: it dead at once rather than waiting out its bound (docs/FAILURES.md §4).
    #: None: $DECODE_BOUNDARY_LIVENESS_TIMEOUT_S, else 5 s. Settable per instance.
    liveness_timeout_s: float | None = None
    _heartbeat = None  # this instance's hold on its process's liveness mark (.liveness)

    def __init__(self, hidden_size: int, hc_mult: int, capacity: int, top_k: int,
                 group: dist.ProcessGroup | None = None, quantize_layer_input: bool = False,
                 residual_only: bool = True, device: torch.device | str | None = None,
                 wait_timeout_s: float = 1.0, transport: str = "auto",
                 tactic: ConsumerTactic | None = None, collapse_pre: str | None = None,
                 hc_eps: float = 1e-6, hc_sinkhorn_iters: int = 20,
                 _mailbox: Mailbox | None = None) -> None:
        """Collective over ``group`` (every rank constructs with the same arguments).

        First, before any collective, NVLink multicast is switched off in the
        environment (``env.disable_multicast(group)``), which raises
        ``RuntimeError`` for an NCCL group whose communicator may predate that
        (see its docstring for what cannot be detected). Then ``tp`` > ``MAX_TP``
        (30) raises ``ValueError``. Then one ``all_gather_object`` (the first
        collective, :func:`.transport.exchange`) compares the geometry of every
        rank (capacity, hidden, hc, tp, top_k, the quantize / residual-only
        flags, the mailbox dtype, the transport asked for) and carries any
        refusal of a rank's own arguments: a mismatch or a refusal raises the
        same ``ValueError`` on every rank, naming the ranks and their values,
        before anything is allocated. Before the exchange, a bounded barrier
        over the rendezvous store (``host_timeout_s``, settable on the class
        before constructing; :mod:`.host_wait`) names a rank that never
        constructs in a ``RuntimeError``."""
        env.disable_multicast(group)  # before anything may touch the group
        tp = _mailbox.tp if _mailbox is not None else \
            dist.get_world_size(group) if group is not None else 1
        if tp > MAX_TP:
            raise ValueError(_TP_ERROR.format(max=MAX_TP, tp=tp))
        problems = construction_problems(transport, hc_mult, top_k, wait_timeout_s, hc_eps,
                                         collapse_pre, hc_sinkhorn_iters)
        if not is_hc_eps(hc_eps):
            hc_eps = 0.0  # (the geometry carries the refusal)
        self.device = env.resolve_device(device)
        placements = None
        if _mailbox is None and group is not None and tp > 1:
            # Bounded: a peer that never constructs is named here, not after the
            # group's own timeout in the exchange (which then finds every rank there).
            self.wait_timeout_s = wait_timeout_s  # the bound's default derives from it
            self._heartbeat = host_wait.start_heartbeat(group, self)
            geometry = dict(capacity=capacity, hidden_size=hidden_size, hc_mult=hc_mult, tp=tp,
                            top_k=top_k, quantize_layer_input=bool(quantize_layer_input),
                            residual_only=bool(residual_only), dtype=str(MAILBOX_DTYPE),
                            transport=transport, collapse_pre=collapse_pre,
                            hc_eps=float(hc_eps), hc_sinkhorn_iters=hc_sinkhorn_iters)
            try:
                host_wait.barrier(group, self.host_timeout, "construct",
                                  "the construction of BoundaryAllReduce",
                                  liveness_s=self.liveness_timeout_s)
                placements = exchange(group, self.device, geometry, "; ".join(problems) or None)
            except BaseException:
                # A refused construction holds no liveness mark: the traceback would keep
                # this half-built instance (and its hold) alive.
                if self._heartbeat is not None:
                    self._heartbeat.release()
                raise
        elif problems:
            raise ValueError(problems[0])
        self.hidden_size, self.hc_mult, self.capacity, self.top_k = (
            hidden_size, hc_mult, capacity, top_k)
        self.quantize_layer_input = quantize_layer_input
        self.residual_only = residual_only
        self.wait_timeout_s = wait_timeout_s
        self.group = group
        if _mailbox is None:
            _mailbox, transport = open_transport(group, capacity, hidden_size, self.device,
                                                 transport, placements)
        elif transport == "auto":
            transport = "mailbox"
        self.transport = transport
        self.collapse_pre, self.hc_eps, self.hc_sinkhorn_iters = (
            collapse_pre, hc_eps, hc_sinkhorn_iters)
        if collapse_pre is not None and _mailbox.mix_rows is None:
            _mailbox.mix_rows = MixRows(torch.zeros(
                capacity, mix_columns(hidden_size, hc_mult), dtype=torch.int64,
                device=self.device))
        self._box: Mailbox | None = _mailbox
        self.tp, self.rank = _mailbox.tp, _mailbox.rank
        self._guard = StepGuard(self)  # published, failed, compiled variants, barriers
        # The mixes the last call left unfinished: on the side stream, or to the next GEMM.
        self._in_flight = MixesInFlight(self.device)
        self.handle = ops.register(self)  # what the custom ops name this instance by
        self.tactic = tactic
        # The kernel launches and eager step paths (what the custom ops run).
        self.launches = Launches(self, self._guard, self._in_flight,
                                 WaitTimeout(wait_timeout_s))

    @classmethod
    def simulated(cls, tp: int, hidden_size: int, hc_mult: int, capacity: int, top_k: int,
                  device: torch.device | str = "cpu", **kwargs) -> list[BoundaryAllReduce]:
        """tp instances in this process sharing simulated mailboxes: publish from
        every instance first (:meth:`publish`), then call each one."""
        if tp > MAX_TP:
            raise ValueError(_TP_ERROR.format(max=MAX_TP, tp=tp))
        boxes = simulated_mailboxes(tp, capacity, hidden_size, device)
        return [cls(hidden_size, hc_mult, capacity, top_k, device=device, _mailbox=box, **kwargs)
                for box in boxes]

    # -- publishing ------------------------------------------------------------------------

    def publish_target(self) -> PublishTarget:
        box = self._open()
        if self.transport != "mailbox":
            raise RuntimeError("this all-reduce runs over NCCL (peers unreachable): "
                               "there is no mailbox to publish into")
        return PublishTarget(box.peer_ptrs, box.stage_state, self.rank, self.tp, self.capacity,
                             self.hidden_size)

    def mark_published(self, x: torch.Tensor) -> None:
        """Record that ``x``'s kernel published it; the next ``__call__`` must be
        with ``x`` and then launches only the consumer."""
        self._ready()
        self._guard.refuse_unreduced()
        self._guard.published = x

    def publish(self, x: torch.Tensor) -> None:
        """Launch the publish kernel for ``x`` and mark it published. A rejected
        ``x`` aborts the step (docs/FAILURES.md) and raises ``ValueError``."""
        self._ready()
        self._guard.refuse_unreduced()
        if torch.compiler.is_compiling():
            check_partial(self, x)  # at trace time: nothing runs
            torch.ops.decode_boundary.boundary_publish(self.handle, x, self._box.stage_state)
        else:
            self.launches.publish_eager(x)
        self._guard.published = x

    def publish_finalize(self, gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx,
                         shared_output) -> torch.Tensor:
        """MoE finalize fused with the publish; returns (and marks published) the
        partial. A rejected input aborts the step and raises ``ValueError``."""
        box = self._ready()
        self._guard.refuse_unreduced()
        idx = expanded_idx_to_permuted_idx
        if torch.compiler.is_compiling():
            check_finalize_inputs(gemm2_permuted, expert_weights, idx, shared_output,
                                  self.hidden_size, self.top_k, self.device, self.capacity)
            partial = torch.ops.decode_boundary.boundary_publish_finalize(
                self.handle, gemm2_permuted, expert_weights, idx, shared_output, box.stage_state)
        else:
            partial = self.launches.publish_finalize_eager(gemm2_permuted, expert_weights, idx,
                                                           shared_output)
        self._guard.published = partial
        return partial

    # -- reducing --------------------------------------------------------------------------

    def __call__(self, x: torch.Tensor, *, residual: torch.Tensor, post: torch.Tensor,
                 comb: torch.Tensor, pre: torch.Tensor | None, norm_weight: torch.Tensor | None,
                 norm_eps: float, mxfp8_out: tuple[torch.Tensor, torch.Tensor] | None = None,
                 mix_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 mixes: str | None = None) -> BoundaryResult:
        """Reduce ``x`` over the group and apply docs/DESIGN.md §5; a
        :class:`BoundaryResult` (``residual_out``, ``layer_input``: None when
        ``pre`` is None, ``mxfp8``: the MXFP8 layer input written into
        ``mxfp8_out`` = (data, swizzled scales), ``mixes``).

        With ``collapse_pre`` set (construction), every full call passes the next
        sublayer's ``mix_weights`` = (hc_fn FP32 [(2 + hc) * hc, hc * H],
        hc_scale FP32 [3], hc_base FP32 [(2 + hc) * hc]) and gets ``mixes``,
        that sublayer's (pre [M, hc], post [M, hc], comb [M, hc, hc]) FP32 from
        this residual_out (:class:`~decode_boundary.mixes.handoff.NextMixes`).
        With ``collapse_pre="same"`` (V4) the call passes ``pre=None`` and is a
        full call: the layer input collapses with the pre computed here
        (residual-only calls do not exist there).

        ``mixes``, how the next mixes are computed and when they are complete
        (None: "consumer"): "consumer", "next_gemm" (their combine left to the
        GEMM launched right after this call on this stream, ``mxfp8_mm(layer,
        x, finish_mixes=result.mixes)``; this instance refuses its next call,
        ``RuntimeError``, the step aborted as for a bad argument, while no GEMM
        launched with it), "side_stream" (the mixes kernel on this instance's
        side stream, complete once :meth:`join_mixes` ran; V4.1 at an hc the
        mixes kernel takes, else ``ValueError``) or "auto" ("side_stream" from
        ``MIXES_ASIDE_MIN_ROWS`` tokens on where possible, else "next_gemm"):
        the contract of each is :mod:`decode_boundary.mixes.handoff`'s.

        Under torch.compile the choice is ignored (the traced consumer combines
        itself). Every argument is checked before anything of this step is
        written to a peer or to the stage words; a rejected one aborts the step
        on every rank (this one raises ``ValueError``, its peers
        ``RuntimeError`` naming it; docs/FAILURES.md)."""
        full = pre is not None or self.collapse_pre == "same"
        inputs = dict(residual=residual, post=post, comb=comb, pre=pre,
                      norm_weight=norm_weight, eps=norm_eps, mxfp8_out=mxfp8_out,
                      mix_weights=mix_weights, mixes=mixes)
        return self.launches.reduce(x, FULL if full else RESIDUAL_ONLY, **inputs)

    @property
    def side_stream_possible(self) -> bool:
        """Whether full calls of this instance may take ``mixes="side_stream"``."""
        return mixes_aside_ok(self.hc_mult, self.collapse_pre)

    def join_mixes(self) -> None:
        """Make the current stream wait for the mixes the last call left on the
        side stream (``mixes="side_stream"``); nothing when none are pending.
        Call it before reading those pre / post / comb, and before a CUDA-graph
        capture that left them ends; the next call of this instance joins by
        itself. Eager mixes joined under a capture raise ``RuntimeError`` (a
        capture cannot wait for work outside it: join before it begins)."""
        if self._in_flight.pending is not None:  # (the capture query only then: every call)
            self._in_flight.join(self.capturing)

    def deferred_finish(self, rows: int, eps: float = 0.0) -> NextMixes | None:
        """The hand-off a full call of ``rows`` tokens with ``mixes="next_gemm"``
        and norm eps ``eps`` leaves to its GEMM (its outputs freshly allocated),
        made only to compile (a GEMM refuses to launch with it), or None where
        such a call leaves nothing: what compiling the finishing GEMM ahead
        needs (``gemm.precompile(..., finish_mixes=...)``; ``eps`` is a run-time
        argument, any value compiles the same kernel)."""
        if isinstance(rows, bool) or not isinstance(rows, int) or not 0 < rows <= self.capacity:
            raise ValueError(f"rows must be an int in [1, capacity = {self.capacity}], got "
                             f"{rows!r}")
        self._open()
        return self.launches.deferred_finish(rows, eps)

    def finalize(self, gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx,
                 shared_output, **call) -> BoundaryResult:
        """MoE finalize + publish in one kernel, then the consumer: ``call`` are
        the keyword arguments of ``__call__``."""
        partial = self.publish_finalize(gemm2_permuted, expert_weights,
                                        expanded_idx_to_permuted_idx, shared_output)
        return self(partial, **call)

    def plain_sum(self, x: torch.Tensor) -> torch.Tensor:
        """The same two kernels with mHC, norm and quantization switched off:
        ``bf16(sum_r x_r)`` (the fusion's baseline in the benchmark)."""
        return self.launches.reduce(x, PLAIN).residual_out

    # -- errors and lifetime ---------------------------------------------------------------

    def precompile(self, rows) -> None:
        """Compile every kernel variant this instance may launch for each M in
        ``rows`` (an int or an iterable), launching nothing, then barrier the
        group (every ``mixes`` choice of a call with mixes). Collective. Call
        it before capturing CUDA graphs."""
        rows = [rows] if isinstance(rows, int) else list(rows)
        self._open()
        compilers = self.launches.every_variant(rows)
        self.compile_variants(compilers, force_barrier=True)

    def check(self) -> None:
        """Raise RuntimeError if a wait of this rank gave up or met a peer's
        abort (device sync), naming the ranks; the outputs of that step are NaN.

        After a timeout the mailbox is out of step: the waiting rank re-armed
        slots that a slow (not absent) peer may still fill, and that peer learns
        nothing. Every rank must then ``reset(collective=True)`` before the next
        step (until then this rank's calls raise); graph users who check only
        every few replays have had NaN outputs since the failure
        (docs/FAILURES.md)."""
        error = status_error(int(self._open().status.item()), self.tp, self.wait_timeout_s)
        if error is not None:
            if self._guard.failed is None:
                self._guard.failed = error  # later steps refuse until reset(collective=True)
            raise RuntimeError(f"BoundaryAllReduce rank {self.rank}: {error}")

    def reset(self, collective: bool = False) -> None:
        """Drop an unreduced publish. ``collective=True`` (every rank must call
        it): also re-arm the mailbox (sentinel fill), the stage words, the norm
        scratch and status, and allow steps again after a failure. Its waits
        (an aborted step's all-gather, the device, two barriers) are bounded by
        ``host_timeout_s`` each: a rank that does not arrive is named in a
        ``RuntimeError`` (a dead peer: recreate the group)."""
        self._open()
        self._guard.published = None
        # The barriers below synchronize the device (collective); else only an event
        # recorded in a capture that never joined it (it raised) is dropped.
        self._in_flight.forget(device_synced=collective)
        if not collective:
            return
        self._guard.rearm()

    def close(self, collective: bool = False) -> None:
        """Stop using the mailbox; later calls raise ``RuntimeError``.

        Local by default (any rank, any time, also on an error path: it never
        waits for a peer). It finishes this rank's own kernels (device sync; not
        during a CUDA-graph capture) and drops the mailbox. A mailbox that peers
        store into (transport "mailbox" over a group of several ranks) may still
        receive a slower peer's stores, and no barrier says they have stopped,
        so its memory is kept (``_RETIRED``) until the process exits instead of
        being freed. Closing twice does nothing more.

        ``collective=True``: every rank of the group must call it (the same
        number of times, closed or not): it barriers the group (every rank's
        kernels done), then frees the mailbox at once. Not for error paths: a
        rank that never arrives holds the others in the barrier up to
        ``host_timeout_s`` (a dead one: the liveness bound). ``with`` blocks
        close locally. Either way this instance's hold on the liveness mark
        ends (the last one on the group marks this rank "closed")."""
        if self.capturing:
            raise RuntimeError("BoundaryAllReduce.close() during a CUDA graph capture")
        box, self._box, self._guard.published = self._box, None, None
        self._in_flight.forget(device_synced=True)  # the device is synchronized below
        try:
            if collective:
                self._guard.barrier()
            elif box is not None and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        finally:
            if self._heartbeat is not None:
                self._heartbeat.release()
        if box is not None and not collective and self.group is not None and \
                self.transport == "mailbox" and self.tp > 1:
            _RETIRED.append(box)

    def __enter__(self) -> BoundaryAllReduce:
        return self

    def __exit__(self, *exc) -> None:
        self.close()  # local: a peer's with-block may have raised and never close

    # -- what the collaborators use (custom ops, rejection, the publishing GEMM) ----------

    @property
    def mailbox(self) -> Mailbox:
        """The mailbox and device words; ``RuntimeError`` once closed."""
        return self._open()

    @property
    def closed(self) -> bool:
        return self._box is None

    @property
    def accepts_steps(self) -> bool:
        """Open, and no step failed since the last ``reset(collective=True)``."""
        return self._box is not None and self._guard.failed is None

    @property
    def has_unreduced_publish(self) -> bool:
        """A contribution was published (or marked so) and not reduced yet."""
        return self._guard.published is not None

    @property
    def compiled_variants(self) -> frozenset:
        """The keys of the kernel variants compiled so far (:meth:`compile_variants`)."""
        return frozenset(self._guard.compiled)

    def abort_step(self, error: Exception, like: object, published: bool) -> None:
        """Abort this step after ``error`` rejected it, before ``error`` is raised
        (:meth:`.step_guard.StepGuard.abort`); ``published``: this rank's
        contribution already went out."""
        self._guard.abort(error, like, published)

    # -- internals -------------------------------------------------------------------------

    def _open(self) -> Mailbox:
        if self._box is None:
            raise RuntimeError("BoundaryAllReduce is closed")
        return self._box

    @property
    def capturing(self) -> bool:
        """A CUDA graph is being captured on this instance's device (current stream)."""
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    @property
    def host_timeout(self) -> float:
        """The bound of this instance's blocking host waits (``host_timeout_s``)."""
        if self.host_timeout_s is not None:
            return float(self.host_timeout_s)
        return max(HOST_TIMEOUT_MIN_S, 10 * self.wait_timeout_s)

    def _ready(self) -> Mailbox:
        """The mailbox, unless closed or a step failed since the last reset."""
        return self.launches.ready()

    def compile_variants(self, compilers: dict, force_barrier: bool = False) -> None:
        """Compile the variants (key -> compile-only call) not compiled yet, then
        barrier the group if anything was new (see the module docstring).
        Collective. Producers that publish into this mailbox themselves (the
        publishing GEMM) register their kernels here too, so no rank's first
        publish waits on another rank's compiler."""
        self._guard.compile_variants(compilers, force_barrier)
