"""The bench's strongest user-built step (``bench.user_step``): its one Triton
kernel for the mixes (``bench.user_mixes_kernel``) against the pure-torch spec
``mhc_mixes_ref`` on fresh random inputs (several M, hc and Sinkhorn rounds,
NaN-poisoned outputs), its refusals, and the step itself — inline, aside, and
V4's inline-only — checked as the bench checks it (``check_baseline``, the
mixes within MIXES_ATOL of the spec of its own residual_out). CPU: the
interpreter, the graphs traced with aot_eager, the steps on the micro config
(tests/helpers/small_models.py: tiny's hidden and hc, narrower projections);
GPU: compiled, at DSV4.1-Flash's TP-4 shapes, under the bench's timer (a CUDA
graph with the side stream)."""

import dataclasses
import os

import pytest
import torch
from small_models import MICRO

from decode_boundary.bench.baselines import BASELINE_RTOL, check_baseline, collapse_rmsnorm
from decode_boundary.bench.paths import applies, baselines_for, build, join_all, paths_for
from decode_boundary.bench.report import DEFAULT_BASELINES
from decode_boundary.bench.user_mixes_kernel import BLOCK_M, launch_user_mixes
from decode_boundary.bench.user_step import UserStep, fp32_matmul, user_mixes
from decode_boundary.mixes.reference import mhc_mixes_ref
from decode_boundary.model.chain import AttentionBoundary
from decode_boundary.model.checks import MIX_NAMES, MIXES_ATOL
from decode_boundary.model.config import MODELS


def _mix_inputs(rows: int, hc: int, hidden: int, gen: torch.Generator, device="cpu"):
    """Random streams [M, hc, H] (BF16, per-token magnitudes) and mix weights
    with the spread a trained model's have (logits of a few units)."""
    n_mix = (2 + hc) * hc
    streams = (torch.randn(rows, hc, hidden, generator=gen)
               * torch.exp2(torch.randint(-3, 4, (rows, 1, 1), generator=gen))).bfloat16()
    hc_fn = torch.randn(n_mix, hc * hidden, generator=gen) * (2.0 / (hc * hidden) ** 0.5)
    hc_scale = torch.rand(3, generator=gen) + 0.5
    hc_base = torch.randn(n_mix, generator=gen) * 0.5
    return [t.to(device) for t in (streams, hc_fn, hc_scale, hc_base)]


def _max_err(got, want) -> float:
    return max((a.double() - b.double()).abs().max().item() for a, b in zip(got, want,
                                                                           strict=True))


@pytest.mark.parametrize(("rows", "hc", "iters"), [
    (1, 4, 20),  # V4.1-Flash's hc and rounds, one token
    (5, 4, 1),  # no round after the first normalisation
    (BLOCK_M + 3, 2, 3),  # a second, mostly masked program
    (2 * BLOCK_M, 8, 7),  # two full programs, a wider hc
    (3, 1, 2),  # one stream: comb is 1 x 1
])
def test_kernel_matches_the_spec(rows, hc, iters):
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    streams, hc_fn, hc_scale, hc_base = _mix_inputs(rows, hc, 64, gen)
    rms_eps, hc_eps = 1e-6, 1e-6
    s = streams.float().reshape(rows, -1)
    projected = s @ hc_fn.t()
    rstd = torch.rsqrt(s.square().mean(dim=-1) + rms_eps)
    out = (torch.full((rows, hc), float("nan")), torch.full((rows, hc), float("nan")),
           torch.full((rows, hc, hc), float("nan")))
    got = launch_user_mixes(projected, rstd, hc_scale, hc_base, hc_eps, iters, out=out)
    assert all(g is o for g, o in zip(got, out, strict=True))  # written in place
    want = mhc_mixes_ref(streams, hc_fn, hc_scale, hc_base, rms_eps, hc_eps, iters)
    assert _max_err(got, want) <= MIXES_ATOL, f"seed {seed}"
    # The user's whole computation (projection + RMS + the kernel): the same spec.
    assert _max_err(user_mixes(streams, hc_fn, hc_scale, hc_base, rms_eps, hc_eps, iters),
                    want) <= MIXES_ATOL, f"seed {seed}"
    # Not a result that ignores its inputs: another base gives other mixes.
    other = launch_user_mixes(projected, rstd, hc_scale, hc_base + 1.0, hc_eps, iters)
    assert _max_err(other, want) > 100 * MIXES_ATOL


