"""``wo_b`` that publishes its partial sum from the GEMM epilogue.

At a low-row boundary the unfused path runs three kernels: the MXFP8 GEMM
writes this rank's partial, the publish kernel reads it back and stores it into
every peer's mailbox, then the consumer reduces. :class:`PublishingMxfp8Linear`
runs the *same* low-latency GEMM with the *same* tactic a plain call would
select, compiled with its publishing epilogue: each BF16 output value, with −0
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
"""

from __future__ import annotations

import torch

from decode_boundary.boundary.all_reduce import BoundaryAllReduce, PublishTarget
from decode_boundary.gemm import (
    LOW_BATCH_MAX_ROWS,
    launch_low_latency,
    mxfp8_eligible,
    precompile,
    selected_tactic,
)
from decode_boundary.mxfp8.format import QuantizedActivation, check_quantized


class PublishingMxfp8Linear:
    """Run an MXFP8 linear whose output ``all_reduce`` reduces next, publishing
    the output from the GEMM epilogue. Call it in place of the linear; anything
    it does not support runs the plain linear and publishes nothing (the
    all-reduce then runs its own publish kernel)."""

    def __init__(self, all_reduce: BoundaryAllReduce) -> None:
        self.all_reduce = all_reduce

    def supports(self, linear: torch.nn.Module, num_tokens: int) -> bool:
        """Whether ``linear`` on ``num_tokens`` rows runs the publishing GEMM."""
        ar = self.all_reduce
        k, n = linear.weight.shape
        return (
            mxfp8_eligible(linear)
            and getattr(linear, "bias", None) is None
            and 0 < num_tokens <= min(LOW_BATCH_MAX_ROWS, ar.capacity)
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
        quantized = isinstance(x, QuantizedActivation)
        shape, dtype = (x.orig_shape, x.orig_dtype) if quantized else (x.shape, x.dtype)
        rows = x.rows if quantized else x.reshape(-1, x.shape[-1]).shape[0]
        if len(shape) != 2 or dtype != torch.bfloat16 or not self.supports(linear, rows):
            return linear(x)
        k, n = linear.weight.shape
        if quantized:
            check_quantized(x, "x")
        elif not x.is_contiguous() or x.data_ptr() % 16:
            x = x.clone()
        width = x.data.shape[1] if quantized else x.shape[1]
        if width != k:
            raise ValueError(f"x has K={width}, linear expects K={k}")
        device = linear.weight.device
        out = torch.empty(rows, n, dtype=torch.bfloat16, device=device)
        target = self.all_reduce.publish_target()
        tactic = self._compiled_tactic(linear, rows, target, bf16_input=not quantized)
        # Marked before the launch: a second publish before the reduce must fail
        # before it overwrites the pending one's slots in every peer's mailbox.
        self.all_reduce.mark_published(out)
        try:
            launch_low_latency(linear, x, out, tactic, publish=target)
        except Exception:
            self.all_reduce.reset()  # nothing was launched: drop the mark
            raise
        return out

    def precompile(self, linear: torch.nn.Module, num_tokens: int) -> None:
        """Compile the kernels ``num_tokens`` rows select (BF16 and MXFP8
        input), launching nothing: a publish without its consumer would
        desynchronise the mailbox. Collective when it compiles something new
        (it barriers the group)."""
        if self.supports(linear, num_tokens):
            for bf16 in (True, False):
                self._compiled_tactic(linear, num_tokens, self.all_reduce.publish_target(), bf16)

    def _compiled_tactic(self, linear: torch.nn.Module, rows: int, target: PublishTarget,
                         bf16_input: bool):
        """The tactic a plain call selects for ``rows`` and the input kind, its
        publishing kernel compiled through the all-reduce: the first use is
        collective, so a rank still compiling cannot make a peer's consumer
        wait past its bound."""
        tactic = selected_tactic(linear, rows, bf16_input)
        k, n = linear.weight.shape
        self.all_reduce.compile_variants({
            ("publishing_gemm", n, k, tactic, bf16_input):
                lambda: precompile(linear, [rows], publish=target, bf16_input=bf16_input),
        })
        return tactic
