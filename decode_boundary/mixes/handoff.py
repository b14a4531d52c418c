"""What an all-reduce call returns of the next sublayer's mHC mixes, and how
the next GEMM finishes them when the consumer left their combine.

:class:`NextMixes` holds ``pre`` [M, hc], ``post`` [M, hc] and ``comb``
[M, hc, hc] (FP32) and says when they are complete: at once in stream order
(the consumer, or the mixes kernel after it, combined them), after the GEMM
launched with it (``mxfp8_mm(layer, x, finish_mixes=...)``: M more programs of
that launch combine them), or after the all-reduce's ``join_mixes`` (the mixes
kernel ran on its side stream). The all-reduce that returned it refuses its
next call while a combine left to a GEMM was never launched (pre, post and
comb would stay unwritten).

:class:`MixRows` is the all-reduce's per-token mix scratch with the count of
launches that (re)wrote it: a hand-off records the count of the launch that
left it, and a GEMM refuses it once a later launch or a re-arm has rewritten
the rows. The count lives with the rows (no state outside the instances).
"""

from __future__ import annotations

import warnings
from enum import StrEnum
from typing import NamedTuple

import torch


class MixesFinish(NamedTuple):
    """The device arguments of a combine left to the next kernel (the device
    side is ``mixes.mhc_combine.finish_token_mixes``): the mix rows and
    scratch words the consumer launch used, the mix parameters, the outputs
    to fill (pre [M, hc], post [M, hc], comb [M, hc, hc] FP32) and the
    geometry of the launch's shares. The finishing kernel runs after the
    consumer in stream order and reads these only after its grid wait (the
    consumer's grid complete); nothing may touch the mix rows or
    ``generation`` in between. A share missing there (never expected) sets
    ``NORM_TIMEOUT_BIT`` in ``status`` after the bound and makes that token's
    mixes NaN; the all-reduce's next ``check()`` reports it."""

    mix_words: torch.Tensor  # int64 [rows, mix_columns(H, hc)]
    generation: torch.Tensor  # int32 [rows]: generation[m] is the shares' tag
    status: torch.Tensor  # int32 [1]: a timeout sets NORM_TIMEOUT_BIT
    hc_scale: torch.Tensor  # FP32 [3]
    hc_base: torch.Tensor  # FP32 [(2 + hc) * hc]
    pre: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor
    eps: float  # the mixes' RMS eps
    hc_eps: float
    rounds: int  # Sinkhorn rounds after the first column normalisation
    wait_bound: int  # ns with use_ptx, spins without
    hc: int
    hidden: int
    chunks: int  # the consumer launch's chunks per token: one share each
    slots: int
    mix_row: int
    totals_off: int
    use_ptx: bool


def current_stream_id(device: torch.device) -> int:
    """The current CUDA stream's id on ``device`` (0 off the GPU): where a
    combine is left and where its GEMM must launch."""
    return torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0


class MixRows:
    """A consumer's per-token mix scratch (int64 tagged words [capacity,
    ``mix_columns(H, hc)``]) and ``epoch``: how many launches (or re-arms)
    have written it."""

    def __init__(self, words: torch.Tensor) -> None:
        self.words = words
        self.epoch = 0

    def advance(self) -> int:
        """Count one more launch (or re-arm) writing the rows; the new epoch."""
        self.epoch += 1
        return self.epoch


class MixesPlacement(StrEnum):
    """Where an all-reduce call's next mixes are computed and when they are
    complete: its ``mixes_placement=`` (docs/DESIGN.md §5.1), and, but "auto",
    the result's ``NextMixes.placement``:

    * "consumer" (the default): in the consumer (beyond ``MIXES_FUSED_MAX_ROWS``
      tokens of V4.1, by the mixes kernel right after it); complete in stream order.
    * "next_gemm": the consumer computes the mixes' shares and leaves their
      combine (pre, post and comb unwritten) to the GEMM launched right after it
      on the call's stream, ``mxfp8_mm(layer, x, finish_mixes=result.mixes)``: its
      M extra programs combine while the products run, instead of the consumer's
      grid ending with the combine, which the next kernel's grid wait would wait
      for; the bits are the same. Where nothing can be left (the mixes kernel
      combined, PTX is off on the GPU, or under torch.compile, where the consumer
      combines) the result's mixes say "consumer" and the GEMM runs plain. The
      GEMM must run on the call's stream before the next consumer launch on these
      scratch rows (else it refuses the hand-off: ``ValueError``), and the
      all-reduce refuses its next call (``RuntimeError``, the step aborted as for
      a bad argument) while no GEMM launched with it. pre, post and comb are
      complete when that GEMM's grid is: a kernel that reads them before its own
      grid wait (the next consumer does, for its early inputs) must not be able to
      start while the GEMM runs, i.e. not sit in an unbroken chain of kernels that
      release their dependents early (PDL) behind it.
    * "side_stream" (mixes of the previous pre, V4.1, at an hc the mixes kernel
      takes): the consumer runs without the mixes and the mixes kernel computes
      them on the all-reduce's side stream, forked after the consumer, so that no
      kernel on the calling stream waits for them (as V4.1 engines run their mixes
      GEMM). pre, post and comb are complete only once the calling stream has
      *joined* the side stream: the all-reduce's ``join_mixes``, which its next
      call does by itself before its consumer (whose scratch the mixes kernel
      reads). Read them on no stream before that; a CUDA-graph capture must call
      ``join_mixes`` before it ends (CUDA refuses an unjoined capture) and cannot
      start while an eager call's mixes are pending (``RuntimeError``: join
      first). The pre, post and comb are the mixes kernel's (another FP32
      summation order than the consumer's fused dots: equal within
      ``MIXES_ATOL``, not bit for bit); residual_out is the same bit for bit, the
      layer input may differ in its last bits (the consumer without the mixes runs
      its own tactic: another sum-of-squares order). The mixes kernel reports a
      missing share into the status word like the consumer: ``check`` sees that
      only once the side stream is joined (every call joins the last one's first).
      A capture that raises before it joins leaves its event pending: ``reset()``
      drops it. Refused (``ValueError``) without mixes or for V4.
    * "auto": "side_stream" from ``MIXES_ASIDE_MIN_ROWS`` tokens on where it is
      possible, else "next_gemm" (the model chain's choice).
    """

    CONSUMER = "consumer"
    NEXT_GEMM = "next_gemm"
    SIDE_STREAM = "side_stream"
    AUTO = "auto"