def test_kernel_refuses_what_it_cannot_take():
    gen = torch.Generator().manual_seed(1)
    streams, hc_fn, hc_scale, hc_base = _mix_inputs(2, 4, 32, gen)
    s = streams.float().reshape(2, -1)
    projected, rstd = s @ hc_fn.t(), torch.ones(2)
    good = (projected, rstd, hc_scale, hc_base, 1e-6, 3)
    cases = [
        ((projected.double(), *good[1:]), "projected"),
        ((projected[:, :20], *good[1:]), "width 20"),
        ((torch.zeros(2, 15), torch.ones(2), torch.ones(3), torch.ones(15), 1e-6, 3), "hc"),
        ((projected, torch.ones(3), *good[2:]), "rstd"),
        ((projected, rstd, torch.ones(2), *good[3:]), "hc_scale"),
        ((*good[:3], hc_base[:-1], *good[4:]), "hc_base"),
        ((*good[:5], 0), "sinkhorn_iters"),
        ((*good[:4], 0.0, 3), "hc_eps"),
    ]
    for args, name in cases:
        with pytest.raises(ValueError, match=name):
            launch_user_mixes(*args)
    with pytest.raises(ValueError, match="out"):
        launch_user_mixes(*good, out=(torch.empty(2, 4), torch.empty(2, 4), torch.empty(2, 4)))


@pytest.fixture(scope="module")
def boundaries():
    made = {collapse: AttentionBoundary(dataclasses.replace(MICRO, collapse_pre=collapse),
                                        1, 0, None, torch.device("cpu"), capacity=8, seed=11)
            for collapse in ("previous", "same")}
    yield made
    for ab in made.values():
        ab.close()


@pytest.mark.parametrize(("collapse", "aside"), [("previous", False), ("previous", True),
                                                 ("same", False)])
def test_user_step_passes_the_bench_check(boundaries, collapse, aside):
    ab = boundaries[collapse]
    step = UserStep(ab, aside=aside, backend="aot_eager")
    inputs = ab.make_inputs(5, seed=int.from_bytes(os.urandom(2), "little"))
    out = step(inputs)
    join_all(ab, [step])()
    ref = ab.reference(inputs)
    assert check_baseline(out, ref, ab, BASELINE_RTOL, MIXES_ATOL) == []
    # The bars still catch mixes or outputs computed wrongly.
    wrong = dataclasses.replace(out, next_comb=out.next_comb + 1e-4)
    assert any(f.startswith("next_comb") for f in
               check_baseline(wrong, ref, ab, BASELINE_RTOL, MIXES_ATOL))
    wrong = dataclasses.replace(out, q=-out.q)
    assert any(f.startswith("q") for f in check_baseline(wrong, ref, ab, BASELINE_RTOL,
                                                         MIXES_ATOL))
    # The collapse takes V4's new pre (these very mixes), V4.1's given one.
    pre = out.next_pre if collapse == "same" else inputs.pre
    assert torch.equal(out.layer_input, collapse_rmsnorm(out.residual_out, pre, ab.norm_weight,
                                                         ab.config.eps))


def test_inline_and_aside_compute_the_same_bits(boundaries):
    ab = boundaries["previous"]
    inputs = ab.make_inputs(3, seed=4)
    inline = UserStep(ab, backend="aot_eager")(inputs)
    aside_step = UserStep(ab, aside=True, backend="aot_eager")
    aside = aside_step(inputs)
    aside_step.join()
    for name in ("residual_out", "layer_input", "q", *MIX_NAMES):
        assert torch.equal(getattr(inline, name), getattr(aside, name)), name


def test_verify_rows_checks_the_user_steps(boundaries, monkeypatch):
    """The bench's verification (``harness.verify_rows``) with the user steps
    as its baselines: fine as built, and a user kernel gone slightly wrong (its
    base off by 1e-3: mixes off by ~1e-4, inside the compiled baselines' bar but
    not MIXES_ATOL) is named."""
    from decode_boundary.bench import harness, user_step

    ab = boundaries["previous"]
    baselines = {"user_step": UserStep(ab, backend="aot_eager"),
                 "user_step_aside": UserStep(ab, aside=True, backend="aot_eager")}
    stages, first_call_s = [], {}
    verdict = harness.verify_rows(ab, 3, None, baselines, stages.append, first_call_s)
    assert verdict["ok"] and verdict["failures"] == [], verdict
    # What a log shows as each part begins, and each baseline's first call timed.
    assert stages == ["verifying M = 3: ours, fused and unfused",
                      "verifying M = 3: compiling baseline user_step",
                      "verifying M = 3: compiling baseline user_step_aside"]
    assert set(first_call_s) == set(baselines)
    assert all(list(s) == ["3"] and s["3"] > 0 for s in first_call_s.values())
    launch = user_step.launch_user_mixes
    monkeypatch.setattr(user_step, "launch_user_mixes",
                        lambda *args: launch(*args[:3], args[3] + 1e-3, *args[4:]))
    verdict = harness.verify_rows(ab, 3, None, baselines)
    assert not verdict["ok"]
    assert {f.split()[0] for f in verdict["failures"]} == {"user_step", "user_step_aside"}


