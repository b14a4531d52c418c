"""The GEMM's MXFP8 output (``QUANT_OUT``, ``mxfp8_mm(..., mxfp8_out=True)``):
byte for byte ``quantize_mxfp8`` of the BF16 output the same tactic writes,
scale padding included, for split-K, grouped, masked and multi-tile rows; the
fallback where the epilogue cannot; clear refusals."""

from __future__ import annotations

import pytest
import torch
from gemm_helpers import make_layer, poisoned
from test_gemm import grouped_layer

from decode_boundary.gemm import mxfp8_mm, mxfp8_out_in_epilogue, selected_tactic
from decode_boundary.gemm.launcher import empty_mxfp8, launch_low_latency
from decode_boundary.gemm.tactics import Tactic
from decode_boundary.mxfp8.format import QuantizedActivation, quantize_mxfp8_ref, unswizzle_scales
from decode_boundary.mxfp8.quantize_kernel import quantize_mxfp8


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def poisoned_mxfp8(rows: int, n: int) -> QuantizedActivation:
    """An MXFP8 out buffer whose every byte is garbage (e4m3 NaN, scale 0xAB)."""
    out = empty_mxfp8(rows, n, torch.device("cpu"))
    out.data.view(torch.uint8).fill_(0x7F)
    out.scale.fill_(0xAB)
    return out


def activation(rows: int, width: int, g: torch.Generator) -> torch.Tensor:
    """BF16 rows over several binades, an all-zero first row and a huge value
    (output scale bytes 0 and far above 127)."""
    x = torch.randn(rows, width, generator=g) * torch.exp2(
        torch.randint(-6, 7, (rows, 1), generator=g))
    x[0] = 0.0
    x[-1, 7] = 3.0e4
    return x.bfloat16()


def assert_same_bytes(got: QuantizedActivation, want: QuantizedActivation) -> None:
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(got.scale, want.scale)  # the whole buffer: padding too


# (rows, N per group, K, groups, tactic): block_n multiple of 32 in every case.
CASES = [
    (3, 128, 512, 1, Tactic(64, 16, 2, 4, 128)),  # tensor cores at few rows, split-K
    (13, 96, 352, 1, Tactic(32, 16, 1, 4, 128)),  # N/32 = 3 groups: a padding group
    (41, 64, 384, 1, Tactic(64, 64, 3, 4, 64)),  # masked 64-row tile, split-K
    (130, 64, 256, 2, Tactic(32, 64, 2, 4, 128)),  # grouped, 3 row tiles, rows past 128
    (8, 32, 256, 1, Tactic(32, 8, 1, 4, 128)),  # CUDA-core rows, whole-group block
]


@pytest.mark.parametrize("rows,n,k,groups,tactic", CASES)
@pytest.mark.parametrize("bf16_in", [True, False])
def test_mxfp8_out_is_the_quantized_bf16_output(rows, n, k, groups, tactic, bf16_in):
    g = gen(7 * rows + n + groups)
    layer = grouped_layer(groups, n, k, g) if groups > 1 else make_layer(n, k, generator=g)
    width, total_n = groups * k, groups * n
    x = activation(rows, width, g)
    a = x if bf16_in else quantize_mxfp8(x)
    bf16_out = launch_low_latency(layer, a, poisoned(rows, total_n), tactic)
    got = launch_low_latency(layer, a, poisoned_mxfp8(rows, total_n), tactic)
    want = quantize_mxfp8(bf16_out)
    assert_same_bytes(got, want)
    assert_same_bytes(got, quantize_mxfp8_ref(bf16_out))  # the spec's bytes, independently
    scales = unswizzle_scales(got.scale, rows, total_n)
    assert scales.max() > 135 and (scales[0] == 0).all()  # both edges exercised


def test_mxfp8_mm_out_in_the_epilogue_and_after():
    """``mxfp8_mm(..., mxfp8_out=True)`` == ``quantize_mxfp8(mxfp8_mm(...))`` for a
    [..., K] input, from the epilogue where the selected tactic has whole groups
    per program and after the GEMM where it has not (one-row tactics)."""
    g = gen(3)
    n, k = 256, 256
    layer = make_layer(n, k, generator=g)
    for rows in (1, 12, 40):
        x = activation(rows, k, g).reshape(2, rows // 2 or 1, k) if rows > 1 else \
            activation(1, k, g)
        in_epilogue = mxfp8_out_in_epilogue(layer, x.reshape(-1, k).shape[0])
        assert in_epilogue == (selected_tactic(layer, rows).block_n % 32 == 0)
        got = mxfp8_mm(layer, x, mxfp8_out=True)
        plain = mxfp8_mm(layer, x)
        assert got.orig_shape == plain.shape and got.orig_dtype == torch.bfloat16
        assert_same_bytes(got, quantize_mxfp8(plain))
    assert not mxfp8_out_in_epilogue(layer, 1)  # 8-column blocks at one row: after
    assert mxfp8_out_in_epilogue(layer, 40)
    # FP16 in: mxfp8_mm returns FP16, which rounds the BF16 output again (values past
    # 65504 become inf): quantized after the GEMM, from what it returns.
    assert not mxfp8_out_in_epilogue(layer, 40, torch.float16)
    x = (activation(40, k, g).float() * 3e3).half()
    got, plain = mxfp8_mm(layer, x, mxfp8_out=True), mxfp8_mm(layer, x)
    assert plain.isinf().any() and got.orig_dtype == torch.float16
    assert_same_bytes(got, quantize_mxfp8(plain))


def test_mxfp8_out_refusals():
    g = gen(5)
    layer = make_layer(64, 256, generator=g)
    x = activation(4, 256, g)
    with pytest.raises(ValueError, match="multiple of 32"):
        launch_low_latency(layer, x, poisoned_mxfp8(4, 64), Tactic(16, 16, 1, 4, 128))
    bad = empty_mxfp8(4, 64, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"out.data must be contiguous float8_e4m3fn \[4, 64\]"):
        launch_low_latency(layer, x, QuantizedActivation(bad.data[:3], bad.scale,
                                                         torch.bfloat16, torch.Size((3, 64))),
                           Tactic(32, 16, 1, 4, 128))
    with pytest.raises(ValueError, match="out.scale"):
        launch_low_latency(layer, x, QuantizedActivation(bad.data, bad.scale[:10],
                                                         torch.bfloat16, torch.Size((4, 64))),
                           Tactic(32, 16, 1, 4, 128))
    with pytest.raises(ValueError, match="BF16 tensor or a QuantizedActivation"):
        launch_low_latency(layer, x, (bad.data, bad.scale), Tactic(32, 16, 1, 4, 128))
