"""The timeline diagnostic's host side: slots are reserved per launch in
launch order, a full buffer is an error, and nothing is recorded (TIMELINE
off, the dummy pointer) outside a recording or in the interpreter."""

import math

import pytest
import torch

from decode_boundary.bench import timeline as analysis
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


def test_kernel_times_are_microseconds_from_t0_and_unset_marks_read_nan():
    t0 = 1_000_000
    start, waited, mark1, mark2, end = range(timeline.STAMPS)  # the stamps' order
    g = torch.Generator().manual_seed(3)
    rows = torch.randint(1, 50_000, (3, timeline.STAMPS), generator=g)
    rows[:, mark2] = -t0  # stored 0: a mark this kernel never sets
    stamps = torch.cat([torch.zeros(2, timeline.STAMPS, dtype=torch.int64), rows + t0])
    got = analysis.kernel_times(stamps, 2, 3, t0)
    us = rows.double() / 1e3
    assert got["programs"] == 3
    assert got["first_start"] == us[:, start].min().item()
    assert got["last_start"] == us[:, start].max().item()
    assert got["median_waited"] == us[:, waited].median().item()
    assert got["median_mark1"] == us[:, mark1].median().item()
    assert got["last_end"] == us[:, end].max().item()
    assert got["first_end"] == us[0, end].item()
    assert math.isnan(got["median_mark2"])
    assert set(analysis.FIELDS) <= set(got)


def test_step_medians_group_launches_by_step_from_each_steps_first_start():
    """Two stamped kernels a step, 8 steps 10 µs apart: each kernel's fields
    are the medians over the kept steps, counted from its step's first start."""
    calls, programs, launches, rows = 8, 2, [], []
    for s in range(calls):
        for k, name in enumerate(("consumer_kernel", "next_mixes_kernel")):
            launches.append((name, len(rows), programs))
            for p in range(programs):
                start = 1_000_000 + s * 10_000 + k * 3_000 + p * 100
                rows.append([start, start + 500, start + 700, start + 800, start + 2_000])
    got = analysis.step_medians(torch.tensor(rows, dtype=torch.int64), launches, calls, skip=2)
    assert [k["kernel"] for k in got["kernels"]] == ["0: consumer_kernel", "1: next_mixes_kernel"]
    first, second = got["kernels"]
    assert first["programs"] == programs and first["first_start"] == 0.0
    assert first["last_start"] == 0.1 and first["last_end"] == 2.1
    assert second["first_start"] == 3.0 and second["median_waited"] == 3.5  # the lower middle
    assert got["step_us"] == 10.0
