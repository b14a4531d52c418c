"""The consumer's numerics against an independent FP64 computation
(tests/helpers/independent_ref.py ``consumer_fp64``) and the package's reference
(``boundary.reference.consumer_ref``), at an RMSNorm eps that matters: eps =
1.0 next to rows whose mean square is far below it, near it and far above it,
and all-zero rows, where only eps keeps rsqrt(mean square + eps) finite (0 x inf
would be NaN). Covered: ``consume`` (gathered and Lamport, serial tactics of
several chunks, and cooperative tactics of several chunks with the programs
run concurrently: tests/helpers/concurrent_programs.py), ``BoundaryAllReduce``, the
strong baseline's ``mhc_rmsnorm`` (eager and traced) and the eager baseline
(``EagerBaseline``: its ``torch._scaled_mm`` runs on CPU).

Bars. The inputs are dyadic (small integers times powers of two) so that every
FP32 sum before the norm is exact (asserted by ``consumer_fp64``): reduced,
residual_out and prenorm are the FP64 values rounded once to BF16, and the
bar for residual_out is exact, bit for bit. layer_input: the FP64 RMSNorm of
that prenorm rounded once to BF16, exact except where the FP32 error of the
norm (length-H sum of squares in any order, rsqrt, two products: see
``consumer_fp64``) may cross a BF16 rounding boundary, where the neighbour 1
ulp away is allowed too; all-zero rows are exactly zero. The MXFP8 output
equals the independent MXFP8 of the kernel's own layer_input, byte for byte,
scale padding included.
"""

from __future__ import annotations

import pytest
import torch
from independent_ref import (
    assert_mxfp8_equal,
    bf16_rne,
    check_rounded_once,
    consumer_fp64,
    e4m3_code,
    e4m3_values,
    gamma,
)

from decode_boundary.boundary.all_reduce import BoundaryAllReduce
from decode_boundary.boundary.consumer import consume, sumsq_columns
from decode_boundary.boundary.consumer_kernel import FULL
from decode_boundary.boundary.consumer_tactics import ConsumerTactic
from decode_boundary.boundary.reference import consumer_ref
from decode_boundary.gemm.reference import bf16_ulp
from decode_boundary.mxfp8.format import mxfp8_scale_bytes

EPS = 1.0
H, HC, TOP_K = 256, 4, 2
# Per-token magnitude: an all-zero token, a token whose pre is zero (residual_out
# nonzero, prenorm zero), then mean squares far below, near and far above EPS.
TOKEN_SCALES = (0.0, 1.0, 2.0**-6, 0.5, 8.0)
ZERO_ROWS = (0, 1)


def exact_inputs(tp, seed, h=H, hc=HC, scales=TOKEN_SCALES):
    """Dyadic step inputs (module docstring): partials and residual k/8 (|k| <= 8)
    times the token's power-of-two scale, post in quarters up to 2, comb and pre
    in eighths up to 1, gamma 1 + k/64."""
    g = torch.Generator().manual_seed(seed)
    m = len(scales)
    t = torch.tensor(scales, dtype=torch.float64)

    def eighths(*shape, lo=-8, hi=8):
        return torch.randint(lo, hi + 1, shape, generator=g).double() / 8

    xs = [(eighths(m, h) * t[:, None]).bfloat16() for _ in range(tp)]
    residual = (eighths(m, hc, h) * t[:, None, None]).bfloat16()
    pre = eighths(m, hc, lo=1).float()
    pre[1] = 0.0
    d = dict(xs=xs, residual=residual, post=(torch.randint(0, 9, (m, hc), generator=g) / 4.0),
             comb=eighths(m, hc, hc, lo=0).float(), pre=pre,
             gamma=(1 + torch.randint(-8, 9, (h,), generator=g) / 64.0).bfloat16())
    return d


