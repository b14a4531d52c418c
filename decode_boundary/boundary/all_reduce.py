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
(:func:`.rejection.abort_step`: the abort poison goes where this rank's partial would have
gone, so the peers' outputs are NaN and their status names this rank), then
raises ``ValueError``. A rank whose step failed refuses further steps until
``reset(collective=True)``. Blocking host waits are bounded by
``host_timeout_s`` (:mod:`.host_wait`).

torch.compile: under tracing, ``publish``, ``publish_finalize`` and the
reduction go through the custom ops of :mod:`.ops` (which declare the device
words they mutate); the host rules (mark_published, one publish per reduce)
stay Python here and are traced with the step. Open the mailbox (construct,
``precompile``) before compiling.

Compiling: the first call of a kernel variant JIT-compiles it (seconds), and
ranks compile at different speeds; a peer still compiling its publish would
look like a rank that never arrived. So before its first launch every variant
(publish, finalize, consumer per mode and tactic) is compiled without
launching, and then the group is barriered once: the first use of a variant is
collective (every rank makes the same calls, as it must anyway). Inside a CUDA
graph capture neither may happen: capturing a variant that is not compiled
raises and asks for :meth:`precompile` (or an eager warm-up call) first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import env
from ..common.contract import (
    MixesFinish,
    PublishTarget,
)
from . import host_wait, ops
from .consumer import (
    COLLAPSES,
    ConsumerTactic,
    MhcMixes,
    WaitTimeout,
    can_leave_combine,
    compile_inputs,
    consume,
    consumer_tactic,
    fuses_mixes,
    is_hc_eps,
    is_positive_int,
    mix_columns,
    mixes_aside_ok,
    mixes_finish,
    status_error,
    wait_bound,
)
from .consumer_kernel import FULL, NORM_TIMEOUT_BIT, PLAIN, RESIDUAL_ONLY
from .finalize_kernel import check_finalize_inputs, finalize_publish
from .mailbox import Mailbox, simulated_mailboxes
from .publish_kernel import publish
from .rejection import abort_step, check_partial, check_reduce_call
from .transport import TRANSPORTS, all_gather, exchange, open_transport

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
# Host waits (docs/FAILURES.md): the floor of the default host_timeout_s, and the
# bound of compile barriers (ranks JIT-compile at different speeds).
HOST_TIMEOUT_MIN_S = 60.0
COMPILE_TIMEOUT_S = 900.0


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
    sublayer's ``mix_weights`` on every full call, which then returns them as a
    third element: None (no mixes), "previous" (V4.1: the collapse keeps the
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
    _failed: str | None = None  # why a step of this rank failed; cleared by reset(True)
    _abort_work: tuple | None = None  # gather transport: an abort's pending all-gather
    _last_rows: int = 1  # M of the last accepted step (an abort's guess in the gather transport)

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
        # Refusals of this rank's own arguments travel with the geometry, so that
        # a rank refusing alone does not leave its peers waiting in the exchange.
        problems = []
        if transport not in TRANSPORTS:
            problems.append(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if hc_mult < 1 or top_k < 1:
            problems.append(f"hc_mult and top_k must be positive, got {hc_mult}, {top_k}")
        if wait_timeout_s <= 0:
            problems.append(f"wait_timeout_s must be positive, got {wait_timeout_s}")
        if not is_hc_eps(hc_eps):
            problems.append(f"hc_eps must be a finite real number >= 2**-126 (the smallest "
                            f"normal FP32), got {hc_eps!r}")
            hc_eps = 0.0  # (the geometry carries the refusal)
        if collapse_pre is not None:
            if collapse_pre not in COLLAPSES:
                problems.append(f"collapse_pre must be None or one of {sorted(COLLAPSES)}, got "
                                f"{collapse_pre!r}")
            if hc_mult & (hc_mult - 1):
                problems.append(f"the mixes need a power-of-two hc_mult, got {hc_mult}")
            if not is_positive_int(hc_sinkhorn_iters):
                problems.append(f"hc_sinkhorn_iters must be an int >= 1, got "
                                f"{hc_sinkhorn_iters!r}")

        self.device = env.resolve_device(device)
        placements = None
        if _mailbox is None and group is not None and tp > 1:
            # Bounded: a peer that never constructs is named here, not after the
            # group's own timeout in the exchange (which then finds every rank there).
            self.wait_timeout_s = wait_timeout_s  # the bound's default derives from it
            self._heartbeat = host_wait.start_heartbeat(group, self)
            host_wait.barrier(group, self._host_timeout(), "construct",
                              "the construction of BoundaryAllReduce",
                              liveness_s=self.liveness_timeout_s)
            geometry = dict(capacity=capacity, hidden_size=hidden_size, hc_mult=hc_mult, tp=tp,
                            top_k=top_k, quantize_layer_input=bool(quantize_layer_input),
                            residual_only=bool(residual_only), dtype=str(MAILBOX_DTYPE),
                            transport=transport, collapse_pre=collapse_pre,
                            hc_eps=float(hc_eps), hc_sinkhorn_iters=hc_sinkhorn_iters)
            placements = exchange(group, self.device, geometry, "; ".join(problems) or None)
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
        if collapse_pre is not None and _mailbox.mix_words is None:
            _mailbox.mix_words = torch.zeros(capacity, mix_columns(hidden_size, hc_mult),
                                             dtype=torch.int64, device=self.device)
        self._box: Mailbox | None = _mailbox
        self.tp, self.rank = _mailbox.tp, _mailbox.rank
        self._published: torch.Tensor | None = None
        # The MixesFinish the last call left to the next GEMM (combine_mixes=False).
        self._left_to_gemm: MixesFinish | None = None
        # mixes_aside: the side stream, and the event of the mixes the last call left
        # on it with whether it was recorded under a graph capture (join_mixes).
        self._mixes_stream: torch.cuda.Stream | None = None
        self._mixes_pending: tuple[torch.cuda.Event, bool] | None = None
        self.handle = ops.register(self)  # what the custom ops name this instance by
        self.tactic = tactic
        self._compiled: set[tuple] = set()
        # Converted to the kernel's unit at each launch, from the same PTX decision
        # as the kernel variant (consumer.WaitTimeout).
        self._wait_bound = WaitTimeout(wait_timeout_s)

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
        if self._published is not None:
            raise RuntimeError("a published contribution is still unreduced")
        self._published = x

    def publish(self, x: torch.Tensor) -> None:
        """Launch the publish kernel for ``x`` and mark it published. A rejected
        ``x`` aborts the step (docs/FAILURES.md) and raises ``ValueError``."""
        self._ready()
        if self._published is not None:
            raise RuntimeError("a published contribution is still unreduced")
        if torch.compiler.is_compiling():
            check_partial(self, x)  # at trace time: nothing runs
            torch.ops.decode_boundary.boundary_publish(self.handle, x, self._box.stage_state)
        else:
            self._publish_launch(x)
        self._published = x

    def _publish_launch(self, x: torch.Tensor) -> None:
        self._ready()
        try:
            check_partial(self, x)
            self.compile_variants({("publish",):
                                   lambda: self._launch_publish(x, compile_only=True)})
        except Exception as error:
            abort_step(self, error, x, published=False)
            raise
        self._launch_publish(x)

    def publish_finalize(self, gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx,
                         shared_output) -> torch.Tensor:
        """MoE finalize fused with the publish; returns (and marks published) the
        partial. A rejected input aborts the step and raises ``ValueError``."""
        box = self._ready()
        if self._published is not None:
            raise RuntimeError("a published contribution is still unreduced")
        idx = expanded_idx_to_permuted_idx
        if torch.compiler.is_compiling():
            check_finalize_inputs(gemm2_permuted, expert_weights, idx, shared_output,
                                  self.hidden_size, self.top_k, self.device, self.capacity)
            partial = torch.ops.decode_boundary.boundary_publish_finalize(
                self.handle, gemm2_permuted, expert_weights, idx, shared_output, box.stage_state)
        else:
            partial = self._publish_finalize_launch(gemm2_permuted, expert_weights, idx,
                                                    shared_output)
        self._published = partial
        return partial

    def _publish_finalize_launch(self, gemm2_permuted, expert_weights, idx, shared_output):
        args = (gemm2_permuted, expert_weights, idx, shared_output)
        self._ready()
        try:
            check_finalize_inputs(*args, self.hidden_size, self.top_k, self.device,
                                  self.capacity)
            # A host read of the index table: only outside capture (it would sync).
            if not self._capturing() and idx.numel():
                low, high = torch.stack(torch.aminmax(idx)).tolist()  # one sync
                if low < -1 or high >= gemm2_permuted.shape[0]:
                    raise ValueError(
                        f"expanded_idx_to_permuted_idx holds values in [{low}, {high}], but "
                        f"must lie in [-1, {gemm2_permuted.shape[0]}) (rows of gemm2_permuted; "
                        "-1: expert on another rank)")
            self.compile_variants({("finalize", expert_weights.dtype, idx.dtype):
                                   lambda: self._launch_finalize(*args, compile_only=True)})
        except Exception as error:
            abort_step(self, error, shared_output, published=False)
            raise
        return self._launch_finalize(*args)

    # -- reducing --------------------------------------------------------------------------

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
                 comb: torch.Tensor, pre: torch.Tensor | None, norm_weight: torch.Tensor | None,
                 norm_eps: float, mxfp8_out: tuple[torch.Tensor, torch.Tensor] | None = None,
                 mix_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 combine_mixes: bool = True, mixes_aside: bool = False) -> tuple:
        """Reduce ``x`` over the group and apply docs/DESIGN.md §5. Returns
        (residual_out [M, hc, H], layer_input [M, H] or None when ``pre`` is None);
        the MXFP8 layer input goes into ``mxfp8_out`` = (data, swizzled scales).

        With ``collapse_pre`` set (construction), every full call passes the next
        sublayer's ``mix_weights`` = (hc_fn FP32 [(2 + hc) * hc, hc * H],
        hc_scale FP32 [3], hc_base FP32 [(2 + hc) * hc]) and gets a third
        element, that sublayer's (pre [M, hc], post [M, hc], comb [M, hc, hc])
        FP32 from this residual_out. With ``collapse_pre="same"`` (V4) the call
        passes ``pre=None`` and is a full call: the layer input collapses with
        the pre computed here (residual-only calls do not exist there).

        ``combine_mixes=False`` (a call with mixes): the consumer computes the
        mixes' shares but leaves their combine (pre, post and comb are then
        unwritten) to the GEMM launched right after it on this stream, and the
        call returns a fourth element, the ``MixesFinish`` to pass to that
        GEMM: ``mxfp8_mm(layer, x, finish_mixes=...)``. Its M extra programs
        combine while the products run, instead of the consumer's grid ending
        with the combine, which the next kernel's grid wait waited for
        (benchmarks/NOTES.md "V4-family mixes" item 13); the bits are the
        same. It is None where nothing is left (the mixes kernel combined, PTX
        is off on the GPU, or under torch.compile, where the consumer
        combines): the GEMM then runs without it. The GEMM must run on this
        call's stream before the next consumer launch on these scratch rows
        (else it refuses the finish: ``ValueError``), and this instance refuses
        its next call (``RuntimeError``, the step aborted as for a bad
        argument) while no GEMM launched with it. pre, post and comb are
        complete when that GEMM's grid is: a kernel that reads them before its
        own grid wait (the next consumer does, for its early inputs) must not
        be able to start while the GEMM runs, i.e. not sit in an unbroken chain
        of kernels that release their dependents early (PDL) behind it.

        ``mixes_aside=True`` (a call with mixes of the previous pre, V4.1, at an
        hc the mixes kernel takes): the consumer runs without the mixes and the
        mixes kernel computes them on this instance's side stream, forked after
        the consumer, so that no kernel on the calling stream waits for them
        (V4.1 engines run their mixes GEMM so; benchmarks/NOTES.md). pre, post
        and comb are then complete only once the calling stream has *joined*
        the side stream: :meth:`join_mixes`, which the next call of this
        instance does by itself before its consumer (whose scratch the mixes
        kernel reads). Read them on no stream before that; a CUDA-graph capture
        must call ``join_mixes`` before it ends (CUDA refuses an unjoined
        capture) and cannot start while an eager call's mixes are pending
        (``RuntimeError``: join first). The pre, post and comb are the mixes
        kernel's (another FP32 summation order than the consumer's fused dots:
        equal within ``MIXES_ATOL``, not bit for bit); residual_out is the same
        bit for bit, the layer input may differ in its last bits (the consumer
        without the mixes runs its own tactic: another sum-of-squares order).
        Under torch.compile the flag is ignored (the traced consumer
        combines itself); without mixes, or for V4, it is refused
        (``ValueError``, the step aborted like any bad argument). The mixes
        kernel reports a missing share into the status word like the
        consumer: :meth:`check` sees that only once the side stream is joined
        (every call joins the last one's first). A capture that raises before
        it joins leaves its event pending: ``reset()`` drops it.

        Every argument is checked before anything of this step is written to a
        peer or to the stage words; a rejected one aborts the step on every rank
        (this one raises ``ValueError``, its peers ``RuntimeError`` naming it;
        docs/FAILURES.md)."""
        full = pre is not None or self.collapse_pre == "same"
        inputs = dict(residual=residual, post=post, comb=comb, pre=pre,
                      norm_weight=norm_weight, eps=norm_eps, mxfp8_out=mxfp8_out,
                      mix_weights=mix_weights, combine_mixes=combine_mixes,
                      mixes_aside=mixes_aside)
        return self._reduce(x, FULL if full else RESIDUAL_ONLY, **inputs)

    def join_mixes(self) -> None:
        """Make the current stream wait for the mixes the last call left on the
        side stream (``mixes_aside=True``); nothing when none are pending. Call
        it before reading those pre / post / comb, and before a CUDA-graph
        capture that left them ends; the next call of this instance joins by
        itself. Eager mixes joined under a capture raise ``RuntimeError`` (a
        capture cannot wait for work outside it: join before it begins)."""
        pending, self._mixes_pending = self._mixes_pending, None
        if pending is None:
            return
        # (A capture that raised before it joined leaves its event here: reset() drops it.)
        event, captured = pending
        capturing = self._capturing()
        if captured and not capturing:
            return  # that capture has ended; CUDA made it join (or refused it)
        if capturing and not captured:
            self._mixes_pending = pending  # still to be joined, outside the capture
            raise RuntimeError(
                "BoundaryAllReduce: an eager call's next mixes are still pending on the side "
                "stream (mixes_aside=True) and a CUDA graph is being captured; call "
                "join_mixes() before the capture begins")
        torch.cuda.current_stream(self.device).wait_event(event)

    def _side_stream(self):
        """The stream ``mixes_aside`` runs the mixes kernel on (created once;
        on a CPU device, where it runs inline, a stand-in)."""
        if self.device.type != "cuda":
            return "inline"
        if self._mixes_stream is None:
            self._mixes_stream = torch.cuda.Stream(self.device)
        return self._mixes_stream

    def deferred_finish(self, rows: int, eps: float = 0.0):
        """The ``MixesFinish`` a full call of ``rows`` tokens with
        ``combine_mixes=False`` and norm eps ``eps`` returns (its outputs
        freshly allocated), or None where it returns None: what compiling the
        finishing GEMM ahead needs (``gemm.precompile(..., finish_mixes=...)``;
        ``eps`` is a run-time argument, any value compiles the same kernel)."""
        if isinstance(rows, bool) or not isinstance(rows, int) or not 0 < rows <= self.capacity:
            raise ValueError(f"rows must be an int in [1, capacity = {self.capacity}], got "
                             f"{rows!r}")
        m, hc, h = rows, self.hc_mult, self.hidden_size
        ptx = env.use_ptx(self.device)
        if self.collapse_pre is None or not fuses_mixes(m, hc, self.collapse_pre) or \
                not can_leave_combine(ptx, self.device):
            return None
        box = self._open()
        f32 = dict(dtype=torch.float32, device=self.device)
        fn = torch.empty(0, **f32)
        mixes = MhcMixes(fn, torch.empty(3, **f32), torch.empty((2 + hc) * hc, **f32),
                         self.hc_eps, self.hc_sinkhorn_iters, self.collapse_pre)
        tactic = self.tactic or consumer_tactic(m, h, self.collapse_pre)
        bound = self._wait_bound
        if isinstance(bound, WaitTimeout):
            bound = wait_bound(bound.seconds, self.device)
        return mixes_finish(mixes, box.mix_words, box.generation, box.status,
                            (torch.empty(m, hc, **f32), torch.empty(m, hc, **f32),
                             torch.empty(m, hc, hc, **f32)), eps, bound, h, tactic, ptx)

    def finalize(self, gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx,
                 shared_output, residual, post, comb, pre, norm_weight, norm_eps,
                 mxfp8_out=None, mix_weights=None, combine_mixes: bool = True) -> tuple:
        """MoE finalize + publish in one kernel, then the consumer (as ``__call__``)."""
        partial = self.publish_finalize(gemm2_permuted, expert_weights,
                                        expanded_idx_to_permuted_idx, shared_output)
        return self(partial, residual, post, comb, pre, norm_weight, norm_eps, mxfp8_out,
                    mix_weights, combine_mixes)

    def plain_sum(self, x: torch.Tensor) -> torch.Tensor:
        """The same two kernels with mHC, norm and quantization switched off:
        ``bf16(sum_r x_r)`` (the fusion's baseline in the benchmark)."""
        return self._reduce(x, PLAIN)[0]

    # -- errors and lifetime ---------------------------------------------------------------

    def precompile(self, rows) -> None:
        """Compile every kernel variant this instance may launch for each M in
        ``rows`` (an int or an iterable), launching nothing, then barrier the
        group (every way of a call with mixes: ``combine_mixes`` True and
        False, ``mixes_aside`` where it applies). Collective. Call it before
        capturing CUDA graphs."""
        rows = [rows] if isinstance(rows, int) else list(rows)
        self._open()
        h, hc, dev = self.hidden_size, self.hc_mult, self.device
        compilers = {}
        for m in rows:
            x = torch.zeros(m, h, dtype=torch.bfloat16, device=dev)
            check_partial(self, x)
            compilers[("publish",)] = lambda x=x: self._launch_publish(x, compile_only=True)
            for dtype in (torch.float32, torch.bfloat16):
                compilers[("finalize", dtype, torch.int32)] = lambda x=x, dtype=dtype: (
                    self._launch_finalize(
                        x, torch.zeros(len(x), self.top_k, dtype=dtype, device=dev),
                        torch.zeros(len(x), self.top_k, dtype=torch.int32, device=dev), x,
                        compile_only=True))
            for mode, used in compile_inputs(m, hc, h, dev, self.residual_only,
                                             self.quantize_layer_input, self.collapse_pre):
                quant = used.get("mxfp8_out") is not None
                compilers[self._consumer_key(m, mode, quant)] = (
                    lambda x=x, mode=mode, used=used: self._consume(x, mode, compile_only=True,
                                                                    **used))
                if used.get("mix_weights") is not None:
                    compilers[self._consumer_key(m, mode, quant, False)] = (
                        lambda x=x, mode=mode, used=used: self._consume(
                            x, mode, compile_only=True, combine_mixes=False, **used))
                    if mixes_aside_ok(hc, self.collapse_pre):
                        compilers[self._consumer_key(m, mode, quant, True, True)] = (
                            lambda x=x, mode=mode, used=used: self._consume(
                                x, mode, compile_only=True, mixes_aside=True, **used))
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
            if self._failed is None:
                self._failed = error  # later steps refuse until reset(collective=True)
            raise RuntimeError(f"BoundaryAllReduce rank {self.rank}: {error}")

    def reset(self, collective: bool = False) -> None:
        """Drop an unreduced publish. ``collective=True`` (every rank must call
        it): also re-arm the mailbox (sentinel fill), the stage words, the norm
        scratch and status, and allow steps again after a failure. Its waits
        (an aborted step's all-gather, the device, two barriers) are bounded by
        ``host_timeout_s`` each: a rank that does not arrive is named in a
        ``RuntimeError`` (a dead peer: recreate the group)."""
        box = self._open()
        self._published = self._left_to_gemm = None
        if self._mixes_pending is not None and self._mixes_pending[1]:
            # Recorded in a capture that never joined it (it raised): nothing to wait for.
            self._mixes_pending = None
        if not collective:
            return
        self._mixes_pending = None  # the barriers below synchronize the device
        work, self._abort_work = self._abort_work, None
        if work is not None:
            host_wait.wait_work(work[0], self.group, self._host_timeout(),
                                "the aborted step's all-gather", self.liveness_timeout_s)
        self._barrier("reset-a")
        box.rearm()
        self._barrier("reset-b")
        self._failed = None
        if self._multi_process():
            host_wait.next_epoch(self.group)

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
        if self._capturing():
            raise RuntimeError("BoundaryAllReduce.close() during a CUDA graph capture")
        box, self._box, self._published = self._box, None, None
        self._mixes_pending = None  # the device is synchronized below
        try:
            if collective:
                self._barrier()
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

    # -- internals -------------------------------------------------------------------------

    def _open(self) -> Mailbox:
        if self._box is None:
            raise RuntimeError("BoundaryAllReduce is closed")
        return self._box

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _host_timeout(self) -> float:
        if self.host_timeout_s is not None:
            return float(self.host_timeout_s)
        return max(HOST_TIMEOUT_MIN_S, 10 * self.wait_timeout_s)

    def _multi_process(self) -> bool:
        return self.group is not None and dist.get_world_size(self.group) > 1

    def _barrier(self, tag: str | None = None, timeout_s: float | None = None,
                 aborts_arrive: bool = False) -> None:
        """This rank's device work done, then every rank of the group here. With
        a ``tag`` (compile, reset): both bounded (``host_timeout_s``, or
        ``timeout_s``), a rank missing named in a ``RuntimeError``, over tagged
        store barriers (:mod:`.host_wait`: barriers of different purposes never
        pair). Without (``close(collective=True)``): a device sync, a store
        barrier bounded the same way, then the group's own ``dist.barrier``.
        Either way a rank judged dead by its liveness mark is named at once."""
        if tag is None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            if self._multi_process():
                host_wait.barrier(self.group, self._host_timeout(), "close",
                                  "the close barrier of BoundaryAllReduce",
                                  liveness_s=self.liveness_timeout_s)
                dist.barrier(group=self.group)
            return
        timeout_s = self._host_timeout() if timeout_s is None else timeout_s
        what = f"the {tag} barrier of BoundaryAllReduce"
        host_wait.sync_device(self.device, timeout_s, what)
        if self._multi_process():
            host_wait.barrier(self.group, timeout_s, tag, what, aborts_arrive,
                              self.liveness_timeout_s)

    def _ready(self) -> Mailbox:
        """The mailbox, unless closed or a step failed since the last reset."""
        box = self._open()
        if self._failed is not None:
            raise RuntimeError(
                f"BoundaryAllReduce rank {self.rank}: a step failed ({self._failed}); call "
                "reset(collective=True) on every rank before the next step")
        return box

    def _launch_publish(self, x: torch.Tensor, compile_only: bool = False) -> None:
        if self.transport == "mailbox":
            box = self._box
            publish(x, box.peer_ptrs, box.stage_state, self.rank, self.capacity,
                    compile_only=compile_only)

    def _launch_finalize(self, gemm2_permuted, expert_weights, idx, shared_output,
                         compile_only: bool = False) -> torch.Tensor:
        box = self._box
        return finalize_publish(gemm2_permuted, expert_weights, idx, shared_output,
                                box.peer_ptrs, box.stage_state, self.rank, self.capacity,
                                publish=self.transport == "mailbox", compile_only=compile_only)

    def _consumer_key(self, m: int, mode: int, quant: bool, combine: bool = True,
                      aside: bool = False) -> tuple:
        mixes = self.collapse_pre if mode == FULL else None
        fused = mixes is not None and not aside and fuses_mixes(m, self.hc_mult, mixes)
        return ("consume", mode, quant, mixes, fused, combine or not fused, aside,
                self.tactic or consumer_tactic(m, self.hidden_size, mixes if fused else None))

    def compile_variants(self, compilers: dict, force_barrier: bool = False) -> None:
        """Compile the variants (key -> compile-only call) not compiled yet, then
        barrier the group if anything was new (see the module docstring).
        Collective. Producers that publish into this mailbox themselves (the
        publishing GEMM) register their kernels here too, so no rank's first
        publish waits on another rank's compiler."""
        new = [key for key in compilers if key not in self._compiled]
        if new and self._capturing():
            raise RuntimeError(
                f"BoundaryAllReduce: kernel variant(s) {new} are not compiled and a CUDA graph "
                "is being captured; call precompile(rows) with every M you capture (on every "
                "rank) or run each call once eagerly before capturing")
        for key in new:
            if not env.interpret_mode():  # nothing to compile in the interpreter
                compilers[key]()
            self._compiled.add(key)
        if new or force_barrier:
            # Ranks compile at different speeds: a longer bound than host_timeout_s. A
            # rank that aborted this step compiles nothing: it counts as arrived.
            self._barrier("compile", max(self._host_timeout(), COMPILE_TIMEOUT_S),
                          aborts_arrive=True)

    def _consume(self, x: torch.Tensor, mode: int, compile_only: bool = False,
                 before_launch=None, mix_weights=None, combine_mixes: bool = True,
                 mixes_aside: bool = False, **inputs):
        """The consumer; ``before_launch`` (the step's publish) runs once
        ``consume`` has checked every input, and in the gather transport is
        followed by the all-gather (bounded over gloo: ``host_timeout_s``)."""
        box = self._box
        m = x.shape[0]
        if mode == FULL and self.collapse_pre is not None:
            inputs.update(mixes=MhcMixes(*mix_weights, self.hc_eps, self.hc_sinkhorn_iters,
                                         self.collapse_pre), mix_words=box.mix_words,
                          combine_mixes=combine_mixes)
            if mixes_aside:
                inputs.update(mixes_stream=self._side_stream())
        # The status word and bound serve the norm hand-off in both transports.
        scratch = dict(generation=box.generation, sumsq=box.sumsq,
                       prenorm=box.prenorm, tactic=self.tactic, compile_only=compile_only,
                       status=box.status, wait_bound=self._wait_bound,
                       partial=x)  # only checked: an early input must not alias it
        if self.transport == "mailbox":
            return consume(box.buffer, self.tp, m, mode=mode, stage_state=box.stage_state,
                           before_launch=before_launch, **scratch, **inputs)
        gathered = torch.empty(self.tp, *x.shape, dtype=x.dtype, device=x.device)

        def gather() -> None:
            if before_launch is not None:
                before_launch()
            flat = gathered.view(-1, x.shape[1])
            if x.device.type == "cuda" and "nccl" in str(dist.get_backend(self.group)).lower():
                # Stream-ordered, no host wait: bounded by the group's own timeout.
                all_gather(flat, x, self.group)
            else:
                work = all_gather(flat, x, self.group, async_op=True)
                host_wait.wait_work(work, self.group, self._host_timeout(),
                                    "the gather transport's all-gather", self.liveness_timeout_s)

        return consume(gathered, self.tp, m, mode=mode, lamport=False, before_launch=gather,
                       **scratch, **inputs)

    def _reduce(self, x: torch.Tensor, mode: int, **inputs):
        """The host rules (one publish per reduce, of this tensor), then the
        launches: directly, or through ``boundary_reduce`` under torch.compile."""
        self._ready()
        published, self._published = self._published, None
        if published is not None and published is not x:
            error = RuntimeError("reducing a tensor other than the published one")
            abort_step(self, error, x, published=True)  # (nothing runs while tracing)
            raise error
        if not torch.compiler.is_compiling():
            return self._reduce_launch(x, mode, published is None, **inputs)
        check_reduce_call(self, x, mode, inputs)  # at trace time: nothing runs
        left_to_next = not inputs.pop("combine_mixes", True)
        inputs.pop("mixes_aside", None)  # traced, the consumer combines itself
        box = self._box
        data, scale = inputs.get("mxfp8_out") or (None, None)
        fn, hc_scale, hc_base = inputs.get("mix_weights") or (None, None, None)
        first, second, *mixes = torch.ops.decode_boundary.boundary_reduce(
            self.handle, x, published is None, mode, inputs.get("residual"), inputs.get("post"),
            inputs.get("comb"), inputs.get("pre"), inputs.get("norm_weight"),
            float(inputs.get("eps", 0.0)), box.stage_state, box.status, box.generation,
            box.sumsq, box.prenorm, data, scale, fn, hc_scale, hc_base, box.mix_words)
        out = first, (second if mode == FULL else None)
        if fn is None:
            return out
        # Traced, the consumer combines itself: nothing is left to the next GEMM.
        return (*out, tuple(mixes), None) if left_to_next else (*out, tuple(mixes))

    def _reduce_launch(self, x: torch.Tensor, mode: int, publish: bool, **inputs):
        """Check every input, (compile and) launch the publish kernel when
        ``publish``, then the consumer; outside capture, check the status word.
        An input rejected before the publish (or, after an earlier publish, before
        the consumer) aborts the step (:func:`.rejection.abort_step`)."""
        started = []

        def publish_now() -> None:  # consume calls it once every input passed
            started.append(True)
            if publish:
                self._launch_publish(x)

        self._ready()
        try:
            # First: the last call's mixes kernel may still write the status word (an abort
            # below ORs into it) and read the scratch this consumer writes (generation, mix
            # rows). A stream wait only.
            self.join_mixes()
            left = self._left_to_gemm
            if left is not None and not left.launched[0]:
                # Refused like a bad argument (the step aborts on every rank); the finish
                # stays valid (nothing rewrote its shares), so it can still be launched.
                raise RuntimeError(
                    "the previous call left its next mixes to the GEMM after it "
                    "(combine_mixes=False), but no GEMM launched with its MixesFinish, so its "
                    "pre, post and comb are unwritten: launch mxfp8_mm(layer, x, "
                    "finish_mixes=...) with it right after such a call (or call with "
                    "combine_mixes=True)")
            self._left_to_gemm = None
            check_reduce_call(self, x, mode, inputs)
            quant = inputs.get("mxfp8_out") is not None
            combine = inputs.get("combine_mixes", True)
            aside = inputs.get("mixes_aside", False)
            compilers = {self._consumer_key(x.shape[0], mode, quant, combine, aside):
                         lambda: self._consume(x, mode, compile_only=True, **inputs)}
            if publish:
                compilers[("publish",)] = lambda: self._launch_publish(x, compile_only=True)
            self.compile_variants(compilers)
            out = self._consume(x, mode, before_launch=publish_now, **inputs)
            if aside and self.device.type == "cuda":
                event = torch.cuda.Event()
                event.record(self._mixes_stream)
                self._mixes_pending = (event, self._capturing())
        except Exception as error:
            if not started:
                abort_step(self, error, x, published=not publish)
            elif self._failed is None:  # the step went out half done: reset first
                self._failed = f"{type(error).__name__}: {error}"
            raise
        self._last_rows = x.shape[0]
        if len(out) == 4 and out[3] is not None:
            self._left_to_gemm = out[3]
        if not self._capturing():
            self.check()
        return out
