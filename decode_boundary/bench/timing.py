"""The one GPU timer: every benchmark (``decode_boundary.bench``,
``benchmarks/``) and the GEMM autotuner time with it (docs/DESIGN.md §9).
It sits below the kernels so the autotuner can use it; it imports only torch.

A call's time is the median, over several replays, of one CUDA graph holding
many back-to-back calls, divided by the calls it holds (CUDA events around
each replay). The calls rotate through copies of the weights that together
exceed ``L2_MULTIPLE`` times the device's L2 (``copies_for_cold_l2``), so no
call finds its weights in L2 — the cold-L2 rule of every figure here. With a
process group, ranks are barriered before each replay. Floors use
:func:`copy_rate`, the HBM rate measured in the same run.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import torch
import torch.distributed as dist

L2_MULTIPLE = 2  # rotated weights exceed this many L2s
MIN_CALLS = 40  # calls per graph: dilutes the replay's launch and the ranks' skew
WARMUP_REPLAYS = 3
REPLAYS = 15
COPY_BYTES = 1 << 30  # smaller buffers read slower than HBM can (docs/DESIGN.md §9)


def copy_rate(device: torch.device | str = "cuda", nbytes: int = COPY_BYTES,
              reps: int = 10) -> float:
    """HBM bytes/s of an ``nbytes`` device copy (read + write counted): median of
    ``reps`` event-timed copies after warm-up. The floor every benchmark reports."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    seconds = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / statistics.median(seconds)


def copies_for_cold_l2(bytes_per_copy: int, device: torch.device | str) -> int:
    """Weight copies to rotate through so that together they exceed
    ``L2_MULTIPLE`` x the device's L2: a call on copy i finds none of copy i-1."""
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(2, L2_MULTIPLE * l2 // bytes_per_copy + 1)


def rotated_copies(layer, device: torch.device | str | None = None) -> list[SimpleNamespace]:
    """Layer-like copies of ``layer``'s MXFP8 weight and scales, as many as
    :func:`copies_for_cold_l2` asks for (the first shares nothing with ``layer``)."""
    storage = layer.weight.t()
    per_copy = storage.numel() + layer.weight_scale.numel()
    count = copies_for_cold_l2(per_copy, device or storage.device)
    return [SimpleNamespace(weight=storage.clone().t(), weight_scale=layer.weight_scale.clone(),
                            bias=getattr(layer, "bias", None), groups=getattr(layer, "groups", 1))
            for _ in range(count)]


def _barrier(group: dist.ProcessGroup | None, device: torch.device) -> None:
    torch.cuda.synchronize(device)
    if group is not None:
        dist.barrier(group=group, device_ids=[device.index])
        torch.cuda.synchronize(device)


def graph_time_us(steps: Sequence[Callable[[], object]], device: torch.device | str = "cuda",
                  group: dist.ProcessGroup | None = None, min_calls: int = MIN_CALLS,
                  replays: int = REPLAYS, join: Callable[[], object] | None = None) -> float:
    """Median µs of one call, from a CUDA graph of back-to-back calls.

    ``steps`` holds one callable per weight copy; the graph calls them
    round-robin, ``min_calls`` times or more (a whole number of rounds), and
    is replayed ``replays`` times after ``WARMUP_REPLAYS``. Each step runs once
    eagerly first, on a side stream as graph capture recommends, so nothing
    compiles or allocates lazily during capture (Triton compiles, workspaces,
    NCCL communicators, torch.compile graphs). With a group, every rank calls
    this with the same steps (the graph may hold collectives). ``join``: called
    after the eager pass and after the last captured call, on the stream that
    ran them: it joins work the steps leave on streams of their own (a capture
    must end joined), e.g. ``BoundaryAllReduce.join_mixes``; each step joins
    what the step before it left."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for step in steps:
            step()
        if join is not None:
            join()
    torch.cuda.current_stream(device).wait_stream(side)
    calls = len(steps) * -(-min_calls // len(steps))
    _barrier(group, device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            steps[i % len(steps)]()
        if join is not None:
            join()
    for _ in range(WARMUP_REPLAYS):
        graph.replay()
    times = []
    for _ in range(replays):
        _barrier(group, device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    return statistics.median(times)
