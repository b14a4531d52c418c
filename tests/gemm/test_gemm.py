"""MXFP8 GEMM in the interpreter: reference vs FP64, kernel vs the bar for
every tactic family (split-K, wide tiles, multi-tile rows), public API paths."""

import pytest
import torch
from gemm_helpers import CASES, exact_activation, exact_layer, make_input, make_layer, poisoned
from gemm_row_ranges import low_latency_mm, pinned_mm, projection_mm, wide_mm, wide_or_pinned_mm
from independent_ref import (
    assert_mxfp8_equal,
    bf16_rne,
    check_gemm,
    decode_mxfp8,
    layer_values,
    mxfp8_bytes,
    summation_depth,
)

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
from decode_boundary.gemm.reference import (
    REL_SUM_TOLERANCE,
    bf16_ulp,
    check_mxfp8_mm,
    mxfp8_mm_exact,
    mxfp8_mm_ref,
)
from decode_boundary.mxfp8.format import (
    QuantizedActivation,
    quantize_mxfp8_ref,
)
from decode_boundary.mxfp8.quantize_kernel import quantize_mxfp8


def gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows,n,k", [(1, 64, 96), (5, 192, 320), (12, 128, 1024)])
def test_reference_meets_bar_and_bar_can_fail(rows, n, k):
    """mxfp8_mm_ref against the independent FP64 product rounded once (exact but
    where its FP32 sums, 32 per group then the K/32 groups, may cross a BF16
    rounding boundary: 1 ulp there), and the package's checker rejects an
    element moved past its bound."""
    g = gen(rows * 7 + n)
    layer, qa = make_layer(n, k, generator=g), make_input(rows, k, generator=g)
    ref = mxfp8_mm_ref(qa, layer.weight, layer.weight_scale)
    assert ref.dtype == torch.bfloat16 and ref.shape == (rows, n)
    check_mxfp8_mm(ref, qa, layer.weight, layer.weight_scale)
    check_gemm(ref, decode_mxfp8(qa.data, qa.scale), layer_values(layer), depth=32 + k // 32,
               min_strict=0.8)
    # One element moved to twice its bound away from the FP64 value (rounded to
    # BF16 away from it): the checker must notice, always.
    exact, abs_sum = mxfp8_mm_exact(qa, layer.weight, layer.weight_scale)
    i, j = rows // 2, n // 3
    bound = bf16_ulp(exact[i, j]) + REL_SUM_TOLERANCE * abs_sum[i, j]
    bad = ref.clone()
    moved = bf16_rne(exact[i, j] + 2 * bound)
    assert moved.double() - exact[i, j] > bound
    bad[i, j] = moved
    with pytest.raises(AssertionError, match=rf"out\[{i}, {j}\].*1 elements out of bound"):
        check_mxfp8_mm(bad, qa, layer.weight, layer.weight_scale)


@pytest.mark.parametrize("rows,n,k,tactic", [CASES[0], CASES[2], CASES[5], CASES[8]])
def test_bf16_input_is_quantized_in_the_prologue_bit_for_bit(rows, n, k, tactic):
    """BF16 in == quantize_mxfp8 then the GEMM, same bits (same kernel
    arithmetic), and both against the independent reference."""
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
    # Both sides share the kernel's arithmetic; the independent side: the
    # quantizer's bytes are the spec's, the product is the FP64 one rounded once
    # (1 ulp only where FP32 accumulation may cross a rounding boundary).
    assert_mxfp8_equal(qa.data, qa.scale, x)
    check_gemm(fused, decode_mxfp8(qa.data, qa.scale), layer_values(layer),
               depth=summation_depth(k, tactic), min_strict=0.8)


