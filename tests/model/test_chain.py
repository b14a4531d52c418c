"""The model-level boundary chain on the tiny config in the interpreter (tp = 1),
and on 2 GPUs at the DSV4.1-Flash shapes."""

import dataclasses

import pytest
import torch
from small_models import MICRO

from decode_boundary.common.contract import STAGES
from decode_boundary.gemm import mxfp8_out_in_epilogue
from decode_boundary.gemm.tactics import PROLOGUE_MAX_ROWS
from decode_boundary.model.chain import AttentionBoundary
from decode_boundary.model.checks import (
    check_outputs,
    outputs_identical,
    run_simulated,
    simulated_boundaries,
)
from decode_boundary.model.config import MODELS


@pytest.fixture(scope="module")
def tiny_boundary():
    ab = AttentionBoundary(MODELS["tiny"], 1, 0, None, torch.device("cpu"), capacity=24, seed=3)
    ab.precompile([1, 2, 5])  # what a server does before its first step (a no-op compile here)
    yield ab
    ab.close()


def test_consecutive_steps_rotate_stages():
    """STAGES + 1 fused steps in a row on a fresh boundary walk the three mailbox
    stages and wrap back to the first; each stays exact. The micro config
    (tests/helpers/small_models.py): the rotation does not depend on the shapes."""
    ab = AttentionBoundary(MICRO, 1, 0, None, torch.device("cpu"), capacity=4, seed=3)
    try:
        for step in range(STAGES + 1):
            inputs = ab.make_inputs(2, seed=100 + step)
            fused = ab(inputs, fused=True)
            assert check_outputs(fused, ab.reference(inputs)) == []
    finally:
        ab.close()


def test_check_outputs_catches_a_wrong_answer(tiny_boundary):
    inputs = tiny_boundary.make_inputs(2, seed=7)
    out = tiny_boundary(inputs, fused=False)
    ref = tiny_boundary.reference(inputs)
    out.q.mul_(1.1)
    assert any(f.startswith("q:") for f in check_outputs(out, ref))


def test_bad_path(tiny_boundary):
    from decode_boundary.bench.paths import build

    with pytest.raises(ValueError, match="path must be one of"):
        build("nccl", tiny_boundary)


def test_two_simulated_ranks_fused_unfused_reference_and_rank_identity():
    ranks = simulated_boundaries(MODELS["tiny"], 2, capacity=8, seed=4)
    inputs = [b.make_inputs(3, seed=9) for b in ranks]
    assert not torch.equal(inputs[0].attn_out, inputs[1].attn_out)  # each rank its own
    unfused = run_simulated(ranks, inputs, fused=False)
    fused = run_simulated(ranks, inputs, fused=True)
    partials = [b.reference_partial(x) for b, x in zip(ranks, inputs, strict=True)]
    ref = ranks[0].reference(inputs[0], partials)
    for u, f in zip(unfused, fused, strict=True):
        assert outputs_identical(u, f)
        assert check_outputs(f, ref) == []
    assert outputs_identical(fused[0], fused[1])


