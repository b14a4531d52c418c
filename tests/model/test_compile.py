"""torch.compile(fullgraph=True) of the public entry points, in the Triton
interpreter on CPU with the ``aot_eager`` backend (what CI can run): compiled
bits equal eager bits, the mailbox protocol survives functionalization (two
simulated ranks), and the host rules still hold. The default backend, CUDA
graphs of the compiled step and 2 GPUs are GPU tests (test_compile_gpu.py)."""

import pytest
import torch

import decode_boundary as db
from decode_boundary.mxfp8.format import mxfp8_scale_bytes

HIDDEN, K, HC, CAPACITY = 128, 96, 2, 8


def compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="aot_eager")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_mxfp8_mm_and_quantize_trace_with_eager_bits():
    gen = torch.Generator().manual_seed(1)
    layer = db.Mxfp8Linear.from_float(torch.randn(64, K, generator=gen).bfloat16())
    grouped = db.Mxfp8Linear.grouped([db.Mxfp8Linear.from_float(
        torch.randn(32, K, generator=gen).bfloat16()) for _ in range(2)])
    x = torch.randn(3, K, generator=gen).bfloat16()
    xg = torch.randn(3, 2 * K, generator=gen).bfloat16()

    def step(x, xg):
        q = db.quantize_mxfp8(x)
        return db.mxfp8_mm(layer, x), db.mxfp8_mm(layer, q), q.data, q.scale, \
            db.mxfp8_mm(grouped, xg)

    eager = step(x, xg)
    for got, want in zip(compiled(step)(x, xg), eager, strict=True):
        assert torch.equal(bits(got), bits(want))

    def into_buffers(x, data, scale):
        db.quantize_mxfp8(x, out=(data, scale))
        return data.float().sum()

    data = torch.empty(3, K, dtype=torch.float8_e4m3fn)
    scale = torch.full((mxfp8_scale_bytes(3, K),), 7, dtype=torch.uint8)
    compiled(into_buffers)(x, data, scale)
    want = db.quantize_mxfp8(x)
    assert torch.equal(bits(data), bits(want.data)) and torch.equal(scale, want.scale)


def _mixing(rows, gen):
    return (torch.randn(rows, HC, HIDDEN, generator=gen).bfloat16(),
            torch.rand(rows, HC, generator=gen), torch.rand(rows, HC, HC, generator=gen),
            torch.rand(rows, HC, generator=gen),
            (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).bfloat16())


def _boundary_outputs(step, rows, seed):
    """Run ``step(ranks, publishers, linears, xs, mixing, bufs)`` on two fresh
    simulated ranks; every rank publishes before any reduces (one process)."""
    gen = torch.Generator().manual_seed(seed)
    ranks = db.BoundaryAllReduce.simulated(2, HIDDEN, HC, CAPACITY, 2, quantize_layer_input=True,
                                           residual_only=False)
    linears = [db.Mxfp8Linear.from_float(torch.randn(HIDDEN, K, generator=gen).bfloat16())
               for _ in ranks]
    xs = [torch.randn(rows, K, generator=gen).bfloat16() for _ in ranks]
    mixing = _mixing(rows, gen)
    publishers = [db.PublishingMxfp8Linear(ar) for ar in ranks]
    outs = []
    for _ in range(4):  # several steps: the stage words must advance through the ops
        bufs = [(torch.empty(rows, HIDDEN, dtype=torch.float8_e4m3fn),
                 torch.empty(mxfp8_scale_bytes(rows, HIDDEN), dtype=torch.uint8))
                for _ in ranks]
        outs.append([bits(t) for t in step(ranks, publishers, linears, xs, mixing, bufs)])
        outs[-1] += [bits(d) for d, _ in bufs] + [s for _, s in bufs]
        outs[-1] += [ar.mailbox.stage_state.clone() for ar in ranks]
    return outs


def _produce(publisher, linear, x, fused):
    if fused:
        return publisher(linear, x)
    out = db.mxfp8_mm(linear, x)
    publisher.all_reduce.publish(out)
    return out


