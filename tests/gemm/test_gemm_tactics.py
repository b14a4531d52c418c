"""Tactic tables and row buckets (selection logic, every entry valid and
reachable, the tables' shapes those of the models), the tactic's independence
of the input kind (BF16 in == quantize_mxfp8 first, bit for bit); choosing
the tables is ``decode-boundary tune`` (tests/bench/test_tune.py)."""

import inspect
from types import SimpleNamespace

import pytest
import torch
from gemm_helpers import make_layer

from decode_boundary.gemm import api, mxfp8_mm, selected_tactic
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
from decode_boundary.model.config import MODELS
from decode_boundary.mxfp8.format import QuantizedActivation, mxfp8_scale_bytes
from decode_boundary.mxfp8.quantize_kernel import quantize_mxfp8

TABLED_SHAPES = sorted(TABLE)
SERVED_TPS = (1, 2, 4, 8)


def model_shapes() -> set[tuple[int, int, int]]:
    """(N, K, groups) of every projection of every model at the TPs it divides."""
    shapes = set()
    for config in MODELS.values():
        for tp in SERVED_TPS:
            if config.o_groups % tp == 0 and config.n_heads % tp == 0:
                shapes |= set(config.projection_shapes(tp).values())
    return shapes


def test_projection_shapes_are_the_chain_layers():
    """config.projection_shapes names the shapes AttentionBoundary builds (wo_a's
    groups as one grouped launch) and refuses a TP the model cannot split."""
    c = MODELS["v4.1-flash"]
    assert c.projection_shapes(4) == {"wo_a": (2048, 4096, 2), "wo_b": (5120, 2048, 1),
                                      "fused_wqa_wkv": (1792, 5120, 1),
                                      "wq_b": (8192, 1280, 1)}
    for config in MODELS.values():
        for tp in (1, 2):
            shapes = config.projection_shapes(tp)
            n, k = config.wo_a_shape()
            assert shapes["wo_a"] == (n * config.o_groups // tp, k, config.o_groups // tp)
            assert shapes["wo_b"][:2] == config.wo_b_shape(tp)
    with pytest.raises(ValueError, match="tp=3"):
        c.projection_shapes(3)


def test_every_table_shape_is_a_model_projection():
    """The table holds no shape a model does not run (a stale or mistyped
    entry would never be selected)."""
    assert set(TABLE) <= model_shapes()


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


@pytest.mark.parametrize("n,k,groups", TABLED_SHAPES)
def test_tables_hold_valid_reachable_tactics_and_default_comes_first(n, k, groups):
    assert sorted(TABLE[(n, k, groups)]) == [1, 2, 4, 8, 16, 32, 48, 64]
    for bucket, tactic in TABLE[(n, k, groups)].items():
        assert is_valid(tactic, n, k, bucket, groups), (bucket, tactic)
        # reachable: every row count of the bucket selects it (the bucket's
        # largest count too, which its tiles must cover)
        smaller = [b for b in TABLE[(n, k, groups)] if b < bucket]
        for rows in range(max(smaller, default=0) + 1, bucket + 1):
            assert selected_tactic((n, k, groups), rows) == tactic, (bucket, rows)
            assert is_valid(tactic, n, k, rows, groups), (bucket, rows)
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


def test_a_table_entry_serves_both_input_kinds(monkeypatch):
    """An entry put into TABLE (what ``decode-boundary tune`` does while it
    times a candidate) is what mxfp8_mm launches, for a BF16 input and for its
    MXFP8 quantization alike, in that bucket only."""
    n, k = 5120, 2048
    layer = shape_layer(n, k, 1)
    for rows in (8, 2, 40):
        tabled = TABLE[(n, k, 1)][row_bucket(rows)]
        other = next(t for t in sweep_tactics(n, k, rows) if t != tabled)
        monkeypatch.setitem(TABLE, (n, k, 1), {**TABLE[(n, k, 1)], row_bucket(rows): other})
        assert selected_tactic(layer, rows) == other
        assert ran_tactics(layer, rows) == (other, other)
        neighbour = 1 if rows > 1 else 2
        assert selected_tactic(layer, neighbour) == TABLE[(n, k, 1)][neighbour]
        monkeypatch.undo()
        assert selected_tactic(layer, rows) == tabled


def test_tactic_selection_takes_no_input_kind():
    """Selection is a function of (N, K, groups, rows) only: no entry point of
    it has an input-kind parameter any more."""
    for fn in (selected_tactic, table_tactic, default_tactic, valid_tactics, sweep_tactics):
        assert "bf16_input" not in inspect.signature(fn).parameters, fn.__name__


def shape_layer(n, k, groups):
    """A layer of zero weights of (N, K, groups): enough to select and record."""
    return SimpleNamespace(weight=torch.zeros(n, k, dtype=torch.float8_e4m3fn).t(),
                           weight_scale=torch.zeros(mxfp8_scale_bytes(n, k), dtype=torch.uint8),
                           bias=None, groups=groups)


def zeros_input(layer, rows: int) -> QuantizedActivation:
    """An all-zero MXFP8 input of ``layer``, laid out like the quantizer's output."""
    k, n = layer.weight.shape
    shape = torch.Size((rows, getattr(layer, "groups", 1) * k))
    return QuantizedActivation(torch.zeros(shape, dtype=torch.float8_e4m3fn),
                               torch.zeros(mxfp8_scale_bytes(*shape), dtype=torch.uint8),
                               torch.bfloat16, shape)


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


@pytest.mark.parametrize("n,k,groups", TABLED_SHAPES)
def test_tabled_shapes_run_one_tactic_for_both_input_kinds(n, k, groups):
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
