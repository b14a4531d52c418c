"""Triton MXFP8 quantization (interpreter on CPU): identical bytes to the
package's reference and to the independent FP64/integer quantization
(tests/helpers/independent_ref.py, which shares no code with the kernel's
``common.rounding.quantize_groups`` nor with ``mxfp8.format``), hand-computed
vectors, caller-given buffers, errors."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from independent_ref import assert_mxfp8_equal
from mxfp8_vectors import HAND_VECTORS

from decode_boundary.mxfp8.format import (
    mxfp8_scale_bytes,
    quantize_mxfp8_ref,
    unswizzle_scales,
)
from decode_boundary.mxfp8.quantize_kernel import quantize_mxfp8

# NaN inputs: the interpreter warns when numpy casts them to integers inside the kernel,
# whose result the kernel then replaces (NaN -> 0x7F), so the warning is expected.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Inputs the rules of format.py single out: signed zeros, NaN, Inf, FP32 subnormals,
# the e4m3 maximum, e4m3 subnormals and ties at scale 1.
SPECIALS = (0.0, -0.0, math.nan, -math.nan, math.inf, -math.inf, 2.0**-149, -(2.0**-130),
            448.0, -440.0, 2.0**-9, 1.5 * 2.0**-9, 1.0625, -1.9375)


def assert_same_bytes(got, want, x):
    """``got`` (the kernel's) equals ``want`` (quantize_mxfp8_ref) and the
    independent quantization of ``x``, scale padding included."""
    assert got.data.dtype == torch.float8_e4m3fn
    assert got.data.view(torch.uint8).equal(want.data.view(torch.uint8))
    assert got.scale.equal(want.scale)
    assert got.orig_shape == want.orig_shape and got.orig_dtype == want.orig_dtype
    assert_mxfp8_equal(got.data, got.scale, x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hand_computed_vectors(dtype):
    # One row per hand vector (zero-padded to 32), all in one launch.
    cases = [c for c in sorted(HAND_VECTORS)
             if not (dtype == torch.float16 and c == "subnormal_amax_over_448")]
    x = torch.zeros(len(cases), 32, dtype=torch.float64)
    for row, case in enumerate(cases):
        values = HAND_VECTORS[case][0]
        x[row, : len(values)] = torch.tensor(values, dtype=torch.float64)
    qa = quantize_mxfp8(x.to(dtype))
    scales = unswizzle_scales(qa.scale, len(cases), 32)[:, 0].tolist()
    for row, case in enumerate(cases):
        _, want, want_scale = HAND_VECTORS[case]
        got = qa.data.view(torch.uint8)[row].tolist()
        assert [hex(b) for b in got[: len(want)]] == [hex(b) for b in want], case
        assert got[len(want) :] == [0] * (32 - len(want)), case
        assert scales[row] == want_scale, case


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 9),
    groups=st.integers(1, 6),
    dtype=st.sampled_from(DTYPES),
    specials=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(SPECIALS)), max_size=6),
    seed=st.integers(0, 2**31 - 1),
)
def test_kernel_bytes_equal_reference(rows, groups, dtype, specials, seed):
    gen = torch.Generator().manual_seed(seed)
    k = groups * 32
    # A different power-of-two magnitude per group: scale bytes across the whole
    # range, including > 200 (the kernel's split reciprocal) and subnormal amax/448.
    lo, hi = {torch.float32: (-140, 120), torch.bfloat16: (-130, 120), torch.float16: (-20, 12)}[
        dtype
    ]
    log2 = torch.randint(lo, hi + 1, (rows, groups, 1), generator=gen).double()
    x = torch.randn(rows, groups, 32, generator=gen, dtype=torch.float64) * torch.exp2(log2)
    x = x.view(rows, k)
    for position, value in specials:
        x.view(-1)[position % x.numel()] = value
    x = x.to(dtype)
    if dtype == torch.bfloat16:
        # The Triton 3.6 interpreter converts bf16 subnormals to FP32 wrongly (2^-127
        # loads as 0); the compiled kernel does not: test_device_bytes covers them.
        x = torch.where(x.abs() < 2.0**-126, torch.zeros_like(x), x)
    assert_same_bytes(quantize_mxfp8(x), quantize_mxfp8_ref(x), x)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_device_bytes(dtype):
    """Compiled on the GPU: same bytes as the reference over every scale byte,
    subnormal inputs of every dtype and the special values included."""
    gen = torch.Generator().manual_seed(7)
    rows, groups = 300, 40
    log2 = torch.randint(-150, 121, (rows, groups, 1), generator=gen).double()
    x = torch.randn(rows, groups, 32, generator=gen, dtype=torch.float64) * torch.exp2(log2)
    spots = x.view(-1)[::97]
    spots.copy_(torch.tensor(SPECIALS, dtype=torch.float64).repeat(spots.numel())[: spots.numel()])
    x = x.view(rows, groups * 32).to(dtype).cuda()
    assert_same_bytes(quantize_mxfp8(x), quantize_mxfp8_ref(x), x)


def test_row_and_k_tiles_beyond_one():
    # 130 rows and 5 groups: a second 128-row tile and a second 4-group tile.
    x = torch.randn(130, 160, dtype=torch.bfloat16) * 3
    assert_same_bytes(quantize_mxfp8(x), quantize_mxfp8_ref(x), x)


def test_leading_dims_and_non_contiguous_input():
    x = torch.randn(64, 2, 3, dtype=torch.float32).permute(1, 2, 0)  # [2, 3, 64], strided
    qa = quantize_mxfp8(x)
    assert qa.data.shape == (6, 64) and qa.orig_shape == (2, 3, 64)
    assert_same_bytes(qa, quantize_mxfp8_ref(x), x)


def test_zero_rows():
    qa = quantize_mxfp8(torch.zeros(0, 64))
    assert qa.data.shape == (0, 64) and qa.scale.numel() == 0


def test_caller_given_buffers_written_in_place_padding_defined():
    """Caller buffers are written in place; the scale padding (rows to 128,
    groups to 4) gets the 0 a fresh buffer holds, bytes past the layout stay."""
    rows, k = 5, 96
    x = torch.randn(rows, k) * 100
    data = torch.full((rows, k), 0x55, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scale = torch.full((mxfp8_scale_bytes(rows, k) + 16,), 0xAB, dtype=torch.uint8)
    qa = quantize_mxfp8(x, out=(data, scale))
    assert qa.data.data_ptr() == data.data_ptr() and qa.scale.data_ptr() == scale.data_ptr()
    want = quantize_mxfp8_ref(x)
    assert data.view(torch.uint8).equal(want.data.view(torch.uint8))
    layout = mxfp8_scale_bytes(rows, k)
    assert scale[:layout].equal(want.scale), "real scales and zero padding, as a fresh buffer"
    assert bool((scale[layout:] == 0xAB).all()), "nothing past the layout is written"
    assert_mxfp8_equal(data, scale[:layout], x)  # the independent bytes, padding zero


def test_errors():
    x = torch.randn(4, 64)
    good_data = torch.empty(4, 64, dtype=torch.float8_e4m3fn)
    good_scale = torch.empty(mxfp8_scale_bytes(4, 64), dtype=torch.uint8)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp8(torch.randn(4, 40))
    with pytest.raises(ValueError, match="floating"):
        quantize_mxfp8(torch.ones(4, 32, dtype=torch.int64))
    bad_outs = [
        ((torch.empty(4, 64, dtype=torch.uint8), good_scale), r"float8_e4m3fn \[4, 64\]"),
        ((torch.empty(4, 32, dtype=torch.float8_e4m3fn), good_scale), r"\[4, 64\]"),
        ((good_data, good_scale[:100]), "at least 512 bytes"),
        ((good_data, good_scale.view(torch.int8)), "uint8"),
        ((torch.empty(64, 4, dtype=torch.float8_e4m3fn).t(), good_scale), "contiguous"),
    ]
    for out, message in bad_outs:
        with pytest.raises(ValueError, match=message):
            quantize_mxfp8(x, out=out)
