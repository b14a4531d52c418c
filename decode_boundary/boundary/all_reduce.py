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
:mod:`.ops`; the host rules stay Python and are traced with the step.

The instance is its :class:`~.spec.BoundarySpec` (validated once, frozen),
its :class:`~.spec.Settings` and three collaborators that take those, never
the instance: :class:`~.step_guard.StepGuard` (the mailbox, step state,
aborts, barriers, compiled variants), :class:`~.mixes_in_flight.MixesInFlight`
(mixes left unfinished) and :class:`~.launches.Launches` (each call planned
once by :mod:`.plan`, then prepare, publish, consume).

Compiling: the first use of a kernel variant is collective (:mod:`.step_guard`).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from .. import env
from ..common.contract import PublishTarget, mix_columns
from ..mixes.handoff import MixesPlacement, MixRows, NextMixes
from . import host_wait
from .consumer_inputs import is_hc_eps
from .consumer_kernel import FULL, PLAIN, RESIDUAL_ONLY, Collapse
from .consumer_tactics import ConsumerTactic
from .finalize_kernel import check_finalize_inputs
from .launches import Launches
from .mailbox import Mailbox, simulated_mailboxes
from .mixes_in_flight import MixesInFlight
from .plan import StepInputs, check_partial
from .result import BoundaryResult as BoundaryResult  # the call's result type
from .spec import MAX_TP as MAX_TP  # re-exported: the most ranks
from .spec import BoundarySpec, Settings, check_tp, spec_problems
from .step_guard import StepGuard
from .transport import exchange, open_transport

# What every rank of a group must construct with the same value (compared at
# construction; the mailbox dtype is fixed, compared against version skew).
MAILBOX_DTYPE = torch.bfloat16
# Mailboxes of peer-reachable transports closed without a barrier: a peer may
# still store into them, so their memory is kept until the process exits.
_RETIRED: list[Mailbox] = []