def test_grouped_gemm_equals_per_group_gemms():
    """wo_a: one launch over G groups == torch.cat of the groups' own GEMMs,
    bit for bit with the same tactic; mxfp8_mm of the grouped layer against the
    independent FP64 product (rounded once; 1 ulp only where FP32 accumulation
    may cross a rounding boundary); the grouped reference == per-group ones."""
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
    check_gemm(mxfp8_mm(grouped, x), decode_mxfp8(*mxfp8_bytes(x)), layer_values(grouped),
               groups, depth=summation_depth(k, selected_tactic(grouped, rows)), min_strict=0.8)
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
    the independent FP64 product rounded once (1 ulp only where FP32
    accumulation in the tactic's order may cross a rounding boundary)."""
    g = gen(100 + seed)
    for n, k, groups in SCALED_SHAPES:
        rows = int(torch.randint(1, 65, (1,), generator=g))
        layer = grouped_layer(groups, n, k, g)
        x = torch.randn(rows, groups * k, generator=g).bfloat16()
        qx = quantize_mxfp8_ref(x)
        values, weights = decode_mxfp8(*mxfp8_bytes(x)), layer_values(layer)
        depth = summation_depth(k, selected_tactic(layer, rows))
        for a in (x, qx):
            out = mxfp8_mm(layer, a)
            check_gemm(out, values, weights, groups, depth=depth, min_strict=0.8,
                       what=f"{(n, k, groups)} M={rows}")


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


def test_ineligible_layer_is_refused_and_the_reference_computes_it():
    """N % 16 != 0: no kernel takes the layer, so ``mxfp8_mm`` refuses it with a
    ValueError naming the shape rule (no silent slow path), and so does a
    misaligned weight; the reference, callable by its own name, computes it.
    Exact bar: integer operands whose FP32 sums are exact, so the output is the
    FP64 product rounded once."""
    g = gen(3)
    layer = exact_layer(40, 64, g, base=(120, 130))
    qa = exact_activation(3, 64, g, base=(124, 130))
    assert low_latency_mm(layer, qa) is None
    with pytest.raises(ValueError, match=r"cannot take this layer: .*N = 40.*% 16 == 0"):
        mxfp8_mm(layer, qa)
    out = mxfp8_mm_ref(qa, layer.weight, layer.weight_scale).reshape(3, 40)
    check_gemm(out, decode_mxfp8(qa.data, qa.scale), layer_values(layer), exact_sums=True)
    eligible = make_layer(64, 128, generator=g)
    shifted = torch.empty(eligible.weight_scale.numel() + 1, dtype=torch.uint8)[1:]
    shifted.copy_(eligible.weight_scale)
    eligible.weight_scale = shifted
    with pytest.raises(ValueError, match="16-byte aligned"):
        mxfp8_mm(eligible, make_input(2, 128, generator=g))


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


def test_shape_representatives_and_precompile(monkeypatch):
    g = gen(8)
    layers = [make_layer(128, 64, generator=g), make_layer(64, 128, generator=g),
              make_layer(128, 64, generator=g), make_layer(40, 64, generator=g)]
    reps = shape_representatives(layers)
    assert [tuple(r.weight.shape) for r in reps] == [(128, 64), (64, 128)]
    assert reps[1] is layers[0]  # sorted by (N, K, groups)
    # Fresh caches: what precompile allocates is exactly what the split-K
    # tactics of these row counts need (nothing left by earlier tests counts).
    monkeypatch.setattr(launcher, "_WORKSPACES", {})
    monkeypatch.setattr(launcher, "_COUNTERS", {})
    big = make_layer(128, 2048, generator=g)
    rows_list = [1, 8, 40]
    precompile(big, rows_list)  # launches nothing; allocates what split-K needs
    tactics = {rows: selected_tactic(big, rows) for rows in rows_list}
    assert tactics[8].split_k > 1 and tactics[1].split_k == 1
    assert tactics[8].rows_tile == 16  # for BF16 and MXFP8 input alike
    want_ws, want_counters = set(), set()
    for rows, t in tactics.items():
        if t.split_k > 1:
            m_tiles = -(-rows // t.rows_tile)
            want_ws.add(pow2_bytes(m_tiles * 128 * t.rows_tile * t.split_k * 4))
            want_counters.add(pow2_bytes(m_tiles * (128 // t.block_n) * 4))
    cpu = torch.device("cpu")
    host = launcher.HOST_STREAM  # the one stream of a CPU launch
    assert set(launcher._WORKSPACES) == {(cpu, host, size) for size in want_ws}
    assert set(launcher._COUNTERS) == {(cpu, host, size) for size in want_counters}
    for (_, _, size), buf in launcher._WORKSPACES.items():
        assert buf.numel() * 4 == size
    # A launch after precompile finds its buffers: nothing new is allocated, and
    # the counters it used are re-armed (zero) for the next launch.
    ws = dict(launcher._WORKSPACES)
    qa = make_input(8, 2048, generator=g)
    out = launch_low_latency(big, qa, poisoned(8, 128), tactics[8])
    assert ws == launcher._WORKSPACES and all(launcher._WORKSPACES[key] is ws[key] for key in ws)
    assert all(int(c.abs().sum()) == 0 for c in launcher._COUNTERS.values())
    check_mxfp8_mm(out, qa, big.weight, big.weight_scale)


class FakeStream:
    """A stand-in for a torch.cuda.Stream (id, device, wait_stream) on a CPU-only host."""

    def __init__(self, stream_id, device):
        self.stream_id, self.device, self.waited = stream_id, device, []

    def wait_stream(self, other):
        self.waited.append(other)

    def __repr__(self):
        return f"<FakeStream {self.stream_id}>"


def pow2_bytes(nbytes):
    """The size launcher._cached rounds a request to: a power of two, >= 4096."""
    return max(4096, 1 << (nbytes - 1).bit_length())


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
