"""MXFP8 GEMM on an H200 (scripts/gpu_tests.sh -k gemm): the numerics bar for
every tactic the table holds or ``decode-boundary tune`` first offers, repeatable bits, BF16
prologue quantization bit-identical to quantize-then-GEMM (the GPU's own e4m3
cvt), ``mxfp8_mm`` of a BF16 input bit-identical to that of its quantization
(one tactic for both kinds), grouped wo_a, PDL on/off, CUDA-graph capture after precompile without
compiling, the publishing epilogue (bits and 16-byte stores)."""

import concurrent.futures as futures
import multiprocessing
import os
import random
from types import SimpleNamespace

import pytest
import torch
from gemm_helpers import exact_activation, exact_layer, make_input, make_layer, poisoned
from gemm_row_ranges import projection_mm
from independent_ref import assert_mxfp8_equal, check_gemm, decode_mxfp8, layer_values

import decode_boundary.gemm.launcher as launcher
from decode_boundary.gemm import (
    Tactic,
    launch_low_latency,
    mxfp8_mm,
    precompile,
    selected_tactic,
    warmup_low_latency,
)
from decode_boundary.gemm.linear import Mxfp8Linear
from decode_boundary.gemm.mxfp8_gemm_kernel import mxfp8_gemm_kernel
from decode_boundary.gemm.reference import check_mxfp8_mm
from decode_boundary.gemm.tactics import (
    PROLOGUE_MAX_ROWS,
    TABLE,
    k_pieces,
    sweep_tactics,
)
from decode_boundary.model.config import MODELS
from decode_boundary.mxfp8.format import (
    QuantizedActivation,
    mxfp8_scale_bytes,
    quantize_mxfp8_ref,
)
from decode_boundary.mxfp8.quantize_kernel import quantize_mxfp8

pytestmark = pytest.mark.gpu
DEV = "cuda"
TUNED_ROWS = (1, 2, 4)  # buckets whose tune candidates (sweep_tactics) are checked too


def _layer_like(n, k, groups):
    return SimpleNamespace(weight=torch.zeros(n, k, dtype=torch.float8_e4m3fn, device=DEV).t(),
                           weight_scale=torch.zeros(mxfp8_scale_bytes(n, k), dtype=torch.uint8,
                                                    device=DEV), bias=None, groups=groups)


def _compile(jobs):
    for n, k, groups, rows, tactic, bf16 in jobs:
        warmup_low_latency(_layer_like(n, k, groups), rows, Tactic(*tactic), bf16_input=bf16)
    return len(jobs)


def compile_in_parallel(jobs, workers=14):
    """Fill Triton's disk cache from worker processes, so the test only loads kernels."""
    chunks = [jobs[i::workers] for i in range(workers) if jobs[i::workers]]
    with futures.ProcessPoolExecutor(len(chunks),
                                     mp_context=multiprocessing.get_context("spawn")) as pool:
        assert sum(pool.map(_compile, chunks)) == len(jobs)


def pickable():
    """(N, K, groups, rows, tactic, bf16) of every tactic the table pins and the
    tuner's first candidates (sweep_tactics) at TUNED_ROWS, on the tabled shapes: on
    MXFP8 input, and on BF16 input where mxfp8_mm quantizes in the prologue
    (<= PROLOGUE_MAX_ROWS rows; one tactic serves both kinds)."""
    out = set()
    for (n, k, groups), entry in TABLE.items():
        for bucket, tactic in entry.items():
            for bf16 in (False, True) if bucket <= PROLOGUE_MAX_ROWS else (False,):
                out.add((n, k, groups, min(bucket, 64), tuple(tactic), bf16))
        for rows in TUNED_ROWS:
            for tactic in sweep_tactics(n, k, rows, groups):
                for bf16 in (False, True):
                    out.add((n, k, groups, rows, tuple(tactic), bf16))
    return sorted(out)


def grouped_layer(groups, n, k, generator=None):
    return Mxfp8Linear.grouped([Mxfp8Linear(lay.weight.t().contiguous(), lay.weight_scale)
                                for lay in (make_layer(n, k, DEV, generator)
                                            for _ in range(groups))])