def _from_spec(field: str, doc: str) -> property:
    """A read-only attribute of the instance's spec (a plain function: traceable)."""
    return property(lambda self: getattr(self.spec, field), doc=doc)


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
    the result's ``mixes``: None (no mixes), :class:`~.consumer_kernel.Collapse`
    ``V4_1`` = "previous" (the collapse keeps the given ``pre``; the mixes are
    the next boundary's) or ``V4`` = "same" (the collapse uses the pre just
    computed; calls pass ``pre=None``). ``hc_eps`` and ``hc_sinkhorn_iters``
    are the model's; the mixes' RMS eps is the call's ``norm_eps`` (one
    ``rms_norm_eps`` in the V4 family's configs).
    """

    #: Seconds every blocking host call of this instance waits for its peers at
    #: most (reset's barriers and device syncs, the gather transport's all-gather
    #: over gloo, an aborted step's all-gather) before it raises RuntimeError
    #: naming the ranks that did not arrive (docs/FAILURES.md). None:
    #: max(HOST_TIMEOUT_MIN_S, 10 * wait_timeout_s). Settable per instance, or
    #: on the class before constructing.
    host_timeout_s: float | None = None
    #: Seconds a peer's liveness mark may stay unchanged before a host wait names
    #: it dead at once rather than waiting out its bound (docs/FAILURES.md §4).
    #: None: $DECODE_BOUNDARY_LIVENESS_TIMEOUT_S, else 5 s. Settable per instance.
    liveness_timeout_s: float | None = None
    #: The consumer tactic pinned for every M (None: the tables). Settable.
    tactic: ConsumerTactic | None = None
    _heartbeat = None  # this instance's hold on its process's liveness mark (.liveness)

    tp = _from_spec("tp", "Ranks of the group.")
    rank = _from_spec("rank", "This rank in the group.")
    device = _from_spec("device", "The device of the partials, mailbox and outputs.")
    group = _from_spec("group", "The process group (None: one rank, or simulated ones).")
    hidden_size = _from_spec("hidden", "Columns of a partial.")
    hc_mult = _from_spec("hc", "Residual streams.")
    capacity = _from_spec("capacity", "The largest M of any call.")
    top_k = _from_spec("top_k", "Experts per token (the MoE finalize).")
    transport = _from_spec("transport", '"mailbox" or "nccl", as resolved.')
    residual_only = _from_spec("residual_only", "Whether pre=None calls are allowed.")
    quantize_layer_input = _from_spec("quantize_layer_input", "Whether mxfp8_out is allowed.")
    wait_timeout_s = _from_spec("wait_timeout_s", "The consumer's wait bound.")
    collapse_pre = _from_spec("collapse", "The next mixes' Collapse (None: none).")
    hc_eps = _from_spec("hc_eps", "The mixes' Sinkhorn eps.")
    hc_sinkhorn_iters = _from_spec("hc_sinkhorn_iters", "The mixes' Sinkhorn rounds.")
    batch_invariant = _from_spec(
        "batch_invariant", "Whether a token's outputs are independent of M and its batch-mates.")
    side_stream_possible = _from_spec(
        "side_stream_possible", 'Whether full calls may take mixes_placement="side_stream".')
    capturing = _from_spec("capturing", "A CUDA graph is being captured on this device.")

    def __init__(self, hidden_size: int, hc_mult: int, capacity: int, top_k: int,
                 group: dist.ProcessGroup | None = None, quantize_layer_input: bool = False,
                 residual_only: bool = True, device: torch.device | str | None = None,
                 wait_timeout_s: float = 1.0, transport: str = "auto",
                 tactic: ConsumerTactic | None = None, collapse_pre: str | None = None,
                 hc_eps: float = 1e-6, hc_sinkhorn_iters: int = 20,
                 batch_invariant: bool | None = None,
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
        constructs in a ``RuntimeError``.

        ``batch_invariant`` (None: ``DECODE_BOUNDARY_BATCH_INVARIANT``, read
        here, once): a token's outputs do not depend on M or its batch-mates
        (docs/DESIGN.md §7.1): one consumer tactic for every M
        (``consumer_tactics.INVARIANT_CONSUMER``; a pinned ``tactic`` must
        have its shape), the mixes kernel's shares in the consumer's order,
        and the publisher's GEMM on the invariant tactics. Compared across
        ranks like the geometry."""
        env.disable_multicast(group)  # before anything may touch the group
        batch_invariant = env.batch_invariant(batch_invariant)
        tp = _mailbox.tp if _mailbox is not None else \
            dist.get_world_size(group) if group is not None else 1
        check_tp(tp)
        problems = spec_problems(transport, hc_mult, top_k, wait_timeout_s, hc_eps,
                                 collapse_pre, hc_sinkhorn_iters)
        if not is_hc_eps(hc_eps):
            hc_eps = 0.0  # (the geometry carries the refusal)
        device = env.resolve_device(device)
        self.settings = Settings(wait_timeout_s, None, type(self).host_timeout_s,
                                 type(self).liveness_timeout_s)
        self.tactic = tactic
        placements = None
        if _mailbox is None and group is not None and tp > 1:
            # Bounded: a peer that never constructs is named here, not after the
            # group's own timeout in the exchange (which then finds every rank there).
            self._heartbeat = host_wait.start_heartbeat(group, self)
            geometry = dict(capacity=capacity, hidden_size=hidden_size, hc_mult=hc_mult, tp=tp,
                            top_k=top_k, quantize_layer_input=bool(quantize_layer_input),
                            residual_only=bool(residual_only), dtype=str(MAILBOX_DTYPE),
                            transport=transport, collapse_pre=collapse_pre,
                            hc_eps=float(hc_eps), hc_sinkhorn_iters=hc_sinkhorn_iters,
                            batch_invariant=batch_invariant)
            try:
                host_wait.barrier(group, self.settings.host_timeout, "construct",
                                  "the construction of BoundaryAllReduce",
                                  liveness_s=self.settings.liveness_timeout_s)
                placements = exchange(group, device, geometry, "; ".join(problems) or None)
            except BaseException:
                # A refused construction holds no liveness mark: the traceback would keep
                # this half-built instance (and its hold) alive.
                if self._heartbeat is not None:
                    self._heartbeat.release()
                raise
        elif problems:
            raise ValueError(problems[0])
        if _mailbox is None:
            _mailbox, transport = open_transport(group, capacity, hidden_size, device,
                                                 transport, placements)
        elif transport == "auto":
            transport = "mailbox"
        collapse = None if collapse_pre is None else Collapse(collapse_pre)
        if collapse is not None and _mailbox.mix_rows is None:
            _mailbox.mix_rows = MixRows(torch.zeros(
                capacity, mix_columns(hidden_size, hc_mult), dtype=torch.int64, device=device))
        self.spec = BoundarySpec(
            _mailbox.tp, _mailbox.rank, hidden_size, hc_mult, capacity, top_k, device, group,
            transport, bool(residual_only), bool(quantize_layer_input), wait_timeout_s,
            collapse, hc_eps, hc_sinkhorn_iters, batch_invariant)
        # published, failed, compiled variants, barriers; the mailbox
        self._guard = StepGuard(self.spec, _mailbox, self.settings)
        # The mixes the last call left unfinished: on the side stream, or to the next GEMM.
        self._in_flight = MixesInFlight(device)
        # The kernel launches and eager step paths (what the custom ops run).
        self.launches = Launches(self.spec, self._guard, self._in_flight, self.settings)

    def __setattr__(self, name: str, value) -> None:
        if name in Settings.NAMES and "settings" in self.__dict__:
            setattr(self.settings, name, value)  # what the collaborators read
        super().__setattr__(name, value)

    @classmethod
    def simulated(cls, tp: int, hidden_size: int, hc_mult: int, capacity: int, top_k: int,
                  device: torch.device | str = "cpu", **kwargs) -> list[BoundaryAllReduce]:
        """tp instances in this process sharing simulated mailboxes: publish from
        every instance first (:meth:`publish`), then call each one."""
        check_tp(tp)
        boxes = simulated_mailboxes(tp, capacity, hidden_size, device)
        return [cls(hidden_size, hc_mult, capacity, top_k, device=device, _mailbox=box, **kwargs)
                for box in boxes]

    # -- publishing ------------------------------------------------------------------------

    def publish_target(self) -> PublishTarget:
        box = self.mailbox
        if self.transport != "mailbox":
            raise RuntimeError("this all-reduce runs over NCCL (peers unreachable): "
                               "there is no mailbox to publish into")
        return PublishTarget(box.peer_ptrs, box.stage_state, self.rank, self.tp, self.capacity,
                             self.hidden_size)

    def mark_published(self, x: torch.Tensor) -> None:
        """Record that ``x``'s kernel published it; the next ``__call__`` must be
        with ``x`` and then launches only the consumer."""
        self._guard.ready()
        self._guard.refuse_unreduced()
        self._guard.published = x

    def publish(self, x: torch.Tensor) -> None:
        """Launch the publish kernel for ``x`` and mark it published. A rejected
        ``x`` aborts the step (docs/FAILURES.md) and raises ``ValueError``."""
        self._guard.ready()
        self._guard.refuse_unreduced()
        if torch.compiler.is_compiling():
            check_partial(self.spec, x)  # at trace time: nothing runs
            torch.ops.decode_boundary.boundary_publish(self.handle, x, self.mailbox.stage_state)
        else:
            self.launches.publish_eager(x)
        self._guard.published = x

    def publish_finalize(self, gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx,
                         shared_output) -> torch.Tensor:
        """MoE finalize fused with the publish; returns (and marks published) the
        partial. A rejected input aborts the step and raises ``ValueError``."""
        box = self._guard.ready()
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
                 mixes_placement: MixesPlacement | str | None = None,
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

        ``mixes_placement`` (:class:`~decode_boundary.mixes.handoff.MixesPlacement`;
        ``mixes=``, its old spelling, still works with a ``DeprecationWarning``),
        where the next mixes are computed and when they are complete
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
        if mixes is not None:
            warnings.warn("BoundaryAllReduce(..., mixes=) is deprecated: pass mixes_placement=",
                          DeprecationWarning, stacklevel=2)
            if mixes_placement is not None:
                raise TypeError("pass mixes_placement= alone (mixes= is its old spelling)")
            mixes_placement = mixes
        full = pre is not None or self.spec.collapse == Collapse.V4
        inputs = StepInputs(residual, post, comb, pre, norm_weight, norm_eps, mxfp8_out,
                            mix_weights)
        return self.launches.reduce(x, FULL if full else RESIDUAL_ONLY, inputs, mixes_placement)

    def join_mixes(self) -> None:
        """Make the current stream wait for the mixes the last call left on the
        side stream (``mixes_placement="side_stream"``); nothing when none are pending.
        Call it before reading those pre / post / comb, and before a CUDA-graph
        capture that left them ends; the next call of this instance joins by
        itself. Eager mixes joined under a capture raise ``RuntimeError`` (a
        capture cannot wait for work outside it: join before it begins)."""
        self.launches.join_mixes()

    def deferred_finish(self, rows: int, eps: float = 0.0) -> NextMixes | None:
        """The hand-off a full call of ``rows`` tokens with ``mixes_placement="next_gemm"``
        and norm eps ``eps`` leaves to its GEMM (its outputs freshly allocated),
        made only to compile (a GEMM refuses to launch with it), or None where
        such a call leaves nothing: what compiling the finishing GEMM ahead
        needs (``gemm.precompile(..., finish_mixes=...)``; ``eps`` is a run-time
        argument, any value compiles the same kernel)."""
        if isinstance(rows, bool) or not isinstance(rows, int) or not 0 < rows <= self.capacity:
            raise ValueError(f"rows must be an int in [1, capacity = {self.capacity}], got "
                             f"{rows!r}")
        self._guard.mailbox  # noqa: B018  (raises once closed)
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
        return self.launches.reduce(x, PLAIN, StepInputs()).residual_out

    # -- errors and lifetime ---------------------------------------------------------------

    def precompile(self, rows) -> None:
        """Compile every kernel variant this instance may launch for each M in
        ``rows`` (an int or an iterable), launching nothing, then barrier the
        group (every mixes placement of a call with mixes). Collective. Call
        it before capturing CUDA graphs. Refused (``RuntimeError``) while a
        step of this rank failed since the last ``reset(collective=True)``:
        its peers' barriers count such a rank as arrived."""
        rows = [rows] if isinstance(rows, int) else list(rows)
        self._guard.mailbox  # noqa: B018  (raises once closed)
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
        self._guard.check()

    def reset(self, collective: bool = False) -> None:
        """Drop an unreduced publish. ``collective=True`` (every rank must call
        it): also re-arm the mailbox (sentinel fill), the stage words, the norm
        scratch and status, keep only the kernel variants every rank has
        compiled (so every rank enters the next step's host collectives
        alike), and allow steps again after a failure. Its waits (an aborted
        step's all-gather, the device, two barriers) are bounded by
        ``host_timeout_s`` each: a rank that does not arrive is named in a
        ``RuntimeError`` (a dead peer: recreate the group)."""
        self._guard.mailbox  # noqa: B018  (raises once closed)
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
        guard = self._guard
        box, guard.box, guard.published = guard.box, None, None
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

    # -- its state ------------------------------------------------------------------------

    @property
    def mailbox(self) -> Mailbox:
        """The mailbox and device words; ``RuntimeError`` once closed."""
        return self._guard.mailbox

    @property
    def handle(self) -> int:
        """What the custom ops name this instance by (:mod:`.ops`)."""
        return self.launches.handle

    @property
    def closed(self) -> bool:
        return self._guard.box is None

    @property
    def accepts_steps(self) -> bool:
        """Open, and no step failed since the last ``reset(collective=True)``."""
        return self._guard.box is not None and self._guard.failed is None

    @property
    def has_unreduced_publish(self) -> bool:
        """A contribution was published (or marked so) and not reduced yet."""
        return self._guard.published is not None

    @property
    def compiled_variants(self) -> frozenset:
        """The keys of the kernel variants compiled so far (:meth:`compile_variants`)."""
        return frozenset(self._guard.compiled)

    @property
    def host_timeout(self) -> float:
        """The bound of this instance's blocking host waits (``host_timeout_s``)."""
        return self.settings.host_timeout

    def abort_step(self, error: Exception, like: object, published: bool) -> None:
        """Abort this step after ``error`` rejected it, before ``error`` is raised
        (:meth:`.step_guard.StepGuard.abort`); ``published``: this rank's
        contribution already went out. For a producer that publishes itself
        (the publishing GEMM)."""
        self._guard.abort(error, like, published)

    def compile_variants(self, compilers: dict, force_barrier: bool = False) -> None:
        """Compile the variants (key -> compile-only call) not compiled yet, then
        barrier the group if anything was new (see the module docstring;
        refused while a step of this rank failed, as :meth:`precompile`).
        Collective. Producers that publish into this mailbox themselves (the
        publishing GEMM) register their kernels here too, so no rank's first
        publish waits on another rank's compiler."""
        self._guard.compile_variants(compilers, force_barrier)
