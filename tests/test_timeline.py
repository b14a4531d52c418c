"""The timeline diagnostic's host side: slots are reserved per launch in
launch order, a full buffer is an error, and nothing is recorded (TIMELINE
off, the dummy pointer) outside a recording or in the interpreter."""

import pytest
import torch

from decode_boundary.common import timeline


def test_slots_in_launch_order_and_a_full_buffer_is_an_error():
    rec = timeline.Recording(torch.zeros(10, timeline.STAMPS, dtype=torch.int64))
    assert rec.reserve("a", 4) == 0 and rec.reserve("b", 5) == 4
    assert rec.launches == [("a", 0, 4), ("b", 4, 5)]
    with pytest.raises(RuntimeError, match="full"):
        rec.reserve("c", 2)


def test_outside_a_recording_launches_are_not_instrumented():
    dummy = torch.zeros(1)
    stamps, first, on = timeline.launch_args("k", 7, torch.device("cpu"), dummy)
    assert stamps is dummy and first == 0 and on is False


def test_recording_refuses_the_interpreter():
    with pytest.raises(RuntimeError, match="CUDA device"), timeline.recording("cpu"):
        pass