def mxfp8_buffers(m, h=H, device="cpu"):
    data = torch.full((m, h), 0x7F, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    return data, torch.full((mxfp8_scale_bytes(m, h),), 0xAB, dtype=torch.uint8, device=device)


def check_step(d, res_out, layer, q=None, eps=EPS, rounded_once=True):
    """residual_out, layer_input (and MXFP8) against consumer_fp64 and consumer_ref
    (module docstring's bars). ``rounded_once=False``: layer_input may be one BF16
    step from the once-rounded FP64 value everywhere (a path that does not fix the norm's
    rounding points, e.g. inductor's fused reduction and approximate rsqrt); eps
    still moves these inputs by many steps, so a missing eps is still caught."""
    want_res, prenorm, y, y_eps = consumer_fp64(d["xs"], d["residual"], d["post"], d["comb"],
                                                d["pre"], d["gamma"], eps)
    assert torch.equal(res_out.cpu().view(torch.int16), want_res.view(torch.int16))
    for r in ZERO_ROWS:
        assert bool((prenorm[r] == 0).all()) and bool((layer[r].cpu() == 0).all()), r
    if rounded_once:
        check_rounded_once(layer, y, y_eps, "layer_input", min_strict=0.95)
    else:
        # One step from the once-rounded value: |layer - rne(y)| <= ulp(rne(y)) (the
        # step below a power of two is half that, so it passes too), i.e. up to 1.5
        # ulps from the unrounded y; a missing eps moves these rows by >= 8 steps.
        once = bf16_rne(y).double()
        assert bool(((layer.cpu().double() - once).abs() <= bf16_ulp(once)).all())
    ref_res, ref_layer, _ = consumer_ref([x.cpu() for x in d["xs"]], d["residual"].cpu(),
                                         d["post"].cpu(), d["comb"].cpu(), d["pre"].cpu(),
                                         d["gamma"].cpu(), eps)
    assert torch.equal(res_out.cpu().view(torch.int16), ref_res.view(torch.int16))
    diff = (layer.cpu().double() - ref_layer.double()).abs()
    assert bool((diff <= bf16_ulp(ref_layer.double())).all())
    if q is not None:
        assert_mxfp8_equal(q[0], q[1], layer)


def test_eps_matters_for_these_inputs():
    """The premise: the mean squares span << eps, ~ eps and >> eps; where the
    mean square is not far above eps, eps = 1 moves the FP64 result by many
    ulps; eps = 0 makes the zero rows NaN."""
    d = exact_inputs(2, seed=1)
    _, prenorm, y, _ = consumer_fp64(d["xs"], d["residual"], d["post"], d["comb"], d["pre"],
                                     d["gamma"], EPS)
    _, _, y0, _ = consumer_fp64(d["xs"], d["residual"], d["post"], d["comb"], d["pre"],
                                d["gamma"], 0.0)
    mean_sq = (prenorm**2).mean(-1)
    assert mean_sq[2] < 0.01 * EPS and 0.25 * EPS < mean_sq[3] < 4 * EPS and mean_sq[4] > 20 * EPS
    assert bool(y0[list(ZERO_ROWS)].isnan().all())
    live = [2, 3]
    moved = (bf16_rne(y[live]).double() - bf16_rne(y0[live]).double()).abs()
    assert bool((moved.amax(-1) > 8 * bf16_ulp(y[live].abs().amax(-1))).all())


def test_reference_at_an_eps_that_matters():
    """consumer_ref (and its MXFP8) against the independent FP64 computation."""
    d = exact_inputs(3, seed=2)
    res_out, layer, quantized = consumer_ref(d["xs"], d["residual"], d["post"], d["comb"],
                                             d["pre"], d["gamma"], EPS, quantize=True)
    check_step(d, res_out, layer)
    assert_mxfp8_equal(quantized.data, quantized.scale, layer)


def scratch(m, h=H, poison=True):
    """Norm scratch as the mailbox holds it (poisoned: NaN partials under an old tag)."""
    fill = float("nan") if poison else 0.0
    stale = torch.tensor(fill).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return dict(generation=torch.zeros(m + 1, dtype=torch.int32),
                status=torch.zeros(1, dtype=torch.int32), wait_bound=100_000,
                sumsq=torch.full((m + 1, sumsq_columns(h)), int(stale), dtype=torch.int64),
                prenorm=torch.full((m + 1, h), fill, dtype=torch.bfloat16))


def gathered_step(d, s, tactic, quantize=True):
    m = d["xs"][0].shape[0]
    q = mxfp8_buffers(m) if quantize else None
    res_out, layer, *_ = consume(torch.stack(d["xs"]), len(d["xs"]), m, mode=FULL, **s,
                             residual=d["residual"], post=d["post"], comb=d["comb"],
                             pre=d["pre"], norm_weight=d["gamma"], eps=EPS, mxfp8_out=q,
                             lamport=False, tactic=tactic)
    return res_out, layer, q


SERIAL = [ConsumerTactic(32, 1, False), ConsumerTactic(64, 2, False),
          ConsumerTactic(256, 4, False)]


@pytest.mark.parametrize("tactic", SERIAL)
def test_serial_consumer_at_an_eps_that_matters(tactic):
    """The interpreter's path: one program per token walking 8, 4 or 1 chunks."""
    d = exact_inputs(2, seed=3)
    s = scratch(len(TOKEN_SCALES))
    check_step(d, *gathered_step(d, s, tactic))
    assert s["status"].item() == 0


COOPERATIVE = [ConsumerTactic(128, 4, True), ConsumerTactic(32, 1, True),
               ConsumerTactic(64, 2, True)]


def test_cooperative_consumer_over_several_chunks(cooperative_in_the_interpreter):
    """The GPU default's path, programs concurrent: each publishes its chunk's
    sum of squares, waits for the token's other chunks and normalises its own.
    Launches on one (poisoned) scratch cut the row into 2, then 8 cooperative
    chunks, then 4 serial ones: none may take a partial of the launch before
    (each rewrites the token's row under its own tag); no timeout."""
    s = scratch(len(TOKEN_SCALES))
    m = len(TOKEN_SCALES)
    for step, tactic in enumerate([COOPERATIVE[0], COOPERATIVE[1], SERIAL[1]], start=1):
        d = exact_inputs(2, seed=10 * step)
        check_step(d, *gathered_step(d, s, tactic))
        assert s["status"].item() == 0, tactic
        assert s["generation"][:m].eq(step).all() and s["generation"][m:].eq(0).all()
        assert (s["sumsq"][:m] >> 32).eq(step).all(), tactic


def test_cooperative_programs_do_not_meet_in_sequence():
    """Without concurrent programs the cooperative tactic is refused in the
    interpreter (it would time out: program 0 waits for chunks that never run)."""
    d = exact_inputs(2, seed=4)
    with pytest.raises(ValueError, match="interpreter"):
        gathered_step(d, scratch(len(TOKEN_SCALES)), COOPERATIVE[0])


def test_boundary_all_reduce_lamport_at_an_eps_that_matters(cooperative_in_the_interpreter):
    """BoundaryAllReduce over two simulated ranks (Lamport mailbox, two steps
    through the stages), a cooperative consumer tactic of 4 chunks with
    concurrent programs: every rank's outputs pass the bars and are
    bit-identical."""
    tactic = COOPERATIVE[2]
    ars = BoundaryAllReduce.simulated(2, H, HC, len(TOKEN_SCALES), TOP_K,
                                      quantize_layer_input=True, residual_only=False,
                                      wait_timeout_s=60.0, tactic=tactic)
    for step in range(2):
        d = exact_inputs(2, seed=20 + step)
        for ar, x in zip(ars, d["xs"], strict=True):
            ar.publish(x)
        outs = []
        for ar, x in zip(ars, d["xs"], strict=True):
            q = mxfp8_buffers(x.shape[0])
            res_out, layer, *_ = ar(x, residual=d["residual"], post=d["post"], comb=d["comb"],
                                    pre=d["pre"], norm_weight=d["gamma"], norm_eps=EPS, mxfp8_out=q)
            check_step(d, res_out, layer, q)
            outs.append((res_out, layer, q[0].view(torch.uint8), q[1]))
        for a, b in zip(*outs, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for ar in ars:
            ar.check()


def strong_inputs(seed):
    d = exact_inputs(1, seed)
    return d["xs"][0], (d["residual"], d["post"], d["comb"], d["pre"], d["gamma"], EPS), d


@pytest.mark.parametrize("traced", [False, True])
def test_strong_baseline_mhc_rmsnorm_at_an_eps_that_matters(traced):
    """bench.baselines.mhc_rmsnorm (what StrongBaseline compiles), eager and
    traced the way StrongBaseline compiles it (aot_eager: the graph inductor
    would get), against the same bars."""
    from decode_boundary.bench.baselines import mhc_rmsnorm

    fn = mhc_rmsnorm
    if traced:
        torch._dynamo.reset()
        fn = torch.compile(mhc_rmsnorm, dynamic=False, fullgraph=True, backend="aot_eager")
    reduced, args, d = strong_inputs(seed=5)
    res_out, layer = fn(reduced, *args)
    check_step(d, res_out, layer)


def test_eager_baseline_on_cpu():
    """EagerBaseline (the ``baseline`` path) runs on CPU: its row-wise FP8 pieces
    against independent FP64 computations, its consumer (``all_reduce_then_mhc``,
    one rank) against the bars at eps = 1, and the whole path close to the
    MXFP8 reference (a speed baseline of other numerics: EAGER_RTOL)."""
    from decode_boundary.bench.baselines import (
        EAGER_RTOL,
        EagerBaseline,
        RowwiseFp8Linear,
        all_reduce_then_mhc,
        check_baseline,
        rowwise_fp8,
    )
    from decode_boundary.model.chain import AttentionBoundary
    from decode_boundary.model.config import MODELS

    g = torch.Generator().manual_seed(6)
    # rowwise_fp8: scale = amax / 448 (FP32), data = e4m3 RNE of clamp(x / scale).
    x = (torch.randn(5, 96, generator=g) * torch.exp2(torch.randint(-6, 7, (5, 1),
                                                                    generator=g))).bfloat16()
    x[2] = 0.0  # an all-zero row: amax clamps to 1e-12, data stays zero
    data, scale = rowwise_fp8(x)
    amax = x.double().abs().amax(-1, keepdim=True).clamp(min=1e-12)
    want_scale = (amax.float() / 448).double()
    assert torch.equal(scale.double(), want_scale)
    scaled = (x.double() / want_scale).float().double().clamp(-448, 448)
    assert torch.equal(data.view(torch.uint8).long(), e4m3_code(scaled))
    # RowwiseFp8Linear: the product of its own FP8 operands (decoded here), FP32 sums.
    tiny = AttentionBoundary(MODELS["tiny"], 1, 0, None, torch.device("cpu"), capacity=8, seed=3)
    lin = RowwiseFp8Linear(tiny.wo_b)
    a = torch.randn(3, tiny.wo_b.weight.shape[0], generator=g).bfloat16()
    out = lin(a)
    a_data, a_scale = rowwise_fp8(a)
    exact = (e4m3_values(a_data.view(torch.uint8)) * a_scale.double()) @ \
        (e4m3_values(lin.weight_t.view(torch.uint8)) * lin.scale_t.double())
    mag = (e4m3_values(a_data.view(torch.uint8)).abs() * a_scale.double()) @ \
        (e4m3_values(lin.weight_t.view(torch.uint8)).abs() * lin.scale_t.double())
    check_rounded_once(out, exact, gamma(a.shape[1] + 2) * mag + 2.0**-40 * mag,
                       "RowwiseFp8Linear", min_strict=0.5)
    # Its consumer at eps = 1 with zero rows.
    reduced, args, d = strong_inputs(seed=7)
    res_out, layer, quantized = all_reduce_then_mhc(reduced, *args, group=None, quantize=True)
    check_step(d, res_out, layer)
    assert_mxfp8_equal(quantized.data, quantized.scale, layer)
    # The whole path.
    eager = EagerBaseline(tiny)
    inputs = tiny.make_inputs(5, seed=21)
    assert check_baseline(eager(inputs), tiny.reference(inputs), tiny, EAGER_RTOL) == []
    tiny.close()


# ------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("tactic", [None, ConsumerTactic(128, 4, True),
                                    ConsumerTactic(256, 2, False)])
