"""Liveness marks: how a rank waiting on a peer tells a dead peer from a slow one
(docs/FAILURES.md §4).

A barrier that only counts arrivals cannot tell a rank that is still compiling
from one that died, so the host waits of :mod:`.host_wait` would sit out their
whole bound (900 s at a compile barrier) before naming a dead rank. So every
process that holds a ``BoundaryAllReduce`` on a multi-process group runs one
*heartbeat* per group (:func:`hold`): a daemon thread that rewrites this rank's
mark in the rendezvous store every ``HEARTBEAT_S`` (``"<pid>:<counter>"``), and
writes ``"closed"`` once the last holder on that group released it (``close()``,
the instance collected, or interpreter exit).

A waiting rank judges the marks of the peers it still waits for with a
:class:`PeerWatch`, by its *own* clock (no wall clocks compared across hosts):
it notes when it last saw a peer's mark change, and names the peer gone when the
mark stayed unchanged for longer than the liveness bound or reads ``"closed"``.
A peer with no mark (it never held a heartbeat: not constructed yet, or an older
version) gets no verdict: the wait's own bound applies, as before.

Why a thread is enough: the mark only stops while the whole process is gone,
frozen, or its main thread holds the GIL without releasing it for the whole
bound. Triton's compiler, torch's kernels and device syncs release the GIL
(a ticking thread keeps ticking through a Triton compile), so a rank that is
alive and compiling keeps its mark fresh and is waited for up to the long bound.

The heartbeat uses its own store client (``Store.clone()``: a store client object
is not safe for concurrent use from two threads), never touches the device, and
costs nothing on the step: marks are only read inside host waits that found a
peer missing (barriers, every ``CHECK_S``) or a collective still running after
``CHECK_S`` (:func:`.host_wait.wait_work`).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import math
import os
import threading
import time
import weakref

from ..env import logger

HEARTBEAT_S = 1.0  # how often a heartbeat rewrites its mark
CHECK_S = 1.0  # how often a waiting rank reads its pending peers' marks
LIVENESS_TIMEOUT_S = 5.0  # default bound: a mark unchanged this long means a dead peer
LIVENESS_ENV = "DECODE_BOUNDARY_LIVENESS_TIMEOUT_S"
CLOSED = "closed"
_STOP_JOIN_S = 0.5  # at interpreter exit: how long to let each heartbeat write "closed"


def mark_key(group_name: str, rank: int) -> str:
    return f"decode_boundary/{group_name}/alive/{rank}"


def bound(value: float | None = None) -> float:
    """The liveness bound in seconds: ``value`` (an instance's
    ``liveness_timeout_s``), else ``$DECODE_BOUNDARY_LIVENESS_TIMEOUT_S``, else
    ``LIVENESS_TIMEOUT_S``. At least twice ``HEARTBEAT_S`` (a shorter bound would
    name live peers between two beats); ``inf`` turns the verdicts off."""
    name = "liveness_timeout_s"
    if value is None:
        raw = os.environ.get(LIVENESS_ENV)
        if raw is None or raw == "":
            return LIVENESS_TIMEOUT_S
        name = f"environment variable {LIVENESS_ENV}"
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r}: expected a number of seconds") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) \
            or value < 2 * HEARTBEAT_S:
        raise ValueError(f"{name} must be a number of seconds >= {2 * HEARTBEAT_S:g} (twice the "
                         f"heartbeat period) or inf, got {value!r}")
    return float(value)


# -- the heartbeat (writer side) ----------------------------------------------------------


class _Heartbeat:
    """One daemon thread rewriting this rank's mark of one group."""

    _values = itertools.count()  # process-wide: a restarted heartbeat never repeats a value

    def __init__(self, store, key: str, group) -> None:
        self.group = weakref.ref(group)
        self.holders = 0
        self._store, self._key = store, key
        self._stop = threading.Event()
        self._store.set(key, self._value())  # marked before this rank waits on anyone
        self._thread = threading.Thread(target=self._run, name=f"decode_boundary-alive-{key}",
                                        daemon=True)
        self._thread.start()

    def _value(self) -> str:
        return f"{os.getpid()}:{next(self._values)}"

    def _run(self) -> None:
        warned = False
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._store.set(self._key, self._value())
            except Exception as error:  # noqa: BLE001 - keep trying: a store blip is no death
                if not warned:
                    logger.warning("liveness mark %s could not be written: %s", self._key, error)
                    warned = True
        # The store may be gone at exit: a stale mark then says the same.
        with contextlib.suppress(Exception):
            self._store.set(self._key, CLOSED)

    def stopped(self) -> bool:
        return self._stop.is_set()

    def running(self) -> bool:
        """The thread has not ended (it may still write "closed")."""
        return self._thread.is_alive()

    def stop(self, join_s: float = 0.0) -> None:
        """Stop beating (the thread writes ``"closed"`` and ends within moments)."""
        self._stop.set()
        if join_s > 0:
            self._thread.join(join_s)


