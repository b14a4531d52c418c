"""BoundaryAllReduce across two real processes on CPU (gloo, Triton interpreter).

Both ranks sit on "one device" (the CPU), which is what a run with more ranks
than GPUs looks like: ``transport="auto"`` must pick the gather (NCCL-fallback)
path rather than the mailbox, and its results must match the reference exactly
where the spec says exact, on both ranks alike.
"""

import torch
from consumer_checks import consumer_mismatches

from decode_boundary.bench.launch import RankContext, launch
from decode_boundary.boundary.all_reduce import BoundaryAllReduce
from decode_boundary.boundary.reference import consumer_ref
from decode_boundary.mxfp8.format import mxfp8_scale_bytes, quantize_mxfp8_ref, unswizzle_scales

HIDDEN, HC, M = 64, 2, 3


def _rank(ctx: RankContext) -> dict:
    ar = BoundaryAllReduce(HIDDEN, HC, capacity=4, top_k=2, group=ctx.group,
                           quantize_layer_input=True, residual_only=False,
                           device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(17)  # every rank draws every rank's partial
    xs = torch.randn(ctx.world_size, M, HIDDEN, generator=gen).bfloat16()
    residual = torch.randn(M, HC, HIDDEN, generator=gen).bfloat16()
    post, pre = torch.rand(M, HC, generator=gen), torch.rand(M, HC, generator=gen)
    comb = torch.rand(M, HC, HC, generator=gen)
    gamma = (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).bfloat16()
    data = torch.full((M, HIDDEN), float("nan")).to(torch.float8_e4m3fn)
    scale = torch.full((mxfp8_scale_bytes(M, HIDDEN),), 0xAB, dtype=torch.uint8)
    res_out, layer, *_ = ar(xs[ctx.rank].clone(), residual=residual, post=post, comb=comb,
                            pre=pre, norm_weight=gamma, norm_eps=1e-6, mxfp8_out=(data, scale))
    ref_res, ref_layer, _ = consumer_ref(list(xs), residual, post, comb, pre, gamma, 1e-6)
    want = quantize_mxfp8_ref(layer)
    ar.close()
    return {
        "transport": ar.transport,
        "consumer_bar": int(consumer_mismatches(res_out, layer, ref_res, ref_layer)) == 0,
        # Scale padding (rows past M) is the caller's: compare the real groups only.
        "mxfp8_exact": torch.equal(data.view(torch.uint8), want.data.view(torch.uint8))
        and torch.equal(unswizzle_scales(scale, M, HIDDEN),
                        unswizzle_scales(want.scale, M, HIDDEN)),
        "digest": res_out.view(torch.int16).sum().item(),
    }


def test_ranks_sharing_a_device_take_the_gather_path_and_agree():
    results = launch(_rank, 2, (), timeout_s=240)
    assert set(results) == {0, 1}
    for rank, out in results.items():
        assert out["transport"] == "nccl", (rank, out)
        assert out["consumer_bar"] and out["mxfp8_exact"], out
    assert results[0]["digest"] == results[1]["digest"]
