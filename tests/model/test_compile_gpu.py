"""torch.compile on the GPU (scripts/gpu_tests.sh -k compile): the default
backend (inductor) gives the eager bits for a whole one-rank boundary step
(grouped wo_a -> publishing wo_b -> consumer with MXFP8 out -> fused_wqa_wkv),
and the compiled step captured in a CUDA graph replays with the mailbox
advancing (fresh inputs every replay, each checked against eager).
Devices given as a bare ``"cuda"`` mean the current device."""

import pytest
import torch

import decode_boundary as db
from decode_boundary.mxfp8.format import mxfp8_scale_bytes

pytestmark = pytest.mark.gpu
H, HC, K_A, GROUPS, N_A, N_Q, ROWS = 1024, 4, 512, 2, 256, 384, 4


def bits(t):
    return t.contiguous().view(torch.uint8)


class Step:
    """One rank's boundary on its own all-reduce (a group of one)."""

    def __init__(self, weights):
        self.ar = db.BoundaryAllReduce(H, HC, 8, 2, device="cuda", quantize_layer_input=True,
                                       residual_only=False)
        self.wo_a, self.wo_b, self.nxt = weights
        self.publisher = db.PublishingMxfp8Linear(self.ar)
        self.publisher.precompile(self.wo_b, ROWS)
        self.ar.precompile([ROWS])
        for layer in (self.wo_a, self.nxt):
            db.precompile(layer, [ROWS])
        self.data = torch.empty(ROWS, H, dtype=torch.float8_e4m3fn, device="cuda")
        self.scale = torch.empty(mxfp8_scale_bytes(ROWS, H), dtype=torch.uint8, device="cuda")

    def __call__(self, attn, residual, post, comb, pre, gamma):
        o = db.mxfp8_mm(self.wo_a, attn)
        partial = self.publisher(self.wo_b, o)
        residual_out, layer_input, *_ = self.ar(partial, residual=residual, post=post, comb=comb,
                                                pre=pre, norm_weight=gamma, norm_eps=1e-6,
                                                mxfp8_out=(self.data, self.scale))
        nxt_in = db.QuantizedActivation(self.data, self.scale, torch.bfloat16, self.data.shape)
        return residual_out, layer_input, db.mxfp8_mm(self.nxt, nxt_in)


def inputs(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    kw = dict(device="cuda", generator=g)
    return (torch.randn(ROWS, GROUPS * K_A, **kw).bfloat16(),
            torch.randn(ROWS, HC, H, **kw).bfloat16(), torch.rand(ROWS, HC, **kw),
            torch.rand(ROWS, HC, HC, **kw), torch.rand(ROWS, HC, **kw),
            (1 + 0.1 * torch.randn(H, **kw)).bfloat16())


def weights():
    torch.manual_seed(0)
    wo_a = db.Mxfp8Linear.grouped([db.Mxfp8Linear.from_float(
        torch.randn(N_A, K_A, device="cuda").bfloat16()) for _ in range(GROUPS)])
    wo_b = db.Mxfp8Linear.from_float(torch.randn(H, GROUPS * N_A, device="cuda").bfloat16())
    nxt = db.Mxfp8Linear.from_float(torch.randn(N_Q, H, device="cuda").bfloat16())
    return wo_a, wo_b, nxt


def test_bare_cuda_means_the_current_device():
    ar = db.BoundaryAllReduce(H, HC, 8, 2, device="cuda")
    assert ar.device == torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(2, H, device="cuda").bfloat16()
    assert torch.equal(ar.plain_sum(x), x)
    with pytest.raises(ValueError, match="on cpu"):
        ar.plain_sum(x.cpu())


def test_compiled_step_gives_eager_bits_and_replays_in_a_graph():
    w = weights()
    eager, traced = Step(w), Step(w)
    compiled = torch.compile(traced, fullgraph=True)
    for seed in range(3):  # several steps: the stage words advance through the ops
        x = inputs(seed)
        want = eager(*x)
        got = compiled(*x)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(bits(a), bits(b)), seed
    assert torch.equal(eager.ar.mailbox.stage_state, traced.ar.mailbox.stage_state)

    static = inputs(100)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        compiled(*static)  # warm: the compiled graph's own allocations
        eager(*static)  # keep the two mailboxes at the same stage
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = compiled(*static)
    for seed in range(200, 206):
        fresh = inputs(seed)
        for dst, src in zip(static, fresh, strict=True):
            dst.copy_(src)
        graph.replay()
        want = eager(*fresh)
        torch.cuda.synchronize()
        for a, b in zip(outs, want, strict=True):
            assert torch.equal(bits(a), bits(b)), seed
        assert torch.equal(eager.ar.mailbox.stage_state, traced.ar.mailbox.stage_state)
    traced.ar.check()
