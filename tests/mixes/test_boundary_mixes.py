"""``BoundaryAllReduce(collapse_pre=...)``: the next sublayer's mixes from the
all-reduce's consumer (docs/DESIGN.md §5.1), two simulated ranks in the
interpreter: a V4.1 call ("previous") and a V4 call ("same") each one call,
their outputs against the references (mixes within tests/mixes/test_consumer_mixes.py's
bar, the rest bit for bit), torch.compile with eager bits, reset, and the
checks of the construction and the call."""

import pytest
import torch

import decode_boundary as db
from decode_boundary.boundary.consumer_kernel import Collapse
from decode_boundary.boundary.consumer_tactics import fuses_mixes
from decode_boundary.boundary.reference import consumer_ref
from decode_boundary.mixes.handoff import MixesPlacement
from decode_boundary.mixes.reference import mhc_mixes_ref

H, HC, CAP, TP = 128, 4, 4, 2
EPS, HC_EPS, ITERS = 1e-6, 1e-6, 20
BAR = 1e-5  # tests/mixes/test_consumer_mixes.py


def inputs(m, seed):
    g = torch.Generator().manual_seed(seed)
    n = (2 + HC) * HC
    return dict(xs=[torch.randn(m, H, generator=g).bfloat16() for _ in range(TP)],
                residual=torch.randn(m, HC, H, generator=g).bfloat16(),
                post=torch.rand(m, HC, generator=g) * 2, comb=torch.rand(m, HC, HC, generator=g),
                pre=torch.rand(m, HC, generator=g),
                gamma=(1 + 0.1 * torch.randn(H, generator=g)).bfloat16(),
                weights=(torch.randn(n, HC * H, generator=g) * 0.2,
                         torch.rand(3, generator=g) + 0.5, torch.randn(n, generator=g) * 0.5))


def ranks(collapse):
    return db.BoundaryAllReduce.simulated(TP, H, HC, CAP, 2, quantize_layer_input=True,
                                          residual_only=False, collapse_pre=collapse)


def one_step(group, d, collapse):
    """Every rank publishes, then each makes its one call."""
    pre = d["pre"] if collapse == "previous" else None
    for ar, x in zip(group, d["xs"], strict=True):
        ar.publish(x)
    return [ar(x, residual=d["residual"], post=d["post"], comb=d["comb"], pre=pre,
               norm_weight=d["gamma"], norm_eps=EPS, mix_weights=d["weights"])
            for ar, x in zip(group, d["xs"], strict=True)]


@pytest.mark.parametrize("collapse", ["previous", "same"])
def test_one_call_per_semantics(collapse):
    group = ranks(collapse)
    for step_no, m in enumerate((3, 1, 4)):  # several steps and M: stage words, tags
        d = inputs(m, seed=step_no)
        outs = one_step(group, d, collapse)
        res_out, layer, _, (pre, post, comb) = outs[0]
        for other in outs[1:]:  # every rank computes the same bits
            assert torch.equal(other[0], res_out) and torch.equal(other[1], layer)
            assert all(torch.equal(a, b) for a, b in zip(other[3], (pre, post, comb),
                                                        strict=True))
        want_res, _, _ = consumer_ref(d["xs"], d["residual"], d["post"], d["comb"], d["pre"],
                                      d["gamma"], EPS)
        assert torch.equal(res_out.view(torch.int16), want_res.view(torch.int16))
        want = mhc_mixes_ref(res_out, *d["weights"], EPS, HC_EPS, ITERS)
        for got, exp in zip((pre, post, comb), want, strict=True):
            assert (got - exp).abs().max().item() <= BAR
        used = d["pre"] if collapse == "previous" else pre
        _, want_layer, _ = consumer_ref(d["xs"], d["residual"], d["post"], d["comb"], used,
                                        d["gamma"], EPS)
        diff = (layer.double() - want_layer.double()).abs()
        assert bool((diff <= want_layer.double().abs() * 2 ** -8).all())  # <= 1 BF16 ulp
    for ar in group:
        assert ar.mailbox.status.item() == 0


@pytest.mark.parametrize("collapse", ["previous", "same"])
def test_compiled_step_gives_eager_bits(collapse):
    d = inputs(2, seed=5)

    def step(x0, x1):
        outs = one_step(group, dict(d, xs=[x0, x1]), collapse)
        return tuple(t for r, layer, _, mixes in outs for t in (r, layer, *mixes))

    group = ranks(collapse)
    eager = step(*d["xs"])
    torch._dynamo.reset()
    group = ranks(collapse)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*d["xs"])
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(got, eager, strict=True))


