"""The timeline diagnostic's analysis: a recording's stamps
(``common.timeline``, written by the instrumented kernels) turned into each
kernel's start / grid-wait / mark / end medians per step, the
where-does-the-time-go table of ``benchmarks/timeline.py``."""

from __future__ import annotations

import statistics

import torch

from decode_boundary.common.timeline import STAMPS, recording

# What kernel_times reports of a launch, µs from the caller's t0.
FIELDS = ("first_start", "last_start", "median_waited", "last_waited", "median_mark1",
          "median_mark2", "median_end", "last_end", "first_end")


def kernel_times(stamps: torch.Tensor, first: int, programs: int, t0: int) -> dict:
    """``FIELDS`` (and ``programs``) of the launch whose programs hold slots
    ``first .. first + programs`` of ``stamps`` (a recording's, on the host),
    in µs from ``t0`` (ns): first / last start, median / last grid-wait pass,
    the median marks (NaN where the kernel sets none), median / last end, and
    the end of the launch's first program (slot ``first``: a GEMM finishing the
    mixes runs token 0's combine there, apart from the weight owners)."""
    s = stamps[first:first + programs].double()
    start, waited, mark1, mark2, end = ((s[:, i] - t0) / 1e3 for i in range(STAMPS))

    def median(x):  # a mark a kernel does not set reads 0
        return x.median().item() if bool((s[:, 0] > 0).all()) and x.min() > -t0 / 1e3 \
            else float("nan")

    return {"first_start": start.min().item(), "last_start": start.max().item(),
            "median_waited": waited.median().item(), "last_waited": waited.max().item(),
            "median_mark1": median(mark1), "median_mark2": median(mark2),
            "median_end": end.median().item(), "last_end": end.max().item(),
            "first_end": end[0].item(), "programs": programs}


def stamped_steps(steps, device: torch.device, calls: int, skip: int = 3) -> dict:
    """Stamp ``calls`` back-to-back calls of ``steps`` (round robin, one per
    weight copy) captured in one CUDA graph and replayed 3 times (the stamps
    are the last replay's). ``{"kernels": per stamped kernel of a step, its
    name, programs and the medians of ``FIELDS`` over the steps but the first
    and last ``skip``, each step's from its first stamped program start;
    "step_us": the median period of those steps}``."""
    # One eager round compiles the stamped variants outside the capture and
    # counts the programs a round stamps, which sizes the graph's buffer.
    with recording(device, slots=1 << 20) as probe:
        for step in steps:
            step()
        torch.cuda.synchronize(device)
    rounds = -(-calls // len(steps))
    with recording(device, slots=probe.used * rounds) as rec:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                steps[i % len(steps)]()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize(device)
        launches = rec.launches
        stamps = rec.stamps.cpu()
    return step_medians(stamps, launches, calls, skip)


def step_medians(stamps: torch.Tensor, launches: list, calls: int, skip: int = 3) -> dict:
    """:func:`stamped_steps`' summary of ``calls`` steps' ``launches`` (a
    recording's, in launch order, the same kernels in every step) and their
    ``stamps`` (on the host)."""
    per_step = len(launches) // calls
    kept = range(skip, calls - skip)
    t0s = [int(stamps[first:first + n, 0].min())  # each step's first stamped kernel
           for _, first, n in (launches[s * per_step] for s in range(calls))]
    kernels = []
    for k in range(per_step):
        samples = [kernel_times(stamps, *launches[s * per_step + k][1:], t0s[s]) for s in kept]
        kernels.append({"kernel": f"{k}: {launches[k][0]}", "programs": samples[0]["programs"],
                        **{f: statistics.median(x[f] for x in samples) for f in FIELDS}})
    return {"kernels": kernels,
            "step_us": statistics.median((t0s[s + 1] - t0s[s]) / 1e3 for s in kept)}
