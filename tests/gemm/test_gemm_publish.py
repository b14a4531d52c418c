"""The GEMM's publishing epilogue in the interpreter, tp = 2 ranks simulated
as separate CPU mailboxes of one process (peer table = their data_ptr()s)."""

from types import SimpleNamespace

import pytest
import torch
from gemm_helpers import make_input, make_layer, poisoned

from decode_boundary.gemm import Tactic, launch_low_latency, warmup_low_latency

SENTINEL = -32768  # 0x8000 = BF16 -0.0, "not yet written"


def mailboxes(tp, capacity, hidden):
    boxes = [torch.full((3, tp, capacity, hidden), SENTINEL, dtype=torch.int16) for _ in range(tp)]
    peer_ptrs = torch.tensor([b.data_ptr() for b in boxes], dtype=torch.int64)
    return boxes, peer_ptrs


def with_negative_zero(layer, qa):
    """Make out[0, 0] = bf16(-2^-135) = -0: weight row 0 is 2^-9 at k = 0
    (e4m3 0x01, scale 2^0) and activation row 0 is -1 at k = 0 with scale 2^-126."""
    w = layer.weight.t().view(torch.uint8)  # the [N, K] storage
    w[0].zero_()
    w[0, 0] = 0x01
    layer.weight_scale[0] = 127  # swizzled offset of (row 0, group 0) is 0
    a = qa.data.view(torch.uint8)
    a[0].zero_()
    a[0, 0] = 0xB8  # -1.0
    qa.scale[0] = 1


@pytest.mark.parametrize("rows,tactic", [
    (1, Tactic(8, 1, 1, 4, 256)),  # CUDA cores, 8 columns: one 16-byte store per row
    (3, Tactic(16, 4, 2, 2, 64)),  # split-K: the last program publishes
    (8, Tactic(64, 16, 2, 4, 128)),  # tensor cores, split-K
    (20, Tactic(32, 32, 1, 4, 64)),  # a wide tile publishes too
])
def test_publish_writes_slot_stage_and_active(rows, tactic):
    g = torch.Generator().manual_seed(rows)
    tp, rank, capacity, n, k, stage = 2, 1, 24, 128, 256, 2
    layer, qa = make_layer(n, k, generator=g), make_input(rows, k, generator=g)
    with_negative_zero(layer, qa)
    plain = launch_low_latency(layer, qa, poisoned(rows, n), tactic)
    assert plain[0, 0].view(torch.int16) == SENTINEL  # the case the epilogue must clear
    boxes, peer_ptrs = mailboxes(tp, capacity, n)
    stage_state = torch.tensor([stage, 0], dtype=torch.int32)
    publish = SimpleNamespace(peer_ptrs=peer_ptrs, stage_state=stage_state, rank=rank, tp=tp,
                              capacity=capacity, hidden=n)
    out = launch_low_latency(layer, qa, poisoned(rows, n), tactic, publish)
    assert torch.equal(out.view(torch.int16), plain.view(torch.int16))
    if rows > 1:  # the BF16-in publishing kernel stores the same bits as BF16 in, plain
        x = torch.randn(rows, k, generator=g).bfloat16()
        bf16_boxes, bf16_ptrs = mailboxes(tp, capacity, n)
        plain_bf16 = launch_low_latency(layer, x, poisoned(rows, n), tactic)
        launch_low_latency(layer, x, poisoned(rows, n), tactic,
                           SimpleNamespace(**{**vars(publish), "peer_ptrs": bf16_ptrs}))
        clean = plain_bf16.view(torch.int16).clone()
        clean[clean == SENTINEL] = 0
        assert all(torch.equal(b[stage, rank, :rows], clean) for b in bf16_boxes)
    expected = plain.view(torch.int16).clone()
    expected[expected == SENTINEL] = 0
    for box in boxes:
        assert torch.equal(box[stage, rank, :rows], expected)
        written = torch.zeros_like(box, dtype=torch.bool)
        written[stage, rank, :rows] = True
        assert bool((box[~written] == SENTINEL).all())  # other slots, stages, tokens untouched
    assert stage_state.tolist() == [stage, stage]


def test_publish_arguments_are_checked():
    g = torch.Generator().manual_seed(0)
    layer, qa = make_layer(128, 128, generator=g), make_input(5, 128, generator=g)
    _, peer_ptrs = mailboxes(2, 4, 128)
    good = dict(peer_ptrs=peer_ptrs, stage_state=torch.zeros(2, dtype=torch.int32), rank=0, tp=2,
                capacity=8, hidden=128)
    tactic = Tactic(64, 8, 1, 4, 128)
    for change, match in [(dict(hidden=256), "hidden"), (dict(capacity=4), "capacity"),
                          (dict(rank=2), "rank"), (dict(peer_ptrs=peer_ptrs.int()), "peer_ptrs"),
                          (dict(stage_state=torch.zeros(3, dtype=torch.int32)), "stage_state")]:
        with pytest.raises(ValueError, match=match):
            launch_low_latency(layer, qa, poisoned(5, 128), tactic,
                               SimpleNamespace(**{**good, **change}))
    misaligned = SimpleNamespace(**{**good, "peer_ptrs": peer_ptrs + 2})
    with pytest.raises(ValueError, match="16-byte"):
        warmup_low_latency(layer, 5, tactic, misaligned)
