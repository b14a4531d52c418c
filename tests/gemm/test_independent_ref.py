"""The independent references of tests/helpers/independent_ref.py against hand-computed
values (docs/DESIGN.md §4), so the bars built on them rest on the spec, not on
agreeing with the package."""

import math

import pytest
import torch
from independent_ref import (
    bf16_rne,
    check_rounded_once,
    e4m3_code,
    e4m3_values,
    quantize_mxfp8_fp64,
    swizzle,
    unswizzle,
)
from mxfp8_vectors import HAND_VECTORS
from test_mxfp8_format import brute_force_layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantizer_matches_hand_vectors(dtype):
    for case, (values, want, want_scale) in sorted(HAND_VECTORS.items()):
        if dtype == torch.float16 and case == "subnormal_amax_over_448":
            continue  # 2^-120 is not an fp16 value
        x = torch.zeros(1, 32, dtype=torch.float64)
        x[0, :len(values)] = torch.tensor(values, dtype=torch.float64)
        data, scales = quantize_mxfp8_fp64(x.to(dtype))
        assert [hex(b) for b in data[0, :len(want)].tolist()] == [hex(b) for b in want], case
        assert data[0, len(want):].eq(0).all() and scales.item() == want_scale, case


def test_e4m3_by_hand():
    # 0x38 = 1.0, 0x7E = 448, 0x08 = 2^-6 (smallest normal), 0x01 = 2^-9, 0x80 = -0.
    got = e4m3_values(torch.tensor([0x38, 0x7E, 0x08, 0x01, 0x80, 0xC4, 0x7F, 0xFF]))
    assert got[:6].tolist() == [1.0, 448.0, 2.0**-6, 2.0**-9, -0.0, -3.0]
    assert math.copysign(1, got[4].item()) == -1 and got[6:].isnan().all()
    # Ties to the even code: 1.0625 -> 0x38, 1.1875 -> 0x3A, 2^-10 -> 0, -0 keeps its sign.
    v = torch.tensor([1.0625, 1.1875, 2.0**-10, 1.5 * 2.0**-9, -0.0, 440.0], dtype=torch.float64)
    assert e4m3_code(v).tolist() == [0x38, 0x3A, 0x00, 0x02, 0x80, 0x7E]


def test_bf16_rne_by_hand():
    x = torch.tensor([1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8 + 2.0**-30), 2.0**-134,
                      3 * 2.0**-134, 2.0**128, 0.0, 255.5], dtype=torch.float64)
    want = [1.0, 1 + 2.0**-6, -(1 + 2.0**-7), 0.0, 2 * 2.0**-133, math.inf, 0.0, 256.0]
    assert bf16_rne(x).double().tolist() == want


@pytest.mark.parametrize("rows,groups", [(1, 1), (33, 3), (130, 5), (257, 9)])
def test_swizzle_matches_the_layout_walk(rows, groups):
    where, total = brute_force_layout(rows, groups)
    scales = torch.randint(1, 255, (rows, groups), dtype=torch.uint8)
    buf = swizzle(scales)
    assert buf.numel() == total
    for (r, g), offset in where.items():
        want = scales[r, g].item() if r < rows and g < groups else 0
        assert buf[offset].item() == want
    assert torch.equal(unswizzle(buf, rows, groups), scales)


def test_rounded_once_bar_rejects_truncation_and_allows_only_straddling_intervals():
    exact = torch.tensor([1 + 0.75 * 2.0**-7, 1 + 0.25 * 2.0**-7, 1 + 0.5 * 2.0**-7],
                         dtype=torch.float64)
    rne = bf16_rne(exact)
    assert check_rounded_once(rne, exact, 0.0, min_strict=1.0) == 0
    truncated = torch.tensor([1.0, 1.0, 1.0], dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="1 of 3 elements wrong"):
        check_rounded_once(truncated, exact, 0.0)
    # An eps that straddles the tie of the third element allows both neighbours there only.
    eps = torch.tensor([0.0, 0.0, 2.0**-12], dtype=torch.float64)
    up = rne.clone()
    up[2] = 1 + 2.0**-7
    assert check_rounded_once(up, exact, eps, min_strict=0.5) == 1
    with pytest.raises(AssertionError, match="pinned exactly"):
        check_rounded_once(rne, exact, eps, min_strict=1.0)
