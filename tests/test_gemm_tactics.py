"""Tactic tables, row buckets and the autotuner (selection logic, pinned
offering, save/load), the tactic's independence of the input kind (BF16 in ==
quantize_mxfp8 first, bit for bit); timing itself is a GPU test."""

import inspect
import json
from types import SimpleNamespace

import pytest
import torch
from gemm_helpers import make_layer

from decode_boundary.gemm import (
    AUTOTUNER,
    Autotuner,
    api,
    mxfp8_mm,
    pinned_tactics,
    selected_tactic,
    zeros_input,
)
from decode_boundary.gemm.autotune import CACHE_VERSION
from decode_boundary.gemm.linear import Mxfp8Linear
from decode_boundary.gemm.tactics import (
    PROLOGUE_MAX_ROWS,
    TABLE,
    Tactic,
    default_tactic,
    heuristic_tactic,
    is_valid,
    k_pieces,
    row_bucket,
    sweep_tactics,
    table_tactic,
    valid_tactics,
)
from decode_boundary.mxfp8.format import mxfp8_scale_bytes
from decode_boundary.mxfp8.quantize_kernel import quantize_mxfp8

DSV4_SHAPES = [(5120, 2048, 1), (8192, 1280, 1), (1792, 5120, 1), (2048, 4096, 2),
               (7168, 4096, 1), (5120, 4096, 1)]


def test_row_buckets():
    got = [row_bucket(r) for r in (1, 2, 3, 5, 8, 9, 16, 17, 33, 48, 49, 64, 65, 200)]
    assert got == [1, 2, 4, 8, 8, 16, 16, 32, 48, 48, 64, 64, 128, 256]
    with pytest.raises(ValueError, match="rows"):
        row_bucket(0)


def test_k_pieces_cover_the_slice():
    for k in (32, 96, 1280, 2048, 5120):
        for t in (Tactic(8, 1, 1, 4, 1024), Tactic(64, 16, 5, 4, 128), Tactic(16, 2, 3, 2, 64)):
            k_slice, pieces = k_pieces(k, t)
            assert k_slice % 32 == 0 and k_slice * t.split_k >= k  # the splits cover K
            assert pieces * t.chunk_k >= k_slice > (pieces - 1) * t.chunk_k  # no empty piece


@pytest.mark.parametrize("n,k,groups", DSV4_SHAPES)
def test_tables_hold_valid_tactics_and_default_comes_first(n, k, groups):
    for bucket, tactic in TABLE[(n, k, groups)].items():
        rows = min(bucket, 64)
        assert is_valid(tactic, n, k, rows, groups), (bucket, tactic)
    for rows in (1, 2, 5, 8, 16, 40, 64, 300):
        tactics = valid_tactics(n, k, rows, groups)
        assert tactics[0] == default_tactic(n, k, rows, groups)
        assert len(set(tactics)) == len(tactics)
        sweep = sweep_tactics(n, k, rows, groups)
        assert sweep[0] == tactics[0] and set(sweep) <= set(tactics) and len(sweep) <= 12
        assert all(is_valid(t, n, k, rows, groups) for t in sweep)


def test_heuristic_gives_a_valid_tactic_for_unpinned_shapes():
    for n, k, groups in [(4096, 2048, 1), (16384, 1280, 1), (4096, 4096, 4), (5120, 8192, 1),
                         (48, 96, 1), (256, 4096, 1)]:
        for rows in (1, 2, 3, 8, 9, 30, 48, 64, 1000):
            t = heuristic_tactic(n, k, rows, groups)
            assert is_valid(t, n, k, rows, groups), (n, k, rows, t)
            assert (t.rows_tile < 16) == (rows <= 2)
    with pytest.raises(ValueError, match="16"):
        heuristic_tactic(40, 128, 1)


@pytest.fixture
def clean_autotuner():
    saved = dict(AUTOTUNER.cache)
    AUTOTUNER.cache.clear()
    yield AUTOTUNER
    AUTOTUNER.cache.clear()
    AUTOTUNER.cache.update(saved)


def test_autotuner_picks_fastest_per_bucket_and_selected_follows(clean_autotuner, tmp_path):
    layer = make_layer(128, 512)
    fast = sweep_tactics(128, 512, 4)[-1]
    seen = []

    def timer(lay, rows, tactic, bf16_input):
        seen.append((rows, tactic, bf16_input))
        return 1.0 if tactic == fast else 2.0

    assert selected_tactic(layer, 3) == default_tactic(128, 512, 3)
    assert clean_autotuner.tune(layer, 3, timer=timer) == fast
    assert {r for r, _, _ in seen} == {4} and len(seen) == len(sweep_tactics(128, 512, 4))
    assert not any(bf16 for _, _, bf16 in seen)
    assert selected_tactic(layer, 4) == fast and selected_tactic(layer, 3) == fast
    assert selected_tactic(layer, 2) == default_tactic(128, 512, 2)  # another bucket
    path = tmp_path / "tactics.json"
    clean_autotuner.save(str(path))
    other = Autotuner()
    other.load(str(path))
    assert other.cache == clean_autotuner.cache


