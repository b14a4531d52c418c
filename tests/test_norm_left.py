"""``BoundaryAllReduce(..., leave_norm=True)``: the consumer leaves its RMSNorm and
MXFP8 quantization to the next GEMM (``PendingNorm``), one simulated rank in the
interpreter. Every output (residual_out, the layer input and its MXFP8 copy, the
next mixes, the GEMM's product) equals the call that normalises in the consumer
followed by the plain GEMM, bit for bit, over consecutive steps that alternate
both ways (the generation the GEMM advances keeps the hand-off tags apart); and
what is left is refused where it must be."""

import pytest
import torch

import decode_boundary as db
from decode_boundary.common.contract import PendingNorm
from decode_boundary.gemm import mxfp8_mm, precompile
from decode_boundary.gemm.linear import Mxfp8Linear
from decode_boundary.mxfp8.format import QuantizedActivation, mxfp8_scale_bytes

H, HC, EPS = 128, 4, 1e-6


def _weights(h, g, dev):
    n = (2 + HC) * HC
    return tuple(t.to(dev) for t in (torch.randn(n, HC * h, generator=g) * (4 / h ** 0.5),
                                     torch.rand(3, generator=g) + 0.5,
                                     torch.randn(n, generator=g) * 0.5))


def _step_inputs(m, h, collapse, g, dev):
    return dict(x=torch.randn(m, h, generator=g).bfloat16().to(dev),
                residual=torch.randn(m, HC, h, generator=g).bfloat16().to(dev),
                post=torch.rand(m, HC, generator=g).to(dev) * 2,
                comb=torch.rand(m, HC, HC, generator=g).to(dev),
                pre=torch.rand(m, HC, generator=g).to(dev) if collapse != "same" else None,
                gamma=(1 + 0.1 * torch.randn(h, generator=g)).bfloat16().to(dev))


def _call(ar, d, m, h, dev, weights, leave, combine=True):
    """One full call; returns (its outputs, the next GEMM's input)."""
    q = (torch.full((m, h), 0x55, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn),
         torch.full((mxfp8_scale_bytes(m, h),), 0x55, dtype=torch.uint8, device=dev))
    out = ar(d["x"], d["residual"], d["post"], d["comb"], d["pre"], d["gamma"], EPS, q,
             mix_weights=weights, combine_mixes=combine, leave_norm=leave)
    if isinstance(out[1], PendingNorm):
        return out, out[1]
    return out, QuantizedActivation(*q, torch.bfloat16, torch.Size((m, h)))


def _same_bits(got, want, what):
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), what


def _norm_left_to_next_gemm(dev, h, rows, collapses=(None, "previous", "same"), tactic=None,
                            n_out=96, pin_gemm=None):
    g = torch.Generator().manual_seed(41)
    weights = _weights(h, g, dev)
    linear = Mxfp8Linear.from_float((torch.randn(n_out, h, generator=g) * 0.05).bfloat16()
                                    .to(dev))
    for m in rows if pin_gemm is not None else ():
        pin_gemm(linear, m)
    for collapse in collapses:
        (ar,) = db.BoundaryAllReduce.simulated(1, h, HC, max(rows), 2, device=dev,
                                               quantize_layer_input=True, residual_only=False,
                                               collapse_pre=collapse)
        ar.tactic = tactic
        mix = weights if collapse is not None else None
        for step, m in enumerate([*rows, *rows]):  # every M twice: steps after a left norm
            d = _step_inputs(m, h, collapse, g, dev)
            combine = step % 2 == 0 or collapse is None
            out, a = _call(ar, d, m, h, dev, mix, leave=False)
            want_q = mxfp8_mm(linear, a)
            out2, pending = _call(ar, d, m, h, dev, mix, leave=True, combine=combine)
            assert isinstance(pending, PendingNorm), (collapse, m)
            finish = out2[3] if not combine else None
            pending.layer_input.fill_(float("nan"))  # the GEMM must write every element
            q2 = mxfp8_mm(linear, pending, finish_mixes=finish)
            assert pending.launched == [True]
            _same_bits(q2, want_q, (collapse, m, "q"))
            _same_bits(out2[0], out[0], (collapse, m, "residual_out"))
            _same_bits(pending.layer_input, out[1], (collapse, m, "layer_input"))
            _same_bits(pending.data, a.data, (collapse, m, "mxfp8 data"))
            _same_bits(pending.scale, a.scale, (collapse, m, "mxfp8 scales with padding"))
            if collapse is not None:
                for got, want in zip(out2[2], out[2], strict=True):
                    _same_bits(got, want, (collapse, m, "mixes"))
            ar.check()
        assert ar._box.status.item() == 0
        ar.close()


def test_norm_left_to_the_next_gemm():
    _norm_left_to_next_gemm("cpu", H, (1, 3))


def test_norm_left_to_a_tensor_core_tile():
    """16 tokens: the GEMM's 16-row tensor-core tile normalises them."""
    _norm_left_to_next_gemm("cpu", H, (16,), collapses=("previous",))


def test_norm_left_to_a_split_k_gemm_of_several_row_blocks(monkeypatch):
    """Split K in two and 2-row blocks: every split of the first weight block
    stores its K-slice of the layer input, every row block its rows."""
    from decode_boundary.gemm.autotune import AUTOTUNER, cache_key
    from decode_boundary.gemm.tactics import Tactic

    def pin(linear, m):
        monkeypatch.setitem(AUTOTUNER.cache, cache_key(linear, m), Tactic(16, 2, 2, 2, 32))

    _norm_left_to_next_gemm("cpu", H, (3,), collapses=(None, "previous"), pin_gemm=pin)


