"""Properties of the Lamport mailbox protocol (docs/DESIGN.md §6) on its host-side model:
random interleavings never lose or mix data and never deadlock; clearing stage s+1
instead of the consumed stage does corrupt a fast peer."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st
from protocol_model import MailboxModel, simulate


def random_bf16_bits(rng, shape):
    """Finite BF16 bit patterns, with +0 and -0 (0x8000, the sentinel) mixed in."""
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    bits[(bits & 0x7F80) == 0x7F80] &= 0xBFFF  # Inf/NaN exponent -> finite
    special = rng.random(shape)
    bits[special < 0.15] = 0x8000
    bits[(special >= 0.15) & (special < 0.25)] = 0x0000
    return bits


def expected_sum(parts):
    """FP32 sum in rank order of what the ranks published (-0 arrives as +0),
    computed with torch rather than the model's numpy conversion."""
    total = None
    for bits in parts:
        values = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float()
        values = torch.where(values == 0, torch.zeros_like(values), values)  # -0 -> +0
        total = values if total is None else total + values
    return total.numpy()


def make_inputs(seed, tp, rows, hidden):
    rng = np.random.default_rng(seed)
    return [[random_bf16_bits(rng, (m, hidden)) for _ in range(tp)] for m in rows]


def assert_all_correct(run, inputs):
    assert not run.deadlocked
    for rank, results in enumerate(run.results):
        assert len(results) == len(inputs), f"rank {rank} finished {len(results)} steps"
        for step, got in enumerate(results):
            want = expected_sum(inputs[step])
            # Bit equality: +0 and -0 differ, so a lost or mixed value cannot hide.
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (rank, step)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tp=st.integers(1, 3),
    rows=st.lists(st.integers(1, 3), min_size=1, max_size=5),
    hidden=st.sampled_from([2, 4, 6]),
    piece=st.sampled_from([1, 2, 4]),
    clear=st.sampled_from(["consumed", "previous"]),
    seed=st.integers(0, 2**32 - 1),
    prefix=st.lists(st.integers(0, 63), max_size=50),
)
def test_random_interleavings_never_lose_or_mix(tp, rows, hidden, piece, clear, seed, prefix):
    inputs = make_inputs(seed, tp, rows, hidden)
    # Hypothesis draws short, small-valued lists, which mostly replay the lockstep
    # order; a seeded uniform tail makes every example a genuinely random interleaving.
    tail = np.random.default_rng(seed).integers(0, 1 << 20, size=2000).tolist()
    run = simulate(inputs, prefix + tail, clear=clear, capacity=3, piece=piece)
    assert_all_correct(run, inputs)
    # The bound the three stages rely on, which nothing in the model enforces directly.
    assert run.max_lead <= 1


def fast_peer_scenario(clear):
    """Rank 1 runs ahead: it consumes step 0 and publishes step 1 into rank 0's
    stage 1 before rank 0 consumes step 0. Returns (model, step inputs, rank 0's sums)."""
    rng = np.random.default_rng(5)
    a = [random_bf16_bits(rng, (1, 4)) for _ in range(2)]
    b = [random_bf16_bits(rng, (1, 4)) for _ in range(2)]
    model = MailboxModel(tp=2, capacity=1, hidden=4, clear=clear)

    def land_all():
        while model.in_flight:
            model.land(len(model.in_flight) - 1)

    model.publish(0, a[0])
    model.publish(1, a[1])
    land_all()
    assert model.consume(1, 1) is not None
    model.publish(1, b[1])  # rank 1 is now one boundary ahead of rank 0
    land_all()
    sums = [model.consume(0, 1)]
    model.publish(0, b[0])
    land_all()
    sums.append(model.consume(0, 1))
    return model, (a, b), sums


def test_fast_peer_survives_the_correct_clear():
    for clear in ("consumed", "previous"):
        _, (a, b), sums = fast_peer_scenario(clear)
        assert np.array_equal(sums[0], expected_sum(a))
        assert np.array_equal(sums[1], expected_sum(b))


def test_clearing_next_stage_loses_the_fast_peers_data():
    model, _, sums = fast_peer_scenario("next")
    assert sums[0] is not None
    # Rank 1's step-1 values were wiped from rank 0's stage 1 and nothing will rewrite
    # them: rank 0 spins forever.
    assert sums[1] is None and not model.in_flight
    assert (model.mailbox[0, 1, 1] == 0x8000).all()


def test_property_catches_the_wrong_clear():
    """Hypothesis finds a schedule on which clear="next" breaks the property that the
    correct clear keeps; if clearing s+1 were harmless, find() would raise."""
    inputs = make_inputs(11, tp=2, rows=[1, 1, 1], hidden=2)

    def broken(choices):
        run = simulate(inputs, choices, clear="next")
        try:
            assert_all_correct(run, inputs)
        except AssertionError:
            return True
        return False

    schedule = find(
        st.lists(st.integers(0, 63), max_size=60),
        broken,
        settings=settings(max_examples=2000, database=None, deadline=None),
    )
    assert_all_correct(simulate(inputs, schedule, clear="consumed"), inputs)


def test_consume_waits_for_every_piece():
    model = MailboxModel(tp=2, capacity=2, hidden=8, clear="consumed", piece=2)
    ones = np.full((2, 8), 0x3F80, dtype=np.uint16)  # bf16 1.0
    model.publish(0, ones)
    model.publish(1, ones)
    mine = [i for i, p in enumerate(model.in_flight) if p.dst == 0]
    for i in reversed(mine[1:]):  # all but the first piece of rank 0's stores
        model.land(i)
    assert model.consume(0, 2) is None, "a 16-byte store landed in part must not be read"
    model.land(mine[0])
    assert np.array_equal(model.consume(0, 2), np.full((2, 8), 2.0, dtype=np.float32))


def test_stage_words_cycle_and_consumed_slots_rearm():
    model = MailboxModel(tp=1, capacity=2, hidden=2)
    for step in range(4):
        assert model.stage_state[0, 0] == step % 3
        model.publish(0, np.array([[0x8000, 0x4000]], dtype=np.uint16))  # -0, 2.0
        assert model.stage_state[0, 1] == step % 3
        while model.in_flight:
            model.land(0)
        total = model.consume(0, 1)
        assert total.view(np.uint32).tolist() == [[0x00000000, 0x40000000]]  # +0, 2.0
        assert (model.mailbox == 0x8000).all()


def test_model_errors():
    with pytest.raises(ValueError, match="clear must be one of"):
        MailboxModel(2, 1, 4, clear="all")
    with pytest.raises(ValueError, match="piece"):
        MailboxModel(2, 1, 4, piece=16)
    model = MailboxModel(2, 1, 4)
    with pytest.raises(ValueError, match=r"uint16 BF16 bits \[M <= 1, 4\]"):
        model.publish(0, np.zeros((2, 4), dtype=np.uint16))
    with pytest.raises(ValueError, match="uint16"):
        model.publish(0, np.zeros((1, 4), dtype=np.float32))