def test_gpu_consumer_at_an_eps_that_matters(tactic):
    """On the GPU (compiled, cooperative by default: H = 2048 in 4 chunks of the
    table's 512 columns, or 16 of 128; and a serial tactic), one rank's mailbox,
    three steps: the same bars (the GPU's rsqrt.approx is within the norm's
    bound, see consumer_fp64)."""
    h, dev, tp = 2048, "cuda", 1
    ars = BoundaryAllReduce.simulated(tp, h, HC, len(TOKEN_SCALES), TOP_K, device=dev,
                                      quantize_layer_input=True, residual_only=False,
                                      tactic=tactic)
    for ar in ars:
        ar.precompile([len(TOKEN_SCALES)])
    for step in range(3):
        d = exact_inputs(tp, seed=30 + step, h=h)
        d = {k: ([x.to(dev) for x in v] if k == "xs" else v.to(dev)) for k, v in d.items()}
        for ar, x in zip(ars, d["xs"], strict=True):
            ar.publish(x)
        for ar, x in zip(ars, d["xs"], strict=True):
            q = mxfp8_buffers(x.shape[0], h, dev)
            res_out, layer, *_ = ar(x, residual=d["residual"], post=d["post"], comb=d["comb"],
                                    pre=d["pre"], norm_weight=d["gamma"], norm_eps=EPS, mxfp8_out=q)
            check_step(d, res_out, layer, q)


