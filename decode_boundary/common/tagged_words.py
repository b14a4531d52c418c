"""Device helpers of bounded waits and tagged words (the consumer's norm
hand-off and mix shares, :mod:`decode_boundary.mixes.mhc_combine`).

A *tagged word* is an int64 whose high half is a launch's tag (the token's
generation + 1) and whose low half is an FP32 value, stored with one aligned
64-bit store, so tag and value land together and a reader that sees the tag
sees the value (docs/DESIGN.md §6). A *spin* polls with a probe until nothing
is pending or its bound passes (``%globaltimer`` nanoseconds on the GPU, spins
in the interpreter); one OR-reduction per poll gives every thread the same
verdict (:func:`_poll_verdict`).
"""
from __future__ import annotations

import triton
import triton.language as tl

# Status bit of a hand-off (norm, or the next mixes) that timed out (bits 0..tp-1
# name missing ranks).
NORM_TIMEOUT_BIT = 1 << 30
_NORM_TIMEOUT_BIT = tl.constexpr(NORM_TIMEOUT_BIT)
_F32_NAN = tl.constexpr(0x7FC00000)  # FP32 quiet NaN bits


@triton.jit
def _now(spins, like, USE_PTX: tl.constexpr):
    """Per element of ``like`` (int32): nanoseconds from ``%globaltimer`` on the
    GPU, read by the thread that holds the element; the spin count otherwise."""
    if USE_PTX:
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [like],
                                         dtype=tl.int64, is_pure=False, pack=1)
    return (like * 0 + spins).to(tl.int64)


@triton.jit
def bit_or(a, b):
    return a | b


@triton.jit
def _poll_verdict(unwritten, start, spins, wait_bound, status_ptr, CHECK_STATUS: tl.constexpr,
                  USE_PTX: tl.constexpr):
    """One verdict per program for a spin loop: bit 0 = some element is still
    unwritten, bit 1 = give up (the bound has passed, or with ``CHECK_STATUS``
    another program already reported a failure). Threads read the timer and the
    status word at different moments, so their own answers can differ; a loop
    exit they disagreed on would leave warps in different iterations, pairing
    the barriers of different block reductions. Hence one OR-reduction over every
    thread's answer decides, and every thread gets the same value."""
    stop = (_now(spins, unwritten, USE_PTX) - start) > wait_bound
    if CHECK_STATUS:
        stop = stop | (tl.load(status_ptr + unwritten * 0, volatile=True) != 0)
    return tl.reduce(unwritten | tl.where(stop, 2, 0), 0, bit_or)  # bit 2: the probe's poison


@triton.jit
def probe_partials(row, live, tag, UNUSED: tl.constexpr):
    """One volatile poll of a token's sum-of-squares row: (the words, per unit 1
    where the word does not carry ``tag`` yet)."""
    words = tl.load(row, mask=live, other=0, volatile=True)
    return words, tl.where(live & ((words >> 32).to(tl.int32) != tag), 1, 0)


@triton.jit
def spin(probe, ptr, mask, arg, status_ptr, wait_bound, N: tl.constexpr,
          CHECK_STATUS: tl.constexpr, USE_PTX: tl.constexpr):
    """Poll with ``probe(ptr, mask, arg, N)`` -> (value, flags per element: bit
    0 pending, bit 2 poison) until nothing is pending or the bound passes (with
    ``CHECK_STATUS``: or another program already reported a failure). Returns
    (the last value, the OR of the last poll's flags: bit 0 = something is
    still pending, bit 2 = poison seen)."""
    value, hole = probe(ptr, mask, arg, N)
    flags = tl.reduce(hole, 0, bit_or)
    if (flags & 1) != 0:
        spins = 0
        start = _now(spins, hole, USE_PTX)
        go = (flags & 1) != 0
        while go:
            value, hole = probe(ptr, mask, arg, N)
            spins += 1
            flags = _poll_verdict(hole, start, spins, wait_bound, status_ptr, CHECK_STATUS,
                                  USE_PTX)
            go = (flags & 3) == 1
    return value, flags


@triton.jit
def tag_word(value, tag):
    """FP32 ``value`` in the low half of an int64 word, ``tag`` in the high half."""
    return (tag.to(tl.int64) << 32) | (value.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF)


@triton.jit
def untag(words):
    return (words & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def f32_nan():
    return tl.full((), _F32_NAN, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def gave_up(flags, status_ptr):
    """Whether a spin of tagged words gave up (its flags' bit 0: still pending);
    then ``NORM_TIMEOUT_BIT`` goes into the status word (several programs may
    set it together: ``atomic_or``)."""
    stale = (flags & 1) != 0
    if stale:
        tl.atomic_or(status_ptr, _NORM_TIMEOUT_BIT)
    return stale
