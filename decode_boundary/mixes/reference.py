"""Pure-torch reference of a sublayer's mHC mixes (docs/DESIGN.md §5.1): the
spec the consumer's fused mixes, the mixes kernel and the finishing GEMM are
held to."""

from __future__ import annotations

import torch


def mhc_mixes_ref(
    streams: torch.Tensor,
    hc_fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sublayer's mHC mixes per token from the hc streams entering it
    (docs/DESIGN.md §5.1): ``(pre [M, hc], post [M, hc], comb [M, hc, hc])``,
    FP32, comb indexed [source, target] as the consumer takes it.

    ``streams`` [M, hc, H] (BF16 at the boundary: the consumer's
    ``residual_out``; upcast to FP32), ``hc_fn`` FP32 [(2 + hc) * hc, hc * H],
    ``hc_scale`` FP32 [3], ``hc_base`` FP32 [(2 + hc) * hc]. In order, with
    ``s`` a token's streams flattened to hc * H values:

    1. ``mixes = (s . hc_fn^T) * rsqrt(mean(s^2) + rms_eps)``;
    2. ``pre = sigmoid(mixes[:hc] * scale[0] + base[:hc]) + hc_eps``;
    3. ``post = 2 * sigmoid(mixes[hc:2hc] * scale[1] + base[hc:2hc])``;
    4. ``comb`` = ``mixes[2hc:] * scale[2] + base[2hc:]`` as [source, target],
       softmax along target, ``+ hc_eps``, divided by its column sums (over
       source) ``+ hc_eps``; then ``sinkhorn_iters - 1`` rounds of dividing by
       the row sums, then by the column sums, each ``+ hc_eps``.

    FP32 throughout (a length hc * H dot per mix, then a few dozen scalar
    operations): a kernel computing it matches within FP32 rounding, not bit
    for bit (summation order of the dots).
    """
    if streams.ndim != 3:
        raise ValueError(f"streams must be [M, hc, H], got {tuple(streams.shape)}")
    m, hc, h = streams.shape
    mixes_n = (2 + hc) * hc
    for name, t, shape in (("hc_fn", hc_fn, (mixes_n, hc * h)), ("hc_scale", hc_scale, (3,)),
                           ("hc_base", hc_base, (mixes_n,))):
        if t.dtype != torch.float32 or tuple(t.shape) != shape:
            raise ValueError(f"{name} must be float32 {list(shape)}, got {t.dtype} "
                             f"{list(t.shape)}")
    if sinkhorn_iters < 1:
        raise ValueError(f"sinkhorn_iters must be >= 1, got {sinkhorn_iters}")
    s = streams.float().reshape(m, hc * h)
    rstd = torch.rsqrt((s * s).mean(dim=-1, keepdim=True) + rms_eps)
    mixes = (s @ hc_fn.t()) * rstd
    pre = torch.sigmoid(mixes[:, :hc] * hc_scale[0] + hc_base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(mixes[:, hc:2 * hc] * hc_scale[1] + hc_base[hc:2 * hc])
    logits = (mixes[:, 2 * hc:] * hc_scale[2] + hc_base[2 * hc:]).reshape(m, hc, hc)
    comb = torch.softmax(logits, dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb
