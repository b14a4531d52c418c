"""One reduce call, checked once into a typed plan.

:func:`plan_step` runs the all-reduce's checks of a call against its
:class:`~.spec.BoundarySpec` (the partial, the mode against the construction
flags, the structure of every argument, the mixes placement) before anything
of the step reaches a peer or the stage words, and returns the
:class:`StepPlan` the launches follow: the mode, the inputs, where the next
mixes run, whether the consumer fuses them, its tactic, and so the kernel
variant. A rejected call raises ``ValueError`` (the caller aborts the step:
docs/FAILURES.md). The consumer's launcher then checks the tensors' layouts
(dtype, shape, device, memory overlap) as every launcher does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..mixes.handoff import MIXES_PLACEMENTS, MixesPlacement, placement_of
from .consumer_inputs import MhcMixes, is_nonnegative_real
from .consumer_kernel import FULL, MODES, PLAIN, RESIDUAL_ONLY, Collapse, Mode
from .consumer_tactics import (
    ConsumerTactic,
    auto_placement,
    chosen_tactic,
    fused_collapse,
)
from .spec import BoundarySpec


class StepInputs(NamedTuple):
    """The tensors of a call (None where its mode reads none) and the norm eps."""

    residual: torch.Tensor | None = None
    post: torch.Tensor | None = None
    comb: torch.Tensor | None = None
    pre: torch.Tensor | None = None
    norm_weight: torch.Tensor | None = None
    eps: float = 0.0
    mxfp8_out: tuple[torch.Tensor, torch.Tensor] | None = None
    mix_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


class StepPlan(NamedTuple):
    """A checked call of M = ``rows`` tokens: ``mode``; ``inputs``;
    ``placement``, where its next mixes run (resolved: never "auto";
    "consumer" without mixes); ``fused``, the collapse of the mixes the
    consumer computes itself (None: none, or the mixes kernel does); the
    consumer's ``tactic``; ``batch_invariant``: the spec's mode (the mixes
    kernel's shares in the consumer's order)."""

    mode: Mode
    rows: int
    inputs: StepInputs
    placement: MixesPlacement
    collapse: Collapse | None  # of this call's mixes (None: it computes none)
    fused: Collapse | None
    tactic: ConsumerTactic
    batch_invariant: bool = False

    @property
    def quantize(self) -> bool:
        return self.inputs.mxfp8_out is not None

    @property
    def combine(self) -> bool:
        """The consumer (or the mixes kernel) combines the mixes; else it leaves
        the combine to the next GEMM."""
        return self.placement != MixesPlacement.NEXT_GEMM or self.fused is None

    @property
    def variant(self) -> tuple:
        """The key of the consumer variant this call runs."""
        return ("consume", self.mode, self.quantize, self.collapse, self.fused is not None,
                self.combine, self.placement == MixesPlacement.SIDE_STREAM, self.tactic,
                self.batch_invariant)

    def mix_params(self, spec: BoundarySpec) -> MhcMixes | None:
        """The next mixes' parameters (None without mixes)."""
        return None if self.collapse is None else spec.mix_params(self.inputs.mix_weights)


def variant_plan(spec: BoundarySpec, pinned: ConsumerTactic | None, rows: int, mode: Mode,
                 inputs: StepInputs,
                 placement: MixesPlacement = MixesPlacement.CONSUMER) -> StepPlan:
    """The plan of a call already checked (or of a variant to compile): the
    resolved ``placement``, the consumer's tactic (``pinned``, else the
    tables'; batch-invariant mode refuses a pinned one of another shape than
    its own)."""
    collapse = spec.collapse if mode == FULL else None
    fused = fused_collapse(rows, spec.hc, collapse, placement)
    tactic = chosen_tactic(pinned, rows, spec.hidden, fused, spec.batch_invariant)
    return StepPlan(MODES[mode], rows, inputs, placement, collapse, fused, tactic,
                    spec.batch_invariant)


def plan_step(spec: BoundarySpec, pinned: ConsumerTactic | None, x: torch.Tensor, mode: Mode,
              inputs: StepInputs, placement) -> StepPlan:
    """Check a reduce call of ``x`` in ``mode`` (``placement``: the call's
    ``mixes_placement``, None for "consumer") and plan it."""
    check_partial(spec, x)
    check_placement(spec, mode, placement)
    if mode != PLAIN:
        check_inputs(spec, mode, inputs)
    rows = x.shape[0]
    placement = placement_of(placement or MixesPlacement.CONSUMER)
    if placement == MixesPlacement.AUTO:
        placement = auto_placement(rows, spec.side_stream_possible)
    return variant_plan(spec, pinned, rows, mode, inputs, placement)


