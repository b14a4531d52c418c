"""The README's decode-step example, transcribed for one CPU rank in the
interpreter (no process group, no CUDA graph; shapes scaled down): the calls it
documents, imported from the top-level package as it does, work together and
give the reference's answer, step after step."""

import torch

from decode_boundary import (
    BoundaryAllReduce,
    Mxfp8Linear,
    PublishingMxfp8Linear,
    mxfp8_mm,
    mxfp8_scale_bytes,
)
from decode_boundary.boundary.reference import consumer_ref
from decode_boundary.mxfp8.format import quantize_mxfp8_ref, unswizzle_scales


def test_readme_decode_step_on_one_cpu_rank():
    H, HC, M, K_A, N_A = 128, 4, 8, 64, 32
    all_reduce = BoundaryAllReduce(H, HC, capacity=16, top_k=6, group=None, device="cpu",
                                   quantize_layer_input=True, residual_only=False)
    wo_a = Mxfp8Linear.grouped([Mxfp8Linear.from_float(0.02 * torch.randn(N_A, K_A))
                                for _ in range(2)])
    wo_b = Mxfp8Linear.from_float(0.02 * torch.randn(H, 2 * N_A))
    publish_wo_b = PublishingMxfp8Linear(all_reduce)
    attn = torch.randn(M, 2 * K_A).bfloat16()
    residual = torch.randn(M, HC, H).bfloat16()
    post, pre = torch.rand(M, HC), torch.rand(M, HC)
    comb = torch.rand(M, HC, HC)
    gamma = torch.ones(H).bfloat16()
    next_in = (torch.empty(M, H, dtype=torch.float8_e4m3fn),
               torch.empty(mxfp8_scale_bytes(M, H), dtype=torch.uint8))

    def boundary():
        o = mxfp8_mm(wo_a, attn)
        partial = publish_wo_b(wo_b, o)
        return all_reduce(partial, residual, post, comb, pre, gamma, 1e-20, mxfp8_out=next_in)

    publish_wo_b.precompile(wo_b, M)
    all_reduce.precompile([M])
    partial = mxfp8_mm(wo_b, mxfp8_mm(wo_a, attn))
    want_res, want_layer, _ = consumer_ref([partial], residual, post, comb, pre, gamma, 1e-20,
                                           quantize=True)
    for _ in range(4):  # crosses every mailbox stage
        residual_out, layer_input = boundary()
        assert torch.equal(residual_out.view(torch.int16), want_res.view(torch.int16))
        assert (layer_input.float() - want_layer.float()).abs().le(
            want_layer.float().abs() * 2**-7).all()
        want_next = quantize_mxfp8_ref(layer_input)  # the next layer's MXFP8 input
        assert torch.equal(next_in[0].view(torch.uint8), want_next.data.view(torch.uint8))
        assert torch.equal(unswizzle_scales(next_in[1], M, H),
                           unswizzle_scales(want_next.scale, M, H))
        assert torch.equal(next_in[1], want_next.scale)  # padding too
    all_reduce.check()
