"""The CuTe DSL Hopper GEMM on an sm_90 GPU (scripts/gpu_tests.sh cute): the
numerics bar against FP64 on randn, heavy-tailed (cubes) and cancelling data at
shapes no other test uses, every tokens tile, split and warpgroup count;
repeatable bits; a BF16 input and its quantization give the same bits; the MXFP8
output is the quantizer's of the BF16 one; CUDA graphs after ``precompile``
(which compiles, so capture does not); ``torch.compile`` through the custom op;
two streams at once; batch-invariant mode's bits over M = 1..64. Skipped where
the DSL is not installed (dispatch.cute_refusal says why)."""

from __future__ import annotations

import pytest
import torch

from decode_boundary.bench.gemm import cancelling
from decode_boundary.gemm import dispatch, mxfp8_mm, precompile, selected_tactic
from decode_boundary.gemm.hopper import launcher
from decode_boundary.gemm.hopper.tactics import HopperTactic, fits, max_stages
from decode_boundary.gemm.linear import Mxfp8Linear
from decode_boundary.gemm.reference import check_mxfp8_mm
from decode_boundary.mxfp8.quantize_kernel import quantize_mxfp8

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
# (N, K, groups): none of the model's shapes; a grouped one (two groups of 384 rows).
SHAPES = [(768, 1536, 1), (1280, 2560, 1), (768, 1024, 2)]


@pytest.fixture(autouse=True)
def _needs_cute():
    reason = dispatch.cute_refusal(torch.device("cuda", torch.cuda.current_device()))
    if reason is not None:
        pytest.skip(f"CuTe path cannot run here: {reason}")


def _layer(n, k, groups, values=torch.randn, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return Mxfp8Linear.grouped([
        Mxfp8Linear.from_float((0.05 * values(n // groups, k, generator=g, device=DEV)).bfloat16())
        for _ in range(groups)])


def _tactic(wgs, tokens, split):
    t = HopperTactic(wgs, tokens, split, 2)
    return t._replace(stages=max_stages(t))


def _run(layer, qa, tactic):
    out = torch.full((qa.rows, layer.weight.shape[1]), float("nan"), dtype=torch.bfloat16,
                     device=DEV)  # poisoned: every element must be written
    return launcher.launch(layer.weight.t(), layer.weight_scale, layer.groups, qa.data,
                           qa.scale, out, tactic, pdl=True)


@pytest.mark.parametrize("n,k,groups", SHAPES)
def test_bar_on_every_tile_split_and_warpgroups(n, k, groups):
    layer = _layer(n, k, groups)
    cubes = _layer(n, k, groups, lambda *s, **kw: torch.randn(*s, **kw) ** 3, seed=1)
    checked = 0
    for rows in (1, 5, 16, 31, 64, 100):
        tokens = next(t for t in (8, 16, 32, 64) if rows <= t or t == 64)
        for wgs in (1, 2):
            for split in (1, 2, 4, 8):
                tactic = _tactic(wgs, tokens, split)
                if not fits(tactic, n, k, groups):
                    continue
                x = torch.randn(rows, groups * k, device=DEV)
                for lay, xs in ((layer, x), (cubes, x ** 3)):
                    qa = quantize_mxfp8(xs.bfloat16())
                    out = _run(lay, qa, tactic)
                    check_mxfp8_mm(out, qa, lay.weight, lay.weight_scale, groups)
                    assert torch.equal(out, _run(lay, qa, tactic)), "bits must repeat"
                checked += 1
    assert checked >= 12


def test_cancelling_data_meets_the_bar_and_the_order_is_fixed():
    n, k, groups = 1280, 2560, 1
    layer, x = cancelling(n, k, 48, groups, DEV)
    qa = quantize_mxfp8(x)
    outs = [_run(layer, qa, _tactic(w, 64, s)) for w, s in ((1, 1), (2, 1), (1, 4), (2, 4))]
    for out in outs:
        check_mxfp8_mm(out, qa, layer.weight, layer.weight_scale, groups)
    # Warpgroups only place the work: the same split gives the same bits.
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[2], outs[3])


def test_mxfp8_mm_inputs_outputs_graphs_and_streams():
    n, k, groups = 768, 1536, 1
    layer = _layer(n, k, groups)
    x = torch.randn(24, k, device=DEV).bfloat16()
    qa = quantize_mxfp8(x)
    assert selected_tactic(layer, 24, backend="cute").backend == "cute"
    ref = mxfp8_mm(layer, qa, backend="cute")
    check_mxfp8_mm(ref, qa, layer.weight, layer.weight_scale)
    assert torch.equal(mxfp8_mm(layer, x, backend="cute"), ref)  # BF16 in: same bits
    q = mxfp8_mm(layer, qa, backend="cute", mxfp8_out=True)
    want = quantize_mxfp8(ref)
    assert torch.equal(q.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(q.scale, want.scale)
    # precompile compiles; a capture then compiles nothing.
    precompile(layer, [24], backend="cute")
    compiled = dict(launcher.COMPILE_SECONDS)
    graph = torch.cuda.CUDAGraph()
    out = None
    with torch.cuda.graph(graph):
        out = mxfp8_mm(layer, qa, backend="cute")
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref) and compiled == launcher.COMPILE_SECONDS
    # Two streams at once: no shared scratch, the same bits.
    streams = [torch.cuda.Stream() for _ in range(2)]
    results = []
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            results.append([mxfp8_mm(layer, qa, backend="cute") for _ in range(8)])
    torch.cuda.synchronize()
    assert all(torch.equal(r, ref) for rs in results for r in rs)


def test_torch_compile_runs_the_cute_kernel_through_the_op():
    n, k, groups = 1280, 2560, 1
    layer = _layer(n, k, groups)
    qa = quantize_mxfp8(torch.randn(16, k, device=DEV).bfloat16())
    ref = mxfp8_mm(layer, qa, backend="cute")

    @torch.compile(fullgraph=True)
    def step(data, scale):
        from decode_boundary.mxfp8.format import QuantizedActivation
        return mxfp8_mm(layer, QuantizedActivation(data, scale, torch.bfloat16, data.shape),
                        backend="cute") * 1.0

    assert torch.equal(step(qa.data, qa.scale), ref)


def test_batch_invariant_bits_over_every_row_count():
    n, k, groups = 1280, 2560, 1
    layer, x = cancelling(n, k, 64, groups, DEV)
    qa_all = quantize_mxfp8(x)
    full = mxfp8_mm(layer, qa_all, batch_invariant=True, backend="cute")
    check_mxfp8_mm(full, qa_all, layer.weight, layer.weight_scale)
    splits = set()
    for rows in range(1, 65):
        splits.add(selected_tactic(layer, rows, batch_invariant=True, backend="cute").split_k)
        part = mxfp8_mm(layer, quantize_mxfp8(x[:rows]), batch_invariant=True, backend="cute")
        assert torch.equal(part, full[:rows]), f"row bits changed at M = {rows}"
    assert len(splits) == 1
