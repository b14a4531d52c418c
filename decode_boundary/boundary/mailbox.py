"""Mailbox allocation (docs/DESIGN.md §6, docs/CONTRACTS.md).

Each rank owns ``buffer`` BF16 [STAGES, tp, capacity, hidden] that every peer
can store into, filled with the sentinel -0 (``common.contract.SENTINEL``,
"not yet written"); ``peer_ptrs`` int64 [tp] on the device holds every rank's
buffer address as seen from this rank; ``stage_state`` int32 [2], indexed
``STAGE_NEXT`` / ``STAGE_ACTIVE``; ``status`` int32 [1] (bit p: rank p never
arrived within the wait bound; ``consumer_kernel.NORM_TIMEOUT_BIT``: a norm
hand-off timed out). ``generation`` / ``sumsq`` / ``prenorm`` are the
consumer's per-token scratch for the RMSNorm hand-off, zeroed together.

Peer memory comes from PyTorch symmetric memory with multicast disabled
(``symm_mem.empty`` + ``rendezvous``; peers reached by unicast stores only):
:func:`symmetric_mailbox`. :func:`local_words` allocates the device words and
scratch without a buffer (the NCCL fallback, chosen in :mod:`.transport`).
:func:`simulated_mailboxes` builds tp mailboxes in one process (CPU tests:
the "peer addresses" are ``data_ptr()`` of separate buffers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..common.contract import SENTINEL, STAGES, check_mailbox_size
from ..env import disable_multicast, logger
from ..mixes.handoff import MixRows
from .consumer import sumsq_columns


@dataclass
class Mailbox:
    """One rank's mailbox and device words (``buffer``/``peer_ptrs`` are None in
    NCCL-fallback mode). ``keepalive`` holds what must outlive the addresses."""

    rank: int
    tp: int
    capacity: int
    hidden: int
    buffer: torch.Tensor | None
    peer_ptrs: torch.Tensor | None
    stage_state: torch.Tensor
    status: torch.Tensor
    generation: torch.Tensor
    sumsq: torch.Tensor
    prenorm: torch.Tensor
    keepalive: object = None
    # The consumer's mix rows (next sublayer's mixes) and their write count,
    # allocated by an all-reduce that computes them; tagged like sumsq, so zeroed with it.
    mix_rows: MixRows | None = None

    @property
    def mix_words(self) -> torch.Tensor | None:
        """The mix rows' tensor (None without mixes)."""
        return self.mix_rows.words if self.mix_rows is not None else None

    def rearm(self) -> None:
        """Sentinel fill, stage words and status cleared, the norm hand-off's generations
        and tagged partials (and mix rows) zeroed together (stream-ordered)."""
        if self.buffer is not None:
            self.buffer.fill_(SENTINEL)
        self.stage_state.zero_()
        self.status.zero_()
        self.generation.zero_()
        self.sumsq.zero_()
        if self.mix_rows is not None:
            self.mix_rows.words.zero_()
            self.mix_rows.advance()  # a combine left before it is stale


def _words(rank, tp, capacity, hidden, device, buffer, peer_ptrs, keepalive=None) -> Mailbox:
    box = Mailbox(
        rank, tp, capacity, hidden, buffer, peer_ptrs,
        stage_state=torch.zeros(2, dtype=torch.int32, device=device),
        status=torch.zeros(1, dtype=torch.int32, device=device),
        generation=torch.zeros(capacity, dtype=torch.int32, device=device),
        sumsq=torch.zeros(capacity, sumsq_columns(hidden), dtype=torch.int64, device=device),
        prenorm=torch.empty(capacity, hidden, dtype=torch.bfloat16, device=device),
        keepalive=keepalive,
    )
    box.rearm()
    return box


def _shape(tp, capacity, hidden):
    if tp < 1 or capacity < 1 or hidden < 1:
        raise ValueError(f"tp, capacity and hidden must be positive, got {tp}, {capacity}, "
                         f"{hidden}")
    if hidden % 8:
        raise ValueError(f"hidden must be a multiple of 8 (16-byte mailbox stores), got {hidden}")
    return (STAGES, tp, capacity, hidden)


def _mailbox_shape(tp, capacity, hidden):
    """``_shape`` of a mailbox buffer, which publishers address with int32 offsets."""
    shape = _shape(tp, capacity, hidden)
    check_mailbox_size(tp, capacity, hidden)
    return shape


def simulated_mailboxes(tp: int, capacity: int, hidden: int,
                        device: torch.device | str = "cpu") -> list[Mailbox]:
    """tp mailboxes in this process, each able to "reach" the others by address
    (CPU interpreter tests, or tp = 1 on one GPU)."""
    device = torch.device(device)
    shape = _mailbox_shape(tp, capacity, hidden)
    buffers = [torch.empty(shape, dtype=torch.bfloat16, device=device) for _ in range(tp)]
    ptrs = [b.data_ptr() for b in buffers]
    return [
        _words(r, tp, capacity, hidden, device, buffers[r],
               torch.tensor(ptrs, dtype=torch.int64, device=device), keepalive=buffers)
        for r in range(tp)
    ]


def symmetric_mailbox(group: dist.ProcessGroup, capacity: int, hidden: int,
                      device: torch.device) -> Mailbox:
    """This rank's mailbox in PyTorch symmetric memory (multicast disabled),
    with the peers' addresses from the rendezvous handle. Collective."""
    disable_multicast()
    import torch.distributed._symmetric_memory as symm_mem

    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    buffer = symm_mem.empty(_mailbox_shape(tp, capacity, hidden), dtype=torch.bfloat16,
                            device=device)
    handle = symm_mem.rendezvous(buffer, group.group_name)
    ptrs = [int(p) for p in handle.buffer_ptrs]
    if any(p % 16 for p in ptrs):
        raise RuntimeError(f"symmetric-memory mailbox not 16-byte aligned: {ptrs}")
    box = _words(rank, tp, capacity, hidden, device, buffer,
                 torch.tensor(ptrs, dtype=torch.int64, device=device), keepalive=handle)
    torch.cuda.synchronize(device)
    dist.barrier(group=group)  # every -0 fill lands before any peer publishes
    logger.debug("rank %d: symmetric mailbox %s, peers %s", rank, tuple(buffer.shape), ptrs)
    return box


def local_words(group: dist.ProcessGroup | None, capacity: int, hidden: int,
                device: torch.device) -> Mailbox:
    """Device words and scratch without a mailbox (NCCL-fallback mode)."""
    tp = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    _shape(tp, capacity, hidden)
    return _words(rank, tp, capacity, hidden, device, None, None)
