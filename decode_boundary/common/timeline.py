"""Per-program timestamps inside a running chain: a diagnostic, off unless a
:func:`recording` block is active (then kernels compile a ``TIMELINE``
variant; the default variant's code is unchanged).

Each program of an instrumented kernel (the MXFP8 GEMM, the consumer, the
mixes kernel) writes
``%globaltimer`` readings (ns) to its slot of the recording's buffer: when it
starts, when it has passed its grid-dependency wait, when it ends, and up to
two marks inside its body (``MARK1``, ``MARK2``: each kernel's docstring or
stamp call says where; 0 where a kernel sets none).
Launchers reserve the slots on the host at launch (or capture) time, in
launch order, so a CUDA graph captured inside the block records every replay
into the same slots. ``benchmarks/timeline.py`` turns them into the
where-does-the-time-go table of a chain (``benchmarks/consumer_mixes.py
--timeline``: of the consumer and the mixes kernel), both through
:func:`kernel_times`.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from decode_boundary.env import interpret_mode

# The stamps of a program (constexpr: kernels read them), STAMPS per slot.
START, WAITED, MARK1, MARK2, END = (tl.constexpr(i) for i in range(5))
STAMPS = 5
_STAMPS = tl.constexpr(STAMPS)


@dataclass
class Recording:
    """Slots of every instrumented launch made inside the block: ``launches``
    holds (kernel name, first slot, programs) in launch order."""

    stamps: torch.Tensor  # int64 [slots, STAMPS] on the device
    launches: list[tuple[str, int, int]] = field(default_factory=list)
    used: int = 0

    def reserve(self, name: str, programs: int) -> int:
        if self.used + programs > self.stamps.shape[0]:
            raise RuntimeError(f"timeline buffer of {self.stamps.shape[0]} slots is full: "
                               f"record fewer launches or pass more slots")
        first, self.used = self.used, self.used + programs
        self.launches.append((name, first, programs))
        return first


_active: Recording | None = None


@contextlib.contextmanager
def recording(device: torch.device | str, slots: int = 1 << 16) -> Iterator[Recording]:
    """Instrument every GEMM / consumer / mixes kernel launch inside the block
    (GPU only)."""
    global _active
    if interpret_mode() or torch.device(device).type != "cuda":
        raise RuntimeError("a timeline reads %globaltimer: it needs a CUDA device and compiled "
                           "kernels (not the Triton interpreter)")
    previous, _active = _active, Recording(torch.zeros(slots, STAMPS, dtype=torch.int64,
                                                       device=device))
    try:
        yield _active
    finally:
        _active = previous


def launch_args(name: str, programs: int, device: torch.device,
                dummy: torch.Tensor) -> tuple[torch.Tensor, int, bool]:
    """(stamp buffer, first slot, TIMELINE) for one launch of ``programs``
    programs: the recording's slots when one is active on ``device``, else a
    dummy pointer and TIMELINE False."""
    if _active is None or _active.stamps.device != device:
        return dummy, 0, False
    return _active.stamps, _active.reserve(name, programs), True


@triton.jit
def stamp_after(stamp_ptr, slot, which: tl.constexpr, after, TIMELINE: tl.constexpr):
    """Stamp ``which`` once the int32 scalar ``after`` is computed (its operand
    keeps the timer read behind it: e.g. a reduction over loaded data, so the
    stamp says when those loads had arrived)."""
    if TIMELINE:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r",
                                        [tl.zeros((1,), tl.int32) + after], dtype=tl.int64,
                                        is_pure=False, pack=1)
        tl.store(stamp_ptr + slot.to(tl.int64) * _STAMPS + which + tl.arange(0, 1), now)


@triton.jit
def stamp(stamp_ptr, slot, which: tl.constexpr, TIMELINE: tl.constexpr):
    """Store ``%globaltimer`` as stamp ``which`` of ``slot`` (a no-op unless
    TIMELINE; GPU only: the interpreter has no PTX)."""
    stamp_after(stamp_ptr, slot, which, 0, TIMELINE)


# What kernel_times reports of a launch, µs from the caller's t0.
FIELDS = ("first_start", "last_start", "median_waited", "last_waited", "median_mark1",
          "median_mark2", "median_end", "last_end", "first_end")


def kernel_times(stamps: torch.Tensor, first: int, programs: int, t0: int) -> dict:
    """``FIELDS`` (and ``programs``) of the launch whose programs hold slots
    ``first .. first + programs`` of ``stamps`` (a recording's, on the host),
    in µs from ``t0`` (ns): first / last start, median / last grid-wait pass,
    the median marks (NaN where the kernel sets none), median / last end, and
    the end of the launch's first program (slot ``first``: a GEMM finishing the
    mixes runs token 0's combine there, apart from the weight owners)."""
    s = stamps[first:first + programs].double()
    start, waited, mark1, mark2, end = ((s[:, i] - t0) / 1e3 for i in range(STAMPS))

    def median(x):  # a mark a kernel does not set reads 0
        return x.median().item() if bool((s[:, 0] > 0).all()) and x.min() > -t0 / 1e3 \
            else float("nan")

    return {"first_start": start.min().item(), "last_start": start.max().item(),
            "median_waited": waited.median().item(), "last_waited": waited.max().item(),
            "median_mark1": median(mark1), "median_mark2": median(mark2),
            "median_end": end.median().item(), "last_end": end.max().item(),
            "first_end": end[0].item(), "programs": programs}


def stamped_steps(steps, device: torch.device, calls: int, skip: int = 3) -> dict:
    """Stamp ``calls`` back-to-back calls of ``steps`` (round robin, one per
    weight copy) captured in one CUDA graph and replayed 3 times (the stamps
    are the last replay's). ``{"kernels": per stamped kernel of a step, its
    name, programs and the medians of ``FIELDS`` over the steps but the first
    and last ``skip``, each step's from its first stamped program start;
    "step_us": the median period of those steps}``."""
    # One eager round compiles the stamped variants outside the capture and
    # counts the programs a round stamps, which sizes the graph's buffer.
    with recording(device, slots=1 << 20) as probe:
        for step in steps:
            step()
        torch.cuda.synchronize(device)
    rounds = -(-calls // len(steps))
    with recording(device, slots=probe.used * rounds) as rec:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                steps[i % len(steps)]()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize(device)
        launches = rec.launches
        stamps = rec.stamps.cpu()
    return step_medians(stamps, launches, calls, skip)


def step_medians(stamps: torch.Tensor, launches: list, calls: int, skip: int = 3) -> dict:
    """:func:`stamped_steps`' summary of ``calls`` steps' ``launches`` (a
    recording's, in launch order, the same kernels in every step) and their
    ``stamps`` (on the host)."""
    per_step = len(launches) // calls
    kept = range(skip, calls - skip)
    t0s = [int(stamps[first:first + n, 0].min())  # each step's first stamped kernel
           for _, first, n in (launches[s * per_step] for s in range(calls))]
    kernels = []
    for k in range(per_step):
        samples = [kernel_times(stamps, *launches[s * per_step + k][1:], t0s[s]) for s in kept]
        kernels.append({"kernel": f"{k}: {launches[k][0]}", "programs": samples[0]["programs"],
                        **{f: statistics.median(x[f] for x in samples) for f in FIELDS}})
    return {"kernels": kernels,
            "step_us": statistics.median((t0s[s + 1] - t0s[s]) / 1e3 for s in kept)}
