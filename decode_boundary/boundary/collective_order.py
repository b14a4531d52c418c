"""Which host collective each rank waits in: the guard that turns ranks waiting
in different collectives of a group into a ``RuntimeError`` within seconds on
every rank, instead of waits that run to their bounds (docs/FAILURES.md §4).

Every host wait of :mod:`.host_wait` has a :class:`Position`: its purpose (the
tag: ``construct``, ``compile``, ``gather``, ``reset-a``, ``reset-b``,
``close``) and its number among the waits of that purpose on the group in this
epoch. Every rank takes the same positions in the same order; that is what the
barriers' keys pair on and what a gloo all-gather pairs by. A rank that has
waited ``QUIET_S`` writes its position under its own key of the rendezvous
store (so a wait that ends sooner, a step's usual all-gather, costs no store
access) and clears it when it leaves; while it waits, it reads the positions
of the peers it waits for every ``CHECK_S``:

* a peer waiting at another position for ``GRACE_S`` while this rank waits at
  its own: neither can pass. (Ranks at neighbouring positions for a moment,
  one already past a barrier that the other has not yet seen complete, part
  within one poll of a few milliseconds, far inside ``GRACE_S``.)
  :class:`CollectiveMismatch` names every rank and where it waits, and this
  rank's key then says so, so each peer raises at its next read without
  waiting out ``GRACE_S`` itself;
* a peer whose key says it raised such an error (it keeps saying so until the
  reset): the same error, at once;
* a peer that is not waiting (computing, compiling, between calls): no verdict,
  however long (its liveness mark and the wait's own bound judge it).

The waits of ``reset(collective=True)`` write their position but never raise
for a mismatch: reset is the cure, and a peer waiting elsewhere raises there
and then comes to the reset. Keys live under the epoch's prefix (a completed
reset starts a new epoch, and with it new keys).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

QUIET_S = 0.25  # a wait writes its position only once it has waited this long
CHECK_S = 0.25  # how often a waiting rank reads its peers' positions
# How long two ranks must be seen waiting at different positions before they are
# judged to be in different collectives: far above a poll (milliseconds), so a
# peer that is one position ahead or behind for a moment is never taken for one.
GRACE_S = 2.0
_LEFT, _WAITING, _RAISED = "-", "w", "!"
_IDLE = "no host collective yet (busy, or between calls)"
ADVICE = ("Every rank must make the same calls of the all-reduce (steps, precompile, reset, "
          "close) in the same order. Call reset(collective=True) on every rank (it waits, "
          "bounded, for an all-gather left pending); if every rank did make the same calls, "
          "this is a bug of decode_boundary: report it with this message")


class CollectiveMismatch(RuntimeError):
    """The ranks of a group wait in different host collectives (module docstring)."""


@dataclass(frozen=True)
class Position:
    """A host wait: ``tag`` (its purpose), ``seq`` (its number among the
    waits of ``tag`` in ``epoch``), ``what`` (its name in errors);
    ``raises``: False for the waits of reset, which never raise a mismatch."""

    tag: str
    seq: int
    epoch: int
    what: str
    raises: bool = True

    def describe(self) -> str:
        return f"{self.what} ({self.tag} #{self.seq} of epoch {self.epoch})"


def position_key(prefix: str, rank: int) -> str:
    """The store key of ``rank``'s position under the epoch's ``prefix``."""
    return f"{prefix}/at/{rank}"


class PositionWatch:
    """This rank's position during one wait, and what it saw of its peers'
    (module docstring). ``store``: the rendezvous store; ``prefix``: the
    epoch's key prefix. Store errors propagate (the caller names them)."""

    def __init__(self, store, prefix: str, me: int, position: Position) -> None:
        self._store, self._prefix, self._me = store, prefix, me
        self.position = position
        self._next = time.monotonic() + QUIET_S
        self._written = False  # this wait's position is in the store
        self._seen: dict[int, tuple[bytes, float]] = {}  # rank -> (its key, since when)

    @property
    def written(self) -> bool:
        return self._written

    def check(self, peers: list[int], now_too: bool = False) -> None:
        """Every ``CHECK_S`` once this wait is ``QUIET_S`` old (``now_too``: also
        now, once written: the wait just ended, maybe by a peer's abort after it
        raised): write this rank's position, read ``peers``' and raise
        :class:`CollectiveMismatch` where the module docstring says."""
        now = time.monotonic()
        if now < self._next and not (now_too and self._written):
            return
        self._next = now + CHECK_S
        mine = [self.position.tag, self.position.seq]
        if not self._written and not self._raised_before():
            self._write(_WAITING + json.dumps([*mine, self.position.describe()]))
        seen, raised, waiting, apart = {}, {}, {}, False
        for rank in peers:
            key = position_key(self._prefix, rank)
            value = self._store.get(key) if self._store.check([key]) else _LEFT.encode()
            state, body = value[:1].decode(), value[1:]
            if state == _RAISED:
                raised[rank] = json.loads(body)
            elif state == _WAITING:
                tag, seq, waiting[rank] = json.loads(body)
                if [tag, seq] == mine:
                    continue
                first = self._seen.get(rank)
                since = first[1] if first is not None and first[0] == value else now
                seen[rank] = (value, since)
                apart = apart or now - since >= GRACE_S
        self._seen = seen
        if self.position.raises and (raised or apart):
            idle = {r: _IDLE for r in peers if r not in raised and r not in waiting}
            self._raise(raised, {**idle, **waiting})

    def leave(self) -> None:
        """This rank left the wait: its position, if written, is cleared."""
        if self._written:
            self._write(_LEFT)

    def _raise(self, raised: dict[int, dict], peers: dict[int, str]) -> None:
        """Raise, naming where this rank and each of ``peers`` waits (merged
        with what the peers that ``raised`` saw), and say so in the store."""
        where: dict[int, str] = {}
        for listing in raised.values():
            where.update({int(r): w for r, w in listing.items()})
        for rank, what in peers.items():  # what this rank saw itself, unless it saw less
            if what != _IDLE or rank not in where:
                where[rank] = what
        where[self._me] = self.position.describe()
        self._write(_RAISED + json.dumps(where))
        self._written = False
        found = f" (found by rank(s) {sorted(raised)})" if raised else ""
        listing = "; ".join(f"rank {r} in {w}" for r, w in sorted(where.items()))
        raise CollectiveMismatch(
            f"decode_boundary rank {self._me}: the ranks wait in different host collectives "
            f"of BoundaryAllReduce and none can pass{found}: {listing}. {ADVICE}")

    def _raised_before(self) -> bool:
        """This rank raised a mismatch earlier in this epoch: its key keeps
        saying so (a peer that has not read it yet would otherwise find this
        rank at its next wait, e.g. the reset's, and raise only ``GRACE_S``
        later, naming that wait)."""
        key = position_key(self._prefix, self._me)
        return self._store.check([key]) and self._store.get(key)[:1].decode() == _RAISED

    def _write(self, value: str) -> None:
        self._store.set(position_key(self._prefix, self._me), value)
        self._written = True
