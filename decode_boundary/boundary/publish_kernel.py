"""Publish: store this rank's partial sum into its slot of every peer's mailbox.

The mailbox layout is the one of docs/CONTRACTS.md and
``decode_boundary.common.contract``: rank p owns BF16
``[STAGES, tp, capacity, hidden]`` filled with the sentinel -0
(``SENTINEL_BITS``, "not yet written"); ``peer_ptrs[p]`` is its base address
as seen from here; ``stage_state`` is this rank's int32 words, indexed
``STAGE_NEXT`` and ``STAGE_ACTIVE``.
``decode_boundary.common.mailbox_store.publish_row`` is the store every
publisher shares (this kernel, the MoE finalize kernel and the GEMM's
publishing epilogue), so all store identical bits.

**Memory consistency.** Stores are plain (weak) unicast stores over NVLink; no
fence and no flag. The consumer polls the data itself with volatile loads
until no element is the sentinel: a BF16 element is written by one 2-byte
piece of a 16-byte store, so an element is either still -0 or final, and no
other data depends on it (the value is its own flag). -0 is turned into +0
here so a published value can never look unwritten. NEXT (``stage_ptr +
STAGE_NEXT``) is read with a plain load after the grid-dependency wait: the
previous consumer wrote it and its grid has completed (kernel boundary), so
the load sees it. ACTIVE (``stage_ptr + STAGE_ACTIVE``) is written with a
plain store by one program; the consumer reads it only after its own grid
wait, i.e. after this whole grid completed and its stores were flushed.

**What the caller must guarantee.** The consumer of the previous step has run
on this rank (it advanced NEXT); the consumer of this step runs next on the
same stream (a publish without its consumer desynchronises the mailbox). ``x``
is contiguous [M, hidden] BF16 with M <= capacity, hidden % 8 == 0, and is
written by the preceding kernel at the latest (read after the grid wait).

**Why it is CUDA-graph safe.** Every address (peer table, stage words) is a
device tensor that lives as long as the mailbox, and the stage is read on the
device, so a replay needs no host step; the grid depends only on M, which a
captured graph fixes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import env
from ..common.compiled import load_module
from ..common.contract import STAGE_ACTIVE, STAGE_NEXT
from ..common.mailbox_store import publish_row

PUBLISH_BLOCK_H = 512  # columns per program: 64 threads x one 16-byte store per peer
PUBLISH_WARPS = 2
_NEXT, _ACTIVE = tl.constexpr(STAGE_NEXT), tl.constexpr(STAGE_ACTIVE)  # stage_state indices


@triton.jit
def publish_kernel(
    x_ptr,
    peer_ptrs_ptr,
    stage_ptr,
    rank,
    capacity,
    TP: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    m = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < HIDDEN
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x and NEXT come from earlier kernels
    x = tl.load(x_ptr + m.to(tl.int64) * HIDDEN + cols, mask=mask)
    stage = tl.load(stage_ptr + _NEXT)
    if USE_PDL:
        # The consumer's pre-wait loads (residual, post, comb, gamma) are not ours.
        tl.extra.cuda.gdc_launch_dependents()
    publish_row(x, peer_ptrs_ptr, stage, rank, m, cols, mask, capacity, TP=TP, HIDDEN=HIDDEN)
    if (m == 0) & (chunk == 0):
        tl.store(stage_ptr + _ACTIVE, stage)


def publish_block(hidden: int) -> int:
    return min(PUBLISH_BLOCK_H, triton.next_power_of_2(hidden))


def publish(x: torch.Tensor, peer_ptrs: torch.Tensor, stage_state: torch.Tensor, rank: int,
            capacity: int, compile_only: bool = False) -> None:
    """Launch the publish kernel for ``x`` [M, hidden] (see the module docstring);
    ``compile_only``: compile it, launch nothing."""
    if x.dtype != torch.bfloat16 or x.ndim != 2 or not x.is_contiguous():
        raise ValueError(f"x must be contiguous bf16 [M, hidden], got {x.dtype} "
                         f"{tuple(x.shape)} contiguous={x.is_contiguous()}")
    m, hidden = x.shape
    if hidden % 8:
        raise ValueError(f"hidden must be a multiple of 8 (16-byte stores), got {hidden}")
    if m > capacity:
        raise ValueError(f"x has {m} rows, more than the mailbox capacity {capacity}")
    if m == 0:
        return
    block = publish_block(hidden)
    grid = (m, triton.cdiv(hidden, block))
    pdl = env.use_pdl(x.device)
    kernel = publish_kernel.warmup if compile_only else publish_kernel[grid]
    compiled = kernel(
        x, peer_ptrs, stage_state, rank, capacity,
        TP=peer_ptrs.numel(), HIDDEN=hidden, BLOCK_H=block, USE_PDL=pdl,
        num_warps=PUBLISH_WARPS, launch_pdl=pdl, **(dict(grid=grid) if compile_only else {}),
    )
    if compile_only:
        load_module(compiled)
