"""Host-side model of the Lamport mailbox protocol (docs/DESIGN.md §6), for the
property tests of ``test_protocol_model.py``.

Pure numpy, no GPU: ``tp`` ranks, each owning ``mailbox [STAGES, tp, capacity,
hidden]`` of BF16 bits filled with the sentinel -0 (``SENTINEL_BITS``, "not
yet written") and the local words {NEXT, ACTIVE}; the constants are those of
``decode_boundary.common.contract``, which the kernels use. The model keeps
exactly the freedom the hardware has:

* a publish reads NEXT, issues its stores and sets ACTIVE; the stores then land
  whenever the scheduler says, in any order, interleaved with everything else,
  and each 16-byte store lands in pieces (``piece`` elements at a time);
* a consume is "not ready yet" (a spin iteration) while any needed element is
  -0; when ready it sums the ranks' values in rank order (FP32), sets NEXT to the
  following stage and writes -0 back according to the ``clear`` policy;
* each rank runs publish(t), consume(t), publish(t+1), ... in program order, at
  its own speed.

Why a rank is at most one boundary ahead: its publish of step t+1 follows its
consume of step t, which waited for every rank's step-t publish. So while rank r
consumes stage s, a peer may already be storing stage s+1 into r's mailbox, but
nobody can store stage s+2 (= the stage before s) until r has finished step t.

Clear policies: ``"consumed"`` (the protocol: clear the slots of stage s just
read) and ``"previous"`` (clear stage s-1, the step before; safe too, since no
peer can write it until we finish) are correct; ``"next"`` (clear stage s+1) is
the wrong variant: it wipes a fast peer's step t+1 values, and we then wait
forever for them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from decode_boundary.common.contract import SENTINEL_BITS, STAGE_ACTIVE, STAGE_NEXT, STAGES

NEG_ZERO = np.uint16(SENTINEL_BITS & 0xFFFF)  # "not yet written", as uint16 BF16 bits
VECTOR = 8  # BF16 elements of one 16-byte store
CLEAR_POLICIES = ("consumed", "previous", "next")


def bf16_to_float(bits: np.ndarray) -> np.ndarray:
    """FP32 values of BF16 bit patterns (uint16)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


@dataclass(frozen=True)
class Piece:
    """Part of one 16-byte store, in flight until the scheduler lands it."""

    dst: int
    stage: int
    src: int
    row: int
    col: int
    bits: np.ndarray