def test_reset_zeroes_the_mix_rows_with_the_generations():
    group = ranks("same")
    one_step(group, inputs(2, seed=7), "same")
    box = group[0].mailbox
    assert bool(box.mix_words.ne(0).any()) and bool(box.generation.ne(0).any())
    for ar in group:
        ar.reset(collective=True)
    assert bool(box.mix_words.eq(0).all()) and bool(box.generation.eq(0).all())


def test_checks():
    with pytest.raises(ValueError, match="collapse_pre must be None or one of"):
        ranks("next")
    with pytest.raises(ValueError, match="hc_sinkhorn_iters must be an int >= 1"):
        db.BoundaryAllReduce(H, HC, CAP, 2, collapse_pre="same", hc_sinkhorn_iters=0,
                             device="cpu")
    with pytest.raises(ValueError, match="hc_eps must be a finite real number"):
        db.BoundaryAllReduce(H, HC, CAP, 2, collapse_pre="same", hc_eps=None, device="cpu")
    for tiny in (0.0, 1e-40):  # the combine's reciprocals need a normal FP32 hc_eps
        with pytest.raises(ValueError, match=r"hc_eps must be .* >= 2\*\*-126"):
            db.BoundaryAllReduce(H, HC, CAP, 2, collapse_pre="previous", hc_eps=tiny,
                                 device="cpu")
    with pytest.raises(ValueError, match="power-of-two hc_mult"):
        db.BoundaryAllReduce(H, 3, CAP, 2, collapse_pre="previous", device="cpu")
    d = inputs(2, seed=8)
    (ar,) = db.BoundaryAllReduce.simulated(1, H, HC, CAP, 2, collapse_pre="previous")
    with pytest.raises(ValueError, match="needs the next sublayer's mix_weights"):
        ar(d["xs"][0], residual=d["residual"], post=d["post"], comb=d["comb"], pre=d["pre"],
           norm_weight=d["gamma"], norm_eps=EPS)
    (same,) = db.BoundaryAllReduce.simulated(1, H, HC, CAP, 2, collapse_pre="same")
    with pytest.raises(ValueError, match="pass pre=None"):
        same(d["xs"][0], residual=d["residual"], post=d["post"], comb=d["comb"], pre=d["pre"],
             norm_weight=d["gamma"], norm_eps=EPS, mix_weights=d["weights"])
    (plain,) = db.BoundaryAllReduce.simulated(1, H, HC, CAP, 2)
    with pytest.raises(ValueError, match="computes no mixes"):
        plain(d["xs"][0], residual=d["residual"], post=d["post"], comb=d["comb"], pre=d["pre"],
              norm_weight=d["gamma"], norm_eps=EPS, mix_weights=d["weights"])
    with pytest.raises(ValueError, match="mixes_placement must be None or one of"):
        ar(d["xs"][0], residual=d["residual"], post=d["post"], comb=d["comb"], pre=d["pre"],
           norm_weight=d["gamma"], norm_eps=EPS, mix_weights=d["weights"],
           mixes_placement="nowhere")
    ar.publish(d["xs"][0])  # a refused flag after the publish aborts the step, as any argument
    with pytest.raises(ValueError, match="mixes_placement must be None or one of"):
        ar(d["xs"][0], residual=d["residual"], post=d["post"], comb=d["comb"], pre=d["pre"],
           norm_weight=d["gamma"], norm_eps=EPS, mix_weights=d["weights"], mixes_placement=1)
    with pytest.raises(ValueError,
                       match="mixes_placement='side_stream' needs .*collapse_pre='same'"):
        same(d["xs"][0], residual=d["residual"], post=d["post"], comb=d["comb"], pre=None,
             norm_weight=d["gamma"], norm_eps=EPS, mix_weights=d["weights"],
             mixes_placement="side_stream")
    (wide,) = db.BoundaryAllReduce.simulated(1, H, 8, CAP, 2, collapse_pre="previous")
    with pytest.raises(ValueError, match="mixes_placement='side_stream' needs .*hc=8"):
        wide(d["xs"][0], residual=torch.zeros(2, 8, H).bfloat16(), post=torch.zeros(2, 8),
             comb=torch.zeros(2, 8, 8), pre=torch.zeros(2, 8), norm_weight=d["gamma"],
             norm_eps=EPS, mix_weights=(torch.zeros(80, 8 * H), torch.ones(3), torch.zeros(80)),
             mixes_placement="side_stream")
    for rows in (0, CAP + 1, 1.0):
        with pytest.raises(ValueError, match="rows must be an int in"):
            ar.deferred_finish(rows)
    finish = ar.deferred_finish(2)
    assert finish.pre.shape == (2, HC) and finish.comb.shape == (2, HC, HC)
    assert plain.deferred_finish(2) is None  # no mixes: nothing to leave
    # A refused call aborts nothing at tp = 1 and leaves the instance usable.
    out = ar(d["xs"][0], residual=d["residual"], post=d["post"], comb=d["comb"], pre=d["pre"],
             norm_weight=d["gamma"], norm_eps=EPS, mix_weights=d["weights"])
    assert out.mixes.placement == "consumer" and out.mixes.comb.shape == (2, HC, HC)