# A member by its value, by dict lookup: torch.compile (Dynamo in torch 2.11) cannot
# trace an enum's construction, MixesPlacement(value), inside a compiled step.
_PLACEMENTS = {p.value: p for p in MixesPlacement}


def placement_of(value: str) -> MixesPlacement:
    """The ``MixesPlacement`` of ``value`` (a member or its string)."""
    return _PLACEMENTS[value]


MIXES_PLACEMENTS = tuple(p.value for p in MixesPlacement)  # as error messages list them


class NextMixes:
    """The next sublayer's (pre, post, comb) of one all-reduce call; iterates
    and indexes as that triple. ``placement``: "consumer" (complete in stream order after the
    call), "next_gemm" (complete once the GEMM launched with this object is:
    ``mxfp8_mm(layer, x, finish_mixes=...)``, which must run next on the
    call's stream) or "side_stream" (complete once the all-reduce's
    ``join_mixes`` ran). A "next_gemm" hand-off whose combine could not be left
    (no PTX on the GPU, torch.compile) is returned as "consumer": passing it to
    a GEMM is then harmless (the GEMM runs plain)."""

    def __init__(self, pre: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                 placement: MixesPlacement = MixesPlacement.CONSUMER,
                 finish: MixesFinish | None = None,
                 rows: MixRows | None = None, epoch: int | None = None,
                 stream: int = 0) -> None:
        self.pre, self.post, self.comb = pre, post, comb
        self.placement = placement_of(placement)
        self.finish = finish  # the device arguments left to the GEMM (None: nothing left)
        self.rows = rows  # the scratch the shares live in, with its write count
        self.epoch = epoch  # that count at the launch that left them; None: compile only
        self.stream = stream  # the stream the GEMM must launch on
        self.finished = False  # a GEMM launched with it

    @property
    def how(self) -> MixesPlacement:
        """Deprecated spelling of :attr:`placement`."""
        warnings.warn("NextMixes.how is deprecated: read NextMixes.placement",
                      DeprecationWarning, stacklevel=2)
        return self.placement

    def __iter__(self):
        return iter((self.pre, self.post, self.comb))

    def __len__(self) -> int:
        return 3

    def __getitem__(self, index):
        return (self.pre, self.post, self.comb)[index]

    @property
    def left_to_gemm(self) -> bool:
        """Whether the next GEMM must combine these (pre, post and comb unwritten)."""
        return self.finish is not None

    @property
    def unfinished(self) -> bool:
        """Left to a GEMM that has not launched with it yet."""
        return self.finish is not None and not self.finished

    def launch_args(self, device: torch.device) -> MixesFinish:
        """The device arguments for a GEMM launch on ``device``'s current
        stream; ``ValueError`` for a hand-off made only to compile, one whose
        shares a later launch (or a re-arm) rewrote, or another stream."""
        if self.finish is None:
            raise ValueError("finish_mixes: these mixes were not left to a GEMM")
        if self.epoch is None:
            raise ValueError("finish_mixes was made to compile the finishing variant "
                             "(deferred_finish), not left by a consumer launch")
        if self.rows is None or self.epoch != self.rows.epoch:
            raise ValueError("finish_mixes is older than the last consumer launch (or re-arm) "
                             "on its mix rows: its shares have been rewritten (launch the "
                             "GEMM with a call's mixes right after that call)")
        if current_stream_id(device) != self.stream:
            raise ValueError("finish_mixes was left on another stream: the GEMM must run on "
                             "the consumer's stream, right after it (its grid wait orders it "
                             "after the consumer only there)")
        return self.finish

    def mark_finished(self) -> None:
        """Record that a GEMM launched with it (the all-reduce's next call checks it)."""
        self.finished = True

    def replace(self, **fields) -> NextMixes:
        """The same hand-off with some of its device arguments (``MixesFinish``
        fields) replaced: what a check of the GEMM's refusals builds."""
        finish = self.finish._replace(**fields)
        other = NextMixes(finish.pre, finish.post, finish.comb, self.placement, finish, self.rows,
                          self.epoch, self.stream)
        return other
