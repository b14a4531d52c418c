"""``common.rounding``'s scale-exponent rule from amax's bits against the
reference's (``mxfp8.format.scale_exponent``: the biased exponent of the IEEE
quotient amax / 448, one more if it is not a power of two, at most 254), in the
interpreter: every biased exponent with the fractions where the rule turns,
random ones, and whole binades at the subnormal / normal edge and in the
middle; every FP32 bit pattern with ``DECODE_BOUNDARY_EXHAUSTIVE=1`` (hours on CPU:
run it when the rule changes)."""

import os

import pytest
import torch
import triton
import triton.language as tl

from decode_boundary.common.rounding import _scale_exponent
from decode_boundary.mxfp8.format import scale_exponent

BLOCK = 1 << 16


@triton.jit
def _exponents(amax_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    amax = tl.load(amax_ptr + i, mask=live, other=0.0)
    tl.store(out_ptr + i, _scale_exponent(amax.to(tl.int32, bitcast=True)), mask=live)


def _check(bits: torch.Tensor) -> None:
    amax = bits.view(torch.float32).abs()  # a group's maximum |x| (NaN: its sign cleared)
    got = torch.empty_like(bits)
    _exponents[(triton.cdiv(bits.numel(), BLOCK),)](amax, got, bits.numel(), BLOCK=BLOCK)
    want = scale_exponent(amax)
    wrong = (got != want).nonzero().flatten()
    assert wrong.numel() == 0, [(hex(int(bits[i]) & 0xFFFFFFFF), int(got[i]), int(want[i]))
                                for i in wrong[:5]]


def test_every_exponent_at_the_turning_fractions_and_at_random():
    g = torch.Generator().manual_seed(0)
    turns = torch.tensor([0, 1, 2, 223, 224, 225, 0x5FFFFF, 0x600000, 0x600001, 0x7FFFFE,
                          0x7FFFFF])
    fractions = torch.cat([turns, torch.randint(0, 1 << 23, (256,), generator=g)])
    biased = torch.arange(256)
    bits = (biased[:, None] << 23 | fractions[None, :]).flatten()
    _check(torch.cat([bits, bits | (1 << 31)]).to(torch.int32))


@pytest.mark.parametrize("biased", [0, 1, 8, 9, 10, 127, 254])
def test_whole_binades(biased):
    _check((biased << 23 | torch.arange(1 << 23)).to(torch.int32))


@pytest.mark.skipif(not os.environ.get("DECODE_BOUNDARY_EXHAUSTIVE"),
                    reason="every FP32 bit pattern: ~12 min (DECODE_BOUNDARY_EXHAUSTIVE=1)")
def test_every_fp32_bit_pattern():
    for biased in range(256):  # every sign-less pattern: amax = |x| carries none
        _check((biased << 23 | torch.arange(1 << 23)).to(torch.int32))
