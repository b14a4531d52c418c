"""The bench's two ways of the next mixes (``bench.mixes``) on the micro config
(tests/helpers/small_models.py: ``tiny``'s structure, smaller) in the
interpreter, the timer stubbed so every timed call runs once: each way
computes the same mixes (within MIXES_ATOL) and, for V4, the same layer input,
every weight copy is used, and the table reports the JSON's numbers."""

import dataclasses

import pytest
import torch
from small_models import MICRO

import decode_boundary.bench.mixes as mixes
from decode_boundary.bench import report
from decode_boundary.model.chain import AttentionBoundary
from decode_boundary.model.checks import MIXES_ATOL
from decode_boundary.model.config import MODELS
from decode_boundary.mxfp8.format import dequantize_mxfp8


@pytest.mark.parametrize("collapse", ["previous", "same"])
def test_both_ways_compute_the_same(collapse, monkeypatch):
    monkeypatch.setattr(mixes, "_compiled", lambda fn, backend: torch.compile(
        fn, dynamic=False, fullgraph=True, backend="aot_eager"))
    ab = AttentionBoundary(dataclasses.replace(MICRO, collapse_pre=collapse), 1, 0,
                           None, torch.device("cpu"), 4, seed=5)
    views = ab.weight_copies(2)
    ran = {}

    def once(calls, device, group):
        ran.setdefault(len(ran), [c() for c in calls])  # every weight copy, once
        return 1.0 + len(ran)

    monkeypatch.setattr(mixes, "graph_time_us", once)
    result = mixes.time_mixes(views, [2], torch.device("cpu"), None)
    ab.close()
    assert result["collapse"] == collapse and [r["rows"] for r in result["rows"]] == [2]
    want = {"fused": 2.0, "consumer": 3.0, "separate": 4.0, "consumer_then_separate": 5.0}
    if collapse == "previous":  # V4.1 also times our mixes kernel after the consumer
        want["mixes_kernel"] = 6.0
    n = len(want)
    want.update(fused_with_gemm=2.0 + n, consumer_with_gemm=3.0 + n)
    assert result["rows"][0]["us"] == want
    assert result["rows"][0]["failures"] == []  # every way checked before the timing
    fused, consumer, separate, both = (ran[i] for i in range(4))
    with_gemm, plain_with_gemm = ran[n], ran[n + 1]
    for copy in range(2):
        # The chain's pair: the mixes the GEMM combined are the consumer's bits; the
        # consumer's outputs and, with V4.1's given pre, the GEMM's are the plain pair's.
        res_out, layer_input, q, gemm_mixes = with_gemm[copy]
        assert all(torch.equal(a, b) for a, b in zip(gemm_mixes, fused[copy][3], strict=True))
        assert torch.equal(res_out, plain_with_gemm[copy][0])
        if collapse == "previous":
            assert torch.equal(layer_input, plain_with_gemm[copy][1])
            assert torch.equal(q, plain_with_gemm[copy][2])
        if collapse == "previous":  # the mixes kernel's: the same consumer, mixes in the bar
            res_out, layer_input, _, kernel_mixes = ran[4][copy]
            assert torch.equal(res_out, fused[copy][0])
            assert torch.equal(layer_input, fused[copy][1])
            for a, b in zip(kernel_mixes, fused[copy][3], strict=True):
                assert (a - b).abs().max().item() <= MIXES_ATOL
        res_out, layer_input, _, fused_mixes = fused[copy]
        assert torch.equal(consumer[copy][0], res_out)  # the same consumer, mixes aside
        if collapse == "same":
            (quantized, tail_mixes), (quantized_2, tail_mixes_2) = separate[copy], both[copy]
            assert torch.equal(quantized.data, quantized_2.data)
            y = dequantize_mxfp8(quantized)
            assert (y - layer_input.float()).abs().max() <= 2 ** -3 * layer_input.float().abs(
            ).max()  # one MXFP8 step of the same layer input, at most
        else:
            tail_mixes, tail_mixes_2 = separate[copy], both[copy]
        for a, b, c in zip(fused_mixes, tail_mixes, tail_mixes_2, strict=True):
            assert (a - b).abs().max().item() <= MIXES_ATOL and torch.equal(b, c)
    # Two weight copies: their mixes differ (each copy has its own hc_fn).
    assert not torch.equal(fused[0][3][2], fused[1][3][2])
    table = report.mixes_table({**report.new_result(
        "bench", "x", report.environment(False, []), {"model": "tiny", "tp": 1}),
        "mixes": result})
    text = report.render(table)
    assert f"{collapse} pre" in text and "-1.00" in text and "2.50x" in text
    headers = [column.header for column in table.columns]
    assert ("consumer + mixes kernel" in headers) == (collapse == "previous")
    assert headers[-3:] == ["fused + GEMM", "consumer + GEMM", "difference"]
    cells = [list(column.cells) for column in table.columns[-3:]]
    assert cells == [[f"{want['fused_with_gemm']:.2f}"], [f"{want['consumer_with_gemm']:.2f}"],
                     [f"{want['fused_with_gemm'] - want['consumer_with_gemm']:+.2f}"]]


