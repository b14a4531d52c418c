"""Split-K scratch per stream on an H200 (scripts/gpu_tests.sh -k split_k):
the same-size split-K GEMM (wo_b 5120 x 2048 at M = 8, tabled split-K 6) on two
streams at once, eagerly and from CUDA graphs captured on each stream, gives
every output bit of a serial run; with the scratch forced shared (the old
cache, one per device and size) the same run goes wrong, which shows that the
runs overlap. ``graph_time_us`` (warm-up on a side stream, capture on
``torch.cuda.graph``'s own stream) still captures a split-K GEMM.

Overlap: eager launches cost more host time than the GPU needs to run them, so
each chunk of launches is queued behind a ``torch.cuda._sleep`` on both
streams; when the sleeps end, both streams' queued GEMMs are ready together.
Graph replays are GPU-bound and overlap by themselves."""

import functools

import pytest
import torch
from gemm_helpers import make_layer

from decode_boundary.bench.timing import graph_time_us
from decode_boundary.gemm import launch_low_latency, launcher, precompile, selected_tactic

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda", 0)
N, K, ROWS = 5120, 2048, 8  # wo_b at M = 8: TABLE tactic _t(128, 16, 6, 8, 128)
LAUNCHES = 10_000  # per stream
INPUTS = 4  # distinct BF16 inputs per stream, rotated; the two streams' differ
CHUNK = 200  # launches per stream queued behind one sleep
SLEEP_CYCLES = 60_000_000  # ~30 ms at ~2 GHz: longer than queuing 2 x CHUNK launches
GRAPH_LAUNCHES = 100  # per captured graph; LAUNCHES // GRAPH_LAUNCHES replays per stream


def scratch_buffers():
    """Every cached split-K buffer, as {(cache, key): address}."""
    return {(name, key): buf.data_ptr() for name, cache in
            (("workspace", launcher._WORKSPACES), ("counters", launcher._COUNTERS))
            for key, buf in cache.items()}


def bits(t):
    return t.view(torch.int16)


@pytest.fixture
def fresh_scratch(monkeypatch):
    """Empty split-K caches for the test (restored after it)."""
    monkeypatch.setattr(launcher, "_WORKSPACES", {})
    monkeypatch.setattr(launcher, "_COUNTERS", {})


def make_cases():
    """(layer, tactic, {stream: (inputs, serial outputs)}, streams): the serial
    reference runs on the current stream, before anything overlaps."""
    g = torch.Generator().manual_seed(2048)
    layer = make_layer(N, K, DEV, g)
    tactic = selected_tactic(layer, ROWS)
    assert tactic.split_k > 1, tactic
    streams = [torch.cuda.Stream(DEV), torch.cuda.Stream(DEV)]
    assert streams[0].stream_id != streams[1].stream_id
    cases = {}
    for s in streams:
        xs = [(torch.randn(ROWS, K, generator=g) * (1 + i)).to(DEV).bfloat16()
              for i in range(INPUTS)]
        refs = [launch_low_latency(layer, x, torch.empty(ROWS, N, dtype=torch.bfloat16,
                                                         device=DEV), tactic) for x in xs]
        cases[s] = (xs, refs)
    torch.cuda.synchronize(DEV)
    return layer, tactic, cases, streams


def eager_on_two_streams(layer, tactic, cases, streams):
    """LAUNCHES launches per stream, interleaved, in sleep-gated chunks; returns
    the number of launches (of 2 x LAUNCHES) whose output differs from the
    serial run in any bit (unwritten outputs stay NaN and differ too)."""
    outs = {s: torch.full((LAUNCHES, ROWS, N), float("nan"), dtype=torch.bfloat16, device=DEV)
            for s in streams}
    current = torch.cuda.current_stream(DEV)
    for s in streams:
        s.wait_stream(current)
    for start in range(0, LAUNCHES, CHUNK):
        for s in streams:
            with torch.cuda.stream(s):
                torch.cuda._sleep(SLEEP_CYCLES)
        for i in range(start, min(start + CHUNK, LAUNCHES)):
            for s in streams:
                with torch.cuda.stream(s):
                    launch_low_latency(layer, cases[s][0][i % INPUTS], outs[s][i], tactic)
    for s in streams:
        current.wait_stream(s)
    torch.cuda.synchronize(DEV)
    bad = 0
    for s in streams:
        for j, ref in enumerate(cases[s][1]):
            bad += int((bits(outs[s][j::INPUTS]) != bits(ref)).flatten(1).any(1).sum())
    return bad


