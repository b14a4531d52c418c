"""What happens to a step that an input rejects (docs/FAILURES.md), for
:class:`.all_reduce.BoundaryAllReduce`: the checks of its construction
arguments and of a call, which run before anything of the step reaches a peer
or the stage words (``consume`` checks the tensors in detail after them, still
before its ``before_launch``), and the poison that tells the peers when one
fails (``BoundaryAllReduce.abort_step`` decides when). The all-reduce is read
through its public attributes only."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..common.contract import ABORT_BITS, STAGE_ACTIVE, STAGE_NEXT, STAGES
from ..mixes.handoff import MIXES_CHOICES
from .consumer import mixes_aside_ok
from .consumer_inputs import COLLAPSES, is_hc_eps, is_nonnegative_real, is_positive_int
from .consumer_kernel import FULL, PLAIN, RESIDUAL_ONLY
from .mailbox import Mailbox
from .publish_kernel import publish
from .transport import TRANSPORTS, all_gather


def construction_problems(transport: str, hc_mult: int, top_k: int, wait_timeout_s: float,
                          hc_eps, collapse_pre: str | None, hc_sinkhorn_iters) -> list[str]:
    """The refusals of a rank's own construction arguments (empty when fine):
    they travel with the geometry exchange, so that a rank refusing alone does
    not leave its peers waiting in it."""
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
    if collapse_pre is not None:
        if collapse_pre not in COLLAPSES:
            problems.append(f"collapse_pre must be None or one of {sorted(COLLAPSES)}, got "
                            f"{collapse_pre!r}")
        if hc_mult & (hc_mult - 1):
            problems.append(f"the mixes need a power-of-two hc_mult, got {hc_mult}")
        if not is_positive_int(hc_sinkhorn_iters):
            problems.append(f"hc_sinkhorn_iters must be an int >= 1, got "
                            f"{hc_sinkhorn_iters!r}")
    return problems


def check_mixes_choice(ar, mode: int, choice) -> None:
    """``mixes=`` of a call: None or one of ``MIXES_CHOICES``, given only to a
    full call of an all-reduce that computes mixes; "side_stream" only with
    the previous pre and an hc the mixes kernel takes."""
    if choice is None:
        return
    if not isinstance(choice, str) or choice not in MIXES_CHOICES:
        raise ValueError(f"mixes must be None or one of {MIXES_CHOICES}, got {choice!r}")
    if choice == "side_stream" and not (mode == FULL and
                                        mixes_aside_ok(ar.hc_mult, ar.collapse_pre)):
        raise ValueError(
            "mixes='side_stream' needs a full call of an all-reduce with "
            "collapse_pre='previous' and an hc the mixes kernel takes; this one has "
            f"collapse_pre={ar.collapse_pre!r}, hc={ar.hc_mult}"
            + ("" if mode == FULL else ", and the call is not a full one"))
    if mode != FULL or ar.collapse_pre is None:
        raise ValueError(f"mixes={choice!r} given, but this all-reduce computes no mixes "
                         "(collapse_pre=None) or the call is not a full one")


def check_reduce_call(ar, x: torch.Tensor, mode: int, inputs: dict) -> None:
    """The all-reduce's own checks of a reduce call (``consume`` checks the
    tensors in detail): x, the mode against the construction flags, the
    structure of residual / mxfp8_out, the tensors' types, eps, the mixes
    choice."""
    check_partial(ar, x)
    check_mixes_choice(ar, mode, inputs.get("mixes"))
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


def check_partial(ar, x: torch.Tensor) -> None:
    """``x``, this rank's partial: BF16 [M, hidden], contiguous, on the
    all-reduce's device, 1 <= M <= capacity; the all-reduce open."""
    ar.mailbox  # noqa: B018  (raises once closed)
    h = ar.hidden_size
    if x.dtype != torch.bfloat16 or x.ndim != 2 or x.shape[1] != h:
        raise ValueError(f"x must be bf16 [M, {h}], got {x.dtype} {list(x.shape)}")
    if x.device != ar.device:
        raise ValueError(f"x is on {x.device}, the all-reduce on {ar.device}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    if not 0 < x.shape[0] <= ar.capacity:
        raise ValueError(f"x has {x.shape[0]} rows; expected 1..capacity = {ar.capacity}")


def poison_mailboxes(box: Mailbox, device: torch.device) -> None:
    """The abort poison (``ABORT_BITS``) where this rank's partial would have
    gone: its slot of every peer's mailbox for all ``capacity`` rows (any M a
    peer uses), at stage NEXT and NEXT + 1 (a peer that already consumed this
    step with a partial published earlier meets it at its next one); the stage
    words advance as a consume would."""
    poison = torch.full((box.capacity, box.hidden), ABORT_BITS, dtype=torch.int16,
                        device=device).view(torch.bfloat16)
    words = box.stage_state
    stage = words[STAGE_NEXT].clone()
    publish(poison, box.peer_ptrs, words, box.rank, box.capacity)  # stage s
    words[STAGE_NEXT] = (stage + 1) % STAGES
    publish(poison, box.peer_ptrs, words, box.rank, box.capacity)  # stage s + 1
    words[STAGE_ACTIVE] = stage  # as after consuming step s: NEXT = s + 1, ACTIVE = s


def poison_gather(group: dist.ProcessGroup, tp: int, rows: int, hidden: int,
                  device: torch.device) -> tuple:
    """The gather transport's abort: this rank takes part in the step's
    all-gather with a poison of ``rows`` rows without waiting for it; the
    (work, poison, gathered) to keep alive until a reset waits for it."""
    poison = torch.full((rows, hidden), ABORT_BITS, dtype=torch.int16,
                        device=device).view(torch.bfloat16)
    gathered = torch.empty(tp * rows, hidden, dtype=torch.bfloat16, device=device)
    return all_gather(gathered, poison, group, async_op=True), poison, gathered
