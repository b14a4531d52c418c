"""Split-K scratch belongs to the stream that launches (``gemm/launcher.py``
module docstring), on CPU: CUDA streams are stand-ins (``FakeStream``) for the
keying and the capture rule, and the interpreter runs the launches. The real
two-stream race and graph captures are ``tests/gemm/test_split_k_streams_gpu.py``."""

import pytest
import torch
from gemm_helpers import make_input, make_layer, poisoned

from decode_boundary.gemm import launcher
from decode_boundary.gemm.launcher import launch_low_latency
from decode_boundary.gemm.reference import check_mxfp8_mm
from decode_boundary.gemm.tactics import Tactic

CUDA = torch.device("cuda", 0)  # a device object only: nothing is allocated on it
CPU = torch.device("cpu")
SPLIT = Tactic(16, 8, 4, 4, 128)  # split-K 4 over K = 512
SINGLE = Tactic(16, 8, 1, 4, 128)


class FakeStream:
    """A torch.cuda.Stream stand-in: id, device, and the streams it waited for."""

    def __init__(self, stream_id, device=CUDA):
        self.stream_id, self.device, self.waited = stream_id, device, []

    def wait_stream(self, other):
        self.waited.append(other)

    def __repr__(self):
        return f"<FakeStream {self.stream_id}>"


class FakeCuda:
    """The current stream and capture state the launcher reads from torch.cuda."""

    def __init__(self, monkeypatch, capture_stream):
        self.current, self.capturing = None, False
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: self.capturing)
        monkeypatch.setattr(torch.cuda.graph, "default_capture_stream", capture_stream)


def scratch_buffers():
    """Every cached split-K buffer, as {(cache, key): address}."""
    return {(name, key): buf.data_ptr() for name, cache in
            (("workspace", launcher._WORKSPACES), ("counters", launcher._COUNTERS))
            for key, buf in cache.items()}


