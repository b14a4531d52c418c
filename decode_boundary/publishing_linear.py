"""``wo_b`` that publishes its partial sum from the GEMM epilogue.

At a low-row boundary the unfused path runs three kernels: the MXFP8 GEMM
writes this rank's partial, the publish kernel reads it back and stores it into
every peer's mailbox, then the consumer reduces. :class:`PublishingMxfp8Linear`
runs the *same* low-latency GEMM with the *same* tactic a plain call would
select (in the all-reduce's batch-invariant mode, that mode's), compiled with
its publishing epilogue: each BF16 output value, with −0
turned into +0, also goes to ``mailbox_p[NEXT, rank, token, column]`` of every
peer p (unicast 16-byte stores; never multicast), and one thread of the grid
sets ACTIVE. The caller's next ``all_reduce(out, ...)`` then launches only the
consumer (``BoundaryAllReduce.mark_published``), as the GEMM's PDL dependent.

Ordering: the epilogue reads NEXT after the GEMM's grid-dependency wait, so
the previous consumer's advance is visible, exactly as the publish kernel
does; the consumer reads ACTIVE only after its own grid wait, i.e. after the
whole GEMM grid and its stores. With split-K only the CTA that finishes the
deterministic reduction publishes, so each value is published once and equals
the plain GEMM's output bits. Both paths therefore feed the consumer the same
bits and its outputs are bit-identical.

Mailbox addresses, stage word, rank, TP, capacity and hidden size come from
``all_reduce.publish_target()`` and stay valid for the all-reduce's lifetime;
one publisher serves one all-reduce.

Under torch.compile the launch is the custom op
``decode_boundary::publishing_mxfp8_mm``, which declares this rank's stage
words mutated (as the all-reduce's own ops do, and for the same reason not the
mailbox: all_reduce.py), so the consumer that follows is ordered after it; the
host rule (mark before the reduce, one publish per reduce) is traced Python as
in eager mode.

This module sits above both the GEMM package and ``boundary/``: it is the one
place where the two meet.
"""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import torch

from decode_boundary.boundary.all_reduce import BoundaryAllReduce
from decode_boundary.boundary.consumer_tactics import PUBLISH_EPILOGUE_MAX_ROWS
from decode_boundary.boundary.ops import sync_words
from decode_boundary.common.contract import PublishTarget
from decode_boundary.gemm import (
    launch_low_latency,
    mxfp8_eligible,
    precompile,
    selected_tactic,
)
from decode_boundary.gemm.tactics import PROLOGUE_MAX_ROWS
from decode_boundary.mxfp8.format import QuantizedActivation, check_quantized
from decode_boundary.mxfp8.quantize_kernel import quantize_mxfp8

# The all-reduces publishers serve, by handle: what the custom op's handle names.
_ALL_REDUCES: weakref.WeakValueDictionary[int, BoundaryAllReduce] = \
    weakref.WeakValueDictionary()