def _count_launches(monkeypatch):
    """Names of the Triton kernels launched (the interpreter's grid executor)."""
    import triton.runtime.interpreter as interpreter

    launched = []
    original = interpreter.GridExecutor.__call__

    def counting(self, *args, **kwargs):
        launched.append(self.fn.__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", counting)
    return launched


@pytest.mark.parametrize("rows", [1, 5, 13, 20])
def test_fused_boundary_is_four_launches_unfused_five(tiny_boundary, rows, monkeypatch):
    """Grouped wo_a -> publishing wo_b -> consumer -> fused_wqa_wkv at a row
    count of each kind up to the capacity (1: the 1-row GEMM tactic; 5: the
    16-row tile and the consumer's tactic for 2-8 tokens, as at 8; 13: the
    16-row tile and the consumer's tactic beyond 8 tokens; 20: the 32-row tile,
    quantize first): wo_a's epilogue hands wo_b
    MXFP8 where its tactic allows (from 4 rows on the tiny shapes), else wo_b
    quantizes wo_a's BF16 in its prologue; above PROLOGUE_MAX_ROWS the attention
    output is quantized first. Unfused adds the publish kernel, and above
    PROLOGUE_MAX_ROWS the quantizer of wo_a's output. Fused and unfused are bit
    for bit the same and meet the reference."""
    gemm, quantize = "mxfp8_gemm_kernel", "quantize_mxfp8_kernel"
    first = [quantize] if rows > PROLOGUE_MAX_ROWS else []
    assert mxfp8_out_in_epilogue(tiny_boundary.wo_a, rows) == (rows >= 4)
    launched = _count_launches(monkeypatch)
    inputs = tiny_boundary.make_inputs(rows, seed=rows)
    fused = tiny_boundary(inputs, fused=True)
    assert launched == [*first, gemm, gemm, "consumer_kernel", gemm], launched
    launched.clear()
    unfused = tiny_boundary(inputs, fused=False)
    assert launched == [*first, gemm, *first, gemm, "publish_kernel", "consumer_kernel",
                        gemm], launched
    assert outputs_identical(fused, unfused)
    assert check_outputs(fused, tiny_boundary.reference(inputs)) == []


def test_precompile_covers_every_gemm_a_step_launches(monkeypatch):
    """Every GEMM variant a fused or unfused step launches (the handoff, the
    plain wo_b on MXFP8 where the publisher declines, the quantize-first rows)
    was compiled by ``precompile`` first, so no capture compiles. The
    publishing variants are compiled through the all-reduce (on the GPU), not
    here: the publisher is made to decline. The micro config
    (tests/helpers/small_models.py): its GEMMs take tiny's tactics at 1, 5
    and 20 rows."""
    import decode_boundary.gemm.api as api
    import decode_boundary.gemm.launcher as launcher

    seen = {False: set(), True: set()}
    original, original_warmup = launcher._launch_config, launcher.warmup_low_latency
    compiling = []  # non-empty inside warmup_low_latency: a compile, not a launch

    def recording(layer, a, out, tactic, publish, finish=None):
        grid, args, kwargs = original(layer, a, out, tactic, publish, finish)
        seen[not compiling].add((tuple(layer.weight.shape), tactic, kwargs["A_BF16"],
                                 kwargs["QUANT_OUT"], kwargs.get("FINISH_MIXES", False)))
        return grid, args, kwargs

    def warmup(*args, **kwargs):
        compiling.append(True)
        try:
            return original_warmup(*args, **kwargs)
        finally:
            compiling.pop()

    monkeypatch.setattr(launcher, "_launch_config", recording)
    monkeypatch.setattr(launcher, "warmup_low_latency", warmup)
    monkeypatch.setattr(api, "warmup_low_latency", warmup)
    ab = AttentionBoundary(MICRO, 1, 0, None, torch.device("cpu"), capacity=24, seed=5)
    rows_list = [1, 5, 20]
    ab.precompile(rows_list)
    monkeypatch.setattr(ab.publisher, "supports", lambda layer, rows: False)
    for rows in rows_list:
        for fused in (True, False):
            ab(ab.make_inputs(rows, seed=rows), fused=fused)
    assert seen[True] and seen[True] <= seen[False], seen[True] - seen[False]
    assert any(quant_out for *_, quant_out, _ in seen[True])  # the handoff ran
    ab.close()


def test_strong_baseline_is_close_to_the_reference(tiny_boundary):
    """cuBLAS-BF16-style GEMMs + the traced mHC (aot_eager: the graph torch.compile
    would hand inductor) against the MXFP8 reference: a speed baseline, so close,
    not equal; the eager mhc_rmsnorm matches the consumer reference on the same sum."""
    from decode_boundary.bench.baselines import (
        BASELINE_RTOL,
        StrongBaseline,
        check_baseline,
        mhc_rmsnorm,
    )
    from decode_boundary.boundary.reference import consumer_ref

    ab = tiny_boundary
    strong = StrongBaseline(ab, backend="aot_eager")
    inputs = ab.make_inputs(5, seed=21)
    args = (inputs.residual, inputs.post, inputs.comb, inputs.pre, ab.norm_weight, ab.config.eps)
    out = strong(inputs)
    assert check_baseline(out, ab.reference(inputs), ab, BASELINE_RTOL) == []
    # The baselines' mixes bar (BASELINE_MIXES_ATOL) still catches mixes computed wrongly.
    wrong = dataclasses.replace(out, next_post=out.next_post + 0.05)
    assert any(f.startswith("next_post") for f in
               check_baseline(wrong, ab.reference(inputs), ab, BASELINE_RTOL))
    reduced = torch.randn(5, ab.config.hidden).bfloat16()
    residual_out, layer_input = mhc_rmsnorm(reduced, *args)
    ref_residual, ref_input, _ = consumer_ref([reduced], *args, quantize=False)
    assert (residual_out.float() - ref_residual.float()).abs().max() <= \
        2**-7 * ref_residual.float().abs().max()
    assert (layer_input.float() - ref_input.float()).norm() <= 1e-2 * ref_input.float().norm()


def test_each_models_collapse_with_the_next_mixes():
    """The micro config (tests/helpers/small_models.py: tiny's structure,
    smaller) with V4.1's collapse (the given pre) and V4's (the pre
    computed from residual_out), two simulated ranks: fused and unfused
    bit-identical, the reference met, the next mixes within MIXES_ATOL of the
    spec of the path's own residual_out; V4's layer input is not V4.1's (it
    really collapses with the new pre), their residual_out and mixes are."""
    import dataclasses

    from decode_boundary.model.checks import check_mixes

    for name in ("v4-flash", "v4-pro"):
        assert MODELS[name].collapse_pre == "same"
    assert MODELS["v4.1-flash"].collapse_pre == "previous"
    outs = {}
    for semantics in ("previous", "same"):
        ranks = simulated_boundaries(dataclasses.replace(MICRO, collapse_pre=semantics),
                                     2, capacity=4, seed=6)
        inputs = [b.make_inputs(3, seed=11) for b in ranks]
        fused = run_simulated(ranks, inputs, fused=True)
        unfused = run_simulated(ranks, inputs, fused=False)
        partials = [b.reference_partial(x) for b, x in zip(ranks, inputs, strict=True)]
        ref = ranks[0].reference(inputs[0], partials)
        assert outputs_identical(fused[0], unfused[0]) and outputs_identical(fused[0], fused[1])
        assert check_outputs(fused[0], ref) == []
        assert check_mixes(fused[0], ranks[0]) == []
        outs[semantics] = fused[0]
    a, b = outs["previous"], outs["same"]
    assert torch.equal(a.residual_out, b.residual_out) and torch.equal(a.next_comb, b.next_comb)
    assert not torch.equal(a.layer_input, b.layer_input)
    with pytest.raises(ValueError, match="collapse_pre must be"):
        dataclasses.replace(MODELS["tiny"], collapse_pre="next")


def test_the_mixes_kernel_in_the_chain(monkeypatch):
    """V4.1's mixes from the mixes kernel (what the chain runs beyond
    MIXES_FUSED_MAX_ROWS, here patched to 0): launched right after the
    consumer, fused and unfused bit-identical, the reference met, the mixes
    within MIXES_ATOL of the spec of residual_out."""
    from decode_boundary.boundary import consumer_tactics
    from decode_boundary.model.checks import check_mixes

    monkeypatch.setattr(consumer_tactics, "MIXES_FUSED_MAX_ROWS", 0)
    ab = AttentionBoundary(MODELS["tiny"], 1, 0, None, torch.device("cpu"), capacity=8, seed=4)
    try:
        inputs = ab.make_inputs(5, seed=9)
        launched = _count_launches(monkeypatch)
        fused = ab(inputs, fused=True)
        assert launched == ["mxfp8_gemm_kernel", "mxfp8_gemm_kernel", "consumer_kernel",
                            "next_mixes_kernel", "mxfp8_gemm_kernel"], launched
        unfused = ab(inputs, fused=False)
        assert outputs_identical(fused, unfused)
        assert check_outputs(fused, ab.reference(inputs)) == []
        assert check_mixes(fused, ab) == []
    finally:
        ab.close()


def test_mixes_aside_in_the_chain(monkeypatch):
    """``mixes_aside=True`` (V4.1): the consumer without the mixes, then the
    mixes kernel (on the all-reduce's side stream on a GPU; inline here), no
    combining programs in the next GEMM; residual_out bit for bit the inline
    path's (the layer input need not be: another consumer tactic), fused =
    unfused, both ranks identical, the reference met and the mixes within
    MIXES_ATOL of the spec of residual_out; ``"auto"`` is inline below
    MIXES_ASIDE_MIN_ROWS (here patched to 4), aside from it.
    V4's collapse needs the mixes in the consumer: there the flag changes
    nothing, bit for bit. The micro config (tests/helpers/small_models.py): the
    dispatch does not depend on the shapes."""
    from decode_boundary.boundary import consumer_tactics
    from decode_boundary.model.checks import check_mixes

    ranks = simulated_boundaries(MICRO, 2, capacity=8, seed=7)
    assert ranks[0].mixes_aside_possible
    for rows in (1, 6):
        inputs = [b.make_inputs(rows, seed=20 + rows) for b in ranks]
        inline = run_simulated(ranks, inputs, fused=True)
        launched = _count_launches(monkeypatch)
        aside = run_simulated(ranks, inputs, fused=True, mixes_aside=True)
        assert launched == ["mxfp8_gemm_kernel", "mxfp8_gemm_kernel"] * 2 + [
            "consumer_kernel", "next_mixes_kernel", "mxfp8_gemm_kernel"] * 2, launched
        monkeypatch.undo()
        unfused = run_simulated(ranks, inputs, fused=False, mixes_aside=True)
        for b in ranks:
            b.join_mixes()  # nothing pending off the GPU: a no-op
        assert torch.equal(aside[0].residual_out, inline[0].residual_out)
        assert outputs_identical(aside[0], unfused[0]) and outputs_identical(aside[0], aside[1])
        partials = [b.reference_partial(x) for b, x in zip(ranks, inputs, strict=True)]
        assert check_outputs(aside[0], ranks[0].reference(inputs[0], partials)) == []
        assert check_mixes(aside[0], ranks[0]) == []
        monkeypatch.setattr(consumer_tactics, "MIXES_ASIDE_MIN_ROWS", 4)
        launched = _count_launches(monkeypatch)
        auto = run_simulated(ranks, inputs, fused=True, mixes_aside="auto")
        assert launched.count("next_mixes_kernel") == (2 if rows >= 4 else 0), launched
        assert outputs_identical(auto[0], aside[0] if rows >= 4 else inline[0])
        monkeypatch.undo()
        for bad in ("yes", 0, None):  # refused before anything is published
            with pytest.raises(ValueError, match="mixes_aside must be True, False or 'auto'"):
                ranks[0](inputs[0], mixes_aside=bad)
    same = simulated_boundaries(dataclasses.replace(MICRO, collapse_pre="same"), 1,
                                capacity=4, seed=7)[0]
    assert not same.mixes_aside_possible
    inputs = same.make_inputs(3, seed=2)
    assert outputs_identical(same(inputs, mixes_aside=True), same(inputs))
    for b in (*ranks, same):
        b.close()


@pytest.mark.gpu
def test_gpu_mixes_aside_streams_and_graphs():
    """On the GPU, V4.1-Flash at TP-4 shapes (one rank, H = 5120), M = 1, 16
    and 40 (the last beyond MIXES_FUSED_MAX_ROWS): eager steps with the mixes
    on the side stream give the inline path's residual_out bits once joined,
    mixes within MIXES_ATOL of the spec, the reference met;
    a graph of three such steps that joins at its end replays to the eager
    bits (the mixes too: the same kernel); consecutive steps join by
    themselves; a capture cannot join an eager call's pending mixes.
    residual_out is the inline path's bit for bit; the layer input and q are
    held to the reference (another consumer tactic: benchmarks/mixes_aside_ab.py
    found one layer-input element apart at M = 8)."""
    from decode_boundary.model.checks import MIX_NAMES, OUTPUT_NAMES, check_mixes

    device = torch.device("cuda", torch.cuda.current_device())
    ab = AttentionBoundary(MODELS["v4.1-flash"], 4, 0, None, device, capacity=40, seed=12)
    rows_list = (1, 16, 40)
    ab.precompile(rows_list)
    try:
        for rows in rows_list:
            inputs = ab.make_inputs(rows, seed=rows)
            inline = ab(inputs)
            aside = ab(inputs, mixes_aside=True)
            again = ab(inputs, mixes_aside=True)  # joins the first one's mixes itself
            ab.join_mixes()
            torch.cuda.synchronize(device)
            assert torch.equal(aside.residual_out.view(torch.int16),
                               inline.residual_out.view(torch.int16)), rows
            assert outputs_identical(aside, again)
            assert check_mixes(aside, ab) == [] and check_mixes(inline, ab) == []
            assert check_outputs(aside, ab.reference(inputs)) == []
            pending = ab(inputs, mixes_aside=True)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph), pytest.raises(RuntimeError, match="join_mixes"):
                ab.join_mixes()
            ab.join_mixes()
            torch.cuda.synchronize(device)
            assert outputs_identical(pending, aside)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = [ab(inputs, mixes_aside=True) for _ in range(3)]
                ab.join_mixes()
            for out in outs:
                for name in OUTPUT_NAMES + MIX_NAMES:
                    getattr(out, name).fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize(device)
            for out in outs:
                assert outputs_identical(out, aside), rows
    finally:
        ab.close()
