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

import torch

STAGES = 3  # a peer may be one boundary ahead: stage s+1 is being written while s is read
STAGE_NEXT, STAGE_ACTIVE = 0, 1  # indices into stage_state
# Publishers address a peer's mailbox with int32 element offsets (int64 ones cost the
# GEMM's 64-row publishing epilogue registers, one resident program per SM), so a
# mailbox [STAGES, tp, capacity, hidden] holds at most this many elements.
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
# GEMM after the consumer (FINISH_MIXES: decode_boundary.mixes.handoff).
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
