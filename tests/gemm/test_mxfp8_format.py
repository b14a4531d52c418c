"""MXFP8 reference format (decode_boundary.mxfp8.format) against hand-computed bytes.

Every expected byte (here and in mxfp8_vectors.py) is worked out by hand from docs/DESIGN.md §4:
scale byte = biased exponent of amax/448, +1 if its mantissa is non-zero;
element = e4m3 of clamp(x / 2^(byte-127), ±448), round to nearest even.
e4m3fn: sign | 4 exponent bits (bias 7) | 3 mantissa bits; subnormals are
multiples of 2^-9; 0x7E = 448, 0x7F = NaN.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mxfp8_vectors import HAND_VECTORS

from decode_boundary.mxfp8.format import (
    QuantizedActivation,
    check_quantized,
    dequantize_mxfp8,
    mxfp8_scale_bytes,
    quantize_mxfp8_ref,
    swizzle_scales,
    swizzled_scale_offset,
    unswizzle_scales,
)


def one_group(values, dtype=torch.float32):
    """Quantize one 32-wide group (values, then zeros).

    Returns (bytes of the values, scale byte, bytes of the zero tail)."""
    x = torch.zeros(1, 32, dtype=torch.float64)
    x[0, : len(values)] = torch.tensor(values, dtype=torch.float64)
    qa = quantize_mxfp8_ref(x.to(dtype))
    data = qa.data.view(torch.uint8)[0].tolist()
    return data[: len(values)], unswizzle_scales(qa.scale, 1, 32).item(), data[len(values) :]


# 2^-120 is not an fp16 value; every other vector is exact in all three dtypes.
CASES_BY_DTYPE = [
    (case, dtype)
    for case in sorted(HAND_VECTORS)
    for dtype in (torch.float32, torch.bfloat16, torch.float16)
    if not (dtype == torch.float16 and case == "subnormal_amax_over_448")
]


@pytest.mark.parametrize("case,dtype", CASES_BY_DTYPE)
def test_hand_computed_bytes(case, dtype):
    values, want, want_scale = HAND_VECTORS[case]
    exact = torch.tensor(values, dtype=torch.float64)
    assert torch.allclose(exact.to(dtype).double(), exact, rtol=0, atol=0, equal_nan=True)
    data, scale, rest = one_group(values, dtype)
    assert [hex(b) for b in data] == [hex(b) for b in want]
    assert scale == want_scale
    assert rest == [0] * len(rest)


def test_fp16_specific_vectors():
    # fp16 max 65504: /448 = 146.2 -> byte 134 + 1 = 135, scale 256; 65504/256 = 255.875 -> 256.
    assert one_group([65504.0], torch.float16)[:2] == ([0x78], 135)
    # fp16 smallest subnormal 2^-24: /448 -> 1.14 * 2^-33 -> byte 94 + 1 = 95, scale 2^-32 -> 256.
    assert one_group([2**-24], torch.float16)[:2] == ([0x78], 95)


def test_fp32_precision_is_used():
    # Scale 1. 1 + 2^-10 is below the 1.0/1.125 midpoint -> 0x38; 1.0625 + 2^-10 is past
    # it -> 0x39. In bf16 the latter would first round to the tie 1.0625 (-> 0x38).
    assert one_group([448.0, 1 + 2**-10, 1.0625 + 2**-10])[0] == [0x7E, 0x38, 0x39]


def test_scale_bytes_per_group_independent():
    # Two groups in one row and a second row: each group has its own scale.
    x = torch.zeros(2, 64)
    x[0, 0], x[0, 32], x[1, 5], x[1, 40] = 448.0, 896.0, 1.0, 0.0
    qa = quantize_mxfp8_ref(x)
    assert unswizzle_scales(qa.scale, 2, 64).tolist() == [[127, 128], [119, 0]]
    assert qa.data.view(torch.uint8)[0, 32].item() == 0x7E  # 896 / 2 = 448
    assert qa.orig_shape == x.shape and qa.orig_dtype == torch.float32


def test_tiny_amax_underflows_to_byte_zero():
    # 2^-149 / 448 underflows to 0 in FP32 -> byte 0; 2^-149 * 2^127 = 2^-22 < 2^-10 -> 0.
    data, scale, _ = one_group([2**-149])
    assert (data, scale) == ([0x00], 0)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 5),
    groups=st.integers(1, 5),
    log2=st.integers(-100, 100),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_error_bound(rows, groups, log2, dtype, seed):
    """dequantize(quantize(x)) is within e4m3's half-ulp of x (relative 2^-4 of the value
    for normals, 2^-10 * scale absolute for subnormals), computed in FP64."""
    if dtype == torch.float16:
        log2 = max(min(log2, 10), -10)
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, groups * 32, generator=gen, dtype=torch.float64) * 2.0**log2).to(dtype)
    qa = quantize_mxfp8_ref(x)
    back = dequantize_mxfp8(qa, torch.float64)
    scale = torch.exp2(unswizzle_scales(qa.scale, rows, groups * 32).double() - 127)
    scale = scale.repeat_interleave(32, dim=1)
    err = (back - x.double()).abs()
    bound = torch.maximum(x.double().abs() * 2.0**-4, scale * 2.0**-10)
    assert bool((err <= bound).all())
    # The group maximum never clamps: amax / scale <= 448.
    amax = x.double().abs().view(rows, groups, 32).amax(-1)
    assert bool((amax / scale[:, ::32] <= 448).all())


def test_dequantize_exact_values_and_shape():
    x = torch.tensor([448.0, -3.0, 2**-9, 0.0] * 16).view(2, 1, 32)
    qa = quantize_mxfp8_ref(x)
    back = dequantize_mxfp8(qa)
    assert back.shape == x.shape and back.dtype == torch.float32
    assert back.equal(x)
    assert dequantize_mxfp8(qa, torch.bfloat16).dtype == torch.bfloat16


def brute_force_layout(rows, groups):
    """[rows, groups] -> byte offset, built by walking the 128x4 layout in storage order:
    tiles of 128 rows x 4 groups, row tiles outer, K tiles inner; inside a tile 32
    row-groups of 16 bytes, each holding rows i, i+32, i+64, i+96, each with 4 groups."""
    row_tiles, k_tiles = -(-rows // 128), -(-groups // 4)
    where = {}
    offset = 0
    for rt in range(row_tiles):
        for kt in range(k_tiles):
            for i in range(32):
                for quarter in range(4):
                    for j in range(4):
                        where[(rt * 128 + quarter * 32 + i, kt * 4 + j)] = offset
                        offset += 1
    return where, offset


@pytest.mark.parametrize("rows,groups", [(1, 1), (33, 3), (128, 4), (130, 5), (257, 9)])
def test_swizzle_offset_matches_brute_force(rows, groups):
    where, total = brute_force_layout(rows, groups)
    k = groups * 32
    assert total == mxfp8_scale_bytes(rows, k)
    m = torch.arange(rows)[:, None].expand(rows, groups)
    kb = torch.arange(groups)[None, :].expand(rows, groups)
    got = swizzled_scale_offset(m, kb, k)
    want = torch.tensor([[where[(r, g)] for g in range(groups)] for r in range(rows)])
    assert got.equal(want)
    assert swizzled_scale_offset(rows - 1, groups - 1, k) == where[(rows - 1, groups - 1)]


def test_swizzle_matches_blocked_reshape():
    """Cross-check against the reshape formulation used by torchao / FlashInfer for
    'to_blocked' scales: [rt, 128, kt, 4] -> permute -> [.., 4, 32, 4] -> transpose."""
    rows, groups = 200, 7
    scales = torch.randint(0, 255, (rows, groups), dtype=torch.uint8)
    padded = torch.zeros(256, 8, dtype=torch.uint8)
    padded[:rows, :groups] = scales
    blocks = padded.view(2, 128, 2, 4).permute(0, 2, 1, 3)
    want = blocks.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1)
    assert swizzle_scales(scales).equal(want)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 300), groups=st.integers(1, 11), seed=st.integers(0, 2**31 - 1))
def test_swizzle_round_trip_odd_shapes(rows, groups, seed):
    gen = torch.Generator().manual_seed(seed)
    scales = torch.randint(0, 255, (rows, groups), dtype=torch.uint8, generator=gen)
    buf = swizzle_scales(scales)
    assert buf.numel() == -(-rows // 128) * 128 * -(-groups // 4) * 4
    assert unswizzle_scales(buf, rows, groups * 32).equal(scales)
    # Padding (rows past `rows`, groups past `groups`) is zero.
    mask = torch.ones_like(buf, dtype=torch.bool)
    used = swizzled_scale_offset(torch.arange(rows)[:, None], torch.arange(groups), groups * 32)
    mask[used] = False
    assert int(buf[mask].count_nonzero()) == 0


def test_format_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp8_ref(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="floating"):
        quantize_mxfp8_ref(torch.zeros(2, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="2-D uint8"):
        swizzle_scales(torch.zeros(4, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="at least 512 bytes"):
        unswizzle_scales(torch.zeros(100, dtype=torch.uint8), 1, 32)


def test_check_quantized():
    qa = quantize_mxfp8_ref(torch.randn(3, 64))
    check_quantized(qa)
    bad = [
        (QuantizedActivation(qa.data.view(torch.uint8), qa.scale, qa.orig_dtype, qa.orig_shape),
         "float8_e4m3fn"),
        (QuantizedActivation(qa.data, qa.scale[:100], qa.orig_dtype, qa.orig_shape), "512 bytes"),
        (QuantizedActivation(qa.data, qa.scale.int(), qa.orig_dtype, qa.orig_shape), "uint8"),
        (QuantizedActivation(torch.zeros(4, 8, dtype=torch.float8_e4m3fn)[:, :4], qa.scale,
                             qa.orig_dtype, qa.orig_shape), "contiguous"),
        (QuantizedActivation(torch.zeros(4, 48, dtype=torch.float8_e4m3fn), qa.scale,
                             qa.orig_dtype, qa.orig_shape), "multiple of 32"),
    ]
    for record, message in bad:
        with pytest.raises(ValueError, match=message):
            check_quantized(record, "act")
