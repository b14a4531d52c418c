"""PublishingMxfp8Linear in the interpreter, tp = 2 simulated in one process:
the fused path (GEMM epilogue publishes) against the unfused one (plain GEMM,
publish kernel), mailbox bytes and consumer outputs bit for bit."""

import pytest
import torch

from decode_boundary.boundary.all_reduce import BoundaryAllReduce
from decode_boundary.boundary.consumer_tactics import PUBLISH_EPILOGUE_MAX_ROWS
from decode_boundary.boundary.reference import consumer_ref
from decode_boundary.gemm import mxfp8_mm
from decode_boundary.gemm.linear import Mxfp8Linear
from decode_boundary.mxfp8.format import mxfp8_scale_bytes
from decode_boundary.mxfp8.quantize_kernel import quantize_mxfp8
from decode_boundary.publishing_linear import PublishingMxfp8Linear

HIDDEN, K, HC, CAPACITY, TP = 128, 96, 2, 24, 2


def _mixing_inputs(rows, gen):
    residual = torch.randn(rows, HC, HIDDEN, generator=gen).bfloat16()
    post = torch.rand(rows, HC, generator=gen)
    comb = torch.rand(rows, HC, HC, generator=gen)
    pre = torch.rand(rows, HC, generator=gen)
    gamma = (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).bfloat16()
    return residual, post, comb, pre, gamma


def _group(**kwargs):
    return BoundaryAllReduce.simulated(TP, HIDDEN, HC, CAPACITY, 2, quantize_layer_input=True,
                                       residual_only=False, **kwargs)


def _step(ranks, linears, xs, mixing, fused):
    """One boundary on every simulated rank; returns (gemm outs, mailbox copies
    before consuming, consumer outputs)."""
    outs = []
    for ar, linear, x in zip(ranks, linears, xs, strict=True):
        if fused:
            outs.append(PublishingMxfp8Linear(ar)(linear, x))
        else:
            out = mxfp8_mm(linear, x)
            ar.publish(out)
            outs.append(out)
    boxes = [ar.mailbox.buffer.clone() for ar in ranks]
    results = []
    rows = outs[0].shape[0]
    for ar, out in zip(ranks, outs, strict=True):
        data = torch.full((rows, HIDDEN), float("nan")).to(torch.float8_e4m3fn)
        scale = torch.full((mxfp8_scale_bytes(rows, HIDDEN),), 0xAB, dtype=torch.uint8)
        residual, post, comb, pre, gamma = mixing
        res_out, layer_in, *_ = ar(out, residual=residual, post=post, comb=comb, pre=pre,
                                   norm_weight=gamma, norm_eps=1e-6, mxfp8_out=(data, scale))
        results.append((res_out, layer_in, data.view(torch.uint8).clone(), scale.clone()))
    return outs, boxes, results


@pytest.mark.parametrize("rows,bf16_in", [(1, False), (3, False), (8, False), (13, True),
                                         (20, False), (24, True)])