def test_autotuner_choice_serves_both_input_kinds(clean_autotuner, tmp_path):
    """A tune timed on BF16 input stores one entry, keyed without the kind, and
    mxfp8_mm runs it for MXFP8 input too (and the other way round)."""
    n, k = 5120, 2048  # a tabled shape: the tuned choice overrides the table
    layer = shape_layer(n, k, 1)
    for rows, bf16 in ((8, True), (2, False)):
        fast = sweep_tactics(n, k, rows)[-1]
        assert fast != table_tactic(n, k, rows)
        kinds = set()

        def timer(lay, rows, tactic, bf16_input, fast=fast, kinds=kinds):
            kinds.add(bf16_input)
            return 1.0 if tactic == fast else 2.0

        assert clean_autotuner.tune(layer, rows, timer=timer, bf16_input=bf16) == fast
        assert kinds == {bf16}  # timed on the kind asked for
        assert clean_autotuner.cache[(n, k, 1, rows)] == fast
        assert clean_autotuner.lookup(n, k, rows) == fast == selected_tactic(layer, rows)
        assert ran_tactics(layer, rows) == (fast, fast)
    path = tmp_path / "tactics.json"
    clean_autotuner.save(str(path))
    saved = json.loads(path.read_text())
    assert saved["version"] == CACHE_VERSION == 3
    assert all("bf16_input" not in entry for entry in saved["entries"])


def test_autotuner_rejects_an_older_cache_version(tmp_path):
    """A version-2 cache (keys with the input kind) is not read as one without."""
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"version": 2, "entries": [
        {"n": 128, "k": 512, "groups": 1, "bucket": 4, "bf16_input": True,
         "tactic": Tactic(64, 16, 2, 4, 128)._asdict()}]}))
    tuner = Autotuner()
    with pytest.raises(ValueError, match="version 2"):
        tuner.load(str(path))
    assert tuner.cache == {}


def test_tactic_selection_takes_no_input_kind():
    """Selection is a function of (N, K, groups, rows) only: no entry point of
    it has an input-kind parameter any more."""
    for fn in (selected_tactic, table_tactic, default_tactic, valid_tactics, sweep_tactics,
               Autotuner.lookup, Autotuner.candidates):
        assert "bf16_input" not in inspect.signature(fn).parameters, fn.__name__


def shape_layer(n, k, groups):
    """A layer of zero weights of (N, K, groups): enough to select and record."""
    return SimpleNamespace(weight=torch.zeros(n, k, dtype=torch.float8_e4m3fn).t(),
                           weight_scale=torch.zeros(mxfp8_scale_bytes(n, k), dtype=torch.uint8),
                           bias=None, groups=groups)


