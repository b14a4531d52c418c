"""Random inputs of one all-reduce step for the boundary tests (simulated ranks)."""

import torch


def random_step(m, tp, seed, *, hc, h):
    """Every rank's BF16 partial [m, h] and the replicated mHC inputs; rank 0's
    first row starts with -0.0 (a published -0 must read as +0, never as
    "unwritten")."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(m, h, generator=g).bfloat16() for _ in range(tp)]
    xs[0][0, :3] = -0.0
    return dict(
        xs=xs,
        residual=torch.randn(m, hc, h, generator=g).bfloat16(),
        post=torch.rand(m, hc, generator=g) * 2,
        comb=torch.rand(m, hc, hc, generator=g),
        pre=torch.rand(m, hc, generator=g),
        gamma=(1 + 0.1 * torch.randn(h, generator=g)).bfloat16(),
    )


def matches_reference(d, out, eps) -> bool:
    """A full step's ``out`` (a BoundaryResult) for the inputs ``d`` of
    :func:`random_step`: residual_out bit-exact against the FP64-ordered
    reference, layer_input within one BF16 ulp (the norm's FP32 sum order is
    the kernel's own)."""
    from decode_boundary.boundary.reference import consumer_ref

    ref_res, ref_layer, _ = consumer_ref(list(d["xs"]), d["residual"], d["post"], d["comb"],
                                         d["pre"], d["gamma"], eps)
    res, layer = out.residual_out, out.layer_input
    return torch.equal(res.view(torch.int16), ref_res.view(torch.int16)) and bool(
        (layer.float() - ref_layer.float()).abs().le(ref_layer.float().abs() * 2**-7).all())
