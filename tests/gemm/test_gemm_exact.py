"""MXFP8 GEMM output bits against an independent reference (tests/helpers/independent_ref.py:
the FP64 product of the independently decoded MXFP8 operands, rounded ONCE to
BF16 nearest-even), over shapes, row counts and explicit tactics of every
family (CUDA cores 1..8 rows, tensor cores 16..64, split-K, masked pieces and
groups, grouped weights), MXFP8 and BF16 (prologue-quantized) input, in the
Triton interpreter.

Where the bar is exact and where it allows 1 ulp:

* ``test_exact_operands_*``: operands of small integers (|v| <= 7, exact e4m3)
  times per-group power-of-two scales spread over a few binades, chosen so
  every FP32 partial sum is exact in any order (asserted:
  ``independent_ref.assert_fp32_exact``). The FP32 result then *is* the FP64
  product, and the only rounding left is the final FP32 -> BF16 one: the bar is
  exact for every element (no ulp allowed). A truncating or round-half-up
  output, a wrong scale byte (group, row or column), a misplaced piece or split
  all change bits.
* ``test_random_operands_*``: random operands over many binades, where FP32
  accumulation in the kernel's order can differ from FP64 by up to
  gamma(depth) * sum|a w| (depth: the most FP32 additions one product goes
  through in the kernel's documented summation structure); an element may take
  the BF16 neighbour 1 ulp away only where that interval straddles a BF16
  rounding boundary (further only where the sum cancels so far that the FP32
  error bound exceeds an ulp of the result), every other element is exact
  (``independent_ref.check_rounded_once``).
* ``test_split_k_*``: each split's partial is exact (integers, one scale per
  split), the splits are built so FP32 addition in split order 0..S-1 gives
  other bits than any other order; the bar is exact: the BF16 RNE of the FP32
  sum in split order, which the spec fixes (gemm/mxfp8_gemm_kernel.py).
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from gemm_helpers import CASES, exact_activation, exact_layer, make_input, make_layer, poisoned
from independent_ref import (
    assert_fp32_exact,
    bf16_rne,
    check_gemm,
    decode_mxfp8,
    layer_values,
    quantize_mxfp8_fp64,
    summation_depth,
    swizzle,
)

from decode_boundary.gemm import Tactic, launch_low_latency, launcher
from decode_boundary.gemm.tactics import activation_upfront, k_pieces
from decode_boundary.mxfp8.format import QuantizedActivation


def gen(seed):
    return torch.Generator().manual_seed(seed)


def activation_values(a):
    """FP64 values the kernel multiplies: a QuantizedActivation decoded, or a BF16
    input's independent MXFP8 quantization decoded."""
    if isinstance(a, QuantizedActivation):
        return decode_mxfp8(a.data, a.scale)
    data, scales = quantize_mxfp8_fp64(a)
    return decode_mxfp8(data.view(torch.float8_e4m3fn), swizzle(scales))


def test_cases_cover_both_activation_schedules():
    """CASES hold tactics whose activation loads are issued all at once and
    piece by piece (tactics.activation_upfront), on both kinds of tile: the
    bits must not depend on the schedule."""
    kinds = {(t.rows_tile >= 16, activation_upfront(t, k, bf16))
             for _, _, k, t in CASES for bf16 in (False, True)}
    assert kinds == {(dot, upfront) for dot in (False, True) for upfront in (False, True)}


@pytest.mark.parametrize("rows,n,k,tactic", CASES)
def test_exact_operands_give_exact_bits(rows, n, k, tactic):
    """Exact bar (module docstring): every element equals bf16_rne(FP64 product)."""
    g = gen(rows * 1000 + n + k)
    spread = 2 if k <= 512 else 1
    layer = exact_layer(n, k, g, spread=spread)
    qa = exact_activation(rows, k, g, spread=spread)
    out = launch_low_latency(layer, qa, poisoned(rows, n), tactic)
    check_gemm(out, activation_values(qa), layer_values(layer), exact_sums=True)


@pytest.mark.parametrize("rows,n,k,tactic", [CASES[i] for i in (0, 2, 5, 8, 10, 11)])
def test_exact_operands_bf16_input_quantized_in_the_prologue(rows, n, k, tactic):
    """Exact bar: a BF16 input whose MXFP8 quantization is lossless (asserted)
    goes through the prologue's quantization; the output is bf16_rne of the
    FP64 product of the BF16 values themselves."""
    g = gen(rows * 77 + k)
    layer = exact_layer(n, k, g)
    x = exact_activation(rows, k, g, bf16=True)
    values = activation_values(x)
    assert torch.equal(values, x.double()), "quantization of the test input is not lossless"
    out = launch_low_latency(layer, x, poisoned(rows, n), tactic)
    check_gemm(out, values, layer_values(layer), exact_sums=True)


@pytest.mark.parametrize("tactic", [Tactic(16, 4, 1, 4, 64), Tactic(32, 16, 2, 4, 64)])
def test_exact_operands_grouped(tactic):
    """Exact bar, grouped weight (wo_a): group g's output columns take
    activation columns [g*K, (g+1)*K) and that group's weight rows and scales."""
    g = gen(23)
    groups, n, k, rows = 3, 96, 192, 5
    layer = exact_layer(n, k, g, groups=groups)
    qa = exact_activation(rows, groups * k, g)
    out = launch_low_latency(layer, qa, poisoned(rows, n), tactic)
    check_gemm(out, activation_values(qa), layer_values(layer), groups, exact_sums=True)


@pytest.mark.parametrize("rows,n,k,tactic", CASES)
def test_random_operands_rounded_once(rows, n, k, tactic):
    """Random operands over many binades: exact except where FP32 accumulation
    (gamma(depth) * sum|a w|, depth from the kernel's summation structure) may
    cross a BF16 rounding boundary, there 1 ulp (module docstring); at least
    80 % of the elements are pinned exactly. A second launch gives the same
    bits; split-K counters are re-armed."""
    g = gen(rows + n + k)
    layer, qa = make_layer(n, k, generator=g), make_input(rows, k, generator=g)
    out = launch_low_latency(layer, qa, poisoned(rows, n), tactic)
    check_gemm(out, activation_values(qa), layer_values(layer), depth=summation_depth(k, tactic),
               min_strict=0.8)
    again = launch_low_latency(layer, qa, poisoned(rows, n), tactic)
    assert torch.equal(out.view(torch.int16), again.view(torch.int16))  # repeatable bits
    if tactic.split_k > 1:  # the last program re-armed every counter it used
        assert all(int(c.abs().sum()) == 0 for c in launcher._COUNTERS.values())


# ------------------------------------------------------------------ split-K order


def _fold(partials, order):
    total = partials[order[0]]
    for s in order[1:]:
        total = total + partials[s]  # FP32
    return total


# (rows, N, tactic, split exponents, split negating split 0 or None): S = 3 as
# [A, -A, b] (in order exact; any order adding b before -A loses b's low bits),
# S = 4 as [A, b, -A, d] (in order loses b's low bits and keeps d).
SPLIT_CASES = [
    (2, 64, Tactic(32, 2, 3, 4, 128), (24, 24, 0), 1),  # CUDA cores
    (4, 64, Tactic(64, 4, 4, 4, 128), (24, 0, 24, -3), 2),  # CUDA cores
    (20, 64, Tactic(64, 16, 3, 4, 64), (24, 24, 0), 1),  # tensor cores, 2 pieces per split
    (40, 64, Tactic(64, 64, 4, 4, 128), (24, 0, 24, -3), 2),  # masked 64-row tile
]


@pytest.mark.parametrize("rows,n,tactic,exps,negated", SPLIT_CASES)
def test_split_k_sums_partials_in_split_order(rows, n, tactic, exps, negated):
    """Exact bar: out == bf16_rne(((p_0 + p_1) + p_2) + ...) in FP32, p_s the
    split's partial, exact by construction (integers, one weight scale 2^E_s
    per split; asserted). The data make every other summation order (each
    permutation not just swapping the first two) give other bits somewhere,
    which is asserted too, so a kernel summing in another order fails."""
    splits = tactic.split_k
    g = gen(5 + splits)
    k_slice, _ = k_pieces(splits * 128, tactic)
    k = splits * k_slice
    assert k_pieces(k, tactic)[0] == k_slice
    w = torch.randint(-6, 7, (n, k), generator=g).float()
    a = torch.randint(-6, 7, (rows, k), generator=g).float()
    lo, hi = negated * k_slice, (negated + 1) * k_slice
    w[:, lo:hi], a[:, lo:hi] = -w[:, :k_slice], a[:, :k_slice]
    w_scale = torch.tensor([127 + e for e in exps for _ in range(k_slice // 32)],
                           dtype=torch.uint8)
    layer = SimpleNamespace(weight=w.to(torch.float8_e4m3fn).t(),
                            weight_scale=swizzle(w_scale.expand(n, k // 32).contiguous()),
                            bias=None)
    qa = QuantizedActivation(a.to(torch.float8_e4m3fn),
                             swizzle(torch.full((rows, k // 32), 127, dtype=torch.uint8)),
                             torch.bfloat16, a.shape)
    out = launch_low_latency(layer, qa, poisoned(rows, n), tactic)
    partials = []
    for s in range(splits):
        cols = slice(s * k_slice, (s + 1) * k_slice)
        av, wv = a[:, cols].double(), w[:, cols].double() * 2.0 ** exps[s]
        assert_fp32_exact(av, wv)
        partials.append((av @ wv.t()).float())  # exact
    in_order = _fold(partials, range(splits))
    want = bf16_rne(in_order.double())
    for order in itertools.permutations(range(splits)):
        if set(order[:2]) == {0, 1} and list(order[2:]) == list(range(2, splits)):
            continue  # the same sums (addition commutes)
        other = bf16_rne(_fold(partials, order).double())
        assert not torch.equal(other.view(torch.int16), want.view(torch.int16)), order
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
