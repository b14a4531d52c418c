"""The mailbox store every publisher shares (docs/CONTRACTS.md, Mailbox).

A device helper below both kernel families: the publish kernel and MoE
finalize (``boundary/``) and the GEMM's publishing epilogue (``gemm/``) store
through :func:`publish_row`, so all of them write identical bits to identical
addresses: -0 turned into +0 (0x8000 is the consumer's "not yet written"),
slot ``[stage][rank][token]`` of every peer's ``[3, tp, capacity, hidden]``
BF16 mailbox, one unicast 16-byte store per peer and 8 columns (never multicast).
:func:`mark_published` is the stage-word update every publisher makes once per
grid.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .contract import SENTINEL_BITS, STAGE_ACTIVE, STAGE_STEP

_SENTINEL = tl.constexpr(SENTINEL_BITS)
_ACTIVE, _STEP = tl.constexpr(STAGE_ACTIVE), tl.constexpr(STAGE_STEP)


@triton.jit
def read_step(stage_ptr):
    """STEP (contract.py), for :func:`mark_published`: read by a publisher after
    its grid wait, early (its round trip then overlaps the publisher's work).
    Volatile: the last writer is the previous publish, a kernel that completed
    before this grid's wait; nothing may serve an older copy."""
    return tl.load(stage_ptr + _STEP, volatile=True)


@triton.jit
def mark_published(stage_ptr, stage, step):
    """Once per publishing grid, by one program after its stores: ACTIVE =
    ``stage`` (the stage the consumer reads) and STEP = ``step`` + 1
    (``step`` from :func:`read_step`: the number that tags this step's layer
    input, contract.py). Plain stores: their readers, this step's consumer and
    the GEMM after it, read them only after this grid has completed."""
    tl.store(stage_ptr + _ACTIVE, stage)
    tl.store(stage_ptr + _STEP, step + 1)


@triton.jit
def publish_row(x, peer_ptrs_ptr, stage, rank, m, cols, mask, capacity,
                TP: tl.constexpr, HIDDEN: tl.constexpr, TILE: tl.constexpr = False):
    """Store BF16 ``x`` (columns ``cols`` of token ``m``) into slot
    [stage][rank][m] of every peer's mailbox, -0 turned into +0. ``x`` is a
    [BLOCK] row, or with ``TILE`` the GEMM epilogue's [BLOCK_N, ROWS] out^T
    tile (``cols`` [BLOCK_N, 1], ``m`` [1, ROWS])."""
    bits = x.to(tl.int16, bitcast=True)
    clean = tl.where(bits == _SENTINEL, 0, bits).to(tl.bfloat16, bitcast=True)
    # int32 offsets (contract.MAILBOX_MAX_ELEMENTS, checked where mailboxes are made and
    # targets checked): int64 ones cost the GEMM's 64-row epilogue 13 registers.
    row = ((stage * TP + rank) * capacity + m) * HIDDEN
    for p in tl.static_range(TP):
        base = tl.load(peer_ptrs_ptr + p).to(tl.pointer_type(tl.bfloat16))
        # Mailboxes are 16-byte aligned and HIDDEN % 8 == 0, stated on the pointers
        # themselves (an int64's alignment is lost in the cast): runs of 8 columns
        # start 16-byte aligned, so the stores become v4.
        if TILE:
            ptrs = tl.multiple_of(base + row + cols, [16, 1])
        else:
            ptrs = tl.multiple_of(base + row + cols, 16)
        tl.store(ptrs, clean, mask=mask)
