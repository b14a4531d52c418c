"""What the consumer launcher (:func:`.consumer.consume`) takes and how it
checks it before anything is launched.

**What ``consume`` checks** (``ValueError`` before anything is launched):
dtype, shape, device and contiguity of every tensor the mode reads or writes
(the mailbox ``[STAGES, tp, capacity, H]`` with its stage words and status
word in Lamport mode, or the gathered ``[tp, M, H]``; residual, post, comb;
in the full mode pre, norm weight, the norm scratch and the status word, and
the MXFP8 output buffers, scales through ``check_scale_buffer``);
``1 <= M <= capacity``; a positive wait bound wherever something may wait; a
tactic of power-of-two columns (>= one MXFP8 group) and warps, never a
cooperative full-mode tactic in the interpreter (its programs run one by one
and cannot wait for each other).

**What the caller guarantees** (nothing here can check it): every rank
publishes exactly once per consume into stage NEXT (publish kernel, finalize
kernel or a publishing GEMM) and consumes once; the early inputs are complete
when the consumer may start (below); output and scratch buffers are not in
use by another kernel; ``generation`` and ``sumsq`` are zeroed together, at
allocation and after any timeout; the kernel variant is compiled before the
peers wait on this rank (``compile_only``, see
``BoundaryAllReduce.precompile``).

**Early inputs: read before the grid-dependency wait.** ``residual``,
``post``, ``comb``, ``pre`` and ``norm_weight`` (gamma) are loaded *before*
the consumer's ``gdc_wait`` (cooperative tactics, the GPU default), so that
their loads overlap the publisher; the mailbox (or the gathered partials),
the stage word, the scratch and every store come after the wait. With PDL the
consumer may start as soon as the kernel before it on the stream, its
*publisher* (publish kernel, finalize kernel or publishing GEMM; in the NCCL
transport the all-gather, which has no PDL: no overlap), releases its
dependents, i.e. while the publisher still runs. So the early inputs must
be complete before the publisher can start: produced by a kernel earlier in
stream order than the publisher, never by the publisher itself. Precisely,
they must not be written by any kernel of the window that may still run when
the consumer starts: the publish and finalize kernels release their
dependents only after their own grid wait (every earlier kernel is complete
by then), so there the window is the publisher alone; a GEMM of this package
releases them at its start, before its wait, so behind a publishing GEMM the
window also holds the kernel before it, and, while that is another GEMM of
this package (``wo_a`` before ``wo_b``), the one before that, and so on, up
to and including the first kernel that is not. A kernel launched without PDL
(any PyTorch op) is complete before its successor starts: it and everything
before it are outside. ``consume`` refuses (``ValueError``) what it can check
cheaply: an early input whose memory overlaps the partial (``partial=``), the
mailbox or gathered buffer, an MXFP8 output buffer, or the stage, status,
generation, sumsq or prenorm words (:func:`check_early_inputs`). With
``mixes``, ``hc_fn``, ``hc_scale`` and ``hc_base`` are held to the same rules
(and checked so): the consumer reads ``hc_fn`` before its wait where the
tactic says ``mix_weights_early`` (the tables' choice up to 8 tokens), the
rest after it, and the mixes kernel after it (beyond ``MIXES_FUSED_MAX_ROWS``)
loads ``hc_fn`` before its own, while the consumer may still run.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import NamedTuple

import torch
import triton

from .. import env
from ..common.contract import MIX_MIN_BLOCK, mix_columns
from ..mixes.mixes_kernel import MIXES_KERNEL_BLOCK_H
from .consumer_kernel import COLLAPSES, FULL, Collapse
from .consumer_tactics import ConsumerTactic

QUANT_GROUP = 32  # MXFP8 group: a chunk holds whole groups, so it is >= 32 columns


def is_nonnegative_real(value) -> bool:
    """A finite real number >= 0 (not a bool): what an eps must be."""
    return not isinstance(value, bool) and isinstance(value, Real) and math.isfinite(value) \
        and value >= 0


# The mixes' hc_eps must be a normal FP32 number: every Sinkhorn sum is >= hc_eps and
# the combine normalises by its reciprocal (rcp.approx.ftz: a subnormal or zero sum
# would give inf and NaN where the reference's division stays finite).
MIN_HC_EPS = 2.0 ** -126


def is_hc_eps(value) -> bool:
    """A finite real number >= ``MIN_HC_EPS`` (not a bool): what hc_eps must be."""
    return is_nonnegative_real(value) and value >= MIN_HC_EPS


def is_positive_int(value) -> bool:
    """An int >= 1 (not a bool): a count of rounds."""
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


class MhcMixes(NamedTuple):
    """The next sublayer's mHC mix parameters and how the boundary uses them
    (docs/DESIGN.md §5.1; spec: ``reference.mhc_mixes_ref``, with the call's
    ``eps`` as its ``rms_eps``). ``hc_fn`` FP32 [(2 + hc) * hc, hc * H],
    ``hc_scale`` FP32 [3], ``hc_base`` FP32 [(2 + hc) * hc]. ``collapse``:
    "previous" (V4.1: collapse with the given pre, the new mixes are the next
    boundary's) or "same" (V4: collapse with the pre just computed):
    :class:`~.consumer_kernel.Collapse`."""

    hc_fn: torch.Tensor
    hc_scale: torch.Tensor
    hc_base: torch.Tensor
    hc_eps: float
    sinkhorn_iters: int
    collapse: Collapse = Collapse.V4_1


class WaitTimeout(NamedTuple):
    """A wait bound given as a timeout: ``consume`` converts it to the kernel's
    unit (:func:`wait_bound`) from the same ``env.use_ptx`` answer that picks
    its ``USE_PTX`` variant, at launch, so the two cannot disagree."""

    seconds: float


def need(t, name, dtype, shape, device):
    if t is None:
        raise ValueError(f"{name} is required here: expected {dtype} {list(shape)}")
    if t.dtype != dtype or tuple(t.shape) != tuple(shape) or t.device != device:
        raise ValueError(f"{name} must be {dtype} {list(shape)} on {device}, got {t.dtype} "
                         f"{list(t.shape)} on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def check_tactic(tactic: ConsumerTactic, hidden: int, mode: int, mixes: bool = False,
                  mixes_kernel: bool = False) -> None:
    """``mixes``: the consumer computes the next mixes; ``mixes_kernel``: the
    mixes kernel follows it (cooperative with the tactic, in its own chunks)."""
    block, warps, cooperative = tactic.block_h, tactic.warps, tactic.cooperative
    if block < QUANT_GROUP or block & (block - 1) or warps < 1 or warps & (warps - 1):
        raise ValueError(f"tactic {tactic}: columns per program must be a power of two "
                         f">= {QUANT_GROUP} and warps a power of two")
    if mixes and block < MIX_MIN_BLOCK:
        raise ValueError(f"tactic {tactic}: with mixes a program takes >= {MIX_MIN_BLOCK} "
                         "columns (one share of the mix row per chunk)")
    chunks = triton.cdiv(hidden, block)
    if mixes_kernel:
        chunks = max(chunks, triton.cdiv(hidden, MIXES_KERNEL_BLOCK_H))
    if mode == FULL and cooperative and chunks > 1 and env.interpret_mode():
        raise ValueError(f"tactic {tactic}: cooperative programs wait for each other, which "
                         "the interpreter (programs run one by one) cannot do")


EARLY_INPUTS = ("residual", "post", "comb", "pre", "norm_weight")  # read before the wait


def check_mixes(mixes: MhcMixes, mode: int, pre, mix_words, m: int, hc: int, hidden: int,
                 device: torch.device) -> None:
    if not isinstance(mixes, MhcMixes):
        raise ValueError(f"mixes must be a consumer.MhcMixes, got {type(mixes).__name__}")
    if mixes.collapse not in COLLAPSES:
        raise ValueError(f"mixes.collapse must be one of {[c.value for c in Collapse]}, got "
                         f"{mixes.collapse!r}")
    if mode != FULL:
        raise ValueError("mixes need the full mode (norm_weight, and pre unless collapse='same')")
    if mixes.collapse == Collapse.V4 and pre is not None:
        raise ValueError("mixes.collapse='same' collapses with the pre computed here: pass "
                         "pre=None")
    if hc & (hc - 1):
        raise ValueError(f"mixes need a power-of-two hc, got {hc}")
    n = (2 + hc) * hc
    need(mixes.hc_fn, "hc_fn", torch.float32, (n, hc * hidden), device)
    need(mixes.hc_scale, "hc_scale", torch.float32, (3,), device)
    need(mixes.hc_base, "hc_base", torch.float32, (n,), device)
    if not is_positive_int(mixes.sinkhorn_iters):
        raise ValueError(f"mixes.sinkhorn_iters must be an int >= 1, got "
                         f"{mixes.sinkhorn_iters!r}")
    if not is_hc_eps(mixes.hc_eps):
        raise ValueError(f"mixes.hc_eps must be a finite real number >= 2**-126 (the smallest "
                         f"normal FP32), got {mixes.hc_eps!r}")
    rows = mix_words.shape[0] if isinstance(mix_words, torch.Tensor) else 0
    need(mix_words, "mix_words scratch", torch.int64, (max(rows, m), mix_columns(hidden, hc)),
          device)


def _byte_span(t: torch.Tensor) -> tuple[int, int] | None:
    """[first, last + 1) byte addresses ``t`` may touch; None when it is empty."""
    if t.numel() == 0:
        return None
    start = t.data_ptr()
    if t.is_contiguous():
        return start, start + t.numel() * t.element_size()
    extent = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride(), strict=True))
    return start, start + extent * t.element_size()


def check_early_inputs(early: dict, later: dict) -> None:
    """Raise ValueError when a tensor of ``early`` (name -> tensor or None: what
    the consumer reads before its grid-dependency wait, ``EARLY_INPUTS``, and
    with mixes hc_fn, hc_scale and hc_base, held to the same rule)
    shares memory with one of ``later`` (name -> tensor or None: the partial,
    the mailbox, buffers the consumer writes), on one device. An early input is
    read while the publisher may still run (module docstring), so it must not
    be memory that the publisher, this consumer or its peers write."""
    spans = []
    for name, t in later.items():
        span = None if t is None else _byte_span(t)
        if span is not None:
            spans.append((name, t.device, span))
    for name, t in early.items():
        span = None if t is None else _byte_span(t)
        if span is None:
            continue
        for other, device, (lo, hi) in spans:
            if device == t.device and span[0] < hi and lo < span[1]:
                raise ValueError(
                    f"{name} overlaps {other} in memory: the consumer reads {name} before its "
                    "grid-dependency wait, while the publisher may still run, so it must be a "
                    f"buffer of its own, complete before the publisher starts, not {other} "
                    "(decode_boundary.boundary.consumer_inputs module docstring)")
