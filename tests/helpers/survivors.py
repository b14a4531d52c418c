"""Run rank processes of which some are meant to die (``os._exit``), and collect
what the survivors report, bounded: for the dead-peer tests."""

from __future__ import annotations

import contextlib
import os
import queue
import time
import traceback
import warnings

import torch.multiprocessing as mp

from decode_boundary.bench.launch import stop_processes


def start_ranks(target, world: int, args: tuple) -> tuple[list, object]:
    """Spawn ``target(rank, *args, results)`` for every rank (daemon
    processes); returns them and the ``results`` queue."""
    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    procs = [spawn.Process(target=target, args=(r, *args, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    return procs, results


def run_ranks(target, world: int, args: tuple, reports: int, timeout_s: float,
              exit_s: float = 0.0):
    """Start ``target(rank, *args, results)`` for every rank (spawned), wait for
    ``reports`` (rank, report) items on the queue or ``timeout_s``, give the
    processes ``exit_s`` to exit on their own, then kill what is still alive.
    Returns ({rank: report}, the processes)."""
    procs, results = start_ranks(target, world, args)
    got = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < reports and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                rank, out = results.get(timeout=0.5)
                got[rank] = out
    finally:
        stop_processes(procs, exit_s, term_s=0)  # a frozen (SIGSTOP) rank ignores SIGTERM
    return got, procs


def timed_error(call) -> tuple[str, float]:
    """(the RuntimeError ``call()`` raised, as text, or "no error"; seconds it took)."""
    start = time.monotonic()
    try:
        call()
        message = "no error"
    except RuntimeError as e:
        message = str(e)
    return message, time.monotonic() - start


def report_and_exit(rank: int, results, body, linger_s: float = 0.0) -> None:
    """The end of a rank process: put ``(rank, body())`` (or the traceback of
    what it raised) on ``results``, flush the queue, on rank 0 stay ``linger_s``
    more (it hosts the store that the other survivors may still poll), then
    ``os._exit(0)``: no teardown of a group with a dead member."""
    warnings.filterwarnings("ignore")
    try:
        results.put((rank, body()))
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((rank, traceback.format_exc()))
    results.close()
    results.join_thread()
    if rank == 0:
        time.sleep(linger_s)
    os._exit(0)