def test_parts_rotate_over_enough_copies(monkeypatch):
    """The breakdown's stages and the mixes paths read one layer or only
    hc_fn: they rotate over enough copies for their smallest part (here an
    L2 stub of 8 x the smallest part's bytes, 2 of them: 17 copies; tiny's
    smallest is wo_a), the whole step over the first of those (the same
    seeds as ``cold_copies``)."""
    from decode_boundary.bench import harness
    from decode_boundary.bench.gemm import mxfp8_weight_bytes

    ab = AttentionBoundary(MODELS["tiny"], 1, 0, None, torch.device("cpu"), 4, seed=5)
    c = ab.config
    sizes = (harness.mix_weight_bytes(ab), mxfp8_weight_bytes(*c.wo_a_shape()),
             mxfp8_weight_bytes(*c.wo_b_shape(1)), mxfp8_weight_bytes(*c.fused_wqa_wkv_shape()))
    l2 = 8 * min(sizes)
    monkeypatch.setattr(harness, "copies_for_cold_l2",
                        lambda per_copy, device: max(2, 2 * l2 // per_copy + 1))
    parts = harness.cold_copies_for_parts(ab)
    whole = harness.copies_for_cold_l2(harness.boundary_weight_bytes(ab.config, 1), ab.device)
    assert len(parts) == 17 > whole
    assert parts[0] is ab and len({id(v.wo_b) for v in parts}) == 17
    assert len({v.mix_weights[0].data_ptr() for v in parts}) == 17
    same = harness.cold_copies(ab)
    assert len(same) == whole
    for a, b in zip(same[1:], parts[1:whole], strict=True):
        assert torch.equal(a.mix_weights[0], b.mix_weights[0])
    ab.close()


def test_the_ways_are_checked_before_timing(monkeypatch):
    """``check_ways`` fails a way whose mixes are off the spec (here: the spec
    nudged by 1e-4) and names it, for every way that computes mixes (on the
    micro config: tiny's hidden and hc)."""
    monkeypatch.setattr(mixes, "_compiled", lambda fn, backend: torch.compile(
        fn, dynamic=False, fullgraph=True, backend="aot_eager"))
    ab = AttentionBoundary(MICRO, 1, 0, None, torch.device("cpu"), 4, seed=5)
    timer = mixes.MixesTimer(ab.weight_copies(1), [2])
    steps = timer.steps(ab.make_inputs(2, seed=2))
    assert mixes.check_ways(steps, ab, timer.same) == []
    spec = mixes.mhc_mixes_ref
    monkeypatch.setattr(mixes, "mhc_mixes_ref",
                        lambda *args: tuple(t + 1e-4 for t in spec(*args)))
    failures = mixes.check_ways(steps, ab, timer.same)
    assert {f.split(":")[0] for f in failures} == {"fused", "separate", "mixes_kernel"}, failures
    timer.close()
    ab.close()
