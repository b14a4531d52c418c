"""The layer input's ready words (common.contract.MixesFinish): the consumer
tags them with the step number once its layer input is stored, and the GEMM
after it starts on them instead of the consumer's grid. In the interpreter
(tiny config, serial consumer) and on the GPU (V4.1-Flash TP-4 shapes,
cooperative consumer, PDL)."""

import pytest
import torch
from chain_gpu_checks import replayed_outputs

from decode_boundary.boundary.consumer_kernel import NORM_TIMEOUT_BIT
from decode_boundary.common.contract import STAGE_STEP, ready_columns
from decode_boundary.gemm import mxfp8_mm
from decode_boundary.model.chain import (
    AttentionBoundary,
    BoundaryOutputs,
    check_mixes,
    check_outputs,
    outputs_identical,
)
from decode_boundary.model.config import MODELS


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _waiting_step(ab: AttentionBoundary, rows: int, seed: int):
    """Publish and consume one step, leaving the combine (and the ready words)
    to the GEMM: (inputs, consumer results, STEP before the publish)."""
    box = ab.all_reduce._box
    inputs = ab.make_inputs(rows, seed=seed)
    before = int(box.stage_state[STAGE_STEP])
    partial = ab.produce(inputs, fused=True)
    return inputs, ab.reduce(inputs, partial, combine_mixes=False), before


def _grid_waiting_outputs(ab: AttentionBoundary, inputs) -> BoundaryOutputs:
    """The same step with the consumer's own combine and a GEMM that waits for
    the consumer's grid (no finish, so no ready words)."""
    partial = ab.produce(inputs, fused=True)
    residual_out, layer_input, next_in, mixes = ab.reduce(inputs, partial, combine_mixes=True)
    return BoundaryOutputs(residual_out, layer_input, mxfp8_mm(ab.fused_wqa_wkv, next_in), *mixes)


@pytest.fixture(scope="module")
def tiny():
    ab = AttentionBoundary(MODELS["tiny"], 1, 0, None, torch.device("cpu"), capacity=24, seed=5)
    yield ab
    ab.close()


@pytest.mark.parametrize("rows", [1, 6])
def test_words_carry_the_step_and_the_gemm_gets_the_grid_waits_bits(tiny, rows):
    box = tiny.all_reduce._box
    for repeat in range(2):  # the second step's words must be new ones
        inputs, (residual_out, layer_input, next_in, mixes, finish), before = _waiting_step(
            tiny, rows, seed=10 * rows + repeat)
        step = int(box.stage_state[STAGE_STEP])
        assert step == before + 1  # one publish, one step
        assert finish.input_ready is box.input_ready and finish.stage_state is box.stage_state
        chunks = -(-tiny.config.hidden // finish.ready_cols)
        words = box.input_ready
        assert bool((words[:rows, :chunks] == step).all())
        assert bool((words[rows:] != step).all()) and bool((words[:, chunks:] != step).all())
        q = mxfp8_mm(tiny.fused_wqa_wkv, next_in, finish_mixes=finish)
        ready = BoundaryOutputs(residual_out, layer_input, q, *mixes)
        assert outputs_identical(ready, _grid_waiting_outputs(tiny, inputs))
        assert check_outputs(ready, tiny.reference(inputs)) == []


def test_a_stale_word_times_out_into_nan_and_the_status_bit(tiny):
    box, ar = tiny.all_reduce._box, tiny.all_reduce
    inputs, (_, _, next_in, _, finish), _ = _waiting_step(tiny, 3, seed=77)
    step = int(box.stage_state[STAGE_STEP])
    box.input_ready[1, 0] = step - 1  # row 1's first program: an older step's word
    q = mxfp8_mm(tiny.fused_wqa_wkv, next_in, finish_mixes=finish._replace(wait_bound=8))
    assert int(box.status) & NORM_TIMEOUT_BIT
    assert bool(q[1].float().isnan().all())  # every program of row 1 reads chunk 0
    with pytest.raises(RuntimeError, match="ready words"):
        ar.check()
    ar.reset(collective=True)
    assert not bool(box.input_ready.any()) and not bool(box.stage_state.any())
    inputs = tiny.make_inputs(3, seed=78)  # a good step after the reset
    assert check_outputs(tiny(inputs), tiny.reference(inputs)) == []


def test_ready_words_arguments_are_checked(tiny):
    _, (_, _, next_in, _, finish), _ = _waiting_step(tiny, 2, seed=90)
    bad = finish._replace(input_ready=finish.input_ready[:, :-1].contiguous())
    with pytest.raises(ValueError, match="ready words"):
        mxfp8_mm(tiny.fused_wqa_wkv, next_in, finish_mixes=bad)
    bad = finish._replace(stage_state=finish.stage_state[:2].clone())
    with pytest.raises(ValueError, match="stage_state"):
        mxfp8_mm(tiny.fused_wqa_wkv, next_in, finish_mixes=bad)
    assert finish.input_ready.shape[1] == ready_columns(tiny.config.hidden)
    mxfp8_mm(tiny.fused_wqa_wkv, next_in, finish_mixes=finish)  # the finish is still good


@pytest.mark.gpu
def test_gpu_ready_words_bits_graphs_and_timeout():
    """V4.1-Flash at TP-4 shapes (one rank, PDL, cooperative consumer) at M =
    1, 16 and 32: the chain's step (the GEMM on the ready words, the mixes
    shares after the layer input) gives the bits of the consumer's own combine
    and a GEMM that waits for its grid; a graph of three steps replays to the
    eager bits; a stale word times out (NaN rows, the status bit) within its
    bound instead of hanging, and a reset brings the next step back."""
    device = torch.device("cuda", torch.cuda.current_device())
    ab = AttentionBoundary(MODELS["v4.1-flash"], 4, 0, None, device, capacity=32, seed=21)
    rows_list = (1, 16, 32)
    ab.precompile(rows_list)
    box, ar = ab.all_reduce._box, ab.all_reduce
    try:
        for rows in rows_list:
            inputs = ab.make_inputs(rows, seed=rows)
            eager = ab(inputs)
            torch.cuda.synchronize(device)
            assert outputs_identical(eager, _grid_waiting_outputs(ab, inputs)), rows
            assert check_outputs(eager, ab.reference(inputs)) == []
            assert check_mixes(eager, ab) == []
            for out in replayed_outputs(lambda inputs=inputs: [ab(inputs) for _ in range(3)],
                                        device):
                assert outputs_identical(out, eager), rows
        inputs, (_, _, next_in, _, finish), _ = _waiting_step(ab, 16, seed=5)
        torch.cuda.synchronize(device)
        box.input_ready[3, 7] -= 1  # row 3, consumer program 7: an older step's word
        q = mxfp8_mm(ab.fused_wqa_wkv, next_in, finish_mixes=finish._replace(wait_bound=20_000))
        torch.cuda.synchronize(device)
        assert int(box.status) & NORM_TIMEOUT_BIT
        # Every column block has a split whose K-slice covers program 7 (the reducer
        # sums the NaN in): row 3's whole tile is NaN.
        assert bool(q[3].float().isnan().all())
        ar.reset(collective=True)
        inputs = ab.make_inputs(16, seed=6)
        out = ab(inputs)
        torch.cuda.synchronize(device)
        assert check_outputs(out, ab.reference(inputs)) == []
    finally:
        ab.close()
