"""Batch-invariant mode on the GPU (scripts/gpu_tests.sh invariant): every bit
of a row of every MXFP8 GEMM, and of a token of the whole boundary chain, is
the same for M = 1..64 and among random batch-mates, on the TP-4 shapes and on
shapes no other test uses, BF16 and MXFP8 inputs; the mode's switch in the
environment; precompile, CUDA graphs and torch.compile give the same bits."""

import pytest
import torch
from invariance_checks import bits, chain_failures, gemm_failures

from decode_boundary.bench.gemm import random_layer
from decode_boundary.env import BATCH_INVARIANT_ENV
from decode_boundary.gemm import mxfp8_mm, precompile, selected_tactic
from decode_boundary.gemm.tactics import DOT_TILES, invariant_order, order_of
from decode_boundary.model.chain import AttentionBoundary
from decode_boundary.model.config import MODELS
from decode_boundary.mxfp8.quantize_kernel import quantize_mxfp8

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
ROWS = list(range(1, 65))
TP4 = sorted(set(MODELS["v4.1-flash"].projection_shapes(4).values()))
# Shapes no other test runs: tall, wide, grouped by 4, an N of 16-row blocks only.
UNUSED = [(3072, 1536, 1), (1536, 7168, 1), (4096, 1024, 4), (2064, 2048, 1)]


@pytest.mark.parametrize("shape", TP4 + UNUSED, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("bf16_input", [True, False], ids=["bf16", "mxfp8"])
def test_gemm_rows_keep_their_bits(shape, bf16_input):
    n, k, groups = shape
    torch.manual_seed(n + k)
    layer = random_layer(n, k, groups, DEV)
    x = torch.randn(96, groups * k, device=DEV).bfloat16()
    orders = {order_of(selected_tactic(layer, m, True)) for m in ROWS + [96]}
    assert orders == {invariant_order(n, k, groups)}
    assert {selected_tactic(layer, m, True).rows_tile for m in ROWS} == set(DOT_TILES)
    assert gemm_failures(layer, x, ROWS, bf16_input, mates=12, batch_invariant=True,
                         seed=n) == []


def test_environment_switch_graphs_and_compile(monkeypatch):
    n, k, groups = 5120, 2048, 1
    layer = random_layer(n, k, groups, DEV)
    x = quantize_mxfp8(torch.randn(5, k, device=DEV).bfloat16())
    want = bits(mxfp8_mm(layer, x, batch_invariant=True))
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "1")
    assert torch.equal(bits(mxfp8_mm(layer, x)), want)
    # precompile, then a graph captured without compiling or allocating
    precompile(layer, [5], bf16_input=False)
    out = torch.full((5, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(mxfp8_mm(layer, x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(bits(out), want)
    # torch.compile reads the switch at trace time, into the op; Dynamo guards the
    # environment read, so switching it off retraces into the default mode.
    xb = torch.randn(5, k, device=DEV).bfloat16()
    compiled = torch.compile(lambda v: mxfp8_mm(layer, v), fullgraph=True)
    assert torch.equal(bits(compiled(xb)), bits(mxfp8_mm(layer, xb, batch_invariant=True)))
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "0")
    assert torch.equal(bits(compiled(xb)), bits(mxfp8_mm(layer, xb, batch_invariant=False)))


@pytest.mark.parametrize("model", ["v4.1-flash", "v4-flash"])
def test_chain_tokens_keep_their_bits(model):
    """Every output of a token (residual_out, layer_input, its MXFP8 bytes, q,
    the next mixes) at M = 1..64, across the mixes' placements, and among
    random batch-mates."""
    ab = AttentionBoundary(MODELS[model], 4, 0, None, DEV, 64, seed=3, batch_invariant=True)
    try:
        ab.precompile([1, 2, 8, 16, 33, 64])
        big = ab.make_inputs(64, seed=7)
        rows = ROWS if model == "v4.1-flash" else [1, 2, 3, 8, 9, 16, 17, 31, 33, 48, 63]
        assert chain_failures(ab, big, rows, mates=8, seed=1) == []
    finally:
        ab.close()


def test_chain_default_mode_differs_so_the_checks_can_fail():
    """The same check in the default mode finds tokens whose bits change with M
    (the tables' tactics and the mixes' placements), so it is not vacuous."""
    ab = AttentionBoundary(MODELS["v4.1-flash"], 4, 0, None, DEV, 64, seed=3,
                           batch_invariant=False)
    try:
        assert chain_failures(ab, ab.make_inputs(64, seed=7), [1, 8, 16, 33], mates=0) != []
    finally:
        ab.close()


def test_chain_graph_replay_in_the_mode():
    ab = AttentionBoundary(MODELS["v4.1-flash"], 4, 0, None, DEV, 64, seed=3,
                           batch_invariant=True)
    try:
        ab.precompile([40])
        inputs = ab.make_inputs(40, seed=2)
        eager = ab(inputs, fused=True, mixes_aside="auto")
        ab.join_mixes()
        eager = {f: bits(getattr(eager, f)).clone() for f in ("residual_out", "q", "next_pre")}
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ab(inputs, fused=True, mixes_aside="auto")
            ab.join_mixes()
        graph.replay()
        torch.cuda.synchronize()
        for f, want in eager.items():
            assert torch.equal(bits(getattr(out, f)), want), f
    finally:
        ab.close()