def test_norm_left_cooperative(cooperative_in_the_interpreter):
    """The cooperative consumer (its programs concurrent): four 32-column chunk
    partials (without mixes), two 64-column ones (V4's collapse), summed by the
    GEMM in the consumer's tree."""
    from decode_boundary.boundary.consumer import ConsumerTactic

    _norm_left_to_next_gemm("cpu", H, (2,), collapses=(None,),
                            tactic=ConsumerTactic(32, 2, True, False))
    _norm_left_to_next_gemm("cpu", H, (2,), collapses=("same",),
                            tactic=ConsumerTactic(64, 2, True, True))


def test_where_the_norm_is_not_left():
    """Beyond NORM_LEFT_MAX_ROWS tokens, without an MXFP8 output, or with a
    width that is not a multiple of 128 the consumer normalises itself."""
    from decode_boundary.boundary.consumer import NORM_LEFT_MAX_ROWS, leaves_norm

    assert leaves_norm(NORM_LEFT_MAX_ROWS, H) and not leaves_norm(NORM_LEFT_MAX_ROWS + 1, H)
    assert not leaves_norm(1, 96) and not leaves_norm(1, H, mixes_in_consumer=False)
    (ar,) = db.BoundaryAllReduce.simulated(1, H, HC, 2, 2, quantize_layer_input=True,
                                           residual_only=False)
    d = _step_inputs(2, H, "previous", torch.Generator().manual_seed(2), "cpu")
    res, layer = ar(d["x"], d["residual"], d["post"], d["comb"], d["pre"], d["gamma"], EPS,
                    leave_norm=True)  # no mxfp8_out: nothing to leave
    assert isinstance(layer, torch.Tensor)
    assert ar.deferred_norm(2) is not None
    ar.close()


def test_a_norm_left_unlaunched_or_stale_is_refused():
    """The all-reduce's next call refuses while no GEMM took the PendingNorm
    (the layer input unwritten, the generation not advanced); the pending norm
    is still good then. A GEMM refuses one older than the last consumer launch,
    one from before a collective reset, one made only to compile, a grouped
    layer or one of another width, and bad fields."""
    (ar,) = db.BoundaryAllReduce.simulated(1, H, HC, 4, 2, quantize_layer_input=True,
                                           residual_only=False)
    g = torch.Generator().manual_seed(5)
    linear = Mxfp8Linear.from_float(torch.randn(32, H, generator=g).bfloat16() * 0.05)
    d = _step_inputs(2, H, "previous", g, "cpu")
    (_, want_layer), a = _call(ar, d, 2, H, "cpu", None, leave=False)
    want_q = mxfp8_mm(linear, a)
    with pytest.raises(ValueError, match="leave_norm must be a bool"):
        _call(ar, d, 2, H, "cpu", None, leave=1)
    (_, pending), _ = _call(ar, d, 2, H, "cpu", None, leave=True)
    assert pending.launched == [False] and pending.epoch > 0
    with pytest.raises(RuntimeError, match="no GEMM took its PendingNorm"):
        _call(ar, d, 2, H, "cpu", None, leave=False)
    with pytest.raises(ValueError, match="16-byte aligned"):
        mxfp8_mm(linear, pending._replace(norm_weight=torch.empty(H + 1).bfloat16()[1:]))
    with pytest.raises(ValueError, match="geometry"):
        mxfp8_mm(linear, pending._replace(chunks=pending.chunks + 1))
    with pytest.raises(ValueError, match="eps"):
        mxfp8_mm(linear, pending._replace(eps=float("nan")))
    grouped = Mxfp8Linear.grouped([Mxfp8Linear.from_float(torch.randn(32, H).bfloat16())] * 2)
    with pytest.raises(ValueError, match="ungrouped layer"):
        mxfp8_mm(grouped, pending)
    _same_bits(mxfp8_mm(linear, pending), want_q, "q after the refusals")
    _same_bits(pending.layer_input, want_layer, "layer_input after the refusals")
    _call(ar, d, 2, H, "cpu", None, leave=False)  # rewrites the partials: the norm is stale
    with pytest.raises(ValueError, match="older than the last consumer launch"):
        mxfp8_mm(linear, pending)
    (_, pending), _ = _call(ar, d, 2, H, "cpu", None, leave=True)
    ar.reset(collective=True)  # re-arms (zeroes) the scratch
    with pytest.raises(ValueError, match="older than the last consumer launch"):
        mxfp8_mm(linear, pending)
    with pytest.raises(ValueError, match="made to compile"):
        mxfp8_mm(linear, ar.deferred_norm(2))
    with pytest.raises(ValueError, match="serves one row count"):
        precompile(linear, [1, 2], pending_norm=ar.deferred_norm(2))
    (_, layer), a = _call(ar, d, 2, H, "cpu", None, leave=False)
    _same_bits(layer, want_layer, "a step after the reset")
    assert ar._box.status.item() == 0
    ar.close()


@pytest.mark.gpu
def test_gpu_norm_left_to_the_next_gemm():
    """On the GPU, DSV4.1-Flash's H = 5120 and fused_wqa_wkv with the tables'
    tactics (the consumer's 512-column chunks against the GEMM's pieces and
    warps; the GEMM's hardware roundings): the same bits both ways, over steps
    that alternate."""
    from decode_boundary.model.config import MODELS

    n_out = MODELS["v4.1-flash"].fused_wqa_wkv_shape()[0]
    _norm_left_to_next_gemm("cuda", 5120, (1, 2, 4, 8, 16), n_out=n_out)