@pytest.mark.parametrize("fused", [True, False])
def test_boundary_step_compiles_with_eager_bits(fused):
    """Publish (GEMM epilogue or publish kernel) on both ranks, then each
    consumer with MXFP8 out, compiled per phase; equal to eager, step after step."""
    produce = compiled(lambda p, lin, x: _produce(p, lin, x, fused))

    def reduce_fn(ar, out, mixing, buf):
        residual, post, comb, pre, gamma = mixing
        result = ar(out, residual=residual, post=post, comb=comb, pre=pre, norm_weight=gamma,
                    norm_eps=1e-6, mxfp8_out=buf)
        return result.residual_out, result.layer_input

    reduce_c = compiled(reduce_fn)

    def make_step(produce_fn, reduce_step):
        def step(ranks, publishers, linears, xs, mixing, bufs):
            outs = [produce_fn(p, lin, x)
                    for p, lin, x in zip(publishers, linears, xs, strict=True)]
            return [t for ar, o, b in zip(ranks, outs, bufs, strict=True)
                    for t in reduce_step(ar, o, mixing, b)]
        return step

    want = _boundary_outputs(make_step(lambda p, lin, x: _produce(p, lin, x, fused), reduce_fn),
                             3, seed=5)
    got = _boundary_outputs(make_step(produce, reduce_c), 3, seed=5)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for i, (a, b) in enumerate(zip(g, w, strict=True)):
            assert torch.equal(a, b), f"step {step}, output {i}"


def test_single_rank_whole_step_in_one_graph():
    """One rank (a group of one): publishing GEMM + consumer + next GEMM in one
    compiled function, several steps, equal to eager."""
    gen = torch.Generator().manual_seed(9)
    rows = 2
    wo_b = db.Mxfp8Linear.from_float(torch.randn(HIDDEN, K, generator=gen).bfloat16())
    nxt = db.Mxfp8Linear.from_float(torch.randn(64, HIDDEN, generator=gen).bfloat16())
    x = torch.randn(rows, K, generator=gen).bfloat16()
    mixing = _mixing(rows, gen)

    def run(step_fn):
        ar = db.BoundaryAllReduce(HIDDEN, HC, CAPACITY, 2, device="cpu",
                                  quantize_layer_input=True, residual_only=False)
        pub = db.PublishingMxfp8Linear(ar)
        out = []
        for _ in range(4):
            data = torch.empty(rows, HIDDEN, dtype=torch.float8_e4m3fn)
            scale = torch.empty(mxfp8_scale_bytes(rows, HIDDEN), dtype=torch.uint8)
            out.append([bits(t) for t in step_fn(ar, pub, data, scale)])
        return out

    def step(ar, pub, data, scale):
        partial = pub(wo_b, x)
        residual, post, comb, pre, gamma = mixing
        residual_out, layer_input, *_ = ar(partial, residual=residual, post=post, comb=comb,
                                           pre=pre, norm_weight=gamma, norm_eps=1e-6,
                                           mxfp8_out=(data, scale))
        q = db.mxfp8_mm(nxt, db.QuantizedActivation(data, scale, torch.bfloat16, data.shape))
        return residual_out, layer_input, q

    want = run(step)
    got = run(compiled(step))
    for g, w in zip(got, want, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(g, w, strict=True))


def test_host_rules_hold_under_compile():
    ar = db.BoundaryAllReduce(HIDDEN, HC, CAPACITY, 2, device="cpu")
    x = torch.randn(2, HIDDEN).bfloat16()

    def twice(x):
        ar.publish(x)
        ar.publish(x)

    # Dynamo reports the rule's RuntimeError as an Unsupported (a RuntimeError)
    # that carries the original message: the message is what is checked.
    with pytest.raises(RuntimeError, match="a published contribution is still unreduced"):
        compiled(twice)(x)
    ar.reset()

    def publish_then_other(x, y):
        ar.publish(x)
        return ar.plain_sum(y)

    with pytest.raises(RuntimeError, match="reducing a tensor other than the published one"):
        compiled(publish_then_other)(x, x.clone())
    ar.reset()
    # The rules did not leave a half-done step behind: a correct step works.
    assert torch.equal(compiled(lambda x: ar.plain_sum(x))(x), x)


def test_no_custom_op_argument_has_a_default():
    """The dispatcher drops an argument passed at its schema default, and torch
    2.11's in-place bookkeeping then indexes past the arguments when that one
    is mutated (``mix_words=None``: an IndexError while compiling a step
    without mixes; pytorch#176078). So no op of ours declares a default."""
    import decode_boundary.boundary.ops  # noqa: F401  (registers the ops)

    names = [n for n in dir(torch.ops.decode_boundary) if n.startswith("boundary_")]
    assert "boundary_reduce" in names
    for name in names:
        schema = getattr(torch.ops.decode_boundary, name).default._schema
        defaulted = [a.name for a in schema.arguments if a.default_value is not None]
        assert not defaulted, f"{name}: {defaulted}"
