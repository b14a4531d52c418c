"""GPU timing the way design.md §9 measures: CUDA graphs of many back-to-back
calls on rotated weight copies (more bytes than L2 holds), CUDA events, medians."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from types import SimpleNamespace

import torch

L2_FLUSH_BYTES = 64 << 20  # H200 L2 is 50 MB: rotating more than this leaves none cached
COPY_BYTES = 1 << 30  # smaller buffers read slower than HBM can (design.md §9)


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


def rotated_copies(layer, min_bytes: int = L2_FLUSH_BYTES) -> list[SimpleNamespace]:
    """Copies of ``layer``'s weight and scales (layer-like objects) whose total
    exceeds ``min_bytes``, so a call on copy i finds none of copy i-1 in L2."""
    storage = layer.weight.t()
    per_copy = storage.numel() + layer.weight_scale.numel()
    count = max(2, -(-min_bytes // per_copy) + 1)
    return [SimpleNamespace(weight=storage.clone().t(), weight_scale=layer.weight_scale.clone(),
                            bias=layer.bias, groups=getattr(layer, "groups", 1))
            for _ in range(count)]


def graph_time_us(call: Callable[[int], object], copies: int, calls: int | None = None,
                  reps: int = 10) -> float:
    """Median µs per call of ``call(i)`` (i cycles over ``copies``) inside one
    CUDA graph of ``calls`` back-to-back calls, replayed ``reps`` times."""
    calls = calls or max(2 * copies, 40)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):  # compile, allocate workspaces, warm the allocator
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    return median_replay_us(graph, calls, reps)


def median_replay_us(graph: torch.cuda.CUDAGraph, calls: int, reps: int,
                     before: Callable[[], object] | None = None) -> float:
    """Median over ``reps`` replays of ``graph`` of its CUDA-event time divided
    by the ``calls`` it holds, in µs; ``before`` runs ahead of each replay
    (e.g. a barrier so that ranks start together)."""
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    return statistics.median(times)