def test_fused_publish_is_bit_identical_to_unfused(rows, bf16_in):
    """Every row count up to the mailbox's capacity publishes from the epilogue:
    CUDA-core and tensor-core tiles, a BF16 input quantized in the prologue
    (<= PROLOGUE_MAX_ROWS rows) or by the quantizer first (above)."""
    gen = torch.Generator().manual_seed(rows)
    linears = [Mxfp8Linear.from_float(torch.randn(HIDDEN, K, generator=gen).bfloat16())
               for _ in range(TP)]
    xs = [torch.randn(rows, K, generator=gen).bfloat16() for _ in range(TP)]
    xs = xs if bf16_in else [quantize_mxfp8(x) for x in xs]
    mixing = _mixing_inputs(rows, gen)
    assert PublishingMxfp8Linear(_group()[0]).supports(linears[0], rows)
    plain_outs, plain_boxes, plain = _step(_group(), linears, xs, mixing, fused=False)
    fused_outs, fused_boxes, fused = _step(_group(), linears, xs, mixing, fused=True)
    for a, b in zip(plain_outs, fused_outs, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    for a, b in zip(plain_boxes, fused_boxes, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    ref_res, ref_layer, _ = consumer_ref(plain_outs, *mixing[:3], mixing[3], mixing[4], 1e-6)
    for (pr, pl, pd, ps), (fr, fl, fd, fs) in zip(plain, fused, strict=True):
        assert torch.equal(pr.view(torch.int16), fr.view(torch.int16))
        assert torch.equal(pl.view(torch.int16), fl.view(torch.int16))
        assert torch.equal(pd, fd) and torch.equal(ps, fs)
        assert torch.equal(fr.view(torch.int16), ref_res.view(torch.int16))
        # layer_input: <= 1 BF16 ulp from the reference (length-H sum of squares order).
        assert (fl.float() - ref_layer.float()).abs().le(ref_layer.float().abs() * 2**-7).all()


def test_fused_publish_rotates_stages_over_steps():
    ranks = _group()
    gen = torch.Generator().manual_seed(11)
    linears = [Mxfp8Linear.from_float(torch.randn(HIDDEN, K, generator=gen).bfloat16())
               for _ in range(TP)]
    for step in range(4):
        xs = [quantize_mxfp8(torch.randn(2, K, generator=gen).bfloat16()) for _ in range(TP)]
        mixing = _mixing_inputs(2, gen)
        outs, _, results = _step(ranks, linears, xs, mixing, fused=step % 2 == 0)
        ref_res, _, _ = consumer_ref(outs, *mixing[:3], mixing[3], mixing[4], 1e-6)
        for res_out, *_ in results:
            assert torch.equal(res_out.view(torch.int16), ref_res.view(torch.int16))
        assert all(int(ar.mailbox.stage_state[0]) == (step + 1) % 3 for ar in ranks)


def test_unsupported_inputs_fall_back_and_publish_nothing():
    ar = _group()[0]
    publisher = PublishingMxfp8Linear(ar)
    gen = torch.Generator().manual_seed(5)
    narrow = Mxfp8Linear.from_float(torch.randn(64, K, generator=gen).bfloat16())  # N != hidden
    x = quantize_mxfp8(torch.randn(2, K, generator=gen).bfloat16())
    assert not publisher.supports(narrow, 2)
    before = ar.mailbox.buffer.clone()
    out = publisher(narrow, x)
    assert torch.equal(out.view(torch.int16), mxfp8_mm(narrow, x).view(torch.int16))
    assert torch.equal(before.view(torch.int16), ar.mailbox.buffer.view(torch.int16))
    wide = Mxfp8Linear.from_float(torch.randn(HIDDEN, K, generator=gen).bfloat16())
    assert publisher.supports(wide, CAPACITY) and not publisher.supports(wide, CAPACITY + 1)
    roomy = PublishingMxfp8Linear(BoundaryAllReduce.simulated(
        TP, HIDDEN, HC, PUBLISH_EPILOGUE_MAX_ROWS + 8, 2, quantize_layer_input=True,
        residual_only=False)[0])
    assert roomy.supports(wide, PUBLISH_EPILOGUE_MAX_ROWS)
    assert not roomy.supports(wide, PUBLISH_EPILOGUE_MAX_ROWS + 1)  # measured slower there
    assert not publisher.supports(wide, 0)


def test_second_publish_before_reduce_raises():
    ar = _group()[0]
    publisher = PublishingMxfp8Linear(ar)
    gen = torch.Generator().manual_seed(6)
    linear = Mxfp8Linear.from_float(torch.randn(HIDDEN, K, generator=gen).bfloat16())
    x = quantize_mxfp8(torch.randn(1, K, generator=gen).bfloat16())
    publisher(linear, x)
    with pytest.raises(RuntimeError, match="unreduced"):
        publisher(linear, x)


def test_second_publish_fails_before_touching_the_mailbox():
    ar = _group()[0]
    publisher = PublishingMxfp8Linear(ar)
    gen = torch.Generator().manual_seed(8)
    linear = Mxfp8Linear.from_float(torch.randn(HIDDEN, K, generator=gen).bfloat16())
    publisher(linear, quantize_mxfp8(torch.randn(2, K, generator=gen).bfloat16()))
    pending = ar.mailbox.buffer.clone()
    with pytest.raises(RuntimeError, match="unreduced"):
        publisher(linear, quantize_mxfp8(torch.randn(2, K, generator=gen).bfloat16()))
    assert torch.equal(pending.view(torch.int16), ar.mailbox.buffer.view(torch.int16))


def test_activations_that_are_not_2d_bf16_fall_back_without_publishing():
    ar = _group()[0]
    publisher = PublishingMxfp8Linear(ar)
    gen = torch.Generator().manual_seed(9)
    linear = Mxfp8Linear.from_float(torch.randn(HIDDEN, K, generator=gen).bfloat16())
    before = ar.mailbox.buffer.clone()
    for x in (torch.randn(1, 2, K, generator=gen).bfloat16(), torch.randn(2, K, generator=gen)):
        out = publisher(linear, x)
        assert out.shape == (*x.shape[:-1], HIDDEN)
    assert torch.equal(before.view(torch.int16), ar.mailbox.buffer.view(torch.int16))
    publisher(linear, quantize_mxfp8(torch.randn(2, K, generator=gen).bfloat16()))  # not pending
