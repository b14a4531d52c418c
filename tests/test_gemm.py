"""MXFP8 GEMM in the interpreter: reference vs FP64, kernel vs the bar for
every tactic family (split-K, wide tiles, multi-tile rows), public API paths."""

from types import SimpleNamespace

import pytest
import torch
from gemm_helpers import make_input, make_layer, poisoned
from gemm_row_ranges import low_latency_mm, pinned_mm, projection_mm, wide_mm, wide_or_pinned_mm

from decode_boundary.gemm import (
    Tactic,
    launcher,
    mxfp8_mm,
    precompile,
    selected_tactic,
    shape_representatives,
)
from decode_boundary.gemm.launcher import launch_low_latency
from decode_boundary.gemm.linear import Mxfp8Linear
from decode_boundary.gemm.reference import check_mxfp8_mm, dequantize_weight, mxfp8_mm_ref
from decode_boundary.mxfp8.format import (
    QuantizedActivation,
    dequantize_mxfp8,
    quantize_mxfp8_ref,
    swizzle_scales,
)
from decode_boundary.mxfp8.quantize_kernel import quantize_mxfp8


def gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows,n,k", [(1, 64, 96), (5, 192, 320), (12, 128, 1024)])
def test_reference_meets_bar_and_bar_can_fail(rows, n, k):
    g = gen(rows * 7 + n)
    layer, qa = make_layer(n, k, generator=g), make_input(rows, k, generator=g)
    ref = mxfp8_mm_ref(qa, layer.weight, layer.weight_scale)
    assert ref.dtype == torch.bfloat16 and ref.shape == (rows, n)
    check_mxfp8_mm(ref, qa, layer.weight, layer.weight_scale)
    # The FP64 product of the dequantized operands, computed independently.
    exact = dequantize_mxfp8(qa, torch.float64) @ dequantize_weight(
        layer.weight, layer.weight_scale).t()
    assert torch.allclose(ref.double(), exact, rtol=2**-7, atol=1e-30)
    # Off by 3 BF16 ulps in one element: the checker must notice.
    bad = ref.clone()
    bad[rows // 2, n // 3] = (ref[rows // 2, n // 3].float() * (1 + 3 * 2**-7)).bfloat16()
    if bad[rows // 2, n // 3] != ref[rows // 2, n // 3]:
        with pytest.raises(AssertionError, match="out of bound"):
            check_mxfp8_mm(bad, qa, layer.weight, layer.weight_scale)


# (rows, N, K, tactic): every family the tables use, plus the edges the kernel masks.
# Tactic(block_n, rows_tile, split_k, num_warps, chunk_k).
CASES = [
    (1, 128, 256, Tactic(8, 1, 1, 4, 256)),  # CUDA cores, one piece
    (1, 64, 1280, Tactic(4, 1, 1, 2, 512)),  # three pieces, the last one half masked
    (2, 96, 640, Tactic(16, 2, 3, 4, 128)),  # 20 groups over 3 splits: last one short
    (4, 64, 160, Tactic(8, 4, 1, 4, 64)),  # K % 64 != 0: a masked group
    (8, 48, 512, Tactic(16, 8, 2, 2, 128)),  # N not a multiple of 32
    (3, 128, 512, Tactic(64, 16, 2, 4, 128)),  # tensor cores at few rows
    (13, 128, 352, Tactic(32, 16, 1, 4, 128)),  # wide 16, K = 11 groups
    (29, 64, 256, Tactic(16, 32, 1, 4, 64)),  # wide 32
    (41, 64, 384, Tactic(64, 64, 3, 4, 64)),  # wide 48 as a masked 64, split-K
    (70, 64, 256, Tactic(32, 32, 2, 4, 128)),  # 3 row tiles, split-K per tile
]


@pytest.mark.parametrize("rows,n,k,tactic", CASES)
def test_kernel_meets_bar_and_repeats_bits(rows, n, k, tactic):
    g = gen(rows + n + k)
    layer, qa = make_layer(n, k, generator=g), make_input(rows, k, generator=g)
    out = launch_low_latency(layer, qa, poisoned(rows, n), tactic)
    check_mxfp8_mm(out, qa, layer.weight, layer.weight_scale)
    again = launch_low_latency(layer, qa, poisoned(rows, n), tactic)
    assert torch.equal(out.view(torch.int16), again.view(torch.int16))
    if tactic.split_k > 1:  # the last program re-armed every counter it used
        assert all(int(c.abs().sum()) == 0 for c in launcher._COUNTERS.values())


@pytest.mark.parametrize("rows,n,k,tactic", [CASES[0], CASES[2], CASES[5], CASES[8]])
def test_bf16_input_is_quantized_in_the_prologue_bit_for_bit(rows, n, k, tactic):
    """BF16 in == quantize_mxfp8 then the GEMM, same bits (same kernel arithmetic)."""
    g = gen(31 * rows + k)
    layer = make_layer(n, k, generator=g)
    x = (torch.randn(rows, k, generator=g) * torch.exp2(torch.randint(-6, 7, (rows, 1),
                                                                      generator=g))).bfloat16()
    x[0, :5] = 0.0  # an all-zero stretch and a huge value exercise scale bytes 0 and > 127
    x[-1, 40] = 3.0e4
    fused = launch_low_latency(layer, x, poisoned(rows, n), tactic)
    qa = quantize_mxfp8(x)
    two_step = launch_low_latency(layer, qa, poisoned(rows, n), tactic)
    assert torch.equal(fused.view(torch.int16), two_step.view(torch.int16))
    check_mxfp8_mm(fused, quantize_mxfp8_ref(x), layer.weight, layer.weight_scale)


def test_grouped_gemm_equals_per_group_gemms():
    """wo_a: one launch over G groups == torch.cat of the groups' own GEMMs,
    bit for bit with the same tactic, and within the bar of the grouped reference."""
    g = gen(17)
    groups, n, k, rows = 3, 64, 192, 5
    linears = [Mxfp8Linear(lay.weight.t().contiguous(), lay.weight_scale)
               for lay in (make_layer(n, k, generator=g) for _ in range(groups))]
    grouped = Mxfp8Linear.grouped(linears)
    assert grouped.groups == groups and tuple(grouped.weight.shape) == (k, groups * n)
    x = torch.randn(rows, groups * k, generator=g).bfloat16()
    for tactic in (Tactic(16, 8, 1, 4, 64), Tactic(32, 16, 2, 4, 64)):
        out = launch_low_latency(grouped, x, poisoned(rows, groups * n), tactic)
        parts = [launch_low_latency(lin, x[:, i * k:(i + 1) * k].contiguous(),
                                    poisoned(rows, n), tactic) for i, lin in enumerate(linears)]
        assert torch.equal(out.view(torch.int16), torch.cat(parts, 1).view(torch.int16))
    qx = quantize_mxfp8_ref(x)
    check_mxfp8_mm(mxfp8_mm(grouped, x), qx, grouped.weight, grouped.weight_scale, groups)
    ref = mxfp8_mm_ref(qx, grouped.weight, grouped.weight_scale, groups)
    per_group = torch.cat([mxfp8_mm_ref(quantize_mxfp8_ref(x[:, i * k:(i + 1) * k]), lin.weight,
                                        lin.weight_scale) for i, lin in enumerate(linears)], 1)
    assert torch.equal(ref, per_group)
    for i, lin in enumerate(linears):  # group(g) gives the group back
        back = grouped.group(i)
        assert torch.equal(back.weight.t(), lin.weight.t()) and \
            torch.equal(back.weight_scale, lin.weight_scale)


def grouped_layer(groups: int, n: int, k: int, generator) -> Mxfp8Linear:
    """A grouped linear of ``groups`` random [n, k] weights."""
    return Mxfp8Linear.grouped([Mxfp8Linear(lay.weight.t().contiguous(), lay.weight_scale)
                                for lay in (make_layer(n, k, generator=generator)
                                            for _ in range(groups))])


# The DSV4.1 TP-4 shapes scaled down (N / 64, K / 16; wq_b K / 8) as (N per
# group, K, groups): wo_b, wq_b, fused_wqa_wkv, grouped wo_a, V4-Pro wo_b.
SCALED_SHAPES = [(80, 128, 1), (128, 160, 1), (32, 320, 1), (16, 256, 2), (112, 256, 1)]


@pytest.mark.parametrize("seed", range(3))
def test_random_rows_on_scaled_down_shapes(seed):
    """Random M in 1..64, the selected tactic, BF16 and MXFP8 inputs, against
    the FP64 bar and the reference."""
    g = gen(100 + seed)
    for n, k, groups in SCALED_SHAPES:
        rows = int(torch.randint(1, 65, (1,), generator=g))
        layer = grouped_layer(groups, n, k, g)
        x = torch.randn(rows, groups * k, generator=g).bfloat16()
        qx = quantize_mxfp8_ref(x)
        for a in (x, qx):
            out = mxfp8_mm(layer, a)
            check_mxfp8_mm(out, qx, layer.weight, layer.weight_scale, groups)


def test_split_k_sums_partials_in_split_order():
    """Split-K output == BF16 of the FP32 partials added in split order 0..S-1.

    Integer elements and one scale per K-block make each split's partial exact
    (p_s = 2^E_s x an integer below 2^13); block 2 is block 0 negated, so
    ((p0 + p1) + p2) + p3 loses p1's low bits while any order adding p0 and
    p2 first would keep them: the bits tell the order apart.
    """
    g = gen(5)
    rows, n, k, exps = 4, 64, 512, (24, 0, 24, -3)
    w = torch.randint(-6, 7, (n, k), generator=g).float()
    a = torch.randint(-6, 7, (rows, k), generator=g).float()
    w[:, 256:384], a[:, 256:384] = -w[:, 0:128], a[:, 0:128]
    w_scale = torch.tensor([127 + e for e in exps for _ in range(4)], dtype=torch.uint8)
    layer = SimpleNamespace(weight=w.to(torch.float8_e4m3fn).t(),
                            weight_scale=swizzle_scales(w_scale.expand(n, 16).contiguous()),
                            bias=None)
    qa = QuantizedActivation(a.to(torch.float8_e4m3fn),
                             swizzle_scales(torch.full((rows, 16), 127, dtype=torch.uint8)),
                             torch.bfloat16, a.shape)
    out = launch_low_latency(layer, qa, poisoned(rows, n), Tactic(64, 4, 4, 4, 128))
    partials = [(a[:, 128 * s:128 * (s + 1)].double() @ w[:, 128 * s:128 * (s + 1)].double().t()
                 * 2.0 ** exps[s]).float() for s in range(4)]
    in_order = ((partials[0] + partials[1]) + partials[2]) + partials[3]
    other_order = ((partials[0] + partials[2]) + partials[1]) + partials[3]
    assert not torch.equal(in_order.bfloat16(), other_order.bfloat16())
    assert torch.equal(out.view(torch.int16), in_order.bfloat16().view(torch.int16))


def test_public_paths_by_row_range():
    g = gen(11)
    n, k = 128, 256
    layer = make_layer(n, k, generator=g)
    x = (torch.randn(2, 3, k, generator=g)).bfloat16()  # BF16 input, 6 rows, quantized inside
    out = mxfp8_mm(layer, x)
    assert out.shape == (2, 3, n) and out.dtype == torch.bfloat16
    qa = quantize_mxfp8_ref(x)
    check_mxfp8_mm(out, qa, layer.weight, layer.weight_scale)
    assert torch.equal(low_latency_mm(layer, x), out)
    assert torch.equal(projection_mm(layer, x, low_batch=True), out)
    check_mxfp8_mm(low_latency_mm(layer, qa), qa, layer.weight, layer.weight_scale)
    assert wide_mm(layer, qa) is None and pinned_mm(layer, qa) is None
    wide_in = make_input(20, k, generator=g)
    wide = wide_or_pinned_mm(layer, wide_in)
    assert low_latency_mm(layer, wide_in) is None and wide is not None
    check_mxfp8_mm(wide, wide_in, layer.weight, layer.weight_scale)
    assert selected_tactic(layer, 20).rows_tile == 32
    many = make_input(60, k, generator=g)
    assert pinned_mm(layer, many) is None  # (128, 256) is not a pinned shape
    check_mxfp8_mm(mxfp8_mm(layer, many), many, layer.weight, layer.weight_scale)


def test_ineligible_layer_falls_back_and_bias_is_added():
    g = gen(3)
    layer = make_layer(40, 64, generator=g)  # N % 16 != 0: no kernel takes it
    qa = make_input(3, 64, generator=g)
    assert low_latency_mm(layer, qa) is None
    out = mxfp8_mm(layer, qa)
    assert torch.equal(out, mxfp8_mm_ref(qa, layer.weight, layer.weight_scale))
    layer.bias = torch.randn(40, generator=g).bfloat16()
    assert torch.equal(mxfp8_mm(layer, qa), out + layer.bias)


def test_bad_arguments_raise_clear_errors():
    g = gen(4)
    layer = make_layer(64, 128, generator=g)
    qa = make_input(2, 128, generator=g)
    with pytest.raises(ValueError, match="K = 96"):
        mxfp8_mm(layer, make_input(2, 96, generator=g))
    with pytest.raises(ValueError, match="float tensor"):
        mxfp8_mm(layer, torch.ones(2, 128, dtype=torch.int32))
    bad_weight = type(layer)(weight=layer.weight.t().contiguous().t().float(),
                             weight_scale=layer.weight_scale, bias=None)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        mxfp8_mm(bad_weight, qa)
    row_major = type(layer)(weight=layer.weight.contiguous(), weight_scale=layer.weight_scale,
                            bias=None)
    with pytest.raises(ValueError, match="column-major"):
        mxfp8_mm(row_major, qa)
    short = type(layer)(weight=layer.weight, weight_scale=layer.weight_scale[:100], bias=None)
    with pytest.raises(ValueError, match="weight_scale"):
        mxfp8_mm(short, qa)
    with pytest.raises(ValueError, match="contiguous"):
        mxfp8_mm(layer, QuantizedActivation(qa.data.t().contiguous().t(), qa.scale,
                                            torch.bfloat16, qa.orig_shape))
    with pytest.raises(ValueError, match="tactic"):
        launch_low_latency(layer, qa, poisoned(2, 64), Tactic(128, 2, 1, 4, 128))
    with pytest.raises(ValueError, match="out must be"):
        launch_low_latency(layer, qa, poisoned(2, 64).float(), Tactic(64, 2, 1, 4, 128))
    with pytest.raises(ValueError, match="bfloat16"):
        launch_low_latency(layer, torch.ones(2, 128), poisoned(2, 64), Tactic(64, 2, 1, 4, 128))
    with pytest.raises(ValueError, match="groups"):
        mxfp8_mm(type(layer)(weight=layer.weight, weight_scale=layer.weight_scale, bias=None,
                             groups=3), qa)


def test_shape_representatives_and_precompile():
    g = gen(8)
    layers = [make_layer(128, 64, generator=g), make_layer(64, 128, generator=g),
              make_layer(128, 64, generator=g), make_layer(40, 64, generator=g)]
    reps = shape_representatives(layers)
    assert [tuple(r.weight.shape) for r in reps] == [(128, 64), (64, 128)]
    assert reps[1] is layers[0]  # sorted by (N, K, groups)
    before = dict(launcher._WORKSPACES)
    big = make_layer(128, 2048, generator=g)
    precompile(big, [1, 8, 40])  # launches nothing; allocates what split-K needs
    assert selected_tactic(big, 8).split_k > 1
    assert len(launcher._WORKSPACES) >= len(before)
    assert any(buf.numel() * 4 >= 128 * 16 * selected_tactic(big, 8).split_k
               for buf in launcher._WORKSPACES.values())
    assert selected_tactic(big, 8).rows_tile == 16  # for BF16 and MXFP8 input alike


def test_custom_op_matches_api_and_has_a_fake():
    from decode_boundary.gemm.ops import mxfp8_mm_op

    g = gen(9)
    layer, qa = make_layer(64, 128, generator=g), make_input(3, 128, generator=g)
    out = torch.ops.decode_boundary.mxfp8_mm(qa.data, qa.scale, layer.weight, layer.weight_scale)
    assert torch.equal(out, mxfp8_mm(layer, qa))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        args = [mode.from_tensor(t) for t in (qa.data, qa.scale, layer.weight, layer.weight_scale)]
        fake = mxfp8_mm_op(*args)
    assert fake.shape == (3, 64) and fake.dtype == torch.bfloat16
