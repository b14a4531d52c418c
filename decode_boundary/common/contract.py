"""The contract between a producer that publishes (the publish kernel, MoE
finalize, the GEMM's publishing epilogue) and the consumer of the boundary
all-reduce: defined here once, imported by ``gemm/`` and ``boundary/``.

Mailbox (docs/DESIGN.md §6, docs/CONTRACTS.md): every rank owns a BF16
``[STAGES, tp, capacity, hidden]`` buffer that every peer can store into,
filled with the sentinel -0.0 (BF16 bits ``SENTINEL_BITS``, "not yet
written"). A publisher turns -0 into +0, so a value it stored is never taken
for a hole. Each rank's local ``stage_state`` int32 [2] holds the stage the
next publish writes (``stage_state[STAGE_NEXT]``) and the stage the next
consume reads (``stage_state[STAGE_ACTIVE]``).

Scale buffers of MXFP8 operands follow the 128x4 swizzle of
``decode_boundary.mxfp8.format`` (``mxfp8_scale_bytes``,
``check_scale_buffer``): one geometry for the quantizer, the GEMM and the
consumer's MXFP8 output.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral
from typing import NamedTuple

import torch

STAGES = 3  # a peer may be one boundary ahead: stage s+1 is being written while s is read
STAGE_NEXT, STAGE_ACTIVE = 0, 1  # indices into stage_state
# Publishers address a peer's mailbox with int32 element offsets (the GEMM's 64-row
# publishing epilogue kept 13 registers more with int64 ones, one resident program
# per SM less: benchmarks/NOTES.md attempt 16), so a mailbox [STAGES, tp, capacity,
# hidden] holds at most this many elements.
MAILBOX_MAX_ELEMENTS = 2**31 - 1


def check_mailbox_size(tp: int, capacity: int, hidden: int) -> None:
    """Raise ``ValueError`` unless a [STAGES, tp, capacity, hidden] mailbox fits
    ``MAILBOX_MAX_ELEMENTS`` (the publishers' int32 offsets)."""
    if STAGES * tp * capacity * hidden > MAILBOX_MAX_ELEMENTS:
        raise ValueError(f"a mailbox of tp {tp} x capacity {capacity} x hidden {hidden} "
                         f"({STAGES} stages) exceeds {MAILBOX_MAX_ELEMENTS} elements: "
                         "lower the capacity")
SENTINEL = -0.0  # the fill value of an unwritten mailbox slot
SENTINEL_BITS = -32768  # the same as int16 bits (0x8000), what kernels compare against
# The abort poison (docs/FAILURES.md): a rank that rejects a step stores these
# BF16 bits (0xFFAB, a signalling NaN: no kernel of ours produces one, every
# rounding here yields a quiet NaN) into its slot of every peer's mailbox; the
# consumer sums it as NaN and names the rank in the status word.
ABORT_BITS = -85  # 0xFFAB as int16


@dataclass(frozen=True)
class PublishTarget:
    """What a producer needs to publish into an all-reduce itself: the peer
    mailbox table (int64 [tp] on the device, 16-byte aligned addresses), this
    rank's stage words (int32 [2] = {NEXT, ACTIVE}), and the slot geometry of
    the BF16 mailboxes ``[STAGES, tp, capacity, hidden]``. Valid for the
    all-reduce's lifetime."""

    peer_ptrs: torch.Tensor | None
    stage_state: torch.Tensor | None
    rank: int
    tp: int
    capacity: int
    hidden: int


# A token's mix row (int64 tagged words, docs/DESIGN.md §5.1): one share of
# mix_slots(hc) words per chunk of its columns, chunks of >= MIX_MIN_BLOCK columns,
# then the combining program's sums of them. Written by the consumer (or the mixes
# kernel), read by whichever kernel combines: the consumer, the mixes kernel or the
# GEMM after the consumer (FINISH_MIXES).
MIX_MIN_BLOCK = 64


def mix_slots(hc: int) -> int:
    """Words per chunk in a token's mix row: the (2 + hc) * hc dots and the sum
    of squares, padded to a power of two."""
    return 1 << ((2 + hc) * hc).bit_length()


def max_mix_chunks(hidden: int) -> int:
    """The most shares a token's mix row holds: one per chunk of >=
    ``MIX_MIN_BLOCK`` columns."""
    return -(-hidden // MIX_MIN_BLOCK)


def mix_totals_offset(hidden: int, hc: int) -> int:
    """Where the combining program puts the shares' sums in a token's mix row
    (``mix_slots`` words, its own scratch, read back as scalars): after the
    ``max_mix_chunks`` shares."""
    return max_mix_chunks(hidden) * mix_slots(hc)


def mix_columns(hidden: int, hc: int) -> int:
    """Row length of the per-token mix scratch (int64 tagged words, a multiple
    of 16: 128-byte lines): the shares, then the combining program's sums."""
    return -(-(mix_totals_offset(hidden, hc) + mix_slots(hc)) // 16) * 16


class MixesFinish(NamedTuple):
    """A consumer launch's next mHC mixes, left for the next kernel to combine
    (``consume(..., combine_mixes=False)``; the device side is
    ``common.mhc_combine.finish_token_mixes``): the mix rows and scratch words
    that launch used, the mix parameters, the outputs to fill (pre [M, hc],
    post [M, hc], comb [M, hc, hc] FP32) and the geometry of the launch's
    shares. The finishing kernel must run after the consumer in stream order
    and read these only after its grid wait (the consumer's grid complete);
    nothing may touch the mix rows or ``generation`` in between. A share
    missing there (never expected) sets ``NORM_TIMEOUT_BIT`` in ``status``
    after the bound and makes that token's mixes NaN; the all-reduce's next
    ``check()`` reports it.

    Host-side bookkeeping: ``launched``, a one-element list the GEMM sets to
    True when it launches with this finish (the all-reduce that returned it
    refuses its next call while it is False: pre, post and comb would stay
    unwritten); ``epoch``, the mix rows' epoch (:func:`mix_rows_epoch`) of the
    consumer launch that left it: a GEMM refuses the finish once a later
    launch (or a re-arm) has rewritten the rows, and -1 marks a finish made
    only to compile the variant (``deferred_finish``), which no launch takes;
    ``stream``, the CUDA stream it was made on (0 off the GPU): the GEMM must
    launch on it (its grid wait orders it after the consumer only there)."""

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
    launched: list | None = None
    epoch: int = -1
    stream: int = 0


def current_stream_id(device: torch.device) -> int:
    """The current CUDA stream's id on ``device`` (0 off the GPU): where a
    MixesFinish is left and where its GEMM must launch."""
    return torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0


# Host-side count of the launches that (re)wrote each mix-row buffer, by its storage:
# a MixesFinish records the count of the launch that left it (MixesFinish.epoch).
_MIX_ROWS_EPOCHS: dict[tuple[str, int], int] = {}


def _mix_rows_key(mix_words: torch.Tensor) -> tuple[str, int]:
    return str(mix_words.device), mix_words.untyped_storage().data_ptr()


def mix_rows_epoch(mix_words: torch.Tensor) -> int:
    """How many consumer launches (or re-arms) have written these mix rows."""
    return _MIX_ROWS_EPOCHS.get(_mix_rows_key(mix_words), 0)


def advance_mix_rows(mix_words: torch.Tensor) -> int:
    """Count one more launch (or re-arm) writing these mix rows; the new epoch."""
    key = _mix_rows_key(mix_words)
    _MIX_ROWS_EPOCHS[key] = _MIX_ROWS_EPOCHS.get(key, 0) + 1
    return _MIX_ROWS_EPOCHS[key]


# The launch arguments of a producer that does not publish (kernels compile the
# publishing code out; these values only fill the constexpr slots).
NO_PUBLISH = PublishTarget(peer_ptrs=None, stage_state=None, rank=0, tp=1, capacity=1, hidden=1)


def check_stage(stage: int, name: str = "stage") -> int:
    """``stage`` if it is a mailbox stage index (``0 <= stage < STAGES``), else
    ``ValueError``: what every host entry that takes a stage index from a
    caller checks before it can reach a kernel's address arithmetic."""
    if isinstance(stage, bool) or not isinstance(stage, Integral) or not 0 <= stage < STAGES:
        raise ValueError(f"{name} must be an int in [0, {STAGES}), got {stage!r}")
    return stage


def check_publish_target(target: PublishTarget, hidden: int, rows: int,
                         device: torch.device) -> None:
    """Raise ``ValueError`` unless ``target`` can take ``rows`` tokens of
    ``hidden`` BF16 values published from ``device``: its geometry in range
    (``tp >= 1``, ``0 <= rank < tp``, ``capacity >= 1``, ``hidden > 0``, a
    multiple of 8, equal to the producer's width, ``rows <= capacity``), the
    peer table and stage words of the right dtype, shape and device, and, where
    reading them costs no device sync (CPU tensors), both stage words in
    ``[0, STAGES)``: a producer's store address is ``stage * tp + rank`` slots in."""
    for field, low in (("tp", 1), ("capacity", 1), ("hidden", 1)):
        value = getattr(target, field)
        if isinstance(value, bool) or not isinstance(value, Integral) or value < low:
            raise ValueError(f"publish.{field} must be an int >= {low}, got {value!r}")
    if isinstance(target.rank, bool) or not isinstance(target.rank, Integral) or \
            not 0 <= target.rank < target.tp:
        raise ValueError(f"publish.rank {target.rank!r} outside [0, {target.tp})")
    ptrs, words = target.peer_ptrs, target.stage_state
    if ptrs is None or ptrs.dtype != torch.int64 or tuple(ptrs.shape) != (target.tp,) or \
            ptrs.device != device:
        got = "None" if ptrs is None else f"{ptrs.dtype} {tuple(ptrs.shape)} on {ptrs.device}"
        raise ValueError(f"publish.peer_ptrs must be int64 [{target.tp}] on {device}, got {got}")
    if words is None or words.dtype != torch.int32 or tuple(words.shape) != (2,) or \
            words.device != device:
        got = "None" if words is None else f"{words.dtype} {tuple(words.shape)} on {words.device}"
        raise ValueError(f"publish.stage_state must be int32 [2] on {device}, got {got}")
    if target.hidden != hidden or hidden % 8:
        raise ValueError(f"publish.hidden ({target.hidden}) must equal the producer's width "
                         f"({hidden}), a multiple of 8 (16-byte mailbox stores)")
    if rows > target.capacity:
        raise ValueError(f"{rows} rows exceed the mailbox capacity {target.capacity}")
    check_mailbox_size(target.tp, target.capacity, target.hidden)
    if words.device.type == "cpu" and not torch.compiler.is_compiling():
        for index, label in ((STAGE_NEXT, "NEXT"), (STAGE_ACTIVE, "ACTIVE")):
            check_stage(int(words[index]), f"publish.stage_state[{label}]")