def test_every_pickable_tactic_meets_bar_and_repeats():
    jobs = pickable()
    compile_in_parallel(jobs)
    layers, inputs = {}, {}
    for n, k, groups, rows, tactic, bf16 in jobs:
        if (n, k, groups) not in layers:
            layers[(n, k, groups)] = grouped_layer(groups, n // groups, k)
        layer = layers[(n, k, groups)]
        if (n, k, groups, rows) not in inputs:
            x = torch.randn(rows, groups * k, device=DEV).bfloat16()
            inputs[(n, k, groups, rows)] = (x, quantize_mxfp8_ref(x))
        x, qx = inputs[(n, k, groups, rows)]
        a = x if bf16 else qx
        out = launch_low_latency(layer, a, poisoned(rows, n, DEV), Tactic(*tactic))
        check_mxfp8_mm(out, qx, layer.weight, layer.weight_scale, groups)
        again = launch_low_latency(layer, a, poisoned(rows, n, DEV), Tactic(*tactic))
        assert torch.equal(out.view(torch.int16), again.view(torch.int16)), tactic


def random_shapes(seed, count):
    rng = random.Random(seed)
    return [(rng.randint(1, 64), 16 * rng.randint(1, 200), 32 * rng.randint(1, 160))
            for _ in range(count)]


@pytest.mark.parametrize("rows,n,k", random_shapes(1, 6))
def test_random_shapes_selected_and_sweep_tactics(rows, n, k):
    g = torch.Generator().manual_seed(rows * n + k)
    layer, qa = make_layer(n, k, DEV, g), make_input(rows, k, DEV, g)
    for tactic in sweep_tactics(n, k, rows)[:4]:
        out = launch_low_latency(layer, qa, poisoned(rows, n, DEV), tactic)
        check_mxfp8_mm(out, qa, layer.weight, layer.weight_scale)


@pytest.mark.parametrize("n,k,groups", sorted(TABLE))
def test_bf16_prologue_equals_quantize_then_gemm_bits(n, k, groups):
    """The prologue rounds with the GPU's e4m3 cvt; quantize_mxfp8 with the
    integer rounding: same e4m3 values, so the same output bits; the
    quantizer's bytes are the independent FP64/integer MXFP8's and the output
    meets the FP64 bar."""
    layer = grouped_layer(groups, n // groups, k)
    for bucket, tactic in TABLE[(n, k, groups)].items():
        if bucket > PROLOGUE_MAX_ROWS:
            continue  # mxfp8_mm quantizes such BF16 inputs first
        x = (torch.randn(bucket, groups * k, device=DEV) *
             torch.exp2(torch.randint(-8, 9, (bucket, 1), device=DEV))).bfloat16()
        x[0, :64] = 0.0
        x[-1, 7] = 6.0e4
        fused = launch_low_latency(layer, x, poisoned(bucket, n, DEV), tactic)
        qx = quantize_mxfp8(x)
        two_step = launch_low_latency(layer, qx, poisoned(bucket, n, DEV), tactic)
        assert torch.equal(fused.view(torch.int16), two_step.view(torch.int16)), (bucket, tactic)
        # Both sides are the kernel: pin them to what does not share its code.
        assert_mxfp8_equal(qx.data, qx.scale, x)
        check_mxfp8_mm(fused, qx, layer.weight, layer.weight_scale, groups)


# TP-4 projections fed BF16 in the chain (V4.1-Flash's wo_b and grouped wo_a, V4-Pro's
# wo_b: tabled; V4-Flash's wo_b: heuristic), and a shape no model has (heuristic).
TP4 = {name: config.projection_shapes(4) for name, config in MODELS.items()}
EQUAL_BITS_SHAPES = [TP4["v4-pro"]["wo_b"], TP4["v4.1-flash"]["wo_b"], TP4["v4.1-flash"]["wo_a"],
                     TP4["v4-flash"]["wo_b"], (3072, 1536, 1)]


@pytest.mark.parametrize("n,k,groups", EQUAL_BITS_SHAPES)
def test_mxfp8_mm_bf16_input_equals_its_quantization_bits(n, k, groups):
    """mxfp8_mm(layer, x) == mxfp8_mm(layer, quantize_mxfp8(x)) bit for bit at
    every prologue row count: the tactic does not depend on the input kind;
    and both meet the FP64 bar."""
    g = torch.Generator().manual_seed(n + k + groups)
    layer = grouped_layer(groups, n // groups, k, g)
    for rows in range(1, PROLOGUE_MAX_ROWS + 1):
        x = (torch.randn(rows, groups * k, device=DEV) *
             torch.exp2(torch.randint(-8, 9, (rows, 1), device=DEV))).bfloat16()
        x[0, :64] = 0.0
        x[-1, 7] = 6.0e4
        fused = mxfp8_mm(layer, x)
        qx = quantize_mxfp8(x)
        two_step = mxfp8_mm(layer, qx)
        assert torch.equal(fused.view(torch.int16), two_step.view(torch.int16)), rows
        check_mxfp8_mm(fused, qx, layer.weight, layer.weight_scale, groups)


@pytest.mark.parametrize("rows", [1, 6, 8, 16, 33, 64])
def test_public_paths_and_grouped(rows):
    layer = grouped_layer(2, 1024, 4096)
    x = torch.randn(rows, 8192, device=DEV).bfloat16()
    out = mxfp8_mm(layer, x)
    check_mxfp8_mm(out, quantize_mxfp8_ref(x), layer.weight, layer.weight_scale, 2)
    proj = projection_mm(layer, x, low_batch=rows <= 8)
    assert proj is not None and torch.equal(proj, out)
    prologue = rows <= PROLOGUE_MAX_ROWS  # what mxfp8_mm does with a BF16 input
    tactic = selected_tactic(layer, rows)
    parts = []
    for g in range(2):
        part = x[:, g * 4096:(g + 1) * 4096].contiguous()
        parts.append(launch_low_latency(layer.group(g), part if prologue else quantize_mxfp8(part),
                                        poisoned(rows, 1024, DEV), tactic))
    assert torch.equal(out.view(torch.int16), torch.cat(parts, 1).view(torch.int16))


def test_pdl_off_gives_the_same_bits(monkeypatch):
    layer, qa = make_layer(5120, 2048, DEV), make_input(8, 2048, DEV)
    tactic = selected_tactic(layer, 8)
    with_pdl = launch_low_latency(layer, qa, poisoned(8, 5120, DEV), tactic)
    monkeypatch.setenv("DECODE_BOUNDARY_DISABLE_PDL", "1")
    without = launch_low_latency(layer, qa, poisoned(8, 5120, DEV), tactic)
    assert torch.equal(with_pdl.view(torch.int16), without.view(torch.int16))
    check_mxfp8_mm(with_pdl, qa, layer.weight, layer.weight_scale)


def _compiled_count():
    return sum(len(cache[0]) for cache in mxfp8_gemm_kernel.device_caches.values())


@pytest.mark.parametrize("rows", [4, 40])
def test_precompile_then_graph_capture_does_not_compile(rows):
    layer = make_layer(8192, 1280, DEV)
    x = torch.randn(rows, 1280, device=DEV).bfloat16()
    qa = quantize_mxfp8(x)
    precompile(layer, [rows])
    compiled = _compiled_count()
    out = torch.empty(rows, 8192, dtype=torch.bfloat16, device=DEV)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        for _ in range(3):  # back to back: split-K counters must re-arm every call
            launch_low_latency(layer, qa, out, selected_tactic(layer, rows))
            out_bf16 = mxfp8_mm(layer, x)  # prologue (4 rows) or quantize first (40)
    assert _compiled_count() == compiled
    eager = launch_low_latency(layer, qa, poisoned(rows, 8192, DEV), selected_tactic(layer, rows))
    eager_bf16 = mxfp8_mm(layer, x)
    check_mxfp8_mm(eager, qa, layer.weight, layer.weight_scale)
    check_mxfp8_mm(eager_bf16, qa, layer.weight, layer.weight_scale)
    for _ in range(3):
        out.fill_(float("nan"))
        out_bf16.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), eager.view(torch.int16))
        assert torch.equal(out_bf16.view(torch.int16), eager_bf16.view(torch.int16))


def publish_target(tp, rank, capacity, hidden):
    boxes = [torch.full((3, tp, capacity, hidden), -32768, dtype=torch.int16, device=DEV)
             for _ in range(tp)]
    peer_ptrs = torch.tensor([b.data_ptr() for b in boxes], dtype=torch.int64, device=DEV)
    stage_state = torch.tensor([1, 0], dtype=torch.int32, device=DEV)
    return boxes, SimpleNamespace(peer_ptrs=peer_ptrs, stage_state=stage_state, rank=rank, tp=tp,
                                  capacity=capacity, hidden=hidden)


@pytest.mark.parametrize("rows,bf16", [(1, True), (2, False), (8, True), (8, False), (24, False)])
def test_publish_on_gpu(rows, bf16):
    n, k = 5120, 2048
    layer = make_layer(n, k, DEV)
    x = torch.randn(rows, k, device=DEV).bfloat16()
    a = x if bf16 else quantize_mxfp8(x)
    tactic = selected_tactic(layer, rows)
    plain = launch_low_latency(layer, a, poisoned(rows, n, DEV), tactic)
    check_mxfp8_mm(plain, quantize_mxfp8(x), layer.weight, layer.weight_scale)
    boxes, target = publish_target(2, 1, 32, n)
    out = launch_low_latency(layer, a, poisoned(rows, n, DEV), tactic, target)
    assert torch.equal(out.view(torch.int16), plain.view(torch.int16))
    expected = plain.view(torch.int16).clone()
    expected[expected == -32768] = 0
    for box in boxes:
        assert torch.equal(box[1, 1, :rows], expected)
        box[1, 1, :rows] = -32768
        assert bool((box == -32768).all())
    assert target.stage_state.tolist() == [1, 1]


@pytest.mark.parametrize("rows,bf16", [(1, True), (8, True), (8, False)])
def test_publish_stores_are_16_byte_vectors(rows, bf16):
    """The mailbox stores vectorize (st.global.v4: 8 BF16) wherever the tile
    holds 8 values per thread, and every weight load is issued before the grid
    wait."""
    layer = make_layer(5120, 2048, DEV)
    _, target = publish_target(2, 0, 8, 5120)
    tactic = selected_tactic(layer, rows)
    plain = warmup_low_latency(layer, rows, tactic, bf16_input=bf16).asm["ptx"]
    publishing = warmup_low_latency(layer, rows, tactic, target, bf16).asm["ptx"]
    if tactic.block_n * tactic.rows_tile >= 8 * tactic.num_warps * 32:
        assert publishing.count("st.global.v4") > plain.count("st.global.v4"), \
            "mailbox stores did not vectorize to 16 bytes"
    else:  # a tile of fewer than 8 values per thread (CUDA-core M = 1): a warp's
        # consecutive 2-byte stores, as wide as the GEMM's own output stores
        assert "st.global.v4" not in plain
        assert publishing.count("st.global.b16") > plain.count("st.global.b16")
    before_wait = plain.split("griddepcontrol.wait")[0]
    assert "griddepcontrol.launch_dependents" in before_wait
    k_slice, pieces = k_pieces(2048, tactic)
    weight_vectors = tactic.block_n * tactic.chunk_k * pieces // (tactic.num_warps * 32 * 16)
    assert before_wait.count("ld.global.v4") >= weight_vectors
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


EXACT_GPU_SHAPES = [TP4["v4.1-flash"][name] for name in ("wo_b", "wo_a", "wq_b")]


@pytest.mark.parametrize("n,k,groups", EXACT_GPU_SHAPES)
def test_tabled_tactics_give_exact_bits_on_exact_operands(n, k, groups):
    """Exact bar on the GPU: integer operands times per-group powers of two
    whose FP32 partial sums are exact (asserted; every partial sum is an integer
    multiple of the smallest product below 2^24 of it, so neither FP32 order nor
    the tensor cores' accumulation loses a bit), every tabled tactic of the
    shape, MXFP8 and (prologue row counts) BF16 input: out == bf16_rne(FP64)."""
    g = torch.Generator().manual_seed(n + k)
    base = exact_layer(n, k, g, groups=groups, spread=0)
    layer = SimpleNamespace(weight=base.weight.to(DEV), weight_scale=base.weight_scale.to(DEV),
                            bias=None, groups=groups)
    weights = layer_values(base)
    for bucket, tactic in TABLE[(n, k, groups)].items():
        rows = min(bucket, 64)
        qa = exact_activation(rows, groups * k, g, spread=0)
        x = exact_activation(rows, groups * k, g, spread=0, bf16=True)
        inputs = [(QuantizedActivation(qa.data.to(DEV), qa.scale.to(DEV), qa.orig_dtype,
                                       qa.orig_shape), decode_mxfp8(qa.data, qa.scale))]
        if bucket <= PROLOGUE_MAX_ROWS:
            inputs.append((x.to(DEV), x.double()))
        for a, values in inputs:
            out = launch_low_latency(layer, a, poisoned(rows, n, DEV), tactic)
            check_gemm(out, values, weights, groups, exact_sums=True,
                       what=f"{(n, k, groups)} {tactic}")


@pytest.mark.parametrize("n,k,groups", sorted(TABLE))
def test_mxfp8_out_equals_the_quantized_output_bytes(n, k, groups):
    """The epilogue's MXFP8 output (the GPU's cvt.rn.satfinite) == quantize_mxfp8
    (integer rounding) of the BF16 output the same tactic writes, every byte
    of data and scales (padding included), at every tabled tactic of whole
    scale groups and at row counts past the tile (33) and the 128-row scale
    tile (130), both input kinds; and mxfp8_mm(..., mxfp8_out=True) likewise."""
    g = torch.Generator().manual_seed(3 * n + k)
    layer = grouped_layer(groups, n // groups, k, g)
    cases = [(bucket, t) for bucket, t in TABLE[(n, k, groups)].items() if t.block_n % 32 == 0]
    cases += [(33, selected_tactic(layer, 33)), (130, selected_tactic(layer, 130))]
    assert cases
    for rows, tactic in cases:
        x = (torch.randn(rows, groups * k, device=DEV) *
             torch.exp2(torch.randint(-8, 9, (rows, 1), device=DEV))).bfloat16()
        x[0] = 0.0  # an all-zero output row: scale byte 0
        x[-1, 7] = 6.0e4
        for a in ((x,) if rows <= PROLOGUE_MAX_ROWS else ()) + (quantize_mxfp8(x),):
            bf16_out = launch_low_latency(layer, a, poisoned(rows, n, DEV), tactic)
            out = QuantizedActivation(
                torch.full((rows, n), 0x7F, dtype=torch.uint8, device=DEV).view(
                    torch.float8_e4m3fn),
                torch.full((mxfp8_scale_bytes(rows, n),), 0xAB, dtype=torch.uint8, device=DEV),
                torch.bfloat16, torch.Size((rows, n)))
            launch_low_latency(layer, a, out, tactic)
            want = quantize_mxfp8(bf16_out)
            assert torch.equal(out.data.view(torch.uint8), want.data.view(torch.uint8)), \
                (rows, tactic)
            assert torch.equal(out.scale, want.scale), (rows, tactic)
            assert_mxfp8_equal(want.data, want.scale, bf16_out)
        via_api = mxfp8_mm(layer, x, mxfp8_out=True)
        want = quantize_mxfp8(mxfp8_mm(layer, x))
        assert torch.equal(via_api.data.view(torch.uint8), want.data.view(torch.uint8)), rows
        assert torch.equal(via_api.scale, want.scale), rows


def _capped_launches():
    """(N, K, groups, tactic) of the table's 64-row entries the launcher caps."""
    out = []
    for (n, k, groups), entry in sorted(TABLE.items()):
        tactic = entry.get(64)
        if tactic is None:
            continue
        programs = n // tactic.block_n * tactic.split_k
        if launcher.register_cap(tactic, programs, torch.device(DEV)) is not None:
            out.append((n, k, groups, tactic))
    return out


# Registers a capped tile may spill (Triton's ``n_spills``: local bytes / 4):
# fused_wqa_wkv's 64-row tile of 128-wide pieces spills 8 (32 bytes) under the cap and
# is still faster in the chain than uncapped or 64-wide; the spills this rule guards
# against ran to hundreds of registers and cost microseconds (docs/EXPERIMENTS.md).
CAPPED_MAX_SPILLS = 8


def test_register_cap_keeps_bits_and_barely_spills():
    """Where the launcher compiles a 64-row tile under ``maxnreg``, the output
    equals the uncapped kernel's bit for bit, with at most the cap's registers
    and ``CAPPED_MAX_SPILLS`` registers spilled (otherwise the cap costs, not buys, a
    program per SM)."""
    capped = _capped_launches()
    assert capped, "no tabled 64-row launch is capped: the V4-Pro wo_b entry should be"
    for n, k, groups, tactic in capped:
        layer = make_layer(n, k, DEV) if groups == 1 else grouped_layer(groups, n // groups, k)
        a = make_input(64, groups * k, DEV)
        outs = []
        for keep_cap in (True, False):
            out = poisoned(64, n, DEV)
            grid, args, kwargs = launcher._launch_config(layer, a, out, tactic, None)
            assert kwargs.get("maxnreg") == launcher.CAPPED_REGISTERS
            if not keep_cap:
                kwargs.pop("maxnreg")
            kernel = mxfp8_gemm_kernel[grid](*args, **kwargs)
            torch.cuda.synchronize()
            if keep_cap:
                assert kernel.n_regs <= launcher.CAPPED_REGISTERS and \
                    kernel.n_spills <= CAPPED_MAX_SPILLS, \
                    (n, k, groups, tactic, kernel.n_regs, kernel.n_spills)
            outs.append(out)
        assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)), (n, k, tactic)
