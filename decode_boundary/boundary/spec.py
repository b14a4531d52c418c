"""What a ``BoundaryAllReduce`` is, fixed at construction, and what a user may
still change on a live one.

:class:`BoundarySpec`: the group's geometry and options, validated once
(:func:`spec_problems` before the geometry exchange, the exchange itself
comparing every rank's) and then frozen; every collaborator of the all-reduce
takes it instead of the all-reduce. :class:`Settings`: the settable
attributes (a pinned consumer tactic, the host-wait bounds), one object the
all-reduce writes its public attributes into and its collaborators read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .consumer_inputs import MhcMixes, is_hc_eps, is_positive_int
from .consumer_kernel import NORM_TIMEOUT_BIT, Collapse
from .consumer_tactics import ConsumerTactic, side_stream_possible
from .transport import TRANSPORTS

# The int32 status word gives rank p bit p and NORM_TIMEOUT_BIT (bit 30) to the
# norm hand-off: ranks 0..29 have a bit of their own, so 30 ranks at most.
MAX_TP = NORM_TIMEOUT_BIT.bit_length() - 1
_TP_ERROR = ("BoundaryAllReduce supports at most {max} ranks, got tp = {tp}: the int32 status "
             "word gives rank p bit p, and bit {max} reports a norm hand-off timeout")
# Host waits (docs/FAILURES.md): the floor of the default host_timeout_s (compile
# barriers wait step_guard.COMPILE_TIMEOUT_S: ranks JIT-compile at different speeds).
HOST_TIMEOUT_MIN_S = 60.0


def check_tp(tp: int) -> None:
    """``ValueError`` beyond ``MAX_TP`` ranks."""
    if tp > MAX_TP:
        raise ValueError(_TP_ERROR.format(max=MAX_TP, tp=tp))


def spec_problems(transport: str, hc_mult: int, top_k: int, wait_timeout_s: float, hc_eps,
                  collapse_pre, hc_sinkhorn_iters) -> list[str]:
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
        names = [c.value for c in Collapse]
        if collapse_pre not in names:
            problems.append(f"collapse_pre must be None or one of {names}, got "
                            f"{collapse_pre!r}")
        if hc_mult & (hc_mult - 1):
            problems.append(f"the mixes need a power-of-two hc_mult, got {hc_mult}")
        if not is_positive_int(hc_sinkhorn_iters):
            problems.append(f"hc_sinkhorn_iters must be an int >= 1, got "
                            f"{hc_sinkhorn_iters!r}")
    return problems


@dataclass(frozen=True)
class BoundarySpec:
    """One rank's all-reduce as constructed: ``tp`` ranks of ``group`` (None:
    one rank, or simulated ones), this one ``rank``; partials BF16 [M,
    ``hidden``] with M <= ``capacity``; ``hc`` residual streams; ``top_k``
    (the MoE finalize); ``transport`` as resolved ("mailbox" or "nccl"); the
    modes it allows (``residual_only``, ``quantize_layer_input``); the
    consumer's wait bound; the next mixes' ``collapse`` (None: none) with the
    model's ``hc_eps`` and Sinkhorn rounds; ``batch_invariant``: a token's
    outputs do not depend on M or its batch-mates (docs/DESIGN.md §7.1)."""

    tp: int
    rank: int
    hidden: int
    hc: int
    capacity: int
    top_k: int
    device: torch.device
    group: dist.ProcessGroup | None
    transport: str
    residual_only: bool
    quantize_layer_input: bool
    wait_timeout_s: float
    collapse: Collapse | None
    hc_eps: float
    hc_sinkhorn_iters: int
    batch_invariant: bool = False

    @property
    def side_stream_possible(self) -> bool:
        """Whether full calls may take ``mixes_placement="side_stream"``."""
        return side_stream_possible(self.hc, self.collapse)

    @property
    def multi_process(self) -> bool:
        """Ranks in other processes: host waits and barriers go over the group."""
        return self.group is not None and dist.get_world_size(self.group) > 1

    @property
    def capturing(self) -> bool:
        """A CUDA graph is being captured on this device (current stream)."""
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def mix_params(self, mix_weights) -> MhcMixes:
        """The next mixes' parameters of a full call with ``mix_weights``."""
        return MhcMixes(*mix_weights, self.hc_eps, self.hc_sinkhorn_iters, self.collapse)


@dataclass
class Settings:
    """What may change on a live all-reduce (its public attributes of these
    names write here): ``tactic``, a consumer tactic pinned for every M (None:
    the tables); ``host_timeout_s`` and ``liveness_timeout_s``, the bounds of
    its blocking host waits (``BoundaryAllReduce``'s docstrings)."""

    wait_timeout_s: float
    tactic: ConsumerTactic | None = None
    host_timeout_s: float | None = None
    liveness_timeout_s: float | None = None

    NAMES = ("tactic", "host_timeout_s", "liveness_timeout_s")

    @property
    def host_timeout(self) -> float:
        """The bound of each blocking host wait: ``host_timeout_s``, else
        max(``HOST_TIMEOUT_MIN_S``, 10 * ``wait_timeout_s``)."""
        if self.host_timeout_s is not None:
            return float(self.host_timeout_s)
        return max(HOST_TIMEOUT_MIN_S, 10 * self.wait_timeout_s)
