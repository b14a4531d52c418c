"""Batch-invariant mode on CPU (interpreter): the tactic dispatch, the switch,
and every bit of a row over row counts and batch-mates for a GEMM whose
tables are made to change the summation order with M (so the same check
fails in the default mode), and for the tiny model's whole boundary chain."""

import pytest
import torch
from invariance_checks import chain_failures, gemm_failures

from decode_boundary import env
from decode_boundary.bench.gemm import cancelling
from decode_boundary.boundary.consumer_tactics import INVARIANT_CONSUMER, ConsumerTactic
from decode_boundary.gemm import selected_tactic
from decode_boundary.gemm.tactics import (
    DOT_TILES,
    INVARIANT_ORDERS,
    TABLE,
    Tactic,
    dot_tile,
    fits,
    invariant_candidates,
    invariant_order,
    order_of,
    tactic_for,
    with_tile,
)
from decode_boundary.model.chain import AttentionBoundary
from decode_boundary.model.config import MODELS

SHAPES = [*INVARIANT_ORDERS, (3072, 1536, 1), (2064, 2048, 1), (4096, 1024, 4), (64, 1024, 1)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_one_order_at_every_row_count(shape):
    n, k, groups = shape
    order = invariant_order(n, k, groups)
    for rows in [*range(1, 70), 127, 128, 129, 1000]:
        tactic = tactic_for(n, k, rows, groups, batch_invariant=True)
        assert order_of(tactic) == order
        assert tactic.rows_tile == dot_tile(rows) and tactic.rows_tile in DOT_TILES
        assert tactic.rows_tile >= min(rows, DOT_TILES[-1])
        assert fits(tactic, n, k, groups)
    assert invariant_candidates(n, k, groups)[0] == order
    assert all(fits(with_tile(o, 64), n, k, groups) for o in invariant_candidates(n, k, groups))


def test_the_switch(monkeypatch):
    shape = (5120, 2048)
    monkeypatch.delenv(env.BATCH_INVARIANT_ENV, raising=False)
    assert not env.batch_invariant()
    assert selected_tactic(shape, 1).rows_tile == 1  # the tables: CUDA cores at one row
    monkeypatch.setenv(env.BATCH_INVARIANT_ENV, "on")
    assert env.batch_invariant() and selected_tactic(shape, 1).rows_tile == 16
    assert selected_tactic(shape, 1, batch_invariant=False).rows_tile == 1  # the argument wins
    monkeypatch.setenv(env.BATCH_INVARIANT_ENV, "sometimes")
    with pytest.raises(ValueError, match=env.BATCH_INVARIANT_ENV):
        env.batch_invariant()
    with pytest.raises(ValueError, match="batch_invariant"):
        env.batch_invariant(1)


@pytest.mark.parametrize("bf16_input", [True, False], ids=["bf16", "mxfp8"])
def test_gemm_rows_keep_their_bits(monkeypatch, bf16_input):
    n, k = 64, 512
    # Tables that change every part of the order with the row count, as the real ones do.
    monkeypatch.setitem(TABLE, (n, k, 1), {
        1: Tactic(8, 1, 1, 4, 1024), 2: Tactic(16, 2, 2, 4, 512), 4: Tactic(32, 16, 4, 4, 128),
        8: Tactic(32, 16, 4, 4, 128), 16: Tactic(64, 16, 2, 4, 128), 32: Tactic(64, 32, 4, 4, 64),
        48: Tactic(32, 64, 4, 4, 64), 64: Tactic(32, 64, 4, 4, 64)})
    layer, x = cancelling(n, k, 40, generator=torch.Generator().manual_seed(3))
    rows = [1, 2, 5, 17, 33]  # every table entry's kind: 1- and 2-row FMA, 16/32/64 tiles
    default = gemm_failures(layer, x, rows, bf16_input, mates=0, batch_invariant=False)
    assert default, "the default mode's tables must change a row's bits (else this test is vacuous)"
    assert gemm_failures(layer, x, rows, bf16_input, mates=3, batch_invariant=True) == []


def test_chain_tokens_keep_their_bits():
    """The tiny chain in the mode: a token's every output at M = 1 (the mixes fused
    in the consumer) and among random batch-mates, against the step of 33 tokens
    (the mixes kernel aside, in the consumer's order)."""
    ab = AttentionBoundary(MODELS["tiny"], 1, 0, None, "cpu", 33, seed=2, batch_invariant=True)
    try:
        assert ab.all_reduce.batch_invariant
        assert chain_failures(ab, ab.make_inputs(33, seed=5), [1], mates=1) == []
    finally:
        ab.close()


def test_chain_refuses_what_would_break_the_mode():
    ab = AttentionBoundary(MODELS["tiny"], 1, 0, None, "cpu", 4, seed=2, batch_invariant=False)
    try:
        with pytest.raises(ValueError, match="batch_invariant"):
            AttentionBoundary(MODELS["tiny"], 1, 0, None, "cpu", 4, all_reduce=ab.all_reduce,
                              batch_invariant=True)
    finally:
        ab.close()
    ab = AttentionBoundary(MODELS["tiny"], 1, 0, None, "cpu", 4, seed=2, batch_invariant=True)
    try:
        ab.all_reduce.tactic = ConsumerTactic(INVARIANT_CONSUMER[0] * 2, INVARIANT_CONSUMER[1])
        with pytest.raises(ValueError, match="batch-invariant mode runs the consumer"):
            ab(ab.make_inputs(2, seed=1))
    finally:
        ab.close()
