"""The model-level boundary chain on the tiny config in the interpreter (tp = 1),
and on 2 GPUs at the DSV4.1-Flash shapes."""

import pytest
import torch

from decode_boundary.model.chain import (
    AttentionBoundary,
    check_outputs,
    outputs_identical,
    run_simulated,
    simulated_boundaries,
)
from decode_boundary.model.config import MODELS


@pytest.fixture(scope="module")
def tiny_boundary():
    ab = AttentionBoundary(MODELS["tiny"], 1, 0, None, torch.device("cpu"), capacity=8, seed=3)
    ab.precompile([1, 2, 5])  # what a server does before its first step (a no-op compile here)
    yield ab
    ab.close()


@pytest.mark.parametrize("rows", [1, 5])
def test_fused_matches_unfused_and_reference(tiny_boundary, rows):
    inputs = tiny_boundary.make_inputs(rows, seed=rows)
    unfused = tiny_boundary.run(inputs, "unfused")
    fused = tiny_boundary.run(inputs, "fused")
    assert outputs_identical(fused, unfused)
    assert check_outputs(fused, tiny_boundary.reference(inputs)) == []


def test_consecutive_steps_rotate_stages(tiny_boundary):
    """Three fused steps in a row walk the three mailbox stages; each stays exact."""
    for step in range(4):
        inputs = tiny_boundary.make_inputs(2, seed=100 + step)
        fused = tiny_boundary.run(inputs, "fused")
        assert check_outputs(fused, tiny_boundary.reference(inputs)) == []


def test_check_outputs_catches_a_wrong_answer(tiny_boundary):
    inputs = tiny_boundary.make_inputs(2, seed=7)
    out = tiny_boundary.run(inputs, "unfused")
    ref = tiny_boundary.reference(inputs)
    out.q.mul_(1.1)
    assert any(f.startswith("q:") for f in check_outputs(out, ref))


def test_bad_path(tiny_boundary):
    with pytest.raises(ValueError, match="path"):
        tiny_boundary.run(tiny_boundary.make_inputs(1, 0), "nccl")


def test_two_simulated_ranks_fused_unfused_reference_and_rank_identity():
    ranks = simulated_boundaries(MODELS["tiny"], 2, capacity=8, seed=4)
    inputs = [b.make_inputs(3, seed=9) for b in ranks]
    assert not torch.equal(inputs[0].attn_out, inputs[1].attn_out)  # each rank its own
    unfused = run_simulated(ranks, inputs, "unfused")
    fused = run_simulated(ranks, inputs, "fused")
    partials = [b.reference_partial(x) for b, x in zip(ranks, inputs, strict=True)]
    ref = ranks[0].reference(inputs[0], partials)
    for u, f in zip(unfused, fused, strict=True):
        assert outputs_identical(u, f)
        assert check_outputs(f, ref) == []
    assert outputs_identical(fused[0], fused[1])
