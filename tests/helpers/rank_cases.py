"""Run several cases in one set of rank processes, each case bounded: for the
recovery tests, whose cases would each cost a spawn (seconds of imports) if
they had processes of their own, and any of which may hang."""

from __future__ import annotations

import contextlib
import os
import queue
import time
import traceback
import warnings

from survivors import start_ranks

from decode_boundary.bench.launch import stop_processes

START_S = 60.0  # spawning, importing and joining the group: before the first case's bound
READY = "ready"  # what a rank reports first (its group joined), before its first case


def run_cases(target, world: int, args: tuple, cases: list[str],
              case_timeout_s: float) -> dict[str, dict[int, object]]:
    """Start ``target(rank, *args, results)`` for every rank (spawned): it
    joins its group, then runs ``cases`` in order and puts ``(rank, case,
    report)`` after each (:func:`report_cases`). Returns {case: {rank:
    report}}; ``AssertionError`` naming the case (and what had come) if any
    rank's report of a case is not there ``case_timeout_s`` after the
    previous case's last report (the first: after every rank reported
    ``READY``, within ``START_S``). The processes are killed either way."""
    procs, results = start_ranks(target, world, args)
    cases = [READY, *cases]
    got: dict[str, dict[int, object]] = {case: {} for case in cases}
    deadline = time.monotonic() + START_S
    done = 0  # cases every rank reported
    try:
        while done < len(cases):
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"case {cases[done]!r} did not end on every rank within {case_timeout_s:g} s "
                    f"(a hang?): reports {got[cases[done]]}; the cases before it "
                    f"{ {c: got[c] for c in cases[max(0, done - 3):done]} }")
            with contextlib.suppress(queue.Empty):
                rank, case, report = results.get(timeout=0.2)
                got[case][rank] = report
            while done < len(cases) and len(got[cases[done]]) == world:
                done += 1
                deadline = time.monotonic() + case_timeout_s
    finally:
        stop_processes(procs, 0.0, term_s=0)
    del got[READY]
    return got


def report_cases(rank: int, results, cases) -> None:
    """The body of a rank process of :func:`run_cases`, once it joined its
    group: put ``READY``, then for each ``(name, call)`` of ``cases`` (an
    iterable, so later cases may follow from earlier ones) put ``(rank, name,
    call())``, or the traceback of what it raised; then flush the queue and
    ``os._exit(0)`` (no teardown of the group)."""
    warnings.filterwarnings("ignore")
    results.put((rank, READY, None))
    for name, call in cases:
        try:
            report = call()
        except BaseException:  # noqa: BLE001 - the parent reports it
            report = traceback.format_exc()
        results.put((rank, name, report))
    results.close()
    results.join_thread()
    os._exit(0)
