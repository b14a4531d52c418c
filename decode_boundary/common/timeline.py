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
into the same slots. ``bench/timeline.py`` turns them into the
where-does-the-time-go table of a chain (``benchmarks/timeline.py``).
"""

from __future__ import annotations

import contextlib
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
