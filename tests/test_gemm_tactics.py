"""Tactic tables, row buckets and the autotuner (selection logic, pinned
offering, save/load); timing itself is a GPU test."""

import pytest
import torch
from gemm_helpers import make_layer

from decode_boundary.gemm import AUTOTUNER, Autotuner, pinned_tactics, selected_tactic
from decode_boundary.gemm.tactics import (
    LOW_BATCH_TACTICS,
    PINNED_TACTICS,
    SPLIT_KS,
    TARGET_CTAS,
    WIDE_TACTICS,
    Tactic,
    default_tactic,
    heuristic_tactic,
    is_valid,
    row_bucket,
    sweep_tactics,
    valid_tactics,
)

DSV4_SHAPES = [(5120, 2048), (8192, 1280), (1792, 5120), (1024, 4096), (7168, 4096)]


def test_row_buckets():
    got = [row_bucket(r) for r in (1, 2, 3, 5, 8, 9, 16, 17, 33, 48, 49, 64, 65, 200)]
    assert got == [1, 2, 4, 8, 8, 16, 16, 32, 48, 48, 64, 64, 128, 256]
    with pytest.raises(ValueError, match="rows"):
        row_bucket(0)


@pytest.mark.parametrize("n,k", DSV4_SHAPES)
def test_tables_hold_valid_tactics_and_default_comes_first(n, k):
    for rows in (1, 5, 8):
        assert is_valid(LOW_BATCH_TACTICS[(n, k)], n, k, rows)
    for tile, rows in ((16, 12), (32, 30), (64, 48)):
        assert is_valid(WIDE_TACTICS[(n, k)][tile], n, k, rows)
    for max_rows, tactic in PINNED_TACTICS[(n, k)]:
        assert is_valid(tactic, n, k, min(max_rows, 4096))
    for rows in (1, 8, 16, 40, 64, 300):
        tactics = valid_tactics(n, k, rows)
        assert tactics[0] == default_tactic(n, k, rows)
        assert len(set(tactics)) == len(tactics) and all(is_valid(t, n, k, rows) for t in tactics)
        sweep = sweep_tactics(n, k, rows)
        assert sweep[0] == tactics[0] and set(sweep) <= set(tactics) and len(sweep) <= 24


def test_heuristic_reaches_target_ctas_or_maximal_split():
    for n, k in [(256, 4096), (4096, 512), (640, 96)]:
        t = heuristic_tactic(n, k, 4)
        ctas = n // t.block_n * t.split_k
        assert ctas >= TARGET_CTAS or t.split_k == max(SPLIT_KS) or \
            not is_valid(t._replace(split_k=t.split_k * 2), n, k, 4)
    with pytest.raises(ValueError, match="N % 64"):
        heuristic_tactic(96, 128, 1)


@pytest.fixture
def clean_autotuner():
    saved = dict(AUTOTUNER.cache)
    AUTOTUNER.cache.clear()
    yield AUTOTUNER
    AUTOTUNER.cache.clear()
    AUTOTUNER.cache.update(saved)


def test_autotuner_picks_fastest_per_bucket_and_selected_follows(clean_autotuner, tmp_path):
    layer = make_layer(128, 512)
    fast = Tactic(64, 128, 16, 4, 4, True)
    seen = []

    def timer(lay, rows, tactic):
        seen.append((rows, tactic))
        return 1.0 if tactic == fast else 2.0

    assert selected_tactic(layer, 3) == default_tactic(128, 512, 3)
    assert clean_autotuner.tune(layer, 3, timer=timer) == fast
    assert {r for r, _ in seen} == {4} and len(seen) == len(sweep_tactics(128, 512, 4))
    assert selected_tactic(layer, 4) == fast and selected_tactic(layer, 3) == fast
    assert selected_tactic(layer, 2) == default_tactic(128, 512, 2)  # another bucket
    path = tmp_path / "tactics.json"
    clean_autotuner.save(str(path))
    other = Autotuner()
    other.load(str(path))
    assert other.cache == clean_autotuner.cache


def test_pinned_tactics_offers_only_the_pinned_one(clean_autotuner):
    n, k = 5120, 2048
    assert len(clean_autotuner.candidates(n, k, 8)) > 1
    with pinned_tactics():
        assert clean_autotuner.candidates(n, k, 8) == [LOW_BATCH_TACTICS[(n, k)]]
        assert clean_autotuner.candidates(n, k, 32) == [WIDE_TACTICS[(n, k)][32]]
        assert len(clean_autotuner.candidates(n, k, 4)) > 1  # 1..4 rows stay tuned
        assert len(clean_autotuner.candidates(256, 256, 8)) > 1  # not a pinned shape
    assert len(clean_autotuner.candidates(n, k, 8)) > 1


def test_autotuner_needs_a_gpu_to_time():
    with pytest.raises(RuntimeError, match="CUDA"):
        Autotuner().tune(make_layer(64, 128), 1)
    assert torch.cuda.device_count() >= 0
