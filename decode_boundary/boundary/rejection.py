"""What happens to a step that an input rejects (docs/FAILURES.md), for
:class:`.all_reduce.BoundaryAllReduce`: the host checks that run before
anything of the step reaches a peer or the stage words (``consume`` checks the
tensors in detail after them, still before its ``before_launch``), and the
abort that tells the peers when one fails.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..common.contract import ABORT_BITS, SENTINEL, STAGE_ACTIVE, STAGE_NEXT, STAGES
from . import host_wait
from .consumer import is_nonnegative_real, mixes_aside_ok
from .consumer_kernel import ABORT_BIT, FULL, PLAIN, RESIDUAL_ONLY
from .publish_kernel import publish
from .transport import all_gather

if TYPE_CHECKING:
    from .all_reduce import BoundaryAllReduce


def check_reduce_call(ar: BoundaryAllReduce, x: torch.Tensor, mode: int, inputs: dict) -> None:
    """The all-reduce's own checks of a reduce call (``consume`` checks the
    tensors in detail): x, the mode against the construction flags, the
    structure of residual / mxfp8_out, the tensors' types, eps, combine_mixes,
    mixes_aside."""
    check_partial(ar, x)
    combine_mixes = inputs.get("combine_mixes", True)
    if not isinstance(combine_mixes, bool):
        raise ValueError(f"combine_mixes must be a bool, got {combine_mixes!r}")
    aside = inputs.get("mixes_aside", False)
    if not isinstance(aside, bool):
        raise ValueError(f"mixes_aside must be a bool, got {aside!r}")
    if aside and not (mode == FULL and mixes_aside_ok(ar.hc_mult, ar.collapse_pre)):
        raise ValueError(
            "mixes_aside=True needs a full call of an all-reduce with collapse_pre='previous' "
            f"and an hc the mixes kernel takes; this one has collapse_pre={ar.collapse_pre!r}, "
            f"hc={ar.hc_mult}" + ("" if mode == FULL else ", and the call is not a full one"))
    if mode == PLAIN:
        return
    if mode == RESIDUAL_ONLY and not ar.residual_only:
        raise ValueError("pre is None (residual-only call) but residual_only=False")
    mxfp8_out = inputs.get("mxfp8_out")
    if mxfp8_out is not None:
        if not ar.quantize_layer_input:
            raise ValueError("mxfp8_out given but quantize_layer_input=False")
        if not isinstance(mxfp8_out, (tuple, list)) or len(mxfp8_out) != 2 or \
                not all(isinstance(t, torch.Tensor) for t in mxfp8_out):
            raise ValueError("mxfp8_out must be a pair of tensors (data, swizzled scales)")
    residual = inputs.get("residual")
    if not isinstance(residual, torch.Tensor) or residual.ndim != 3 or \
            residual.shape[1] != ar.hc_mult:
        got = list(residual.shape) if isinstance(residual, torch.Tensor) else type(residual)
        raise ValueError(f"residual must be bf16 [M, {ar.hc_mult}, {ar.hidden_size}], "
                         f"got {got}")
    for name in ("post", "comb", "pre", "norm_weight"):
        t = inputs.get(name)
        if t is not None and not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    mix_weights = inputs.get("mix_weights")
    if mode == FULL and ar.collapse_pre is not None:
        if not isinstance(mix_weights, (tuple, list)) or len(mix_weights) != 3 or \
                not all(isinstance(t, torch.Tensor) for t in mix_weights):
            raise ValueError(f"collapse_pre={ar.collapse_pre!r}: a full call needs the next "
                             "sublayer's mix_weights = (hc_fn, hc_scale, hc_base) tensors")
    elif mix_weights is not None:
        raise ValueError("mix_weights given, but this all-reduce computes no mixes "
                         "(collapse_pre=None) or the call is not a full one")
    if mode == FULL:
        eps = inputs.get("eps")
        if not is_nonnegative_real(eps):
            raise ValueError(f"norm_eps must be a finite real number >= 0, got {eps!r}")


def check_partial(ar: BoundaryAllReduce, x: torch.Tensor) -> None:
    """``x``, this rank's partial: BF16 [M, hidden], contiguous, on the
    all-reduce's device, 1 <= M <= capacity; the all-reduce open."""
    ar._open()
    h = ar.hidden_size
    if x.dtype != torch.bfloat16 or x.ndim != 2 or x.shape[1] != h:
        raise ValueError(f"x must be bf16 [M, {h}], got {x.dtype} {list(x.shape)}")
    if x.device != ar.device:
        raise ValueError(f"x is on {x.device}, the all-reduce on {ar.device}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    if not 0 < x.shape[0] <= ar.capacity:
        raise ValueError(f"x has {x.shape[0]} rows; expected 1..capacity = {ar.capacity}")


def abort_step(ar: BoundaryAllReduce, error: Exception, like: object, published: bool) -> None:
    """Abort this step after ``error`` rejected it (docs/FAILURES.md), before
    ``error`` is raised. tp = 1: nothing waits for us; a publish of this step
    is wiped (sentinel fill) and the instance stays usable. tp > 1: the abort
    poison (``ABORT_BITS``) goes where this step's partial would have gone:
    into this rank's slot of every peer's mailbox for all ``capacity`` rows
    (any M a peer uses), at stage NEXT and NEXT + 1 (a peer that already
    consumed this step with a partial published earlier meets it at its next
    one), the stage words advance as a consume would; or, in the gather
    transport, this rank takes part in the step's all-gather with a poison
    of ``like``'s rows (else the last accepted M) without waiting for it.
    Then this rank's status word names it, compile barriers of this epoch
    count it as arrived, and its steps refuse until ``reset(collective=True)``.
    Nothing runs while tracing or capturing (nothing of the step executes)."""
    ar._published = None
    box = ar._box
    if box is None or ar._capturing() or torch.compiler.is_compiling():
        return
    if ar.tp == 1:
        if published and box.buffer is not None:
            box.buffer.fill_(SENTINEL)
        return
    why = f"{type(error).__name__}: {error}"
    ar._failed = f"this rank aborted it: {why}"
    hidden = ar.hidden_size
    if ar.transport == "mailbox":
        poison = torch.full((ar.capacity, hidden), ABORT_BITS, dtype=torch.int16,
                            device=ar.device).view(torch.bfloat16)
        words = box.stage_state
        stage = words[STAGE_NEXT].clone()
        publish(poison, box.peer_ptrs, words, ar.rank, ar.capacity)  # stage s
        words[STAGE_NEXT] = (stage + 1) % STAGES
        publish(poison, box.peer_ptrs, words, ar.rank, ar.capacity)  # stage s + 1
        words[STAGE_ACTIVE] = stage  # as after consuming step s: NEXT = s + 1, ACTIVE = s
    else:
        rows = getattr(like, "shape", (0,))[0] if getattr(like, "ndim", 0) == 2 else 0
        rows = rows if 0 < rows <= ar.capacity else ar._last_rows
        poison = torch.full((rows, hidden), ABORT_BITS, dtype=torch.int16,
                            device=ar.device).view(torch.bfloat16)
        gathered = torch.empty(ar.tp * rows, hidden, dtype=torch.bfloat16,
                               device=ar.device)
        work = all_gather(gathered, poison, ar.group, async_op=True)
        ar._abort_work = (work, poison, gathered)  # kept alive until reset waits for it
    box.status.bitwise_or_(ABORT_BIT | 1 << ar.rank)
    if ar._multi_process():
        host_wait.signal_abort(ar.group, why)
    error.add_note(f"BoundaryAllReduce rank {ar.rank} aborted this step: its peers raise "
                   "RuntimeError naming it; call reset(collective=True) on every rank")