def check_partial(spec: BoundarySpec, x: torch.Tensor) -> None:
    """``x``, this rank's partial: BF16 [M, hidden], contiguous, on the
    all-reduce's device, 1 <= M <= capacity."""
    h = spec.hidden
    if x.dtype != torch.bfloat16 or x.ndim != 2 or x.shape[1] != h:
        raise ValueError(f"x must be bf16 [M, {h}], got {x.dtype} {list(x.shape)}")
    if x.device != spec.device:
        raise ValueError(f"x is on {x.device}, the all-reduce on {spec.device}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    if not 0 < x.shape[0] <= spec.capacity:
        raise ValueError(f"x has {x.shape[0]} rows; expected 1..capacity = {spec.capacity}")


def check_placement(spec: BoundarySpec, mode: Mode, placement) -> None:
    """``mixes_placement=`` of a call: None or one of ``MIXES_PLACEMENTS``,
    given only to a full call of an all-reduce that computes mixes;
    "side_stream" only with V4.1's collapse and an hc the mixes kernel takes."""
    if placement is None:
        return
    if not isinstance(placement, str) or placement not in MIXES_PLACEMENTS:
        raise ValueError(f"mixes_placement must be None or one of {MIXES_PLACEMENTS}, got "
                         f"{placement!r}")
    collapse = None if spec.collapse is None else spec.collapse.value
    if placement == MixesPlacement.SIDE_STREAM and not (mode == FULL and
                                                        spec.side_stream_possible):
        raise ValueError(
            "mixes_placement='side_stream' needs a full call of an all-reduce with "
            "collapse_pre='previous' and an hc the mixes kernel takes; this one has "
            f"collapse_pre={collapse!r}, hc={spec.hc}"
            + ("" if mode == FULL else ", and the call is not a full one"))
    if mode != FULL or spec.collapse is None:
        raise ValueError(f"mixes_placement={str(placement)!r} given, but this all-reduce "
                         "computes no mixes (collapse_pre=None) or the call is not a full one")


def check_inputs(spec: BoundarySpec, mode: Mode, inputs: StepInputs) -> None:
    """A residual-only or full call's arguments against the construction
    flags, and their structure: residual / mxfp8_out / mix_weights, the
    tensors' types, eps (the launcher checks the layouts)."""
    if mode == RESIDUAL_ONLY and not spec.residual_only:
        raise ValueError("pre is None (residual-only call) but residual_only=False")
    mxfp8_out = inputs.mxfp8_out
    if mxfp8_out is not None:
        if not spec.quantize_layer_input:
            raise ValueError("mxfp8_out given but quantize_layer_input=False")
        if not isinstance(mxfp8_out, (tuple, list)) or len(mxfp8_out) != 2 or \
                not all(isinstance(t, torch.Tensor) for t in mxfp8_out):
            raise ValueError("mxfp8_out must be a pair of tensors (data, swizzled scales)")
    residual = inputs.residual
    if not isinstance(residual, torch.Tensor) or residual.ndim != 3 or \
            residual.shape[1] != spec.hc:
        got = list(residual.shape) if isinstance(residual, torch.Tensor) else type(residual)
        raise ValueError(f"residual must be bf16 [M, {spec.hc}, {spec.hidden}], got {got}")
    for name in ("post", "comb", "pre", "norm_weight"):
        t = getattr(inputs, name)
        if t is not None and not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    mix_weights = inputs.mix_weights
    if mode == FULL and spec.collapse is not None:
        if not isinstance(mix_weights, (tuple, list)) or len(mix_weights) != 3 or \
                not all(isinstance(t, torch.Tensor) for t in mix_weights):
            raise ValueError(f"collapse_pre={spec.collapse.value!r}: a full call needs the "
                             "next sublayer's mix_weights = (hc_fn, hc_scale, hc_base) tensors")
    elif mix_weights is not None:
        raise ValueError("mix_weights given, but this all-reduce computes no mixes "
                         "(collapse_pre=None) or the call is not a full one")
    if mode == FULL and not is_nonnegative_real(inputs.eps):
        raise ValueError(f"norm_eps must be a finite real number >= 0, got {inputs.eps!r}")