def ran_tactics(layer, rows):
    """(tactic mxfp8_mm launches for a BF16 input of ``rows`` rows, for an MXFP8
    one), recorded without running the kernel (nor, above PROLOGUE_MAX_ROWS,
    the quantizer mxfp8_mm runs first: its zeros stand in for its output)."""
    seen, quantized = [], []

    def record(lay, a, out, tactic, *args, **kwargs):
        seen.append((isinstance(a, torch.Tensor), tactic))
        return out

    def quantize(x):
        quantized.append(x.shape[0])
        return zeros_input(layer, x.shape[0])

    k, n = layer.weight.shape
    groups = getattr(layer, "groups", 1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(api, "launch_low_latency", record)
        mp.setattr(api, "quantize_mxfp8", quantize)
        mxfp8_mm(layer, torch.zeros(rows, groups * k, dtype=torch.bfloat16))
        mxfp8_mm(layer, zeros_input(layer, rows))
    assert [bf16 for bf16, _ in seen] == [rows <= PROLOGUE_MAX_ROWS, False]
    assert quantized == ([] if rows <= PROLOGUE_MAX_ROWS else [rows])
    return tuple(t for _, t in seen)


@pytest.mark.parametrize("n,k,groups", DSV4_SHAPES)
def test_tabled_shapes_run_one_tactic_for_both_input_kinds(clean_autotuner, n, k, groups):
    """Every tabled shape and bucket: mxfp8_mm launches the same tactic for a
    BF16 input (quantized in the prologue up to PROLOGUE_MAX_ROWS rows) as for
    its MXFP8 quantization, the table's."""
    layer = shape_layer(n, k, groups)
    for rows in (*range(1, PROLOGUE_MAX_ROWS + 1), 17, 32, 48, 64, 100):
        tactic = TABLE[(n, k, groups)][min(row_bucket(rows), 64)]
        assert selected_tactic((n, k, groups), rows) == tactic
        assert ran_tactics(layer, rows) == (tactic, tactic), rows


# (N, K, groups) no other test runs: unpinned, so the heuristic's tactics.
EQUAL_BITS_SHAPES = [(96, 160, 1), (64, 96, 2), (128, 320, 1)]


@pytest.mark.parametrize("n,k,groups", EQUAL_BITS_SHAPES)
def test_bf16_input_and_its_quantization_give_the_same_bits(n, k, groups):
    """mxfp8_mm(layer, x) == mxfp8_mm(layer, quantize_mxfp8(x)) bit for bit at
    every row count of the prologue (1..16) and one above it."""
    g = torch.Generator().manual_seed(n * 1000 + k * 10 + groups)
    layer = Mxfp8Linear.grouped([Mxfp8Linear(lay.weight.t().contiguous(), lay.weight_scale)
                                 for lay in (make_layer(n // groups, k, generator=g)
                                             for _ in range(groups))])
    assert layer.groups == groups and api.mxfp8_eligible(layer)
    for rows in (*range(1, PROLOGUE_MAX_ROWS + 1), PROLOGUE_MAX_ROWS + 3):
        x = (torch.randn(rows, groups * k, generator=g) *
             torch.exp2(torch.randint(-6, 7, (rows, 1), generator=g))).bfloat16()
        x[0, :40] = 0.0  # an all-zero group (scale byte 0) and a huge value
        x[-1, 33] = 3.0e4
        fused = mxfp8_mm(layer, x)
        two_step = mxfp8_mm(layer, quantize_mxfp8(x))
        assert fused.shape == two_step.shape == (rows, n)
        assert torch.equal(fused.view(torch.int16), two_step.view(torch.int16)), rows


def test_pinned_tactics_offers_only_the_pinned_one(clean_autotuner):
    n, k = 5120, 2048
    assert len(clean_autotuner.candidates(n, k, 8)) > 1
    with pinned_tactics():
        assert clean_autotuner.candidates(n, k, 8) == [TABLE[(n, k, 1)][8]]  # both kinds
        assert clean_autotuner.candidates(n, k, 32) == [TABLE[(n, k, 1)][32]]
        assert len(clean_autotuner.candidates(n, k, 4)) > 1  # 1..4 rows stay tuned
        assert len(clean_autotuner.candidates(256, 256, 8)) > 1  # not a pinned shape
    assert len(clean_autotuner.candidates(n, k, 8)) > 1


def test_autotuner_needs_a_gpu_to_time():
    """The default timer refuses a CPU layer (and names the way out) before
    timing anything; the tuner then caches nothing."""
    tuner = Autotuner()
    with pytest.raises(RuntimeError, match="times on a CUDA device; pass timer="):
        tuner.tune(make_layer(64, 128), 1)
    assert tuner.cache == {}


def test_register_cap_only_where_a_third_program_per_sm_saves_a_wave(monkeypatch):
    """The launcher caps 4-warp 64-row tiles of 128-wide K-pieces at 168
    registers only when three programs per SM run the grid in fewer waves than
    two do; never on the interpreter or on a CPU tensor's device."""
    import decode_boundary.gemm.launcher as launcher

    monkeypatch.setattr(launcher, "_sm_count", lambda device: 132)
    monkeypatch.setattr(launcher, "interpret_mode", lambda: False)
    cuda = torch.device("cuda")
    tile = Tactic(64, 64, 8, 4, 128)
    for programs in range(1, 1200, 7):
        saves = -(-programs // 396) < -(-programs // 264)
        assert launcher.register_cap(tile, programs, cuda) == (168 if saves else None), programs
    assert launcher.register_cap(tile, 896, cuda) == 168  # V4-Pro wo_b at 64 rows: 4 -> 3 waves
    assert launcher.register_cap(tile, 256, cuda) is None  # grouped wo_a: one wave either way
    assert launcher.register_cap(Tactic(128, 64, 16, 8, 128), 896, cuda) is None
    assert launcher.register_cap(Tactic(64, 32, 8, 4, 128), 896, cuda) is None
    assert launcher.register_cap(Tactic(64, 64, 8, 4, 64), 896, cuda) is None  # spills capped
    assert launcher.register_cap(tile, 896, torch.device("cpu")) is None
    monkeypatch.setattr(launcher, "interpret_mode", lambda: True)
    assert launcher.register_cap(tile, 896, cuda) is None
