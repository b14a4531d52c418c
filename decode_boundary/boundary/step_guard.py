"""One rank's step rules for a :class:`~.all_reduce.BoundaryAllReduce`, owned
by it (docs/FAILURES.md): the contribution published and not yet reduced,
whether a step of this rank failed (its steps refuse until
``reset(collective=True)``), an aborted step's pending all-gather, the kernel
variants compiled so far, and the bounded barriers of its group
(:mod:`.host_wait`), and the mailbox itself (None once closed). It takes the
all-reduce's spec, mailbox and settings, never the all-reduce.

Compiling: the first call of a kernel variant JIT-compiles it (seconds), and
ranks compile at different speeds; a peer still compiling its publish would
look like a rank that never arrived. So before its first launch every variant
(publish, finalize, consumer per mode and tactic) is compiled without
launching, and then the group is barriered once: the first use of a variant is
collective (every rank makes the same calls, as it must anyway). Inside a CUDA
graph capture neither may happen: capturing a variant that is not compiled
raises and asks for ``precompile`` (or an eager warm-up call) first.

Whether a variant still needs its barrier must be the same on every rank, or
one rank enters the compile barrier while its peers enter the step's
all-gather, each waiting for the other. So a variant counts as compiled only
once every rank met its barrier: a barrier that counted a rank by its abort
(that rank compiled nothing) leaves its variants to be barriered again at
their next use, on every rank; a rank whose step failed enters no compile
barrier until its reset; and ``reset(collective=True)`` keeps only the
variants every rank has (their keys' digests shared at its first barrier),
whatever left them different.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import torch
import torch.distributed as dist

from .. import env
from ..common.contract import SENTINEL
from . import host_wait
from .consumer import status_error
from .consumer_kernel import ABORT_BIT
from .mailbox import Mailbox
from .rejection import poison_gather, poison_mailboxes
from .spec import BoundarySpec, Settings

# Ranks JIT-compile at different speeds: the bound of compile barriers.
COMPILE_TIMEOUT_S = 900.0


class PendingGather(NamedTuple):
    """An all-gather this rank entered and did not wait for (an abort's, or
    one left by a collective mismatch): ``seq``, its number (tag ``gather``),
    and the tensors to keep alive until ``reset`` waits for ``work``."""

    seq: int
    work: object
    tensors: tuple


def variant_digest(key: tuple) -> str:
    """A variant key's digest, the same in every process (its repr holds
    strings, numbers, dtypes, enums and tactic tuples, no addresses; a key
    whose repr differed across processes would be dropped at every reset on
    every rank alike: compiled again, never divergent)."""
    return hashlib.sha1(repr(key).encode()).hexdigest()[:16]


class StepGuard:
    """The step state of one rank's all-reduce of ``spec`` over ``box``, its
    host waits bounded by ``settings`` (module docstring)."""

    def __init__(self, spec: BoundarySpec, box: Mailbox, settings: Settings) -> None:
        self.spec = spec
        self.box: Mailbox | None = box  # None once closed
        self.settings = settings
        self.published: torch.Tensor | None = None
        self.failed: str | None = None  # why a step of this rank failed
        self.pending_gather: PendingGather | None = None  # reset waits for it
        self.last_rows = 1  # M of the last accepted step (an abort's guess in that transport)
        self.compiled: set[tuple] = set()

    @property
    def mailbox(self) -> Mailbox:
        """The mailbox and device words; ``RuntimeError`` once closed."""
        if self.box is None:
            raise RuntimeError("BoundaryAllReduce is closed")
        return self.box

    def ready(self) -> Mailbox:
        """The mailbox, unless closed or a step failed since the last reset."""
        box = self.mailbox
        self.refuse_if_failed()
        return box

    def refuse_if_failed(self) -> None:
        """``RuntimeError`` while a step of this rank failed since the last reset."""
        if self.failed is not None:
            raise RuntimeError(
                f"BoundaryAllReduce rank {self.spec.rank}: a step failed ({self.failed}); call "
                "reset(collective=True) on every rank before the next step")

    def refuse_unreduced(self) -> None:
        """``RuntimeError`` while a published contribution waits for its reduce."""
        if self.published is not None:
            raise RuntimeError("a published contribution is still unreduced")

    def check(self) -> None:
        """``BoundaryAllReduce.check``: read the status word (device sync)."""
        spec = self.spec
        error = status_error(int(self.mailbox.status.item()), spec.tp, spec.wait_timeout_s)
        if error is not None:
            if self.failed is None:
                self.failed = error  # later steps refuse until reset(collective=True)
            raise RuntimeError(f"BoundaryAllReduce rank {spec.rank}: {error}")

    def barrier(self, tag: str | None = None, timeout_s: float | None = None,
                aborts_arrive: bool = False, share: str | None = None) -> host_wait.Met:
        """This rank's device work done, then every rank of the group here. With
        a ``tag`` (compile, reset): both bounded (``host_timeout_s``, or
        ``timeout_s``), a rank missing named in a ``RuntimeError``, over tagged
        store barriers (:mod:`.host_wait`: barriers of different purposes never
        pair; ``share``: a value every rank reads). Without
        (``close(collective=True)``): a device sync, a store barrier bounded the
        same way, then the group's own ``dist.barrier``. Either way a rank
        judged dead by its liveness mark is named at once, and ranks waiting in
        different collectives raise ``CollectiveMismatch`` within seconds."""
        spec, settings = self.spec, self.settings
        met = host_wait.Met([], {})  # a single process: nobody to meet
        if tag is None:
            if spec.device.type == "cuda":
                torch.cuda.synchronize(spec.device)
            if spec.multi_process:
                met = host_wait.barrier(spec.group, settings.host_timeout, "close",
                                        "the close barrier of BoundaryAllReduce",
                                        liveness_s=settings.liveness_timeout_s)
                dist.barrier(group=spec.group)
            return met
        timeout_s = settings.host_timeout if timeout_s is None else timeout_s
        what = f"the {tag} barrier of BoundaryAllReduce"
        host_wait.sync_device(spec.device, timeout_s, what)
        if spec.multi_process:
            met = host_wait.barrier(spec.group, timeout_s, tag, what, aborts_arrive,
                                    settings.liveness_timeout_s, share)
        return met

    def compile_variants(self, compilers: dict, force_barrier: bool = False) -> None:
        """``BoundaryAllReduce.compile_variants``: refused while a step of this
        rank failed (its peers counted it as arrived: module docstring)."""
        self.refuse_if_failed()
        new = [key for key in compilers if key not in self.compiled]
        if new and self.spec.capturing:
            raise RuntimeError(
                f"BoundaryAllReduce: kernel variant(s) {new} are not compiled and a CUDA graph "
                "is being captured; call precompile(rows) with every M you capture (on every "
                "rank) or run each call once eagerly before capturing")
        for key in new:
            if not env.interpret_mode():  # nothing to compile in the interpreter
                compilers[key]()
        if new or force_barrier:
            # Ranks compile at different speeds: a longer bound than host_timeout_s. A
            # rank that aborted this step compiles nothing: it counts as arrived, and
            # these variants stay to be barriered at their next use, on every rank.
            met = self.barrier("compile", max(self.settings.host_timeout, COMPILE_TIMEOUT_S),
                               aborts_arrive=True)
            if not met.by_abort:
                self.compiled.update(new)

    def abort(self, error: Exception, like: object, published: bool) -> None:
        """Abort this step after ``error`` rejected it (docs/FAILURES.md), before
        ``error`` is raised; ``published``: this rank's contribution already went
        out. tp = 1: nothing waits for us; a publish of this step is wiped
        (sentinel fill) and the instance stays usable. tp > 1: the abort poison
        goes where this step's partial would have gone
        (:func:`.rejection.poison_mailboxes`), or, in the gather transport, this
        rank takes part in the step's all-gather with a poison of ``like``'s
        rows (else the last accepted M) without waiting for it. Then this rank's
        status word names it, compile barriers of this epoch count it as
        arrived, and its steps refuse until ``reset(collective=True)``. Nothing
        runs while tracing or capturing (nothing of the step executes)."""
        spec, box = self.spec, self.box
        self.published = None
        if box is None or spec.capturing or torch.compiler.is_compiling():
            return
        if spec.tp == 1:
            if published and box.buffer is not None:
                box.buffer.fill_(SENTINEL)
            return
        why = f"{type(error).__name__}: {error}"
        self.failed = f"this rank aborted it: {why}"
        if spec.transport == "mailbox":
            poison_mailboxes(box, spec.device)
        else:
            rows = getattr(like, "shape", (0,))[0] if getattr(like, "ndim", 0) == 2 else 0
            rows = rows if 0 < rows <= spec.capacity else self.last_rows
            # The step's all-gather, with this rank's poison: kept until reset waits for it.
            seq = host_wait.number(spec.group, "gather")
            work, *tensors = poison_gather(spec.group, spec.tp, rows, spec.hidden, spec.device)
            self.pending_gather = PendingGather(seq, work, tuple(tensors))
        box.status.bitwise_or_(ABORT_BIT | 1 << spec.rank)
        if spec.multi_process:
            host_wait.signal_abort(spec.group, why)
        error.add_note(f"BoundaryAllReduce rank {spec.rank} aborted this step: its peers "
                       "raise RuntimeError naming it; call reset(collective=True) on every rank")

    def rearm(self) -> None:
        """The collective part of ``reset(collective=True)``: wait for an
        all-gather left pending (an aborted step's), barrier (sharing the
        compiled variants: each rank keeps those every rank has), re-arm the
        mailbox, barrier, allow steps."""
        spec, settings = self.spec, self.settings
        pending, self.pending_gather = self.pending_gather, None
        if pending is not None:
            host_wait.wait_work(pending.work, spec.group, settings.host_timeout,
                                "the aborted step's all-gather", pending.seq,
                                settings.liveness_timeout_s, in_reset=True)
        digests = {variant_digest(key): key for key in self.compiled}
        met = self.barrier("reset-a", share=" ".join(sorted(digests)))
        if met.shared:
            everyone = set.intersection(*(set(v.split()) for v in met.shared.values()))
            self.compiled = {key for digest, key in digests.items() if digest in everyone}
        self.mailbox.rearm()
        self.barrier("reset-b")
        self.failed = None
        if spec.multi_process:
            host_wait.next_epoch(spec.group)