class MailboxModel:
    """The mailboxes and stage words of ``tp`` ranks, plus the stores in flight."""

    def __init__(
        self, tp: int, capacity: int, hidden: int, clear: str = "consumed", piece: int = 2
    ) -> None:
        if clear not in CLEAR_POLICIES:
            raise ValueError(f"clear must be one of {CLEAR_POLICIES}, got {clear!r}")
        if tp < 1 or capacity < 1 or hidden < 1 or not 1 <= piece <= VECTOR:
            raise ValueError(
                f"need tp, capacity, hidden >= 1 and 1 <= piece <= {VECTOR}; got "
                f"tp={tp}, capacity={capacity}, hidden={hidden}, piece={piece}"
            )
        self.tp, self.capacity, self.hidden = tp, capacity, hidden
        self.clear, self.piece = clear, piece
        self.mailbox = np.full((tp, STAGES, tp, capacity, hidden), NEG_ZERO, dtype=np.uint16)
        self.stage_state = np.zeros((tp, 2), dtype=np.int64)
        self.in_flight: list[Piece] = []

    def publish(self, rank: int, values: np.ndarray) -> None:
        """Issue rank ``rank``'s stores of BF16 bits ``values`` [M, hidden] into
        stage NEXT of every mailbox (its own included), -0 turned into +0."""
        m = values.shape[0]
        if values.dtype != np.uint16 or values.shape[1:] != (self.hidden,) or m > self.capacity:
            raise ValueError(
                f"values must be uint16 BF16 bits [M <= {self.capacity}, {self.hidden}], "
                f"got {values.dtype} {values.shape}"
            )
        s = int(self.stage_state[rank, STAGE_NEXT])
        bits = np.where(values == NEG_ZERO, np.uint16(0), values)
        for dst in range(self.tp):
            for row in range(m):
                for col in range(0, self.hidden, self.piece):
                    part = bits[row, col : col + self.piece].copy()
                    self.in_flight.append(Piece(dst, s, rank, row, col, part))
        self.stage_state[rank, STAGE_ACTIVE] = s

    def land(self, index: int) -> None:
        """The in-flight piece ``index`` reaches its mailbox."""
        p = self.in_flight.pop(index)
        self.mailbox[p.dst, p.stage, p.src, p.row, p.col : p.col + len(p.bits)] = p.bits

    def ready(self, rank: int, m: int) -> bool:
        """Whether rank ``rank``'s consume of ``m`` rows would stop spinning now:
        every element of its ACTIVE stage's rows ``[:m]`` from every rank is written."""
        s = int(self.stage_state[rank, STAGE_ACTIVE])
        return not bool((self.mailbox[rank, s, :, :m] == NEG_ZERO).any())

    def consume(self, rank: int, m: int) -> np.ndarray | None:
        """One consume attempt: None while not ready (spin), else the FP32 sum
        [m, hidden] of all ranks' values in rank order; advances NEXT and clears."""
        if not self.ready(rank, m):
            return None
        s = int(self.stage_state[rank, STAGE_ACTIVE])
        parts = bf16_to_float(self.mailbox[rank, s, :, :m])
        total = parts[0].copy()
        for part in parts[1:]:
            total += part
        self.stage_state[rank, STAGE_NEXT] = (s + 1) % STAGES
        if self.clear == "consumed":
            self.mailbox[rank, s, :, :m] = NEG_ZERO
        elif self.clear == "previous":
            self.mailbox[rank, (s - 1) % STAGES] = NEG_ZERO
        else:
            self.mailbox[rank, (s + 1) % STAGES] = NEG_ZERO
        return total


@dataclass
class Run:
    """What a simulated schedule produced."""

    results: list[list[np.ndarray]]  # [rank][step]: the consumed sums
    deadlocked: bool  # nothing could move, yet some rank had steps left
    max_lead: int  # largest (publishes of one rank) - (publishes of another)


def simulate(
    inputs: Sequence[Sequence[np.ndarray]],
    choices: Iterable[int],
    clear: str = "consumed",
    capacity: int | None = None,
    piece: int = 2,
) -> Run:
    """Run ``inputs[step][rank]`` (BF16 bits [M_step, hidden]) through the protocol.

    At each point the scheduler picks, by the next value of ``choices`` modulo the
    number of enabled actions, one of: a rank's publish (in program order), the
    landing of one in-flight piece, or a consume that is ready (a consume that
    would spin changes nothing, so it is never an action). When ``choices`` runs
    out the first enabled action is taken. Stops when nothing is enabled.
    """
    steps = len(inputs)
    tp = len(inputs[0])
    hidden = inputs[0][0].shape[1]
    rows = [step[0].shape[0] for step in inputs]
    model = MailboxModel(tp, capacity or max(rows), hidden, clear, piece)
    done = [0] * tp  # steps finished (consumed) per rank
    published = [0] * tp
    results: list[list[np.ndarray]] = [[] for _ in range(tp)]
    choices = iter(choices)
    max_lead = 0
    while True:
        actions = [("publish", r) for r in range(tp) if published[r] == done[r] < steps]
        actions += [
            ("consume", r)
            for r in range(tp)
            if published[r] == done[r] + 1 and model.ready(r, rows[done[r]])
        ]
        actions += [("land", i) for i in range(len(model.in_flight))]
        if not actions:
            break
        kind, who = actions[next(choices, 0) % len(actions)]
        if kind == "publish":
            model.publish(who, inputs[published[who]][who])
            published[who] += 1
            max_lead = max(max_lead, max(published) - min(published))
        elif kind == "consume":
            results[who].append(model.consume(who, rows[done[who]]))
            done[who] += 1
        else:
            model.land(who)
    return Run(results, deadlocked=min(done) < steps, max_lead=max_lead)
