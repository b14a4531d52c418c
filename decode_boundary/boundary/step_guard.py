"""One rank's step rules for a :class:`~.all_reduce.BoundaryAllReduce`, owned
by it (docs/FAILURES.md): the contribution published and not yet reduced,
whether a step of this rank failed (its steps refuse until
``reset(collective=True)``), an aborted step's pending all-gather, the kernel
variants compiled so far, and the bounded barriers of its group
(:mod:`.host_wait`). It reads the all-reduce's public attributes only.

Compiling: the first call of a kernel variant JIT-compiles it (seconds), and
ranks compile at different speeds; a peer still compiling its publish would
look like a rank that never arrived. So before its first launch every variant
(publish, finalize, consumer per mode and tactic) is compiled without
launching, and then the group is barriered once: the first use of a variant is
collective (every rank makes the same calls, as it must anyway). Inside a CUDA
graph capture neither may happen: capturing a variant that is not compiled
raises and asks for ``precompile`` (or an eager warm-up call) first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import env
from ..common.contract import SENTINEL
from . import host_wait
from .consumer_kernel import ABORT_BIT
from .rejection import poison_gather, poison_mailboxes

# Ranks JIT-compile at different speeds: the bound of compile barriers.
COMPILE_TIMEOUT_S = 900.0


class StepGuard:
    """The step state of the all-reduce ``ar`` (module docstring)."""

    def __init__(self, ar) -> None:
        self.ar = ar
        self.published: torch.Tensor | None = None
        self.failed: str | None = None  # why a step of this rank failed
        self.abort_work: tuple | None = None  # gather transport: an abort's all-gather
        self.last_rows = 1  # M of the last accepted step (an abort's guess in that transport)
        self.compiled: set[tuple] = set()

    def refuse_if_failed(self) -> None:
        """``RuntimeError`` while a step of this rank failed since the last reset."""
        if self.failed is not None:
            raise RuntimeError(
                f"BoundaryAllReduce rank {self.ar.rank}: a step failed ({self.failed}); call "
                "reset(collective=True) on every rank before the next step")

    def refuse_unreduced(self) -> None:
        """``RuntimeError`` while a published contribution waits for its reduce."""
        if self.published is not None:
            raise RuntimeError("a published contribution is still unreduced")

    def multi_process(self) -> bool:
        group = self.ar.group
        return group is not None and dist.get_world_size(group) > 1

    def barrier(self, tag: str | None = None, timeout_s: float | None = None,
                aborts_arrive: bool = False) -> None:
        """This rank's device work done, then every rank of the group here. With
        a ``tag`` (compile, reset): both bounded (``host_timeout_s``, or
        ``timeout_s``), a rank missing named in a ``RuntimeError``, over tagged
        store barriers (:mod:`.host_wait`: barriers of different purposes never
        pair). Without (``close(collective=True)``): a device sync, a store
        barrier bounded the same way, then the group's own ``dist.barrier``.
        Either way a rank judged dead by its liveness mark is named at once."""
        ar = self.ar
        if tag is None:
            if ar.device.type == "cuda":
                torch.cuda.synchronize(ar.device)
            if self.multi_process():
                host_wait.barrier(ar.group, ar.host_timeout, "close",
                                  "the close barrier of BoundaryAllReduce",
                                  liveness_s=ar.liveness_timeout_s)
                dist.barrier(group=ar.group)
            return
        timeout_s = ar.host_timeout if timeout_s is None else timeout_s
        what = f"the {tag} barrier of BoundaryAllReduce"
        host_wait.sync_device(ar.device, timeout_s, what)
        if self.multi_process():
            host_wait.barrier(ar.group, timeout_s, tag, what, aborts_arrive,
                              ar.liveness_timeout_s)

    def compile_variants(self, compilers: dict, force_barrier: bool = False) -> None:
        """``BoundaryAllReduce.compile_variants``."""
        new = [key for key in compilers if key not in self.compiled]
        if new and self.ar.capturing:
            raise RuntimeError(
                f"BoundaryAllReduce: kernel variant(s) {new} are not compiled and a CUDA graph "
                "is being captured; call precompile(rows) with every M you capture (on every "
                "rank) or run each call once eagerly before capturing")
        for key in new:
            if not env.interpret_mode():  # nothing to compile in the interpreter
                compilers[key]()
            self.compiled.add(key)
        if new or force_barrier:
            # Ranks compile at different speeds: a longer bound than host_timeout_s. A
            # rank that aborted this step compiles nothing: it counts as arrived.
            self.barrier("compile", max(self.ar.host_timeout, COMPILE_TIMEOUT_S),
                         aborts_arrive=True)

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
        ar = self.ar
        self.published = None
        if ar.closed or ar.capturing or torch.compiler.is_compiling():
            return
        box = ar.mailbox
        if ar.tp == 1:
            if published and box.buffer is not None:
                box.buffer.fill_(SENTINEL)
            return
        why = f"{type(error).__name__}: {error}"
        self.failed = f"this rank aborted it: {why}"
        if ar.transport == "mailbox":
            poison_mailboxes(box, ar.device)
        else:
            rows = getattr(like, "shape", (0,))[0] if getattr(like, "ndim", 0) == 2 else 0
            rows = rows if 0 < rows <= ar.capacity else self.last_rows
            # Kept alive until reset waits for it.
            self.abort_work = poison_gather(ar.group, ar.tp, rows, ar.hidden_size, ar.device)
        box.status.bitwise_or_(ABORT_BIT | 1 << ar.rank)
        if self.multi_process():
            host_wait.signal_abort(ar.group, why)
        error.add_note(f"BoundaryAllReduce rank {ar.rank} aborted this step: its peers "
                       "raise RuntimeError naming it; call reset(collective=True) on every rank")

    def rearm(self) -> None:
        """The collective part of ``reset(collective=True)``: wait for an aborted
        step's all-gather, barrier, re-arm the mailbox, barrier, allow steps."""
        ar = self.ar
        work, self.abort_work = self.abort_work, None
        if work is not None:
            host_wait.wait_work(work[0], ar.group, ar.host_timeout,
                                "the aborted step's all-gather", ar.liveness_timeout_s)
        self.barrier("reset-a")
        ar.mailbox.rearm()
        self.barrier("reset-b")
        self.failed = None
        if self.multi_process():
            host_wait.next_epoch(ar.group)