@pytest.mark.gpu
def test_gpu_strong_baseline_mhc_rmsnorm_at_an_eps_that_matters():
    """mhc_rmsnorm compiled by inductor for the GPU, as StrongBaseline does."""
    from decode_boundary.bench.baselines import mhc_rmsnorm

    torch._dynamo.reset()
    fn = torch.compile(mhc_rmsnorm, dynamic=False, fullgraph=True)
    reduced, args, d = strong_inputs(seed=8)
    args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
    res_out, layer = fn(reduced.cuda(), *args)
    # Inductor fuses the mean square in its own order and uses the hardware rsqrt:
    # measured on the H200, 147 of 1280 elements one BF16 step from the once-rounded
    # FP64 value. A speed baseline (BASELINE_RTOL), so one step is its bar.
    check_step(d, res_out, layer, rounded_once=False)


def test_baseline_bars_at_the_real_shapes():
    """The bench's bars for its baselines (``check_baseline``) at DSV4.1-Flash's
    TP-4 shapes, M = 2: the eager baseline (row-wise FP8), which missed the
    common 8e-2 bar there (q 8.04 %, next_post 11 % from its own residual_out),
    passes its own; wrong outputs fail: q off by 30 %, and mixes 0.02 away
    from those of the baseline's own residual_out (twice ``BASELINE_MIXES_ATOL``,
    the bar that lets Inductor keep the FP32 mix in its fused kernels: 1.3e-3 to
    3.9e-3 from the spec on the GPU)."""
    import dataclasses

    from decode_boundary.bench.baselines import (
        BASELINE_MIXES_ATOL,
        BASELINE_RTOL,
        EAGER_RTOL,
        EagerBaseline,
        baseline_rtol,
        check_baseline,
    )
    from decode_boundary.model.chain import AttentionBoundary
    from decode_boundary.model.checks import check_outputs
    from decode_boundary.model.config import MODELS

    assert baseline_rtol("baseline") == EAGER_RTOL
    assert baseline_rtol("strong_baseline") == baseline_rtol("compiled_step") == BASELINE_RTOL
    ab = AttentionBoundary(MODELS["v4.1-flash"], 4, 0, None, torch.device("cpu"), 2, seed=0)
    inputs = ab.make_inputs(2, seed=2)
    ref = ab.reference(inputs)
    out = EagerBaseline(ab)(inputs)
    old_bar = check_outputs(out, ref, BASELINE_RTOL)
    assert any(f.startswith("q:") for f in old_bar), old_bar
    assert check_baseline(out, ref, ab, EAGER_RTOL) == []
    wrong_q = dataclasses.replace(out, q=(out.q.float() * 1.3).to(out.q.dtype))
    assert [f for f in check_baseline(wrong_q, ref, ab, EAGER_RTOL) if f.startswith("q:")]
    nudged = dataclasses.replace(out, next_post=out.next_post + 2 * BASELINE_MIXES_ATOL)
    assert [f for f in check_baseline(nudged, ref, ab, EAGER_RTOL)
            if f.startswith("next_post:")]
    ab.close()
