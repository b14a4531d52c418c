"""Run rank processes of which some are meant to die (``os._exit``), and collect
what the survivors report, bounded: for the dead-peer tests."""

from __future__ import annotations

import contextlib
import queue
import time

import torch.multiprocessing as mp


def run_ranks(target, world: int, args: tuple, reports: int, timeout_s: float):
    """Start ``target(rank, *args, results)`` for every rank (spawned), wait for
    ``reports`` (rank, report) items on the queue or ``timeout_s``, then kill
    what is still alive. Returns ({rank: report}, the processes)."""
    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    procs = [spawn.Process(target=target, args=(r, *args, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < reports and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                rank, out = results.get(timeout=0.5)
                got[rank] = out
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    return got, procs
