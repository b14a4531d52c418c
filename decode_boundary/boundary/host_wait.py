"""Bounded host waits of ``BoundaryAllReduce`` (docs/FAILURES.md): every call
that blocks the host on a peer gives up after a timeout and raises
``RuntimeError`` naming the ranks that did not arrive.

* :func:`barrier`: a barrier over the rendezvous store of ``torch.distributed``
  (the default store: a ``TCPStore`` under torchrun or ``tcp://``), not over
  the group's communicator. Each rank sets its key, then polls for everyone's
  until the timeout, so the ranks still missing can be named. Keys are tagged
  by purpose (``construct``, ``compile``, ``reset-a``, ``reset-b``, ``close``,
  ``presence``) and numbered per tag
  within an *epoch* (advanced by every completed collective reset,
  :func:`next_epoch`): barriers of different purposes never pair with each
  other (a rank in ``reset()`` is never taken for one in a compile barrier),
  and a rank that left a barrier out because it aborted its step is back in
  step after the reset. A rank that signalled an abort (:func:`signal_abort`)
  counts as arrived where the caller allows it (compile barriers: an aborting
  rank compiles nothing and publishes its poison instead); the barrier says
  which ranks it counted so (:class:`Met`). A key may carry a value that every
  rank reads once all arrived (``share``: what ``reset`` agrees on).
* :func:`wait_work`: a collective's ``Work`` waited with a timeout (the
  gather transport on CPU / gloo); after a failure (gloo reports a dead peer
  at once: "Connection closed by peer") or a timeout, a presence check over
  the store names the ranks that are gone.
* :func:`sync_device`: a device synchronize that gives up after the timeout
  (in a helper thread: a GPU stuck in a collective cannot be interrupted).

Dead or slow (:mod:`.liveness`): the barriers and :func:`wait_work` also read
the liveness marks of the peers they still wait for (every ``CHECK_S``) and
name a peer whose mark went stale beyond the liveness bound (``liveness_s``;
None: the environment's or the default), or reads "closed", at once, with the
same ``RuntimeError`` wording; a peer whose mark stays fresh (alive, e.g. still
compiling) is waited for up to the wait's own bound. :func:`start_heartbeat`
starts this process's mark on a group.

The order (:mod:`.collective_order`): every wait but the presence check has a
position (its tag and its number, :func:`number`), written to the store once it
has waited a moment; ranks found waiting at different positions raise
``CollectiveMismatch`` (a ``RuntimeError``) within seconds, on every rank,
instead of waiting out their bounds. The gather transport's all-gathers are
numbered too (tag ``gather``), though only those over gloo wait on the host.

Group state (epoch, per-tag sequence numbers) is per process group name and
shared by every all-reduce on that group: collective calls happen in the same
order on every rank, which is what keeps the numbers equal.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..env import logger
from . import liveness
from .collective_order import CollectiveMismatch, Position, PositionWatch, position_key

POLL_MIN_S, POLL_MAX_S = 0.0005, 0.02  # store polling: back off from 0.5 ms to 20 ms
# A collective's completion is polled from WORK_POLL_MIN_S up (doubling to POLL_MAX_S):
# a step's all-gather over gloo then costs at most about twice its own time.
WORK_POLL_MIN_S = 2e-5
# The waits of reset(collective=True): they never raise a mismatch (reset is its cure).
RESET_TAGS = ("reset-a", "reset-b")


@dataclass
class _GroupState:
    epoch: int = 0
    seq: dict = field(default_factory=dict)
    last_key: str | None = None  # this rank's key of its last passed barrier
    abort_key: str | None = None  # this rank's abort key in the current epoch


_STATE: dict[str, _GroupState] = {}


def _state(group) -> _GroupState:
    return _STATE.setdefault(group.group_name, _GroupState())


def number(group, tag: str) -> int:
    """The next number of a ``tag`` wait on ``group`` in this epoch (every rank
    takes the numbers of a tag in the same order: its collectives')."""
    state = _state(group)
    seq = state.seq.get(tag, 0)
    state.seq[tag] = seq + 1
    return seq


def _prefix(group, epoch: int) -> str:
    return f"decode_boundary/{group.group_name}/e{epoch}"


def _watch(group, store, me: int, tag: str, seq: int, what: str,
           raises: bool = True) -> PositionWatch:
    epoch = _state(group).epoch
    return PositionWatch(store, _prefix(group, epoch), me,
                         Position(tag, seq, epoch, what, raises and tag not in RESET_TAGS))


class Met(NamedTuple):
    """A passed barrier: ``by_abort``, the ranks counted as arrived by their
    abort (they never reached it); ``shared``, with ``share``, every rank's
    value (None for a rank counted by its abort)."""

    by_abort: list[int]
    shared: dict[int, str | None]


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception as error:  # noqa: BLE001 - say what is missing
        raise RuntimeError("decode_boundary: bounded host waits need the rendezvous store of "
                           "torch.distributed (init_process_group first)") from error


def _me(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _store_error(me: int, what: str, error: Exception) -> RuntimeError:
    return RuntimeError(
        f"decode_boundary rank {me}: {what}: the rendezvous store is unreachable ({error}); "
        "the process hosting it (usually global rank 0, or torchrun's agent) has died")


def start_heartbeat(group, owner) -> liveness.Hold | None:
    """Start (or join) this process's liveness mark on ``group`` for ``owner``
    (release the returned hold when ``owner`` closes; :mod:`.liveness`)."""
    return liveness.hold(group, _store(), _me(group)[0], owner)


def _arrivals(group, tag: str, timeout_s: float, what: str, aborts_arrive: bool,
              liveness_s: float | None = None, share: str | None = None
              ) -> tuple[list[int], dict[int, str], Met]:
    """Set this rank's key of the next ``tag`` barrier (to ``share``), poll for
    the others' until ``timeout_s`` or until a pending peer is judged gone by
    its liveness mark (bound ``liveness_s``); returns the ranks still missing
    (empty: all arrived), those judged gone, with why, and what was met. Ranks
    waiting elsewhere raise ``CollectiveMismatch`` (module docstring; not the
    presence check, which follows a failed collective)."""
    me, ranks = _me(group)
    state = _state(group)
    seq = number(group, tag)
    base = f"{_prefix(group, state.epoch)}/{tag}{seq}/"
    abort_base = f"{_prefix(group, state.epoch)}/abort/"
    store = _store()
    # A peer that closed its last all-reduce comes back to a construction barrier
    # by constructing the next one: there "closed" is no verdict.
    watch = liveness.PeerWatch(group.group_name, store, liveness.bound(liveness_s),
                               closed_is_gone=tag != "construct")
    order = None if tag == "presence" else _watch(group, store, me, tag, seq, what)
    gone: dict[int, str] = {}
    by_abort: list[int] = []
    try:
        store.set(base + str(me), "1" if share is None else share)
        pending = [r for r in range(ranks) if r != me]
        deadline = time.monotonic() + timeout_s
        delay = POLL_MIN_S
        while True:
            pending = [r for r in pending if not store.check([base + str(r)])]
            if pending and aborts_arrive:
                aborted = [r for r in pending if store.check([abort_base + str(r)])]
                # A rank that passed this barrier before it aborted had set its key
                # first: look again, so such a rank is never counted by its abort.
                aborted = [r for r in aborted if not store.check([base + str(r)])]
                by_abort += aborted
                pending = [r for r in pending if r not in aborted]
            if not pending or time.monotonic() >= deadline:
                break
            gone = watch.gone(pending)
            if gone:
                break
            if order is not None:
                order.check(pending)
            time.sleep(delay)
            delay = min(2 * delay, POLL_MAX_S)
        if order is not None:
            order.leave()
        shared: dict[int, str | None] = {}
        if not pending:
            if share is not None:
                shared = {r: None if r in by_abort else
                          share if r == me else store.get(base + str(r)).decode()
                          for r in range(ranks)}
            # Everyone has passed this barrier, hence my previous one: its key can go.
            if state.last_key is not None:
                store.delete_key(state.last_key)
            state.last_key = base + str(me)
    except CollectiveMismatch:
        raise
    except RuntimeError as error:
        raise _store_error(me, what, error) from error
    return pending, gone, Met(sorted(by_abort), shared)


def _gone_text(gone: dict[int, str]) -> str:
    return "; ".join(f"rank {r}: {why}" for r, why in sorted(gone.items()))


def barrier(group, timeout_s: float, tag: str, what: str, aborts_arrive: bool = False,
            liveness_s: float | None = None, share: str | None = None) -> Met:
    """Every rank of ``group`` reaches this ``tag`` barrier within ``timeout_s``
    seconds, or ``RuntimeError`` naming the ranks that did not (module
    docstring): at once for a rank judged gone by its liveness mark (bound
    ``liveness_s``); ``CollectiveMismatch`` within seconds where the ranks wait
    in different collectives. ``aborts_arrive``: a rank that signalled an abort
    in this epoch counts as arrived. ``share``: this rank's value, read by
    every rank once all arrived (:class:`Met`)."""
    missing, gone, met = _arrivals(group, tag, timeout_s, what, aborts_arrive, liveness_s,
                                   share)
    me, _ = _me(group)
    if gone:
        alive = [r for r in missing if r not in gone]
        raise RuntimeError(
            f"decode_boundary rank {me}: rank(s) {sorted(gone)} did not reach {what} "
            f"({_gone_text(gone)}; named before the {timeout_s:g} s bound"
            + (f"; rank(s) {alive} alive but not there yet" if alive else "")
            + "); nothing was changed on this rank. The group cannot continue: recreate it")
    if missing:
        raise RuntimeError(
            f"decode_boundary rank {me}: rank(s) {missing} did not reach {what} within "
            f"{timeout_s:g} s (dead, hung, or still busy in an earlier call); nothing was "
            "changed on this rank. If they are dead, the group cannot continue: recreate it")
    return met


def signal_abort(group, why: str) -> None:
    """Record in the store that this rank aborted its step (compile barriers of
    this epoch then count it as arrived). Best effort: the device poison is
    the abort's real channel."""
    me, _ = _me(group)
    state = _state(group)
    key = f"{_prefix(group, state.epoch)}/abort/{me}"
    try:
        _store().set(key, why[:200])
        state.abort_key = key
    except Exception as error:  # noqa: BLE001 - the poison still tells the peers
        logger.warning("rank %d: could not record the abort in the store: %s", me, error)


def next_epoch(group) -> None:
    """After a completed collective reset (every rank calls it there): a new
    epoch, every tag's sequence back to 0, this rank's abort key and position
    gone."""
    state = _state(group)
    me, _ = _me(group)
    stale = [position_key(_prefix(group, state.epoch), me)]
    if state.abort_key is not None:
        stale.append(state.abort_key)
    for key in stale:
        with contextlib.suppress(Exception):  # a stale key of an old epoch is never read
            _store().delete_key(key)
    state.epoch += 1
    state.seq.clear()
    state.abort_key = None


def wait_work(work, group, timeout_s: float, what: str, seq: int,
              liveness_s: float | None = None, in_reset: bool = False) -> None:
    """Wait for a collective's ``work``, the all-gather number ``seq`` of the
    epoch (:func:`number`, tag ``gather``), at most ``timeout_s`` seconds; on
    a failure or timeout, name the ranks that do not reach a presence check
    within ``timeout_s`` either (the survivors all get there), and raise
    ``RuntimeError``. A wait longer than ``liveness.CHECK_S`` also reads the
    peers' liveness marks and raises at once for one judged gone (bound
    ``liveness_s``); so does the presence check. The group is then unusable
    (its collective sequence is broken): recreate it. A wait that finds the
    ranks in different collectives raises ``CollectiveMismatch`` within
    seconds with ``work`` still pending (the caller keeps it for the reset to
    wait for; ``in_reset``: that wait, which never raises a mismatch).

    Polled (``is_completed``, backing off to ``POLL_MAX_S``) rather than waited
    with a timeout: an expired timed wait aborts an NCCL communicator, and the
    marks are read between polls. A step's usual wait reads no mark and
    writes no position."""
    me, ranks = _me(group)
    peers = [r for r in range(ranks) if r != me]
    start = time.monotonic()
    watch, gone, missing, failure = None, {}, None, None
    order = None
    delay = WORK_POLL_MIN_S
    while not work.is_completed():
        now = time.monotonic()
        if now - start >= timeout_s:
            failure = f"not completed within {timeout_s:g} s"
            break
        try:
            if order is None:
                order = _watch(group, _store(), me, "gather", seq, what, not in_reset)
            order.check(peers)
            if now - start >= liveness.CHECK_S:  # still running: is a peer gone?
                if watch is None:
                    watch = liveness.PeerWatch(group.group_name, _store(),
                                               liveness.bound(liveness_s))
                gone = watch.gone(peers)
        except CollectiveMismatch:
            raise
        except RuntimeError as error:
            raise _store_error(me, what, error) from None
        if gone:
            failure = "the collective was still running"
            break
        time.sleep(delay)
        delay = min(2 * delay, POLL_MAX_S)
    if order is not None and order.written:
        try:
            if failure is None:  # completed: by the abort of a peer that found a mismatch?
                order.check(peers, now_too=True)
            order.leave()
        except CollectiveMismatch:
            raise
        except RuntimeError as error:
            raise _store_error(me, what, error) from None
    if failure is None:
        try:
            work.wait()  # completed: returns at once, or raises its failure
            return
        except Exception as error:  # noqa: BLE001 - gloo raises RuntimeError, others may differ
            failure = error  # gloo: "Connection closed by peer"
    if not gone:
        try:
            missing, gone, _ = _arrivals(group, "presence", timeout_s, what, False, liveness_s)
        except RuntimeError as error:
            failure = f"{failure}; {error}"
    if gone:
        who = f"rank(s) {sorted(gone)} dead ({_gone_text(gone)})"
    else:
        who = f"rank(s) {missing} dead or hung" if missing else "a peer dead or hung"
    raise RuntimeError(
        f"decode_boundary rank {me}: {what} failed or timed out (bound {timeout_s:g} s): "
        f"{who} ({failure}). The group cannot continue: recreate it") from None


def sync_device(device: torch.device, timeout_s: float, what: str) -> None:
    """``torch.cuda.synchronize(device)`` that raises ``RuntimeError`` after
    ``timeout_s`` seconds instead of blocking (the helper thread it runs in
    stays blocked behind the stuck work). Nothing to do off CUDA."""
    if device.type != "cuda":
        return
    done, errors = threading.Event(), []

    def run() -> None:
        try:
            torch.cuda.synchronize(device)
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller
            errors.append(error)
        finally:
            done.set()

    threading.Thread(target=run, name="decode_boundary-sync", daemon=True).start()
    if not done.wait(timeout_s):
        raise RuntimeError(
            f"decode_boundary: {what}: this rank's GPU work did not finish within {timeout_s:g} s "
            "(a collective waiting for a dead peer?)")
    if errors:
        raise errors[0]
