"""Transport selection: how the ranks of a ``BoundaryAllReduce`` exchange their
partials, and the mailbox (:mod:`.mailbox`) opened for it.

* ``"mailbox"``: every rank stores its partial into every peer's symmetric
  memory mailbox (publish kernel, finalize kernel or a publishing GEMM) and
  the consumer polls its own. Needs every rank to reach every other rank's
  GPU memory (same host and ``can_device_access_peer``) and one rank per GPU
  (symmetric memory cannot map two mailboxes of one GPU).
* ``"nccl"``: the fallback. Each rank's partial is all-gathered over the group
  into a ``[tp, M, H]`` buffer (``BoundaryAllReduce``, bounded by its host
  timeout over gloo) that the same
  consumer reads (``lamport=False``), with identical results; only the device
  words and norm scratch are allocated, no mailbox buffer.
* ``"auto"``: the mailbox where every rank reaches every other, else NCCL.

A single rank (no group, or a group of one) always gets a local mailbox.
:func:`open_transport` is collective: every rank of the group calls it with
the same arguments, and all ranks get the same transport. A construction
starts with :func:`exchange` (one ``all_gather_object``: each rank's GPU
placement, its geometry and any refusal of its own arguments): a refusal or a
mismatch raises the same ``ValueError`` on every rank before anything is
allocated, so no rank goes on to wait for peers that stopped.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from .mailbox import Mailbox, local_words, simulated_mailboxes, symmetric_mailbox

TRANSPORTS = ("auto", "mailbox", "nccl")


def gpu_placements(group: dist.ProcessGroup, device: torch.device) -> list[tuple[str, int]]:
    """(host name, device index) of every rank of ``group``, in rank order. Collective."""
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, _placement(device), group=group)
    return everyone


def _placement(device: torch.device) -> tuple[str, int]:
    return socket.gethostname(), device.index if device.index is not None else 0


def exchange(group: dist.ProcessGroup, device: torch.device, geometry: dict,
             problem: str | None = None) -> list[tuple[str, int]]:
    """The first collective of a construction: one ``all_gather_object`` of
    every rank's placement (as :func:`gpu_placements`, which it returns), its
    ``geometry`` (what all ranks must agree on) and ``problem`` (why this rank
    refused its own arguments, or None). Every rank sees the same gathered
    list, so either every rank raises the same ``ValueError`` (a rank's
    problem, or geometries that differ: :func:`check_same_geometry`) or none
    does, and no rank goes on to wait for peers that stopped here."""
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (_placement(device), geometry, problem), group=group)
    refused = [f"rank {rank}: {why}" for rank, (_, _, why) in enumerate(everyone) if why]
    if refused:
        raise ValueError("BoundaryAllReduce: construction refused by "
                         + "; ".join(refused) + " (every rank stops here)")
    check_same_geometry([g for _, g, _ in everyone])
    return [tuple(p) for p, _, _ in everyone]


def check_same_geometry(geometries: list[dict]) -> None:
    """Raise ``ValueError`` unless every rank's geometry (``geometries[r]``:
    rank r's dict) is the same, naming each differing key with the ranks that
    hold each value ("hidden_size: 64 on rank 0, 128 on rank 1")."""
    missing = object()
    differences = []
    for key in dict.fromkeys(k for g in geometries for k in g):
        holders: list[tuple[object, list[int]]] = []  # (value, ranks holding it), by ==
        for rank, g in enumerate(geometries):
            value = g.get(key, missing)
            match = next((ranks for v, ranks in holders if v is value or
                          (v is not missing and value is not missing and v == value)), None)
            if match is None:
                holders.append((value, [rank]))
            else:
                match.append(rank)
        if len(holders) > 1:
            differences.append(f"{key}: " + ", ".join(
                ("<missing>" if value is missing else repr(value)) + " on "
                + (f"ranks {ranks}" if len(ranks) > 1 else f"rank {ranks[0]}")
                for value, ranks in holders))
    if differences:
        raise ValueError("BoundaryAllReduce: the ranks of the group were constructed with "
                         "different geometries (every rank must pass the same arguments): "
                         + "; ".join(differences))


def peers_reachable(group: dist.ProcessGroup, device: torch.device,
                    placements: list[tuple[str, int]]) -> bool:
    """Whether every rank of ``group`` can store into every other rank's GPU
    memory (same host and ``can_device_access_peer``), given the ranks'
    :func:`gpu_placements`. Collective; all ranks get the same answer."""
    host, index = placements[dist.get_rank(group)]
    ok = all(h == host for h, _ in placements) and all(
        idx == index or torch.cuda.can_device_access_peer(index, idx) for _, idx in placements
    )
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def ranks_share_a_gpu(placements: list[tuple[str, int]]) -> bool:
    """Whether two ranks run on one GPU of one host (from their
    :func:`gpu_placements`): symmetric memory refuses to map their mailboxes."""
    return len(set(placements)) < len(placements)


def open_transport(group: dist.ProcessGroup | None, capacity: int, hidden: int,
                   device: torch.device, transport: str,
                   placements: list[tuple[str, int]] | None = None) -> tuple[Mailbox, str]:
    """This rank's mailbox (or, for NCCL, its device words alone) and the
    transport chosen for ``transport`` (one of :data:`TRANSPORTS`). Collective;
    ``placements``: the ranks' :func:`gpu_placements` when already gathered
    (:func:`exchange`), else gathered here."""
    if group is None or dist.get_world_size(group) == 1:
        return simulated_mailboxes(1, capacity, hidden, device)[0], "mailbox"
    if placements is None:
        placements = gpu_placements(group, device)
    shared_gpu = ranks_share_a_gpu(placements)
    if transport == "auto":
        reachable = not shared_gpu and peers_reachable(group, device, placements)
        transport = "mailbox" if reachable else "nccl"
    if transport == "mailbox" and shared_gpu:
        raise RuntimeError(
            "two ranks of the group share a GPU: symmetric memory cannot map their "
            "mailboxes; run one rank per GPU or use transport='nccl'")
    if transport == "mailbox":
        return symmetric_mailbox(group, capacity, hidden, device), transport
    return local_words(group, capacity, hidden, device), transport


def all_gather(out: torch.Tensor, x: torch.Tensor, group, async_op: bool = False):
    """``all_gather_single`` where torch has it, else ``all_gather_into_tensor``
    (the gather transport's collective, and an aborted step's)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, x, group=group, async_op=async_op)