def test_the_old_spellings_still_work_with_a_deprecation_warning():
    """``mixes=`` (now ``mixes_placement=``) and ``NextMixes.how`` (now
    ``placement``) for one release; the enums compare equal to their strings."""
    d = inputs(2, seed=8)
    (ar,) = db.BoundaryAllReduce.simulated(1, H, HC, CAP, 2, collapse_pre="previous")
    assert ar.collapse_pre == "previous" == Collapse.V4_1
    call = dict(residual=d["residual"], post=d["post"], comb=d["comb"], pre=d["pre"],
                norm_weight=d["gamma"], norm_eps=EPS, mix_weights=d["weights"])
    with pytest.warns(DeprecationWarning, match="mixes_placement"):
        old = ar(d["xs"][0], mixes="consumer", **call)
    with pytest.warns(DeprecationWarning, match="placement"):
        assert old.mixes.how == "consumer"
    new = ar(d["xs"][0], mixes_placement=MixesPlacement.CONSUMER, **call)
    assert all(torch.equal(a, b) for a, b in zip(old.mixes, new.mixes, strict=True))
    with pytest.raises(TypeError, match="mixes_placement= alone"), \
            pytest.warns(DeprecationWarning):
        ar(d["xs"][0], mixes="consumer", mixes_placement="consumer", **call)


def _step_tensors(m, h, g, dev):
    """One rank's random (x, residual, post, comb, pre, gamma) for M = ``m``."""
    x = torch.randn(m, h, generator=g).bfloat16().to(dev)
    residual = torch.randn(m, HC, h, generator=g).bfloat16().to(dev)
    post, comb, pre = (torch.rand(m, HC, generator=g).to(dev) * 2,
                       torch.rand(m, HC, HC, generator=g).to(dev),
                       torch.rand(m, HC, generator=g).to(dev))
    gamma = (1 + 0.1 * torch.randn(h, generator=g)).bfloat16().to(dev)
    return x, residual, post, comb, pre, gamma


