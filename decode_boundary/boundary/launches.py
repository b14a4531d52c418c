"""The kernel launches of one :class:`~.all_reduce.BoundaryAllReduce`, owned
by it: the publish and finalize kernels, the consumer in either transport
(peer mailboxes, or the NCCL all-gather then the same consumer), the key of
each kernel variant and a compile-only launch of every variant an instance
may run (``BoundaryAllReduce.precompile``), and the hand-off a call leaving
its combine to the next GEMM makes (``deferred_finish``, for compiling that
GEMM ahead). It reads the all-reduce's public attributes only; the host rules
(one publish per reduce, aborts, compile barriers) stay with the all-reduce."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import env
from ..mixes.handoff import NextMixes, current_stream_id
from ..mxfp8.format import QuantizedActivation
from . import consumer, host_wait
from .consumer import (
    can_leave_combine,
    compile_inputs,
    consume,
    consumer_tactic,
    fuses_mixes,
    mixes_finish,
    wait_bound,
)
from .consumer_inputs import MhcMixes, WaitTimeout
from .consumer_kernel import FULL
from .finalize_kernel import check_finalize_inputs, finalize_publish
from .mailbox import Mailbox
from .mixes_in_flight import MixesInFlight
from .publish_kernel import publish
from .rejection import check_partial, check_reduce_call
from .result import BoundaryResult
from .step_guard import StepGuard
from .transport import all_gather


class Launches:
    """The launches of the all-reduce ``ar`` (its mailbox, transport, tactic,
    mix parameters and wait bound); ``in_flight``: where a call's mixes on
    the side stream go."""

    def __init__(self, ar, guard: StepGuard, in_flight: MixesInFlight,
                 timeout: WaitTimeout) -> None:
        self.ar = ar
        self.guard = guard
        self.in_flight = in_flight
        # Converted to the kernel's unit at each launch, from the same PTX decision
        # as the kernel variant (consumer_inputs.WaitTimeout).
        self.wait_bound = timeout

    def ready(self) -> Mailbox:
        """The mailbox, unless closed or a step failed since the last reset."""
        box = self.ar.mailbox
        self.guard.refuse_if_failed()
        return box

    def publish(self, x: torch.Tensor, compile_only: bool = False) -> None:
        ar = self.ar
        if ar.transport == "mailbox":
            box = ar.mailbox
            publish(x, box.peer_ptrs, box.stage_state, ar.rank, ar.capacity,
                    compile_only=compile_only)

    def finalize(self, gemm2_permuted, expert_weights, idx, shared_output,
                 compile_only: bool = False) -> torch.Tensor:
        ar, box = self.ar, self.ar.mailbox
        return finalize_publish(gemm2_permuted, expert_weights, idx, shared_output,
                                box.peer_ptrs, box.stage_state, ar.rank, ar.capacity,
                                publish=ar.transport == "mailbox", compile_only=compile_only)

    def consumer_key(self, m: int, mode: int, quant: bool, how: str = "consumer") -> tuple:
        """The consumer variant a call of M tokens in ``mode`` runs (``how``: the
        resolved mixes choice)."""
        ar = self.ar
        mixes = ar.collapse_pre if mode == FULL else None
        aside = how == "side_stream"
        fused = mixes is not None and not aside and fuses_mixes(m, ar.hc_mult, mixes)
        return ("consume", mode, quant, mixes, fused, how != "next_gemm" or not fused, aside,
                ar.tactic or consumer_tactic(m, ar.hidden_size, mixes if fused else None))

    def consume(self, x: torch.Tensor, mode: int, compile_only: bool = False,
                before_launch=None, mix_weights=None, mixes: str = "consumer", **inputs):
        """The consumer (``mixes``: the resolved choice); ``before_launch`` (the
        step's publish) runs once ``consume`` has checked every input, and in the
        gather transport is followed by the all-gather (bounded over gloo:
        ``host_timeout_s``)."""
        ar, box = self.ar, self.ar.mailbox
        m = x.shape[0]
        if mode == FULL and ar.collapse_pre is not None:
            inputs.update(mixes=MhcMixes(*mix_weights, ar.hc_eps, ar.hc_sinkhorn_iters,
                                         ar.collapse_pre), mix_words=box.mix_words,
                          combine_mixes=mixes != "next_gemm")
            if mixes == "side_stream":
                inputs.update(mixes_stream=self.in_flight.side_stream())
        # The status word and bound serve the norm hand-off in both transports.
        scratch = dict(generation=box.generation, sumsq=box.sumsq,
                       prenorm=box.prenorm, tactic=ar.tactic, compile_only=compile_only,
                       status=box.status, wait_bound=self.wait_bound,
                       partial=x)  # only checked: an early input must not alias it
        if ar.transport == "mailbox":
            return consume(box.buffer, ar.tp, m, mode=mode, stage_state=box.stage_state,
                           before_launch=before_launch, **scratch, **inputs)
        gathered = torch.empty(ar.tp, *x.shape, dtype=x.dtype, device=x.device)

        def gather() -> None:
            if before_launch is not None:
                before_launch()
            flat = gathered.view(-1, x.shape[1])
            if x.device.type == "cuda" and "nccl" in str(dist.get_backend(ar.group)).lower():
                # Stream-ordered, no host wait: bounded by the group's own timeout.
                all_gather(flat, x, ar.group)
            else:
                work = all_gather(flat, x, ar.group, async_op=True)
                host_wait.wait_work(work, ar.group, ar.host_timeout,
                                    "the gather transport's all-gather", ar.liveness_timeout_s)

        return consume(gathered, ar.tp, m, mode=mode, lamport=False, before_launch=gather,
                       **scratch, **inputs)

    def every_variant(self, rows: list[int]) -> dict:
        """key -> compile-only launch of every kernel variant the all-reduce may
        launch for each M in ``rows`` (every mixes choice of a call with mixes)."""
        ar = self.ar
        h, hc, dev = ar.hidden_size, ar.hc_mult, ar.device
        compilers = {}
        for m in rows:
            x = torch.zeros(m, h, dtype=torch.bfloat16, device=dev)
            check_partial(ar, x)
            compilers[("publish",)] = lambda x=x: self.publish(x, compile_only=True)
            for dtype in (torch.float32, torch.bfloat16):
                compilers[("finalize", dtype, torch.int32)] = lambda x=x, dtype=dtype: (
                    self.finalize(
                        x, torch.zeros(len(x), ar.top_k, dtype=dtype, device=dev),
                        torch.zeros(len(x), ar.top_k, dtype=torch.int32, device=dev), x,
                        compile_only=True))
            for mode, used in compile_inputs(m, hc, h, dev, ar.residual_only,
                                             ar.quantize_layer_input, ar.collapse_pre):
                quant = used.get("mxfp8_out") is not None
                compilers[self.consumer_key(m, mode, quant)] = (
                    lambda x=x, mode=mode, used=used: self.consume(x, mode, compile_only=True,
                                                                   **used))
                if used.get("mix_weights") is None:
                    continue
                for how in ("next_gemm", "side_stream")[:1 + ar.side_stream_possible]:
                    compilers[self.consumer_key(m, mode, quant, how)] = (
                        lambda x=x, mode=mode, used=used, how=how: self.consume(
                            x, mode, compile_only=True, mixes=how, **used))
        return compilers

    def deferred_finish(self, rows: int, eps: float = 0.0) -> NextMixes | None:
        """``BoundaryAllReduce.deferred_finish``."""
        ar = self.ar
        m, hc, h = rows, ar.hc_mult, ar.hidden_size
        ptx = env.use_ptx(ar.device)
        if ar.collapse_pre is None or not fuses_mixes(m, hc, ar.collapse_pre) or \
                not can_leave_combine(ptx, ar.device):
            return None
        box = ar.mailbox
        f32 = dict(dtype=torch.float32, device=ar.device)
        fn = torch.empty(0, **f32)
        mixes = MhcMixes(fn, torch.empty(3, **f32), torch.empty((2 + hc) * hc, **f32),
                         ar.hc_eps, ar.hc_sinkhorn_iters, ar.collapse_pre)
        tactic = ar.tactic or consumer_tactic(m, h, ar.collapse_pre)
        bound = wait_bound(self.wait_bound.seconds, ar.device)  # a WaitTimeout, converted
        outputs = (torch.empty(m, hc, **f32), torch.empty(m, hc, **f32),
                   torch.empty(m, hc, hc, **f32))
        finish = mixes_finish(mixes, box.mix_words, box.generation, box.status, outputs, eps,
                              bound, h, tactic, ptx)
        return NextMixes(*outputs, "next_gemm", finish, box.mix_rows, epoch=None)

    def resolve_mixes(self, m: int, choice: str | None) -> str:
        if choice is None:
            return "consumer"
        if choice == "auto":
            # Read at the call (the module's value: a sweep or a test may move it).
            aside = m >= consumer.MIXES_ASIDE_MIN_ROWS and self.ar.side_stream_possible
            return "side_stream" if aside else "next_gemm"
        return choice

    def result(self, x: torch.Tensor, out: tuple, mxfp8_out, how: str = "consumer",
                finish=None, epoch: int | None = None) -> BoundaryResult:
        """The launch's (or traced op's) outputs as a :class:`BoundaryResult`."""
        first, second, *rest = out
        quantized = None
        if mxfp8_out is not None:
            quantized = QuantizedActivation(mxfp8_out[0], mxfp8_out[1], torch.bfloat16,
                                            torch.Size((x.shape[0], self.ar.hidden_size)))
        mixes = None
        if rest:
            if finish is None and how == "next_gemm":
                how = "consumer"  # nothing could be left: the consumer combined
            # The stream matters only for a combine left to the GEMM (never under
            # tracing, where reading the stream would enter the traced graph).
            stream = current_stream_id(x.device) if finish is not None else 0
            mixes = NextMixes(*rest[0], how, finish, self.ar.mailbox.mix_rows, epoch, stream)
        return BoundaryResult(first, second, quantized, mixes)

    def publish_eager(self, x: torch.Tensor) -> None:
        """The eager publish, without the host rule of ``BoundaryAllReduce.publish``."""
        self.ready()
        try:
            check_partial(self.ar, x)
            self.guard.compile_variants({("publish",):
                                   lambda: self.publish(x, compile_only=True)})
        except Exception as error:
            self.ar.abort_step(error, x, published=False)
            raise
        self.publish(x)

    def publish_finalize_eager(self, gemm2_permuted, expert_weights, idx, shared_output):
        """The eager finalize + publish, without the host rule."""
        args = (gemm2_permuted, expert_weights, idx, shared_output)
        self.ready()
        try:
            check_finalize_inputs(*args, self.ar.hidden_size, self.ar.top_k, self.ar.device,
                                  self.ar.capacity)
            # A host read of the index table: only outside capture (it would sync).
            if not self.ar.capturing and idx.numel():
                low, high = torch.stack(torch.aminmax(idx)).tolist()  # one sync
                if low < -1 or high >= gemm2_permuted.shape[0]:
                    raise ValueError(
                        f"expanded_idx_to_permuted_idx holds values in [{low}, {high}], but "
                        f"must lie in [-1, {gemm2_permuted.shape[0]}) (rows of gemm2_permuted; "
                        "-1: expert on another rank)")
            self.guard.compile_variants({("finalize", expert_weights.dtype, idx.dtype):
                                   lambda: self.finalize(*args, compile_only=True)})
        except Exception as error:
            self.ar.abort_step(error, shared_output, published=False)
            raise
        return self.finalize(*args)

    def reduce_eager(self, x: torch.Tensor, mode: int, publish: bool,
                     **inputs) -> BoundaryResult:
        """The eager reduce: check every input, (compile and) launch the publish
        kernel when ``publish``, then the consumer; outside capture, check the
        status word. An input rejected before the publish (or, after an earlier
        publish, before the consumer) aborts the step (``BoundaryAllReduce.abort_step``)."""
        started = []

        def publish_now() -> None:  # consume calls it once every input passed
            started.append(True)
            if publish:
                self.publish(x)

        self.ready()
        try:
            # First: the last call's mixes kernel may still write the status word (an abort
            # below ORs into it) and read the scratch this consumer writes (generation, mix
            # rows). A stream wait only.
            self.ar.join_mixes()
            self.in_flight.refuse_unfinished()
            check_reduce_call(self.ar, x, mode, inputs)
            how = self.resolve_mixes(x.shape[0], inputs.pop("mixes", None))
            quant = inputs.get("mxfp8_out") is not None
            compilers = {self.consumer_key(x.shape[0], mode, quant, how):
                         lambda: self.consume(x, mode, compile_only=True, mixes=how, **inputs)}
            if publish:
                compilers[("publish",)] = lambda: self.publish(x, compile_only=True)
            self.guard.compile_variants(compilers)
            out = self.consume(x, mode, before_launch=publish_now, mixes=how, **inputs)
            if how == "side_stream":
                self.in_flight.record_aside(self.ar.capturing)
        except Exception as error:
            if not started:
                self.ar.abort_step(error, x, published=not publish)
            elif self.guard.failed is None:  # the step went out half done: reset first
                self.guard.failed = f"{type(error).__name__}: {error}"
            raise
        self.guard.last_rows = x.shape[0]
        epoch = self.ar.mailbox.mix_rows.advance() if len(out) > 2 else None  # the rows rewritten
        result = self.result(x, out[:3], inputs.get("mxfp8_out"), how,
                              out[3] if len(out) == 4 else None, epoch)
        if result.mixes is not None and result.mixes.left_to_gemm:
            self.in_flight.left_to_gemm = result.mixes
        if not self.ar.capturing:
            self.ar.check()
        return result

    def reduce(self, x: torch.Tensor, mode: int, **inputs) -> BoundaryResult:
        """A call of the all-reduce: the host rules (one publish per reduce, of
        this tensor), then the launches: directly (:meth:`reduce_eager`), or
        through ``boundary_reduce`` under torch.compile."""
        ar = self.ar
        self.ready()
        published, self.guard.published = self.guard.published, None
        if published is not None and published is not x:
            error = RuntimeError("reducing a tensor other than the published one")
            ar.abort_step(error, x, published=True)  # (nothing runs while tracing)
            raise error
        if not torch.compiler.is_compiling():
            return self.reduce_eager(x, mode, published is None, **inputs)
        check_reduce_call(ar, x, mode, inputs)  # at trace time: nothing runs
        inputs.pop("mixes", None)  # traced, the consumer combines itself
        box = ar.mailbox
        data, scale = inputs.get("mxfp8_out") or (None, None)
        fn, hc_scale, hc_base = inputs.get("mix_weights") or (None, None, None)
        first, second, *mixes = torch.ops.decode_boundary.boundary_reduce(
            ar.handle, x, published is None, mode, inputs.get("residual"), inputs.get("post"),
            inputs.get("comb"), inputs.get("pre"), inputs.get("norm_weight"),
            float(inputs.get("eps", 0.0)), box.stage_state, box.status, box.generation,
            box.sumsq, box.prenorm, data, scale, fn, hc_scale, hc_base, box.mix_words)
        out = (first, second if mode == FULL else None, *((tuple(mixes),) if fn is not None
                                                          else ()))
        return self.result(x, out, inputs.get("mxfp8_out"))
