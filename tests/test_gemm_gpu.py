"""MXFP8 GEMM on an H200 (scripts/gpu_tests.sh -k gemm): the numerics bar for
random shapes on every path and tactic, repeatable bits, PDL on/off, CUDA-graph
capture after precompile without compiling, the publishing epilogue."""

import os
import random
from types import SimpleNamespace

import pytest
import torch
from gemm_helpers import make_input, make_layer, poisoned

from decode_boundary.gemm import (
    Tactic,
    launch_low_latency,
    mxfp8_mm,
    precompile,
    projection_mm,
    selected_tactic,
    valid_tactics,
    warmup_low_latency,
)
from decode_boundary.gemm.mxfp8_gemm_kernel import mxfp8_gemm_kernel
from decode_boundary.gemm.reference import check_mxfp8_mm
from decode_boundary.gemm.tactics import sweep_tactics

pytestmark = pytest.mark.gpu
DEV = "cuda"


def random_shapes(seed, count):
    rng = random.Random(seed)
    return [(rng.randint(1, 64), 128 * rng.randint(1, 24), 32 * rng.randint(1, 96))
            for _ in range(count)]


@pytest.mark.parametrize("rows,n,k", random_shapes(1, 6) + [(1, 5120, 2048), (48, 1792, 5120)])
def test_every_sweep_tactic_meets_bar_and_repeats(rows, n, k):
    g = torch.Generator().manual_seed(rows * n + k)
    layer, qa = make_layer(n, k, DEV, g), make_input(rows, k, DEV, g)
    for tactic in sweep_tactics(n, k, rows):
        out = launch_low_latency(layer, qa, poisoned(rows, n, DEV), tactic)
        check_mxfp8_mm(out, qa, layer.weight, layer.weight_scale)
        for _ in range(2):
            again = launch_low_latency(layer, qa, poisoned(rows, n, DEV), tactic)
            assert torch.equal(out.view(torch.int16), again.view(torch.int16)), tactic


def test_every_valid_tactic_of_one_shape():
    rows, n, k = 7, 640, 1312
    layer, qa = make_layer(n, k, DEV), make_input(rows, k, DEV)
    for tactic in valid_tactics(n, k, rows):
        out = launch_low_latency(layer, qa, poisoned(rows, n, DEV), tactic)
        check_mxfp8_mm(out, qa, layer.weight, layer.weight_scale)


@pytest.mark.parametrize("rows", [1, 6, 8, 16, 33, 64])
def test_public_paths(rows):
    layer = make_layer(1024, 4096, DEV)
    x = torch.randn(rows, 4096, device=DEV).bfloat16()
    out = mxfp8_mm(layer, x)
    from decode_boundary.mxfp8.format import quantize_mxfp8_ref

    check_mxfp8_mm(out, quantize_mxfp8_ref(x), layer.weight, layer.weight_scale)
    proj = projection_mm(layer, x, low_batch=rows <= 8)
    assert proj is not None and torch.equal(proj, out)


def test_pdl_off_gives_the_same_bits(monkeypatch):
    layer, qa = make_layer(5120, 2048, DEV), make_input(8, 2048, DEV)
    tactic = selected_tactic(layer, 8)
    with_pdl = launch_low_latency(layer, qa, poisoned(8, 5120, DEV), tactic)
    monkeypatch.setenv("DECODE_BOUNDARY_DISABLE_PDL", "1")
    without = launch_low_latency(layer, qa, poisoned(8, 5120, DEV), tactic)
    assert torch.equal(with_pdl.view(torch.int16), without.view(torch.int16))


def _compiled_count():
    return sum(len(cache[0]) for cache in mxfp8_gemm_kernel.device_caches.values())


@pytest.mark.parametrize("rows", [4, 40])
def test_precompile_then_graph_capture_does_not_compile(rows):
    layer = make_layer(8192, 1280, DEV)  # a shape no other test compiles
    qa = make_input(rows, 1280, DEV)
    precompile(layer, [rows])
    compiled = _compiled_count()
    out = torch.empty(rows, 8192, dtype=torch.bfloat16, device=DEV)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        for _ in range(3):  # back to back: split-K counters must re-arm every call
            launch_low_latency(layer, qa, out, selected_tactic(layer, rows))
    assert _compiled_count() == compiled
    eager = launch_low_latency(layer, qa, poisoned(rows, 8192, DEV), selected_tactic(layer, rows))
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), eager.view(torch.int16))


def publish_target(tp, rank, capacity, hidden):
    boxes = [torch.full((3, tp, capacity, hidden), -32768, dtype=torch.int16, device=DEV)
             for _ in range(tp)]
    peer_ptrs = torch.tensor([b.data_ptr() for b in boxes], dtype=torch.int64, device=DEV)
    stage_state = torch.tensor([1, 0], dtype=torch.int32, device=DEV)
    return boxes, SimpleNamespace(peer_ptrs=peer_ptrs, stage_state=stage_state, rank=rank, tp=tp,
                                  capacity=capacity, hidden=hidden)


@pytest.mark.parametrize("rows", [1, 8, 24])
def test_publish_on_gpu(rows):
    n, k = 5120, 2048
    layer, qa = make_layer(n, k, DEV), make_input(rows, k, DEV)
    tactic = selected_tactic(layer, rows)
    plain = launch_low_latency(layer, qa, poisoned(rows, n, DEV), tactic)
    boxes, target = publish_target(2, 1, 32, n)
    out = launch_low_latency(layer, qa, poisoned(rows, n, DEV), tactic, target)
    assert torch.equal(out.view(torch.int16), plain.view(torch.int16))
    expected = plain.view(torch.int16).clone()
    expected[expected == -32768] = 0
    for box in boxes:
        assert torch.equal(box[1, 1, :rows], expected)
        box[1, 1, :rows] = -32768
        assert bool((box == -32768).all())
    assert target.stage_state.tolist() == [1, 1]


def test_publish_stores_are_16_byte_vectors():
    """The mailbox stores vectorize (st.global.v4: 8 BF16) like the out stores."""
    layer = make_layer(5120, 2048, DEV)
    _, target = publish_target(2, 0, 8, 5120)
    tactic = selected_tactic(layer, 8)
    plain = warmup_low_latency(layer, 8, tactic).asm["ptx"]
    publishing = warmup_low_latency(layer, 8, tactic, target).asm["ptx"]
    assert publishing.count("st.global.v4") > plain.count("st.global.v4"), \
        "mailbox stores did not vectorize to 16 bytes"
    assert "griddepcontrol.wait" in plain
    # Only a CTA with more than one K-block has a rest of its slice to prefetch.
    k_blocks_per_split = -(-2048 // tactic.block_k) // tactic.split_k
    assert ("prefetch.global.L2" in plain) == (tactic.prefetch and k_blocks_per_split > 1)
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def test_autotuner_times_on_gpu():
    from decode_boundary.gemm import Autotuner, pinned_tactics

    layer = make_layer(1024, 4096, DEV)
    tuner = Autotuner()
    with pinned_tactics():
        assert tuner.tune(layer, 8) == selected_tactic(layer, 8)
    assert isinstance(tuner.tune(layer, 2), Tactic)