def make(size, device):  # scratch of a CUDA key, made on the CPU
    return torch.zeros(size // 4, dtype=torch.int32)


def test_stream_key_is_the_current_cuda_stream(monkeypatch):
    seen = []
    stream = FakeStream(42)

    def current_stream(device=None):
        seen.append(device)
        return stream

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    assert launcher._launch_stream(CUDA) == (42, stream) and seen == [CUDA]
    assert launcher._launch_stream(CPU) == (launcher.HOST_STREAM, None) and seen == [CUDA]


def test_two_streams_get_their_own_scratch_and_one_stream_reuses(monkeypatch):
    capture = FakeStream(100)
    cuda = FakeCuda(monkeypatch, capture)
    cache = {}
    a, b = FakeStream(1), FakeStream(2)
    cuda.current = a
    on_a = launcher._cached(cache, CUDA, 5000, make)
    cuda.current = b
    on_b = launcher._cached(cache, CUDA, 5000, make)
    assert on_a is not on_b and on_a.data_ptr() != on_b.data_ptr()
    cuda.current = a
    assert launcher._cached(cache, CUDA, 8000, make) is on_a  # same stream, same size: reused
    cuda.current = b
    assert launcher._cached(cache, CUDA, 6000, make) is on_b
    # Each allocation outside capture also served torch.cuda.graph's default
    # capture stream (once), ordered after the zero fill on the allocating stream.
    assert set(cache) == {(CUDA, 1, 8192), (CUDA, 2, 8192), (CUDA, 100, 8192)}
    assert cache[(CUDA, 100, 8192)] is not on_a and cache[(CUDA, 100, 8192)] is not on_b
    assert capture.waited == [a]


def test_capture_finds_its_stream_or_names_it(monkeypatch):
    """graph_time_us's pattern: warm up on a side stream, capture with
    torch.cuda.graph(g) (its default capture stream): found. A capture on a
    stream nothing was allocated for raises, naming that stream and precompile."""
    capture = FakeStream(100)
    cuda = FakeCuda(monkeypatch, capture)
    cache = {}
    cuda.current = FakeStream(5)  # the side stream of the warm-up
    launcher._cached(cache, CUDA, 5000, make)
    cuda.current, cuda.capturing = capture, True
    assert launcher._cached(cache, CUDA, 5000, make) is cache[(CUDA, 100, 8192)]
    cuda.current = FakeStream(6)  # torch.cuda.graph(g, stream=s), s never warmed up
    with pytest.raises(RuntimeError, match=r"capture on stream <FakeStream 6> \(stream_id 6.*"
                                           r"precompile\(layer, rows, stream="):
        launcher._cached(cache, CUDA, 5000, make)
    assert (CUDA, 6, 8192) not in cache
    cuda.current = capture  # a size the warm-up did not need: still never allocated
    with pytest.raises(RuntimeError, match="stream_id 100"):
        launcher._cached(cache, CUDA, 50000, make)


def test_default_capture_stream_is_created_as_torch_cuda_graph_would(monkeypatch):
    made = []

    def stream(device):
        made.append(FakeStream(77, device))
        return made[-1]

    monkeypatch.setattr(torch.cuda.graph, "default_capture_stream", None)
    monkeypatch.setattr(torch.cuda, "Stream", stream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert launcher._default_capture_stream(CUDA) is None and not made  # not the current device
    assert torch.cuda.graph.default_capture_stream is None
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    created = launcher._default_capture_stream(CUDA)
    assert made == [created] and torch.cuda.graph.default_capture_stream is created
    assert launcher._default_capture_stream(CUDA) is created and len(made) == 1
    assert launcher._default_capture_stream(torch.device("cuda", 1)) is None  # other device


def test_launches_on_two_streams_use_two_scratch_sets_and_the_same_bits(monkeypatch):
    """Interpreter launches under two stream keys: each key gets its own
    workspace and counters (passed to the kernel), the bits equal a serial run,
    the counters are re-armed, and a split-K 1 tactic allocates nothing."""
    monkeypatch.setattr(launcher, "_WORKSPACES", {})
    monkeypatch.setattr(launcher, "_COUNTERS", {})
    key = {"now": 11}
    monkeypatch.setattr(launcher, "_launch_stream", lambda device: (key["now"], None))
    g = torch.Generator().manual_seed(5)
    layer = make_layer(64, 512, generator=g)
    inputs = {11: make_input(5, 512, generator=g), 12: make_input(5, 512, generator=g)}
    serial = {}
    for stream, qa in inputs.items():
        key["now"] = stream
        serial[stream] = launch_low_latency(layer, qa, poisoned(5, 64), SPLIT)
        check_mxfp8_mm(serial[stream], qa, layer.weight, layer.weight_scale)
    scratch = {}
    for stream in inputs:  # what the launches above were given
        key["now"] = stream
        scratch[stream] = launcher._buffers(CPU, 64, 5, SPLIT)[:2]
    (ws_a, cnt_a), (ws_b, cnt_b) = scratch[11], scratch[12]
    assert ws_a is not ws_b and cnt_a is not cnt_b
    assert {k[1] for k in launcher._WORKSPACES} == {11, 12} == {k[1] for k in launcher._COUNTERS}
    for _ in range(2):  # interleaved: A, B, A, B
        for stream, qa in inputs.items():
            key["now"] = stream
            out = launch_low_latency(layer, qa, poisoned(5, 64), SPLIT)
            assert torch.equal(out.view(torch.int16), serial[stream].view(torch.int16))
    assert all(int(c.abs().sum()) == 0 for c in launcher._COUNTERS.values())
    before = scratch_buffers()
    key["now"] = 13
    out = launch_low_latency(layer, inputs[11], poisoned(5, 64), SINGLE)
    check_mxfp8_mm(out, inputs[11], layer.weight, layer.weight_scale)
    assert scratch_buffers() == before  # no scratch for split-K 1