@pytest.mark.gpu
@pytest.mark.parametrize("collapse", ["previous", "same"])
def test_gpu_mixes_cooperative_graphs_and_compile(collapse):
    """On the GPU at DSV4.1-Flash's H = 5120 (the cooperative tactic, PDL,
    %globaltimer bounds): mixes within the bar of the spec and FP64 for M = 1,
    16 and 48 (V4.1's from the mixes kernel there: mixes_kernel.py); against
    the consumer without mixes given the pre the collapse used, the exact
    contract of docs/DESIGN.md §5.1 (:func:`assert_against_the_plain_consumer`);
    a CUDA graph replay and the compiled step (inductor) give the eager bits."""
    from independent_ref import mhc_mixes_fp64

    from decode_boundary.mxfp8.format import mxfp8_scale_bytes

    h, dev = 5120, "cuda"
    (ar,) = db.BoundaryAllReduce.simulated(1, h, HC, 48, 2, device=dev, quantize_layer_input=True,
                                           residual_only=False, collapse_pre=collapse)
    (plain,) = db.BoundaryAllReduce.simulated(1, h, HC, 48, 2, device=dev,
                                              quantize_layer_input=True, residual_only=False)
    ar.precompile([1, 16, 48])
    plain.precompile([1, 16, 48])
    g = torch.Generator().manual_seed(21)
    n = (2 + HC) * HC
    weights = tuple(t.to(dev) for t in (torch.randn(n, HC * h, generator=g) * 0.02,
                                         torch.rand(3, generator=g) + 0.5,
                                         torch.randn(n, generator=g) * 0.5))
    assert fuses_mixes(16, HC, collapse) and fuses_mixes(48, HC, collapse) == (collapse == "same")
    for m in (1, 16, 48):
        x, residual, post, comb, pre, gamma = _step_tensors(m, h, g, dev)

        def buffers(m=m):
            return (torch.empty(m, h, dtype=torch.float8_e4m3fn, device=dev),
                    torch.empty(mxfp8_scale_bytes(m, h), dtype=torch.uint8, device=dev))

        def step(q, x=x, residual=residual, post=post, comb=comb, pre=pre, gamma=gamma):
            return ar(x, residual=residual, post=post, comb=comb,
                      pre=pre if collapse == "previous" else None, norm_weight=gamma,
                      norm_eps=EPS, mxfp8_out=q, mix_weights=weights)

        q = buffers()
        res_out, layer, _, mixes = step(q)
        torch.cuda.synchronize()
        args = (res_out.cpu(), *(w.cpu() for w in weights), EPS, HC_EPS, ITERS)
        for want in (mhc_mixes_fp64(*args), mhc_mixes_ref(*args)):
            for got, exp in zip(mixes, want, strict=True):
                assert (got.cpu().double() - exp.double()).abs().max().item() <= BAR
        used = pre if collapse == "previous" else mixes.pre
        q_plain = buffers()
        res_plain, layer_plain, *_ = plain(x, residual=residual, post=post, comb=comb, pre=used,
                                           norm_weight=gamma, norm_eps=EPS, mxfp8_out=q_plain)
        assert_against_the_plain_consumer((res_out, layer, q), (res_plain, layer_plain, q_plain),
                                          same_order(m, h, collapse, ar.tactic, plain.tactic))
        # A CUDA graph of the step replays the eager bits.
        q_graph = buffers()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed = step(q_graph)
        graph.replay()
        ar.check()
        assert torch.equal(graphed[1].view(torch.int16), layer.view(torch.int16))
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32))
                   for a, b in zip(graphed[3], mixes, strict=True))
        torch._dynamo.reset()
        q_comp = buffers()
        compiled = torch.compile(step, fullgraph=True)(q_comp)
        assert torch.equal(compiled[1].view(torch.int16), layer.view(torch.int16))
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32))
                   for a, b in zip(compiled[3], mixes, strict=True))
    assert ar.mailbox.status.item() == 0


def same_order(m, h, collapse, tactic=None, plain_tactic=None) -> bool:
    """Whether the consumer with the mixes and the one without them sum the
    squares in one order at M = ``m``: tactics of the same block_h and warps."""
    from decode_boundary.boundary.consumer_tactics import consumer_tactic

    fused = fuses_mixes(m, HC, collapse)
    with_mixes = tactic or consumer_tactic(m, h, collapse if fused else None)
    without = plain_tactic or consumer_tactic(m, h)
    return (with_mixes.block_h, with_mixes.warps) == (without.block_h, without.warps)


