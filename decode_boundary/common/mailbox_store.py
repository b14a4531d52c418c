"""The mailbox store every publisher shares (docs/CONTRACTS.md, Mailbox).

A device helper below both kernel families: the publish kernel and MoE
finalize (``boundary/``) and the GEMM's publishing epilogue (``gemm/``) store
through :func:`publish_row`, so all of them write identical bits to identical
addresses: -0 turned into +0 (0x8000 is the consumer's "not yet written"),
slot ``[stage][rank][token]`` of every peer's ``[3, tp, capacity, hidden]``
BF16 mailbox, one unicast 16-byte store per peer and 8 columns (never multicast).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .contract import SENTINEL_BITS

_SENTINEL = tl.constexpr(SENTINEL_BITS)


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