def test_split_k_on_two_streams_concurrently_matches_serial_bits(fresh_scratch):
    layer, tactic, cases, streams = make_cases()
    assert eager_on_two_streams(layer, tactic, cases, streams) == 0
    # Each stream launched with scratch of its own, and left its counters re-armed.
    for cache in (launcher._WORKSPACES, launcher._COUNTERS):
        ptrs = [{buf.data_ptr() for key, buf in cache.items() if key[1] == s.stream_id}
                for s in streams]
        assert ptrs[0] and ptrs[1] and not ptrs[0] & ptrs[1]
    assert all(int(c.abs().sum()) == 0 for c in launcher._COUNTERS.values())


def test_shared_scratch_would_race(fresh_scratch, monkeypatch):
    """The control: the same run with one scratch for every stream (the old
    keying) goes wrong; if it did not, the run above would not overlap the
    streams and would prove nothing."""
    monkeypatch.setattr(launcher, "_launch_stream",
                        lambda device: (0, torch.cuda.current_stream(device)))
    layer, tactic, cases, streams = make_cases()
    bad = eager_on_two_streams(layer, tactic, cases, streams)
    assert bad > 0, "two streams sharing split-K scratch never raced: no overlap achieved"


def test_graphs_captured_per_stream_replay_concurrently(fresh_scratch):
    """precompile(..., stream=s) prepares the capture on s (nothing is allocated
    under capture); graphs captured on two streams hold two scratch sets and
    replay concurrently on them with every bit of the serial run."""
    layer, tactic, cases, streams = make_cases()
    for s in streams:
        precompile(layer, [ROWS], bf16_input=True, stream=s)
    before = scratch_buffers()
    outs, wants, graphs = {}, {}, {}
    for s in streams:
        xs, refs = cases[s]
        outs[s] = torch.empty(GRAPH_LAUNCHES, ROWS, N, dtype=torch.bfloat16, device=DEV)
        wants[s] = torch.stack([refs[i % INPUTS] for i in range(GRAPH_LAUNCHES)])
        graphs[s] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[s], stream=s):
            for i in range(GRAPH_LAUNCHES):
                launch_low_latency(layer, xs[i % INPUTS], outs[s][i], tactic)
    assert scratch_buffers() == before  # nothing allocated in capture
    current = torch.cuda.current_stream(DEV)
    bad = {s: torch.zeros((), dtype=torch.int64, device=DEV) for s in streams}
    for s in streams:
        s.wait_stream(current)
    for _ in range(LAUNCHES // GRAPH_LAUNCHES):
        for s in streams:
            with torch.cuda.stream(s):
                outs[s].fill_(float("nan"))
                graphs[s].replay()
                bad[s] += (bits(outs[s]) != bits(wants[s])).flatten(1).any(1).sum()
    for s in streams:
        current.wait_stream(s)
    torch.cuda.synchronize(DEV)
    assert [int(b) for b in bad.values()] == [0, 0]
    assert all(int(c.abs().sum()) == 0 for c in launcher._COUNTERS.values())


def test_graph_time_us_captures_a_split_k_gemm(fresh_scratch):
    """Warm-up on a side stream, capture on torch.cuda.graph's default stream:
    the warm-up's allocation served the capture stream too."""
    layer, tactic, cases, _ = make_cases()
    launcher._WORKSPACES.clear()  # only the warm-up below allocates
    launcher._COUNTERS.clear()
    x = cases[next(iter(cases))][0][0]
    out = torch.empty(ROWS, N, dtype=torch.bfloat16, device=DEV)
    step = functools.partial(launch_low_latency, layer, x, out, tactic)
    assert graph_time_us([step], DEV, min_calls=8, replays=3) > 0
