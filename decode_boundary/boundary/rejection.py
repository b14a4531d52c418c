"""What a rank sends its peers when an input rejects its step
(docs/FAILURES.md): the abort poison, in either transport. The checks that
reject are :mod:`.spec` (construction) and :mod:`.plan` (a call);
:meth:`.step_guard.StepGuard.abort` decides when to poison."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..common.contract import ABORT_BITS, STAGE_ACTIVE, STAGE_NEXT, STAGES
from .mailbox import Mailbox
from .publish_kernel import publish
from .transport import all_gather


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