_BEATS: dict[str, _Heartbeat] = {}
# Every heartbeat started, until the exit joins it: weakref.finalize's own exit
# hook runs before ours (registered later) and may release the last hold, taking
# the beat out of _BEATS without waiting for its "closed".
_STARTED: list[_Heartbeat] = []
# Reentrant: a holder collected while this thread holds the lock (a garbage
# collection inside hold()) releases its share from within.
_LOCK = threading.RLock()


class Hold:
    """A holder's share of its process's heartbeat on a group; :meth:`release`
    once (further calls do nothing). Released also when the holder is collected
    and at interpreter exit."""

    def __init__(self, name: str, beat: _Heartbeat) -> None:
        self._name, self._beat = name, beat
        self._held = True

    def release(self) -> None:
        with _LOCK:
            if not self._held:
                return
            self._held = False
            beat = self._beat
            beat.holders -= 1
            if beat.holders == 0:
                beat.stop()
                if _BEATS.get(self._name) is beat:
                    del _BEATS[self._name]


def hold(group, store, rank: int, owner) -> Hold | None:
    """Join (or start) this process's heartbeat on ``group``, as rank ``rank``
    of it, on a clone of the rendezvous ``store``; ``owner`` (the all-reduce)
    releases its hold when collected. None where the store cannot be cloned
    (the waits then fall back to their own bounds)."""
    name = group.group_name
    with _LOCK:
        beat = _BEATS.get(name)
        if beat is not None and beat.group() is not group:
            beat.stop()  # a destroyed group's name reused by a new group: start afresh
            beat = None
        if beat is not None and beat.stopped():
            beat = None  # released from within (see _LOCK) just now
        if beat is None:
            key = mark_key(name, rank)
            for old in _STARTED:  # a stopped beat of this key writes "closed" as it ends:
                if old._key == key and old.running():  # let it, before the new first mark
                    old.stop(_STOP_JOIN_S)
            try:
                beat = _Heartbeat(store.clone(), key, group)
            except Exception as error:  # noqa: BLE001 - liveness is a refinement, never a refusal
                logger.warning("no liveness heartbeat on group %s (the waits keep their own "
                               "bounds): %s", name, error)
                return None
            _BEATS[name] = beat
            _STARTED[:] = [b for b in _STARTED if b.running()] + [beat]
        beat.holders += 1
        share = Hold(name, beat)
    weakref.finalize(owner, share.release)
    return share


def _stop_all() -> None:
    """At interpreter exit: stop every heartbeat and let each write "closed"."""
    with _LOCK:
        beats = list(_STARTED)
        _STARTED.clear()
        _BEATS.clear()
    for beat in beats:
        beat.stop(_STOP_JOIN_S)


def _forget_in_child() -> None:
    """A forked child has no heartbeat threads: it holds none."""
    global _LOCK
    _LOCK = threading.RLock()
    _BEATS.clear()
    _STARTED.clear()


atexit.register(_stop_all)
os.register_at_fork(after_in_child=_forget_in_child)


# -- the verdicts (waiter side) -----------------------------------------------------------


class PeerWatch:
    """What one waiting rank has seen of its peers' marks during one wait.

    ``closed_is_gone``: a ``"closed"`` mark names the peer at once (it left
    every all-reduce on the group, so it never reaches this wait); False for
    the construction barrier, which a peer that closed its last all-reduce
    reaches again by constructing the next one."""

    def __init__(self, group_name: str, store, bound_s: float, closed_is_gone: bool = True):
        self._name, self._store, self._bound = group_name, store, bound_s
        self._closed_is_gone = closed_is_gone
        self._seen: dict[int, tuple[bytes, float]] = {}  # rank -> (mark, when it last changed)
        self._next = time.monotonic()

    def gone(self, ranks: list[int]) -> dict[int, str]:
        """The ranks among ``ranks`` judged gone, with why (empty: none, or not
        time to look yet). Store errors propagate (the caller names them)."""
        now = time.monotonic()
        if now < self._next or math.isinf(self._bound):
            return {}
        self._next = now + CHECK_S
        verdicts = {}
        for rank in ranks:
            key = mark_key(self._name, rank)
            if not self._store.check([key]):
                continue  # never held a heartbeat: no verdict
            mark = self._store.get(key)
            if mark == CLOSED.encode():
                if self._closed_is_gone:
                    verdicts[rank] = "it has closed (it released its last all-reduce on this " \
                                     "group, or its process exited)"
                continue
            seen = self._seen.get(rank)
            if seen is None or seen[0] != mark:
                self._seen[rank] = (mark, now)
            elif now - seen[1] > self._bound:
                verdicts[rank] = (f"its liveness mark went stale: unchanged for "
                                  f"{now - seen[1]:.1f} s, bound {self._bound:g} s; its process "
                                  "is dead or frozen")
        return verdicts