class PublishingMxfp8Linear:
    """Run an MXFP8 linear whose output ``all_reduce`` reduces next, publishing
    the output from the GEMM epilogue. Call it in place of the linear; anything
    it does not support runs the plain linear and publishes nothing (the
    all-reduce then runs its own publish kernel)."""

    def __init__(self, all_reduce: BoundaryAllReduce) -> None:
        self.all_reduce = all_reduce
        _ALL_REDUCES[all_reduce.handle] = all_reduce

    def supports(self, linear: torch.nn.Module, num_tokens: int) -> bool:
        """Whether ``linear`` on ``num_tokens`` rows runs the publishing GEMM."""
        ar = self.all_reduce
        k, n = linear.weight.shape
        return (
            mxfp8_eligible(linear)
            and getattr(linear, "bias", None) is None
            and 0 < num_tokens <= min(PUBLISH_EPILOGUE_MAX_ROWS, ar.capacity)
            and n == ar.hidden_size
            and linear.weight.device == ar.device
            and ar.transport == "mailbox"  # over NCCL there is no mailbox to publish into
        )

    def __call__(
        self, linear: torch.nn.Module, x: torch.Tensor | QuantizedActivation
    ) -> torch.Tensor:
        """``linear(x)``, published into the all-reduce's mailbox when supported.

        ``x``: BF16 [M, K] (quantized in the GEMM's prologue) or MXFP8. Only a
        2-D activation of BF16 origin publishes: the all-reduce reduces [M,
        hidden] tensors, and a published output it then rejected would leave
        the peers waiting."""
        ar = self.all_reduce
        eager = not torch.compiler.is_compiling()
        quantized = isinstance(x, QuantizedActivation)
        try:
            shape, dtype = (x.orig_shape, x.orig_dtype) if quantized else (x.shape, x.dtype)
            rows = x.rows if quantized else x.reshape(-1, x.shape[-1]).shape[0]
            publishes = len(shape) == 2 and dtype == torch.bfloat16 and \
                self.supports(linear, rows)
            if not publishes:
                return linear(x)  # the all-reduce publishes this step itself
            k, n = linear.weight.shape
            if quantized:
                check_quantized(x, "x")
            width = x.data.shape[1] if quantized else x.shape[1]
            if width != k:
                raise ValueError(f"x has K={width}, linear expects K={k}")
        except Exception as error:
            # This rank's producer of the step failed: abort the step on every rank
            # at once (docs/FAILURES.md) rather than let the peers wait out their bound.
            if eager and ar.accepts_steps:
                ar.abort_step(error, None, published=ar.has_unreduced_publish)
            raise
        if not eager:
            # A second publish raises in mark_published while tracing: nothing runs.
            data, scale = (x.data, x.scale) if quantized else (x, None)
            out = torch.ops.decode_boundary.publishing_mxfp8_mm(
                ar.handle, data, scale, linear.weight, linear.weight_scale,
                ar.mailbox.stage_state)
            ar.mark_published(out)
            return out
        out = torch.empty(rows, n, dtype=torch.bfloat16, device=linear.weight.device)
        # Marked before the launch: a second publish before the reduce must fail
        # before it overwrites the pending one's slots in every peer's mailbox.
        ar.mark_published(out)
        self._launch(linear, x, out)
        return out

    def _launch(self, linear, x, out: torch.Tensor) -> None:
        """The publishing launch (eager, or inside the custom op). The launcher
        checks every operand before the kernel; a failure aborts the step
        (``BoundaryAllReduce.abort_step``: the poison goes where the epilogue would
        have published) and re-raises."""
        ar = self.all_reduce
        try:
            target = ar.publish_target()
            bf16 = isinstance(x, torch.Tensor)
            if bf16 and out.shape[0] > PROLOGUE_MAX_ROWS:
                # As mxfp8_mm: above this many rows every program quantizing its own
                # K-slice costs more than the quantizer's launch (gemm/tactics.py).
                x, bf16 = quantize_mxfp8(x), False
            elif bf16 and (not x.is_contiguous() or x.data_ptr() % 16):
                x = x.clone()
            tactic = self._compiled_tactic(linear, out.shape[0], target, bf16_input=bf16)
            launch_low_latency(linear, x, out, tactic, publish=target)
        except Exception as error:
            if ar.accepts_steps:
                ar.abort_step(error, out, published=True)
            raise

    def precompile(self, linear: torch.nn.Module, num_tokens: int) -> None:
        """Compile the kernels ``num_tokens`` rows select (BF16 and MXFP8
        input; above ``PROLOGUE_MAX_ROWS`` gemm.precompile compiles the MXFP8
        one and loads the quantizer, as ``_launch`` quantizes such a BF16
        input first), launching no GEMM: a publish without its consumer would
        desynchronise the mailbox. Collective when it compiles something new
        (it barriers the group)."""
        if self.supports(linear, num_tokens):
            for bf16 in (True, False):
                self._compiled_tactic(linear, num_tokens, self.all_reduce.publish_target(), bf16)

    def _compiled_tactic(self, linear: torch.nn.Module, rows: int, target: PublishTarget,
                         bf16_input: bool):
        """The tactic a plain call selects for ``rows`` (either input kind), its
        publishing kernel for the input kind (``bf16_input``: the BF16-in
        variant) compiled through the all-reduce: the first use is collective,
        so a rank still compiling cannot make a peer's consumer wait past its
        bound. Batch-invariant mode is the all-reduce's."""
        invariant = self.all_reduce.batch_invariant
        tactic = selected_tactic(linear, rows, invariant, backend="triton")  # its epilogue
        k, n = linear.weight.shape
        self.all_reduce.compile_variants({
            ("publishing_gemm", n, k, tactic, bf16_input):
                lambda: precompile(linear, [rows], publish=target, bf16_input=bf16_input,
                                   batch_invariant=invariant),
        })
        return tactic


@torch.library.custom_op("decode_boundary::publishing_mxfp8_mm", mutates_args=("stage_state",))
def publishing_mm_op(handle: int, x: torch.Tensor, x_scale: torch.Tensor | None,
                      weight: torch.Tensor, weight_scale: torch.Tensor,
                      stage_state: torch.Tensor) -> torch.Tensor:
    """BF16 [M, N] = x @ weight, published into the mailbox of all-reduce ``handle``."""
    layer = SimpleNamespace(weight=weight, weight_scale=weight_scale, bias=None, groups=1)
    a = x if x_scale is None else QuantizedActivation(x, x_scale, torch.bfloat16, x.shape)
    out = torch.empty(x.shape[0], weight.shape[1], dtype=torch.bfloat16, device=weight.device)
    all_reduce = _ALL_REDUCES.get(handle)
    if all_reduce is None or all_reduce.closed:
        raise RuntimeError(f"BoundaryAllReduce {handle} is closed or gone")
    PublishingMxfp8Linear(all_reduce)._launch(layer, a, out)
    sync_words(handle, stage_state=stage_state)
    return out


@publishing_mm_op.register_fake
def _(handle, x, x_scale, weight, weight_scale, stage_state):
    return x.new_empty((x.shape[0], weight.shape[1]), dtype=torch.bfloat16)
