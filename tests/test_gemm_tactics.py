"""Tactic tables, row buckets and the autotuner (selection logic, pinned
offering, save/load); timing itself is a GPU test."""

import pytest
import torch
from gemm_helpers import make_layer

from decode_boundary.gemm import AUTOTUNER, Autotuner, pinned_tactics, selected_tactic
from decode_boundary.gemm.tactics import (
    BF16_TABLE,
    TABLE,
    Tactic,
    default_tactic,
    heuristic_tactic,
    is_valid,
    k_pieces,
    row_bucket,
    sweep_tactics,
    valid_tactics,
)

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
    for table in (TABLE, BF16_TABLE):
        for bucket, tactic in table[(n, k, groups)].items():
            rows = min(bucket, 64)
            assert is_valid(tactic, n, k, rows, groups), (bucket, tactic)
    for rows in (1, 2, 5, 8, 16, 40, 64, 300):
        for bf16 in (False, True):
            tactics = valid_tactics(n, k, rows, groups, bf16)
            assert tactics[0] == default_tactic(n, k, rows, groups, bf16)
            assert len(set(tactics)) == len(tactics)
            sweep = sweep_tactics(n, k, rows, groups, bf16)
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
    assert selected_tactic(layer, 4, bf16_input=True) == default_tactic(128, 512, 4)
    path = tmp_path / "tactics.json"
    clean_autotuner.save(str(path))
    other = Autotuner()
    other.load(str(path))
    assert other.cache == clean_autotuner.cache


def test_pinned_tactics_offers_only_the_pinned_one(clean_autotuner):
    n, k = 5120, 2048
    assert len(clean_autotuner.candidates(n, k, 8)) > 1
    with pinned_tactics():
        assert clean_autotuner.candidates(n, k, 8) == [TABLE[(n, k, 1)][8]]
        assert clean_autotuner.candidates(n, k, 8, bf16_input=True) == [BF16_TABLE[(n, k, 1)][8]]
        assert clean_autotuner.candidates(n, k, 32) == [TABLE[(n, k, 1)][32]]
        assert len(clean_autotuner.candidates(n, k, 4)) > 1  # 1..4 rows stay tuned
        assert len(clean_autotuner.candidates(256, 256, 8)) > 1  # not a pinned shape
    assert len(clean_autotuner.candidates(n, k, 8)) > 1


def test_autotuner_needs_a_gpu_to_time():
    with pytest.raises(RuntimeError, match="CUDA"):
        Autotuner().tune(make_layer(64, 128), 1)
    assert torch.cuda.device_count() >= 0
