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
from ..common.contract import PublishTarget
from . import ops
from .consumer import (
    ConsumerTactic,
    compile_inputs,
    consume,
    consumer_tactic,
    status_error,
    wait_bound,
)
from .consumer_kernel import FULL, PLAIN, RESIDUAL_ONLY
from .finalize_kernel import check_finalize_inputs, finalize_publish
from .mailbox import Mailbox, simulated_mailboxes
from .publish_kernel import publish
from .transport import TRANSPORTS, gather_partials, open_transport


class BoundaryAllReduce:
    """All-reduce of [M, hidden] BF16 partials over ``group`` with the mHC consumer.

    ``capacity``: the largest M of any call (mailbox slots per rank).
    ``residual_only``: allow ``pre=None`` calls. ``quantize_layer_input``: allow
    ``mxfp8_out``. ``transport``: "mailbox" (peer stores), "nccl" (all-gather +
    the same consumer; identical results), or "auto" (mailbox where every rank
    reaches every other's memory). ``group=None``: a single rank. ``tactic``:
    pin the consumer tactic for every M (benchmark sweeps; default: the table).
    """

    def __init__(self, hidden_size: int, hc_mult: int, capacity: int, top_k: int,
                 group: dist.ProcessGroup | None = None, quantize_layer_input: bool = False,
                 residual_only: bool = True, device: torch.device | str | None = None,
                 wait_timeout_s: float = 1.0, transport: str = "auto",
                 tactic: ConsumerTactic | None = None, _mailbox: Mailbox | None = None) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if hc_mult < 1 or top_k < 1:
            raise ValueError(f"hc_mult and top_k must be positive, got {hc_mult}, {top_k}")
        if wait_timeout_s <= 0:
            raise ValueError(f"wait_timeout_s must be positive, got {wait_timeout_s}")
        self.device = env.resolve_device(device)
        self.hidden_size, self.hc_mult, self.capacity, self.top_k = (
            hidden_size, hc_mult, capacity, top_k)
        self.quantize_layer_input = quantize_layer_input
        self.residual_only = residual_only
        self.wait_timeout_s = wait_timeout_s
        self.group = group
        if _mailbox is None:
            _mailbox, transport = open_transport(group, capacity, hidden_size, self.device,
                                                 transport)
        elif transport == "auto":
            transport = "mailbox"
        self.transport = transport
        self._box: Mailbox | None = _mailbox
        self.tp, self.rank = _mailbox.tp, _mailbox.rank
        self._published: torch.Tensor | None = None
        self.handle = ops.register(self)  # what the custom ops name this instance by
        self.tactic = tactic
        self._compiled: set[tuple] = set()
        self._wait_bound = wait_bound(wait_timeout_s, self.device)

    @classmethod
    def simulated(cls, tp: int, hidden_size: int, hc_mult: int, capacity: int, top_k: int,
                  device: torch.device | str = "cpu", **kwargs) -> list[BoundaryAllReduce]:
        """tp instances in this process sharing simulated mailboxes: publish from
        every instance first (:meth:`publish`), then call each one."""
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
        self._open()
        if self._published is not None:
            raise RuntimeError("a published contribution is still unreduced")
        self._published = x

    def publish(self, x: torch.Tensor) -> None:
        """Launch the publish kernel for ``x`` and mark it published."""
        self._check_x(x)
        if self._published is not None:
            raise RuntimeError("a published contribution is still unreduced")
        if torch.compiler.is_compiling():
            torch.ops.decode_boundary.boundary_publish(self.handle, x, self._box.stage_state)
        else:
            self._publish_launch(x)
        self._published = x

    def _publish_launch(self, x: torch.Tensor) -> None:
        self.compile_variants({("publish",): lambda: self._launch_publish(x, compile_only=True)})
        self._launch_publish(x)

    def publish_finalize(self, gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx,
                         shared_output) -> torch.Tensor:
        """MoE finalize fused with the publish; returns (and marks published) the partial."""
        box = self._open()
        if self._published is not None:
            raise RuntimeError("a published contribution is still unreduced")
        idx = expanded_idx_to_permuted_idx
        check_finalize_inputs(gemm2_permuted, expert_weights, idx, shared_output,
                              self.hidden_size, self.top_k, self.device, self.capacity)
        if torch.compiler.is_compiling():
            partial = torch.ops.decode_boundary.boundary_publish_finalize(
                self.handle, gemm2_permuted, expert_weights, idx, shared_output, box.stage_state)
        else:
            partial = self._publish_finalize_launch(gemm2_permuted, expert_weights, idx,
                                                    shared_output)
        self._published = partial
        return partial

    def _publish_finalize_launch(self, gemm2_permuted, expert_weights, idx, shared_output):
        # A host read of the index table: only outside capture (it would sync).
        if not self._capturing() and idx.numel() and int(idx.max()) >= gemm2_permuted.shape[0]:
            raise ValueError(f"expanded_idx_to_permuted_idx holds {int(idx.max())}, but "
                             f"gemm2_permuted has {gemm2_permuted.shape[0]} rows")
        args = (gemm2_permuted, expert_weights, idx, shared_output)
        self.compile_variants({("finalize", expert_weights.dtype, idx.dtype):
                               lambda: self._launch_finalize(*args, compile_only=True)})
        return self._launch_finalize(*args)

    # -- reducing --------------------------------------------------------------------------

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
                 comb: torch.Tensor, pre: torch.Tensor | None, norm_weight: torch.Tensor | None,
                 norm_eps: float, mxfp8_out: tuple[torch.Tensor, torch.Tensor] | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Reduce ``x`` over the group and apply docs/DESIGN.md §5. Returns
        (residual_out [M, hc, H], layer_input [M, H] or None when ``pre`` is None);
        the MXFP8 layer input goes into ``mxfp8_out`` = (data, swizzled scales)."""
        if pre is None and not self.residual_only:
            raise ValueError("pre is None (residual-only call) but residual_only=False")
        if mxfp8_out is not None and not self.quantize_layer_input:
            raise ValueError("mxfp8_out given but quantize_layer_input=False")
        if residual is None or residual.ndim != 3 or residual.shape[1] != self.hc_mult:
            raise ValueError(f"residual must be bf16 [M, {self.hc_mult}, {self.hidden_size}], got "
                             f"{None if residual is None else list(residual.shape)}")
        return self._reduce(x, FULL if pre is not None else RESIDUAL_ONLY, residual=residual,
                            post=post, comb=comb, pre=pre, norm_weight=norm_weight,
                            eps=norm_eps, mxfp8_out=mxfp8_out)

    def finalize(self, gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx,
                 shared_output, residual, post, comb, pre, norm_weight, norm_eps,
                 mxfp8_out=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """MoE finalize + publish in one kernel, then the consumer (as ``__call__``)."""
        partial = self.publish_finalize(gemm2_permuted, expert_weights,
                                        expanded_idx_to_permuted_idx, shared_output)
        return self(partial, residual, post, comb, pre, norm_weight, norm_eps, mxfp8_out)

    def plain_sum(self, x: torch.Tensor) -> torch.Tensor:
        """The same two kernels with mHC, norm and quantization switched off:
        ``bf16(sum_r x_r)`` (the fusion's baseline in the benchmark)."""
        return self._reduce(x, PLAIN)[0]

    # -- errors and lifetime ---------------------------------------------------------------

    def precompile(self, rows) -> None:
        """Compile every kernel variant this instance may launch for each M in
        ``rows`` (an int or an iterable), launching nothing, then barrier the
        group. Collective. Call it before capturing CUDA graphs."""
        rows = [rows] if isinstance(rows, int) else list(rows)
        self._open()
        h, hc, dev = self.hidden_size, self.hc_mult, self.device
        compilers = {}
        for m in rows:
            x = torch.zeros(m, h, dtype=torch.bfloat16, device=dev)
            self._check_x(x)
            compilers[("publish",)] = lambda x=x: self._launch_publish(x, compile_only=True)
            for dtype in (torch.float32, torch.bfloat16):
                compilers[("finalize", dtype, torch.int32)] = lambda x=x, dtype=dtype: (
                    self._launch_finalize(
                        x, torch.zeros(len(x), self.top_k, dtype=dtype, device=dev),
                        torch.zeros(len(x), self.top_k, dtype=torch.int32, device=dev), x,
                        compile_only=True))
            for mode, used in compile_inputs(m, hc, h, dev, self.residual_only,
                                             self.quantize_layer_input):
                quant = used.get("mxfp8_out") is not None
                compilers[self._consumer_key(m, mode, quant)] = (
                    lambda x=x, mode=mode, used=used: self._consume(x, mode, compile_only=True,
                                                                    **used))
        self.compile_variants(compilers, force_barrier=True)

    def check(self) -> None:
        """Raise RuntimeError if a wait of this rank gave up (device sync).

        After a timeout the mailbox is out of step: the waiting rank re-armed
        slots that a slow (not absent) peer may still fill, and that peer learns
        nothing. Every rank must then ``reset(collective=True)`` before the next
        step; graph users who check only every few replays may have consumed
        wrong sums since the timeout."""
        error = status_error(int(self._open().status.item()), self.tp, self.wait_timeout_s)
        if error is not None:
            raise RuntimeError(f"BoundaryAllReduce rank {self.rank}: {error}")

    def reset(self, collective: bool = False) -> None:
        """Drop an unreduced publish. ``collective=True`` (every rank must call
        it): also re-arm the mailbox (sentinel fill), the stage words, the norm
        scratch and status."""
        box = self._open()
        self._published = None
        if not collective:
            return
        self._barrier()
        box.rearm()
        self._barrier()

    def close(self) -> None:
        """Free the mailbox (its buffers go when the last reference does)."""
        self._box = None
        self._published = None

    def __enter__(self) -> BoundaryAllReduce:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------

    def _open(self) -> Mailbox:
        if self._box is None:
            raise RuntimeError("BoundaryAllReduce is closed")
        return self._box

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _barrier(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.barrier(group=self.group)

    def _check_x(self, x: torch.Tensor) -> None:
        self._open()
        h = self.hidden_size
        if x.dtype != torch.bfloat16 or x.ndim != 2 or x.shape[1] != h:
            raise ValueError(f"x must be bf16 [M, {h}], got {x.dtype} {list(x.shape)}")
        if x.device != self.device:
            raise ValueError(f"x is on {x.device}, the all-reduce on {self.device}")
        if not x.is_contiguous():
            raise ValueError("x must be contiguous")
        if not 0 < x.shape[0] <= self.capacity:
            raise ValueError(f"x has {x.shape[0]} rows; expected 1..capacity = {self.capacity}")

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

    def _consumer_key(self, m: int, mode: int, quant: bool) -> tuple:
        return ("consume", mode, quant, self.tactic or consumer_tactic(m, self.hidden_size))

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
            self._barrier()

    def _consume(self, x: torch.Tensor, mode: int, compile_only: bool = False, **inputs):
        box = self._box
        m = x.shape[0]
        # The status word and bound serve the norm hand-off in both transports.
        scratch = dict(generation=box.generation, sumsq=box.sumsq,
                       prenorm=box.prenorm, tactic=self.tactic, compile_only=compile_only,
                       status=box.status, wait_bound=self._wait_bound)
        if self.transport == "mailbox":
            return consume(box.buffer, self.tp, m, mode=mode, stage_state=box.stage_state,
                           **scratch, **inputs)
        gathered = gather_partials(x, self.tp, self.group, compile_only)
        return consume(gathered, self.tp, m, mode=mode, lamport=False, **scratch, **inputs)

    def _reduce(self, x: torch.Tensor, mode: int, **inputs):
        """The host rules (one publish per reduce, of this tensor), then the
        launches: directly, or through ``boundary_reduce`` under torch.compile."""
        self._check_x(x)
        published, self._published = self._published, None
        if published is not None and published is not x:
            raise RuntimeError("reducing a tensor other than the published one")
        if not torch.compiler.is_compiling():
            return self._reduce_launch(x, mode, published is None, **inputs)
        box = self._box
        data, scale = inputs.get("mxfp8_out") or (None, None)
        first, second = torch.ops.decode_boundary.boundary_reduce(
            self.handle, x, published is None, mode, inputs.get("residual"), inputs.get("post"),
            inputs.get("comb"), inputs.get("pre"), inputs.get("norm_weight"),
            float(inputs.get("eps", 0.0)), box.stage_state, box.status, box.generation,
            box.sumsq, box.prenorm, data, scale)
        return first, (second if mode == FULL else None)

    def _reduce_launch(self, x: torch.Tensor, mode: int, publish: bool, **inputs):
        """(Compile and) launch the publish kernel when ``publish``, then the
        consumer; outside capture, check the status word."""
        quant = inputs.get("mxfp8_out") is not None
        compilers = {self._consumer_key(x.shape[0], mode, quant):
                     lambda: self._consume(x, mode, compile_only=True, **inputs)}
        if publish:
            compilers[("publish",)] = lambda: self._launch_publish(x, compile_only=True)
        self.compile_variants(compilers)
        if publish:
            self._launch_publish(x)
        out = self._consume(x, mode, **inputs)
        if not self._capturing():
            self.check()
        return out