def test_v4_has_no_aside_user_step(boundaries):
    v4, v41 = boundaries["same"], boundaries["previous"]
    assert not applies("user_step_aside", v4) and applies("user_step_aside", v41)
    assert applies("user_step", v4)
    # The bench's default set leaves compiled_step out; --baselines picks, in order.
    assert paths_for(v41, DEFAULT_BASELINES) == ["user_step", "user_step_aside",
                                                 "strong_baseline", "baseline", "unfused",
                                                 "fused", "fused_invariant"]
    assert paths_for(v4, DEFAULT_BASELINES) == ["user_step", "strong_baseline", "baseline",
                                                "unfused", "fused", "fused_invariant"]
    assert baselines_for(v41, ("baseline", "compiled_step")) == ["compiled_step", "baseline"]
    assert paths_for(v4) == ["user_step", "compiled_step", "strong_baseline", "baseline",
                             "unfused", "fused", "fused_invariant"]
    with pytest.raises(ValueError, match="user_step_aside"):
        build("user_step_aside", v4)
    with pytest.raises(ValueError, match="cannot run aside"):
        UserStep(v4, aside=True, backend="aot_eager")


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_gpu_kernel_matches_the_spec_at_flash_shapes(rows):
    """Compiled for the device at V4.1-Flash's hc and hidden size, 20 rounds."""
    c = MODELS["v4.1-flash"]
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    streams, hc_fn, hc_scale, hc_base = _mix_inputs(rows, c.hc_mult, c.hidden, gen, "cuda")
    want = mhc_mixes_ref(streams.cpu(), hc_fn.cpu(), hc_scale.cpu(), hc_base.cpu(), c.eps,
                         c.hc_eps, c.hc_sinkhorn_iters)
    s = streams.float().reshape(rows, -1)
    out = tuple(torch.full_like(w, float("nan"), device="cuda") for w in want)
    with fp32_matmul():
        projected = s @ hc_fn.t()
    got = launch_user_mixes(projected, torch.rsqrt(s.square().mean(dim=-1) + c.eps),
                            hc_scale, hc_base, c.hc_eps, c.hc_sinkhorn_iters, out=out)
    assert _max_err([g.cpu() for g in got], want) <= MIXES_ATOL, f"seed {seed}"
    got = user_mixes(streams, hc_fn, hc_scale, hc_base, c.eps, c.hc_eps, c.hc_sinkhorn_iters)
    assert _max_err([g.cpu() for g in got], want) <= MIXES_ATOL, f"seed {seed}"


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["v4.1-flash", "v4-flash"])
def test_gpu_user_steps_under_the_bench_timer(model):
    """Each user step of the model at TP-4 shapes on one GPU, as the bench runs
    it: checked eagerly, then timed in a CUDA graph (the aside one joined at
    its end), then checked again on the graph's last outputs."""
    from decode_boundary.bench.timing import graph_time_us

    ab = AttentionBoundary(MODELS[model], 4, 0, None, torch.device("cuda"), capacity=16, seed=2)
    try:
        for name in [n for n in ("user_step", "user_step_aside") if applies(n, ab)]:
            step = build(name, ab)
            inputs = ab.make_inputs(16, seed=16)
            ref = ab.reference(inputs)
            out = step(inputs)
            join_all(ab, [step])()
            assert check_baseline(out, ref, ab, BASELINE_RTOL, MIXES_ATOL) == [], name
            kept = []

            def timed(step=step, kept=kept, inputs=inputs):
                kept[:] = [step(inputs)]

            us = graph_time_us([timed], ab.device, join=join_all(ab, [step]))
            torch.cuda.synchronize()
            assert 0 < us < 10_000, (name, us)
            assert check_baseline(kept[0], ref, ab, BASELINE_RTOL, MIXES_ATOL) == [], name
            assert all(torch.equal(getattr(kept[0], n), getattr(out, n)) for n in MIX_NAMES), name
    finally:
        ab.close()


@pytest.mark.parametrize("collapse", ["previous", "same"])
def test_user_step_stages_are_its_launches(boundaries, collapse):
    """The breakdown's stages of the headline baseline, run in order, give the
    step's own outputs: its compiled graph(s) and the mixes kernel, nothing left out."""
    ab = boundaries[collapse]
    step = UserStep(ab, backend="aot_eager")
    inputs = ab.make_inputs(3, seed=int.from_bytes(os.urandom(2), "little"))
    want = step(inputs)
    results = [fn() for fn in step.stages(inputs).values()]
    assert len(results) == (4 if collapse == "same" else 3)
    for got, ref in zip(results[2], (want.next_pre, want.next_post, want.next_comb),
                        strict=True):
        assert torch.equal(got, ref)
    first = results[0] if collapse == "same" else results[0][0]
    assert torch.equal(first, want.residual_out)
    if collapse == "same":
        assert torch.equal(results[3][0], want.layer_input)


def test_the_breakdown_times_the_inline_user_step(boundaries):
    step = UserStep(boundaries["previous"], aside=True, backend="aot_eager")
    with pytest.raises(ValueError, match="inline"):
        step.stages(boundaries["previous"].make_inputs(2, seed=0))