def assert_against_the_plain_consumer(got, plain, same_sum_order: bool) -> None:
    """docs/DESIGN.md §5.1, given the same pre: residual_out bit for bit;
    layer_input and its MXFP8 bit for bit when the two tactics sum the squares
    in one order, else every layer_input element within one BF16 ulp of the
    plain one (same sign, adjacent bit patterns) and the MXFP8 the spec's
    quantization of that layer input. ``got`` / ``plain``: (residual_out,
    layer_input, (MXFP8 data, scales))."""
    from decode_boundary.mxfp8.format import quantize_mxfp8_ref

    (res, layer, q), (res_plain, layer_plain, q_plain) = got, plain
    assert torch.equal(res.view(torch.int16), res_plain.view(torch.int16))
    if same_sum_order:
        assert torch.equal(layer.view(torch.int16), layer_plain.view(torch.int16))
        assert torch.equal(q[0].view(torch.uint8), q_plain[0].view(torch.uint8))
        assert torch.equal(q[1], q_plain[1])
        return
    bits, plain_bits = layer.view(torch.int16).int(), layer_plain.view(torch.int16).int()
    assert bool(((bits - plain_bits).abs() <= 1).all()), "more than one BF16 ulp apart"
    want = quantize_mxfp8_ref(layer)
    assert torch.equal(q[0].view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(q[1], want.scale)


@pytest.mark.gpu
@pytest.mark.parametrize("collapse", ["same", "previous"])
def test_gpu_mixes_against_the_consumer_without_them(collapse):
    """The contract of docs/DESIGN.md §5.1 on shapes no other test uses: V4's
    H = 7168 at M = 16, 37 and 64 (where the tables' tactics with and without
    the mixes sum the squares in other orders, and layer_input was seen to
    differ in 2-4 elements by one ulp), with the tables' tactics (within one
    ulp, residual_out the same bits) and with one tactic pinned on both (the
    same bits)."""
    from decode_boundary.boundary.consumer_tactics import ConsumerTactic
    from decode_boundary.mxfp8.format import mxfp8_scale_bytes

    h, dev, rows = 7168, "cuda", (16, 37, 64)
    (ar,) = db.BoundaryAllReduce.simulated(1, h, HC, 64, 2, device=dev, quantize_layer_input=True,
                                           residual_only=False, collapse_pre=collapse)
    (plain,) = db.BoundaryAllReduce.simulated(1, h, HC, 64, 2, device=dev,
                                              quantize_layer_input=True, residual_only=False)
    g = torch.Generator().manual_seed(47)
    n = (2 + HC) * HC
    weights = tuple(t.to(dev) for t in (torch.randn(n, HC * h, generator=g) * 0.02,
                                         torch.rand(3, generator=g) + 0.5,
                                         torch.randn(n, generator=g) * 0.5))
    for pinned in (None, ConsumerTactic(256, 4)):
        ar.tactic = plain.tactic = pinned
        ar.precompile(rows)
        plain.precompile(rows)
        for m in rows:
            x, residual, post, comb, pre, gamma = _step_tensors(m, h, g, dev)
            outs = []
            for reducer, given_pre in ((ar, pre if collapse == "previous" else None),
                                       (plain, None)):
                q = (torch.empty(m, h, dtype=torch.float8_e4m3fn, device=dev),
                     torch.empty(mxfp8_scale_bytes(m, h), dtype=torch.uint8, device=dev))
                if reducer is plain:  # the pre the collapse used
                    given_pre = pre if collapse == "previous" else outs[0][3].pre
                result = reducer(x, residual=residual, post=post, comb=comb, pre=given_pre,
                                 norm_weight=gamma, norm_eps=EPS, mxfp8_out=q,
                                 mix_weights=weights if reducer is ar else None)
                outs.append((result.residual_out, result.layer_input, q, result.mixes))
            assert_against_the_plain_consumer(
                outs[0][:3], outs[1][:3], same_order(m, h, collapse, pinned, pinned))
            if pinned is not None:
                assert same_order(m, h, collapse, pinned, pinned)
    ar.check()
    plain.check()


def _left_to_next_gemm(dev, h, rows, tactic=None, n_out=96, pin_gemm=None):
    """For each M: the call with ``mixes_placement="next_gemm"`` leaves the mixes to
    the next GEMM (its ``NextMixes``); outputs poisoned, then that GEMM's
    extra programs fill them. Every output (the mixes, residual_out, the layer
    input and its MXFP8, the GEMM's own) equals the call that combines in the
    consumer followed by the plain GEMM, bit for bit; the status word stays 0.
    ``pin_gemm(linear, m)``: pins the GEMM's tactic (split-K and row blocks put
    copies of the finishing programs at grid positions where they only pass)."""
    from decode_boundary.gemm import mxfp8_mm
    from decode_boundary.gemm.linear import Mxfp8Linear
    from decode_boundary.mxfp8.format import QuantizedActivation, mxfp8_scale_bytes

    cap = max(rows)
    g = torch.Generator().manual_seed(31)
    n = (2 + HC) * HC
    weights = tuple(t.to(dev) for t in (torch.randn(n, HC * h, generator=g) * (4 / h ** 0.5),
                                         torch.rand(3, generator=g) + 0.5,
                                         torch.randn(n, generator=g) * 0.5))
    linear = Mxfp8Linear.from_float((torch.randn(n_out, h, generator=g) * 0.05).bfloat16()
                                    .to(dev))
    for m in rows if pin_gemm is not None else ():
        pin_gemm(linear, m)
    for collapse in ("previous", "same"):
        (ar,) = db.BoundaryAllReduce.simulated(1, h, HC, cap, 2, device=dev,
                                               quantize_layer_input=True, residual_only=False,
                                               collapse_pre=collapse)
        ar.tactic = tactic
        for m in rows:
            x = torch.randn(m, h, generator=g).bfloat16().to(dev)
            residual = torch.randn(m, HC, h, generator=g).bfloat16().to(dev)
            post, comb = (torch.rand(m, HC, generator=g).to(dev) * 2,
                          torch.rand(m, HC, HC, generator=g).to(dev))
            pre = torch.rand(m, HC, generator=g).to(dev) if collapse == "previous" else None
            gamma = (1 + 0.1 * torch.randn(h, generator=g)).bfloat16().to(dev)

            def call(combine, ar=ar, m=m, x=x, residual=residual, post=post, comb=comb,
                     pre=pre, gamma=gamma):
                q = (torch.empty(m, h, dtype=torch.float8_e4m3fn, device=dev),
                     torch.empty(mxfp8_scale_bytes(m, h), dtype=torch.uint8, device=dev))
                out = ar(x, residual=residual, post=post, comb=comb, pre=pre, norm_weight=gamma,
                         norm_eps=EPS, mxfp8_out=q, mix_weights=weights,
                         mixes_placement="consumer" if combine else "next_gemm")
                return out, QuantizedActivation(*q, torch.bfloat16, torch.Size((m, h)))

            (res, layer, _, mixes), a = call(True)
            want_q = mxfp8_mm(linear, a)
            (res2, layer2, _, finish), a2 = call(False)
            mixes2 = tuple(finish)
            assert finish.left_to_gemm and finish.placement == "next_gemm"
            assert all(t is u for t, u in zip((finish.pre, finish.post, finish.comb), mixes2,
                                              strict=True))
            for t in mixes2:
                t.fill_(float("nan"))
            q2 = mxfp8_mm(linear, a2, finish_mixes=finish)
            pairs = ((res2, res), (layer2, layer), (q2, want_q), *zip(mixes2, mixes, strict=True))
            for got, want in pairs:
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (collapse, m)
            assert torch.equal(a2.data.view(torch.uint8), a.data.view(torch.uint8))
            assert torch.equal(a2.scale, a.scale)
            ar.check()
            with pytest.raises(ValueError, match="finish_mixes.pre must be a contiguous"):
                mxfp8_mm(linear, a2, finish_mixes=finish.replace(pre=finish.pre[:, :1]))
            # A geometry that is not the mix row's (a wrong slot count, totals offset,
            # chunk count or hidden) is refused before anything launches.
            for wrong in (dict(slots=finish.finish.slots * 2),
                          dict(totals_off=finish.finish.totals_off - 1),
                          dict(chunks=0), dict(chunks=h), dict(hidden=h * 2),
                          dict(mix_row=finish.finish.mix_row + 16)):
                with pytest.raises(ValueError, match="is not the mix row of hidden"):
                    mxfp8_mm(linear, a2, finish_mixes=finish.replace(**wrong))
        ar.close()


def test_mixes_left_to_the_next_gemm():
    _left_to_next_gemm("cpu", H, (1, 3))


def test_mixes_left_to_a_split_k_gemm_of_several_row_blocks(monkeypatch):
    from decode_boundary.gemm.tactics import TABLE, Tactic, row_bucket

    def pin(linear, m):
        k, n = linear.weight.shape
        monkeypatch.setitem(TABLE, (n, k, getattr(linear, "groups", 1)),
                            {row_bucket(m): Tactic(16, 2, 2, 2, 64)})

    _left_to_next_gemm("cpu", H, (3,), pin_gemm=pin)


def test_mixes_left_to_the_next_gemm_cooperative(cooperative_in_the_interpreter):
    from decode_boundary.boundary.consumer_tactics import ConsumerTactic

    _left_to_next_gemm("cpu", H, (2,), ConsumerTactic(64, 2, True, True))


@pytest.mark.gpu
def test_gpu_mixes_left_to_the_next_gemm():
    """On the GPU, DSV4.1-Flash's H = 5120 and fused_wqa_wkv with the tables'
    tactics (hc_fn early at M = 1, late at 16; the GEMM's 2 warps at M = 1
    against the consumer's 4, so a share sum ordered by the layout would
    differ; the GEMM compiled with FMA contraction): the same bits both ways."""
    from decode_boundary.model.config import MODELS

    n_out = MODELS["v4.1-flash"].fused_wqa_wkv_shape()[0]
    _left_to_next_gemm("cuda", 5120, (1, 2, 4, 16), n_out=n_out)


def test_a_finish_left_unlaunched_or_stale_is_refused():
    """``mixes_placement="next_gemm"`` leaves pre / post / comb unwritten for the next
    GEMM: the all-reduce's next call refuses (``RuntimeError``; at tp = 1 the
    instance stays usable) while no GEMM launched with the returned
    ``NextMixes``; the finish is still good then (nothing rewrote its
    shares) and its GEMM gives the combining call's bits. A GEMM refuses a
    finish older than the last consumer launch on its rows, one from before a
    collective reset (the rows re-armed), one made only to compile
    (``deferred_finish``), a 0-row input, and a misaligned output."""
    from decode_boundary.gemm import mxfp8_mm
    from decode_boundary.gemm.linear import Mxfp8Linear
    from decode_boundary.mxfp8.format import QuantizedActivation, mxfp8_scale_bytes

    (ar,) = db.BoundaryAllReduce.simulated(1, H, HC, CAP, 2, quantize_layer_input=True,
                                           residual_only=False, collapse_pre="previous")
    linear = Mxfp8Linear.from_float(torch.randn(32, H).bfloat16() * 0.05)
    d = inputs(2, seed=12)

    def call(combine):
        q = (torch.empty(2, H, dtype=torch.float8_e4m3fn),
             torch.empty(mxfp8_scale_bytes(2, H), dtype=torch.uint8))
        out = ar(d["xs"][0], residual=d["residual"], post=d["post"], comb=d["comb"], pre=d["pre"],
                 norm_weight=d["gamma"], norm_eps=EPS, mxfp8_out=q, mix_weights=d["weights"],
                 mixes_placement="consumer" if combine else "next_gemm")
        return out, QuantizedActivation(*q, torch.bfloat16, torch.Size((2, H)))

    (_, _, _, want), _ = call(True)
    (_, _, _, finish), a = call(False)
    mixes = tuple(finish)
    assert finish.unfinished and finish.epoch > 0
    with pytest.raises(RuntimeError, match="no GEMM launched with them"):
        call(True)
    with pytest.raises(RuntimeError, match="no GEMM launched"):  # still pending
        call(False)
    with pytest.raises(ValueError, match="got 0 rows"):
        mxfp8_mm(linear, torch.empty(0, H).bfloat16(), finish_mixes=finish)
    with pytest.raises(ValueError, match="16-byte aligned"):
        shifted = torch.empty(2 * HC + 1)[1:].view(2, HC)
        mxfp8_mm(linear, a, finish_mixes=finish.replace(pre=shifted))
    mxfp8_mm(linear, a, finish_mixes=finish)  # the refused calls rewrote nothing
    assert finish.finished and not finish.unfinished
    for got, exp in zip(mixes, want, strict=True):
        assert torch.equal(got.view(torch.int32), exp.view(torch.int32))
    call(True)  # the next consumer launch rewrites the mix rows: the finish is stale
    with pytest.raises(ValueError, match="older than the last consumer launch"):
        mxfp8_mm(linear, a, finish_mixes=finish)
    (_, _, _, finish), a = call(False)
    ar.reset()  # not collective: forgets the pending finish, rewrites nothing
    call(True)
    (_, _, _, finish), a = call(False)
    ar.reset(collective=True)  # re-arms (zeroes) the mix rows
    with pytest.raises(ValueError, match="older than the last consumer launch"):
        mxfp8_mm(linear, a, finish_mixes=finish)
    with pytest.raises(ValueError, match="made to compile"):
        mxfp8_mm(linear, a, finish_mixes=ar.deferred_finish(2))
    with pytest.raises(ValueError, match="serves one row count"):
        from decode_boundary.gemm import precompile
        precompile(linear, [1, 2], finish_mixes=ar.deferred_finish(2))
    call(True)
    assert ar.mailbox.status.item() == 0
    ar.close()
