"""The README's decode-step example, transcribed for one CPU rank in the
interpreter (no process group, no CUDA graph; shapes scaled down): the calls it
documents, imported from the top-level package as it does, work together and
give the right answer, step after step.

Nothing on the reference side runs the code under test: each GEMM output is
checked against the independent FP64 product of its (independently quantized)
operands, rounded once to BF16 (tests/helpers/independent_ref.py; 1 ulp only where FP32
accumulation in the tactic's order may cross a rounding boundary); the
consumer's outputs against ``consumer_ref`` of the partial so checked
(residual_out bit for bit, layer_input within 1 ulp); the next layer's MXFP8
input against the independent quantization of layer_input, byte for byte."""

import torch
from independent_ref import (
    assert_mxfp8_equal,
    check_gemm,
    decode_mxfp8,
    layer_values,
    mxfp8_bytes,
    summation_depth,
)

from decode_boundary import (
    MODELS,
    AttentionBoundary,
    BoundaryAllReduce,
    Mxfp8Linear,
    PublishingMxfp8Linear,
    mxfp8_mm,
    mxfp8_scale_bytes,
)
from decode_boundary.boundary.reference import consumer_ref
from decode_boundary.gemm import selected_tactic
from decode_boundary.gemm.reference import bf16_ulp
from decode_boundary.model.checks import check_mixes, check_outputs, outputs_identical


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
    norm_weight = torch.ones(H).bfloat16()  # the RMSNorm's gamma
    norm_eps = 1e-6  # the model's rms_norm_eps
    next_in = (torch.empty(M, H, dtype=torch.float8_e4m3fn),
               torch.empty(mxfp8_scale_bytes(M, H), dtype=torch.uint8))

    def boundary():  # the README's, also returning the GEMM outputs it checks here
        o = mxfp8_mm(wo_a, attn)
        partial = publish_wo_b(wo_b, o)
        return o, partial, all_reduce(partial, residual=residual, post=post, comb=comb, pre=pre,
                                      norm_weight=norm_weight, norm_eps=norm_eps,
                                      mxfp8_out=next_in)

    publish_wo_b.precompile(wo_b, M)
    all_reduce.precompile([M])
    first = None
    for _ in range(4):  # crosses every mailbox stage
        o, partial, out = boundary()
        residual_out, layer_input = out.residual_out, out.layer_input
        assert out.mixes is None and out.mxfp8 is not None  # no mix weights; MXFP8 asked for
        check_gemm(o, decode_mxfp8(*mxfp8_bytes(attn)), layer_values(wo_a), groups=2,
                   depth=summation_depth(K_A, selected_tactic(wo_a, M)), what="wo_a",
                   min_strict=0.8)
        check_gemm(partial, decode_mxfp8(*mxfp8_bytes(o)), layer_values(wo_b),
                   depth=summation_depth(2 * N_A, selected_tactic(wo_b, M)), what="wo_b",
                   min_strict=0.8)
        want_res, want_layer, _ = consumer_ref([partial], residual, post, comb, pre,
                                               norm_weight, norm_eps)
        assert torch.equal(residual_out.view(torch.int16), want_res.view(torch.int16))
        diff = (layer_input.double() - want_layer.double()).abs()
        assert bool((diff <= bf16_ulp(want_layer.double())).all())
        assert_mxfp8_equal(next_in[0], next_in[1], layer_input)  # the next layer's input
        step = [t.view(torch.int16) for t in (o, partial, residual_out, layer_input)]
        first = first or step
        assert all(torch.equal(a, b) for a, b in zip(step, first, strict=True))
    all_reduce.check()


def test_readme_attention_boundary_on_cpu():
    """The README's simplest entry point, transcribed for the CPU (tiny model,
    interpreter): one rank's whole boundary, precompiled, then called; its
    outputs within the chain's tolerance of the pure-torch reference and its
    next mixes within MIXES_ATOL of the spec, fused and unfused bit-identical."""
    rows = int(torch.randint(1, 5, ()))
    ab = AttentionBoundary(MODELS["tiny"], tp=1, rank=0, group=None,
                           device=torch.device("cpu"), capacity=8,
                           seed=int(torch.randint(0, 1000, ())))
    ab.precompile([rows])
    inputs = ab.make_inputs(rows=rows, seed=int(torch.randint(0, 1000, ())))
    out = ab(inputs)
    assert not check_outputs(out, ab.reference(inputs))
    assert not check_mixes(out, ab)
    assert outputs_identical(out, ab(inputs, fused=False))
    ab.close()
