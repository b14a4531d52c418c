"""The launch sequence of one rank's all-reduce: the publish and finalize
kernels, the consumer in either transport (peer mailboxes, or the NCCL
all-gather then the same consumer), the compile-only launch of every variant
an instance may run (``BoundaryAllReduce.precompile``), and the hand-off a
call leaving its combine to the next GEMM makes (``deferred_finish``, for
compiling that GEMM ahead).

A reduce is four steps in this order: plan (:func:`.plan.plan_step`: the
call's checks), prepare (:func:`.consumer.prepare_consume`: the consumer's
layout checks, its outputs), publish (this rank's partial to every peer; in
the gather transport the all-gather), consume. An input rejected before the
publish aborts the step (:meth:`.step_guard.StepGuard.abort`): nothing of it
reached a peer. It takes the spec, the step guard (the mailbox and step
state), the mixes in flight and the settings, never the all-reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import env
from ..mixes.handoff import MixesPlacement, NextMixes, current_stream_id
from ..mxfp8.format import QuantizedActivation
from . import host_wait, ops
from .collective_order import CollectiveMismatch
from .consumer import (
    ConsumerLaunch,
    ConsumerResult,
    can_leave_combine,
    compile_inputs,
    mixes_finish,
    prepare_consume,
    wait_bound,
)
from .consumer_inputs import MhcMixes, WaitTimeout
from .consumer_kernel import FULL, Mode
from .consumer_tactics import chosen_tactic, fuses_mixes
from .finalize_kernel import check_finalize_inputs, finalize_publish
from .mailbox import Mailbox
from .mixes_in_flight import MixesInFlight
from .plan import StepInputs, StepPlan, check_partial, plan_step, variant_plan
from .publish_kernel import publish
from .result import BoundaryResult
from .spec import BoundarySpec, Settings
from .step_guard import PendingGather, StepGuard
from .transport import all_gather


class Launches:
    """The launches of the all-reduce of ``spec``: ``guard`` holds its mailbox
    and step state, ``in_flight`` the mixes a call left unfinished,
    ``settings`` the pinned tactic and host-wait bounds. ``handle``: what the
    custom ops (:mod:`.ops`) name it by."""

    def __init__(self, spec: BoundarySpec, guard: StepGuard, in_flight: MixesInFlight,
                 settings: Settings) -> None:
        self.spec = spec
        self.guard = guard
        self.in_flight = in_flight
        self.settings = settings
        # Converted to the kernel's unit at each launch, from the same PTX decision
        # as the kernel variant (consumer_inputs.WaitTimeout).
        self.wait_bound = WaitTimeout(spec.wait_timeout_s)
        self.handle = ops.register(self)

    @property
    def mailbox(self) -> Mailbox:
        return self.guard.mailbox

    # -- the kernels -----------------------------------------------------------------------

    def publish(self, x: torch.Tensor, compile_only: bool = False) -> None:
        spec = self.spec
        if spec.transport == "mailbox":
            box = self.mailbox
            publish(x, box.peer_ptrs, box.stage_state, spec.rank, spec.capacity,
                    compile_only=compile_only)

    def finalize(self, gemm2_permuted, expert_weights, idx, shared_output,
                 compile_only: bool = False) -> torch.Tensor:
        spec, box = self.spec, self.mailbox
        return finalize_publish(gemm2_permuted, expert_weights, idx, shared_output,
                                box.peer_ptrs, box.stage_state, spec.rank, spec.capacity,
                                publish=spec.transport == "mailbox", compile_only=compile_only)

    def gather(self, x: torch.Tensor, gathered: torch.Tensor) -> None:
        """The gather transport's publish: every rank's partial into
        ``gathered`` (bounded over gloo: ``host_timeout_s``). Numbered like
        every host collective (:func:`.host_wait.number`); one left pending by
        a collective mismatch is the reset's to wait for."""
        spec, settings = self.spec, self.settings
        flat = gathered.view(-1, x.shape[1])
        seq = host_wait.number(spec.group, "gather")
        if x.device.type == "cuda" and "nccl" in str(dist.get_backend(spec.group)).lower():
            # Stream-ordered, no host wait: bounded by the group's own timeout.
            all_gather(flat, x, spec.group)
            return
        work = all_gather(flat, x, spec.group, async_op=True)
        try:
            host_wait.wait_work(work, spec.group, settings.host_timeout,
                                "the gather transport's all-gather", seq,
                                settings.liveness_timeout_s)
        except CollectiveMismatch:
            self.guard.pending_gather = PendingGather(seq, work, (flat, x))
            raise

    def prepare(self, x: torch.Tensor, plan: StepPlan) -> tuple[ConsumerLaunch,
                                                                 torch.Tensor | None]:
        """The consumer launch of ``plan``, every input checked, and in the
        gather transport the buffer the all-gather must fill before it runs."""
        spec, box = self.spec, self.mailbox
        inputs = plan.inputs._asdict()
        del inputs["mix_weights"]
        mix_params = plan.mix_params(spec)
        if mix_params is not None:
            inputs.update(mixes=mix_params, mix_words=box.mix_words,
                          combine_mixes=plan.placement != MixesPlacement.NEXT_GEMM)
            if plan.placement == MixesPlacement.SIDE_STREAM:
                inputs.update(mixes_stream=self.in_flight.side_stream())
        # The status word and bound serve the norm hand-off in both transports.
        scratch = dict(generation=box.generation, sumsq=box.sumsq, prenorm=box.prenorm,
                       status=box.status, tactic=plan.tactic, wait_bound=self.wait_bound,
                       # partial: only checked (an early input must not alias it)
                       partial=x, batch_invariant=plan.batch_invariant)
        if spec.transport == "mailbox":
            return prepare_consume(box.buffer, spec.tp, plan.rows, mode=plan.mode,
                                   stage_state=box.stage_state, **scratch, **inputs), None
        gathered = torch.empty(spec.tp, *x.shape, dtype=x.dtype, device=x.device)
        return prepare_consume(gathered, spec.tp, plan.rows, mode=plan.mode, lamport=False,
                               **scratch, **inputs), gathered

    # -- what to compile -------------------------------------------------------------------

    def every_variant(self, rows: list[int]) -> dict:
        """key -> compile-only launch of every kernel variant the all-reduce may
        launch for each M in ``rows`` (every mixes placement of a call with mixes)."""
        spec = self.spec
        h, hc, dev = spec.hidden, spec.hc, spec.device
        compilers = {}
        for m in rows:
            x = torch.zeros(m, h, dtype=torch.bfloat16, device=dev)
            check_partial(spec, x)
            compilers[("publish",)] = lambda x=x: self.publish(x, compile_only=True)
            for dtype in (torch.float32, torch.bfloat16):
                compilers[("finalize", dtype, torch.int32)] = lambda x=x, dtype=dtype: (
                    self.finalize(
                        x, torch.zeros(len(x), spec.top_k, dtype=dtype, device=dev),
                        torch.zeros(len(x), spec.top_k, dtype=torch.int32, device=dev), x,
                        compile_only=True))
            for mode, used in compile_inputs(m, hc, h, dev, spec.residual_only,
                                             spec.quantize_layer_input, spec.collapse):
                inputs = StepInputs(**used)
                placements = [MixesPlacement.CONSUMER]
                if inputs.mix_weights is not None:
                    placements.append(MixesPlacement.NEXT_GEMM)
                    if spec.side_stream_possible:
                        placements.append(MixesPlacement.SIDE_STREAM)
                for placement in placements:
                    plan = variant_plan(spec, self.settings.tactic, m, mode, inputs, placement)
                    compilers[plan.variant] = lambda x=x, plan=plan: (
                        self.prepare(x, plan)[0].compile())
        return compilers

    def deferred_finish(self, rows: int, eps: float = 0.0) -> NextMixes | None:
        """``BoundaryAllReduce.deferred_finish``."""
        spec = self.spec
        m, hc, h, device = rows, spec.hc, spec.hidden, spec.device
        ptx = env.use_ptx(device)
        if spec.collapse is None or not fuses_mixes(m, hc, spec.collapse) or \
                not can_leave_combine(ptx, device):
            return None
        box = self.mailbox
        f32 = dict(dtype=torch.float32, device=device)
        mix_params = MhcMixes(torch.empty(0, **f32), torch.empty(3, **f32),
                              torch.empty((2 + hc) * hc, **f32), spec.hc_eps,
                              spec.hc_sinkhorn_iters, spec.collapse)
        tactic = chosen_tactic(self.settings.tactic, m, h, spec.collapse, spec.batch_invariant)
        bound = wait_bound(self.wait_bound.seconds, device)  # a WaitTimeout, converted
        outputs = (torch.empty(m, hc, **f32), torch.empty(m, hc, **f32),
                   torch.empty(m, hc, hc, **f32))
        finish = mixes_finish(mix_params, box.mix_words, box.generation, box.status, outputs,
                              eps, bound, h, tactic, ptx)
        return NextMixes(*outputs, MixesPlacement.NEXT_GEMM, finish, box.mix_rows, epoch=None)

    # -- the steps -------------------------------------------------------------------------

    def join_mixes(self) -> None:
        """``BoundaryAllReduce.join_mixes``."""
        if self.in_flight.pending is not None:  # (the capture query only then: every call)
            self.in_flight.join(self.spec.capturing)

    def result(self, x: torch.Tensor, out: ConsumerResult, mxfp8_out,
               placement: MixesPlacement = MixesPlacement.CONSUMER,
               epoch: int | None = None) -> BoundaryResult:
        """The launch's (or traced op's) outputs as a :class:`BoundaryResult`."""
        quantized = None
        if mxfp8_out is not None:
            quantized = QuantizedActivation(mxfp8_out[0], mxfp8_out[1], torch.bfloat16,
                                            torch.Size((x.shape[0], self.spec.hidden)))
        mixes = None
        if out.mixes is not None:
            if out.finish is None and placement == MixesPlacement.NEXT_GEMM:
                placement = MixesPlacement.CONSUMER  # nothing could be left: it combined
            # The stream matters only for a combine left to the GEMM (never under
            # tracing, where reading the stream would enter the traced graph).
            stream = current_stream_id(x.device) if out.finish is not None else 0
            mixes = NextMixes(*out.mixes, placement, out.finish, self.mailbox.mix_rows, epoch,
                              stream)
        return BoundaryResult(out.residual_out, out.layer_input, quantized, mixes)

    def publish_eager(self, x: torch.Tensor) -> None:
        """The eager publish, without the host rule of ``BoundaryAllReduce.publish``."""
        self.guard.ready()
        try:
            check_partial(self.spec, x)
            self.guard.compile_variants({("publish",):
                                         lambda: self.publish(x, compile_only=True)})
        except Exception as error:
            self.guard.abort(error, x, published=False)
            raise
        self.publish(x)

    def publish_finalize_eager(self, gemm2_permuted, expert_weights, idx, shared_output):
        """The eager finalize + publish, without the host rule."""
        spec = self.spec
        args = (gemm2_permuted, expert_weights, idx, shared_output)
        self.guard.ready()
        try:
            check_finalize_inputs(*args, spec.hidden, spec.top_k, spec.device, spec.capacity)
            # A host read of the index table: only outside capture (it would sync).
            if not spec.capturing and idx.numel():
                low, high = torch.stack(torch.aminmax(idx)).tolist()  # one sync
                if low < -1 or high >= gemm2_permuted.shape[0]:
                    raise ValueError(
                        f"expanded_idx_to_permuted_idx holds values in [{low}, {high}], but "
                        f"must lie in [-1, {gemm2_permuted.shape[0]}) (rows of gemm2_permuted; "
                        "-1: expert on another rank)")
            self.guard.compile_variants({("finalize", expert_weights.dtype, idx.dtype):
                                         lambda: self.finalize(*args, compile_only=True)})
        except Exception as error:
            self.guard.abort(error, shared_output, published=False)
            raise
        return self.finalize(*args)

    def reduce_eager(self, x: torch.Tensor, mode: Mode, publish: bool, inputs: StepInputs,
                     placement=None) -> BoundaryResult:
        """The eager reduce (module docstring), the publish when ``publish``;
        outside capture, then the status word checked."""
        guard, spec = self.guard, self.spec
        guard.ready()
        sent = False  # whether anything of this step went to a peer
        try:
            # First: the last call's mixes kernel may still write the status word (an abort
            # below ORs into it) and read the scratch this consumer writes (generation, mix
            # rows). A stream wait only.
            self.join_mixes()
            self.in_flight.refuse_unfinished()
            plan = plan_step(spec, self.settings.tactic, x, mode, inputs, placement)
            launch, gathered = self.prepare(x, plan)
            compilers = {plan.variant: launch.compile}
            if publish:
                compilers[("publish",)] = lambda: self.publish(x, compile_only=True)
            guard.compile_variants(compilers)
            sent = True
            if publish:
                self.publish(x)
            if gathered is not None:
                self.gather(x, gathered)
            out = launch.run()
            if plan.placement == MixesPlacement.SIDE_STREAM:
                self.in_flight.record_aside(spec.capturing)
        except Exception as error:
            if not sent:
                guard.abort(error, x, published=not publish)
            elif guard.failed is None:  # the step went out half done: reset first
                guard.failed = f"{type(error).__name__}: {error}"
            raise
        guard.last_rows = x.shape[0]
        epoch = self.mailbox.mix_rows.advance() if out.mixes is not None else None
        result = self.result(x, out, inputs.mxfp8_out, plan.placement, epoch)
        if result.mixes is not None and result.mixes.left_to_gemm:
            self.in_flight.left_to_gemm = result.mixes
        if not spec.capturing:
            guard.check()
        return result

    def reduce(self, x: torch.Tensor, mode: Mode, inputs: StepInputs,
               placement=None) -> BoundaryResult:
        """A call of the all-reduce: the host rules (one publish per reduce, of
        this tensor), then the launches: directly (:meth:`reduce_eager`), or
        through ``boundary_reduce`` under torch.compile (where the traced
        consumer combines the mixes itself, whatever the placement)."""
        guard = self.guard
        guard.ready()
        published, guard.published = guard.published, None
        if published is not None and published is not x:
            error = RuntimeError("reducing a tensor other than the published one")
            guard.abort(error, x, published=True)  # (nothing runs while tracing)
            raise error
        if not torch.compiler.is_compiling():
            return self.reduce_eager(x, mode, published is None, inputs, placement)
        plan_step(self.spec, self.settings.tactic, x, mode, inputs, placement)  # checks only
        box = self.mailbox
        data, scale = inputs.mxfp8_out or (None, None)
        fn, hc_scale, hc_base = inputs.mix_weights or (None, None, None)
        first, second, *mixes = torch.ops.decode_boundary.boundary_reduce(
            self.handle, x, published is None, int(mode), inputs.residual, inputs.post,
            inputs.comb, inputs.pre, inputs.norm_weight, float(inputs.eps), box.stage_state,
            box.status, box.generation, box.sumsq, box.prenorm, data, scale, fn, hc_scale,
            hc_base, box.mix_words)
        out = ConsumerResult(first, second if mode == FULL else None,
                             tuple(mixes) if fn is not None else None, None)
        return self.result(x, out, inputs.mxfp8_out)
