"""Run a function once per rank: one process per GPU started here, or the
processes of a ``torchrun`` world.

* ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set): this process is one rank; it
  joins the world from the environment and runs the function itself.
* ``world_size == 1``: the function runs in this process without a group.
* otherwise: ``world_size`` children are spawned (``spawn``, never ``fork``:
  CUDA may already be initialised here), rendezvous over TCP on 127.0.0.1 with
  a free port, and send their result or their traceback back through a queue.

Every process runs with NVLink multicast off: :func:`decode_boundary.env.disable_multicast`
is applied in the parent before anything is spawned or joined (children inherit
the environment) and again in every rank process before ``init_process_group``,
so each group's NCCL communicator is created with ``NCCL_NVLS_ENABLE=0``.

Nothing can hang: the parent waits at most ``timeout_s`` for all ranks; the
first rank that fails (exception or non-zero exit) ends the run, its peers are
given a short grace period and then terminated (they are usually blocked in a
collective waiting for the failed rank), and :class:`RankError` names the rank.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from decode_boundary.env import disable_multicast

GRACE_S = 5.0  # how long children may take to exit before they are terminated
POLL_S = 0.2


class RankError(RuntimeError):
    """A rank raised, died or did not finish in time; ``rank`` is the first one
    that did (or None when the whole run timed out)."""

    def __init__(self, rank: int | None, message: str) -> None:
        super().__init__(message)
        self.rank = rank


@dataclass(frozen=True)
class RankContext:
    """What the per-rank function gets: its rank, the world size, its device
    (``cuda:rank % gpus``; CPU without CUDA) and the process group (None when
    ``world_size == 1``)."""

    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup | None


def in_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def device_for(local_rank: int) -> torch.device:
    """Ranks beyond the GPU count share GPUs round-robin (correctness runs with
    more ranks than GPUs; the all-reduce of ranks sharing a GPU then takes its
    gather transport, not the mailbox)."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join_group(rank: int, world_size: int, device: torch.device, init_method: str,
                timeout_s: float) -> RankContext:
    disable_multicast()  # before the process group (and any communicator) exists
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # NCCL refuses two ranks on one GPU; gloo carries the group when ranks
    # outnumber GPUs (correctness runs at a TP larger than the machine).
    nccl = device.type == "cuda" and world_size <= torch.cuda.device_count()
    dist.init_process_group(
        "nccl" if nccl else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return RankContext(rank, world_size, device, dist.group.WORLD)


def _child(rank: int, world_size: int, port: int, timeout_s: float, fn: Callable, args: tuple,
           results: mp.Queue) -> None:
    disable_multicast()  # first: inherited from the parent, forced again here
    try:
        ctx = _join_group(rank, world_size, device_for(rank), f"tcp://127.0.0.1:{port}",
                          timeout_s)
        out = fn(ctx, *args)
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - any failure must reach the parent with its rank
        results.put((rank, False, traceback.format_exc()))
        return
    results.put((rank, True, out))


def launch(fn: Callable, world_size: int, args: tuple = (), timeout_s: float = 600.0) -> dict:
    """Run ``fn(ctx: RankContext, *args)`` on every rank; return ``{rank: result}``.

    Spawned: results of all ranks (they must pickle). Under torchrun: only this
    process's own result. Raises :class:`RankError` when a rank fails or the run
    exceeds ``timeout_s``.
    """
    disable_multicast()  # first: before torchrun's group is joined or children are spawned
    if in_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != world_size:
            raise ValueError(f"torchrun started {world} ranks but tp={world_size} was asked for")
        rank = int(os.environ["RANK"])
        ctx = _join_group(rank, world, device_for(int(os.environ.get("LOCAL_RANK", rank))),
                          "env://", timeout_s)
        try:
            return {rank: fn(ctx, *args)}
        finally:
            dist.destroy_process_group()
    if world_size == 1:
        return {0: fn(RankContext(0, 1, device_for(0), None), *args)}
    return _spawn(fn, world_size, args, timeout_s)


def _spawn(fn: Callable, world_size: int, args: tuple, timeout_s: float) -> dict:
    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    port = free_port()
    procs = [
        spawn.Process(target=_child, args=(r, world_size, port, timeout_s, fn, args, results),
                      daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    done: dict = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(done) < world_size:
            rank, ok, payload = _next_message(procs, done, results, deadline, timeout_s)
            if not ok:
                raise _failure(procs, done, results, {rank: payload})
            done[rank] = payload
    finally:
        # After a failure or a timeout, _failure has already waited: end the rest now.
        stop_processes(procs, GRACE_S if len(done) == world_size else 0.0)
    return done


def _next_message(procs: list, done: dict, results, deadline: float, timeout_s: float) -> tuple:
    """The next (rank, ok, payload) from the children, or (rank, False, why) for
    a rank that exited without a result; raises when the deadline passes."""
    while True:
        try:
            return results.get(timeout=POLL_S)
        except queue.Empty:
            pass
        for rank, p in enumerate(procs):
            if rank in done or p.exitcode is None:
                continue
            try:
                # A clean exit flushes the queue first, but the message may still be in the pipe.
                return results.get(timeout=1.0)
            except queue.Empty:
                return rank, False, f"exited with code {p.exitcode} without a result"
        if time.monotonic() > deadline:
            missing = [r for r in range(len(procs)) if r not in done]
            raise RankError(
                None, f"timed out after {timeout_s:.0f} s; ranks {missing} did not finish"
            )


def _failure(procs: list, done: dict, results, failures: dict) -> RankError:
    """The error for a failed run, blaming the rank that failed first.

    A failing rank often takes its peers down with it (their collective sees a
    broken connection and raises too, sometimes before the culprit's own report
    arrives), so collect reports for GRACE_S and blame, in this order, a rank that
    died without a word, then the first rank that reported an exception."""
    until = time.monotonic() + GRACE_S
    while time.monotonic() < until and any(p.is_alive() for p in procs):
        try:
            rank, ok, payload = results.get(timeout=POLL_S)
        except queue.Empty:
            continue
        if not ok:
            failures.setdefault(rank, payload)
    silent = {
        rank: f"exited with code {p.exitcode} without a result"
        for rank, p in enumerate(procs)
        if rank not in done and rank not in failures and p.exitcode not in (None, 0)
    }
    ordered = {**silent, **failures}
    first = next(iter(ordered))
    return RankError(first, "\n".join(f"rank {r} failed: {why}" for r, why in ordered.items()))


def stop_processes(procs: list, grace_s: float, term_s: float = GRACE_S) -> None:
    """Let the children exit on their own for ``grace_s``, then end them (after a
    failure the survivors usually wait in a collective for the failed rank):
    terminated, killed if still alive ``term_s`` later (0: killed at once)."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive() and term_s > 0:
            p.terminate()
            p.join(timeout=term_s)
        if p.is_alive():
            p.kill()
            p.join()
