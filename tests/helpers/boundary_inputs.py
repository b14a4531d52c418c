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
