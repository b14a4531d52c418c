"""The next sublayer's mixes after their projection, as a careful user writes
them: ONE Triton kernel for the sigmoids, the softmax and every Sinkhorn round.
The bench's user-built step (``bench.user_step``) runs it after cuBLAS has
projected the streams onto ``hc_fn`` in FP32 and torch has taken their RMS, so
that a baseline does not pay Inductor's dozens of dependent kernels for the
Sinkhorn rounds. Not a kernel of the library: the library fuses the mixes into
its consumer (``boundary``).

**Contract.** ``launch_user_mixes(projected, rstd, hc_scale, hc_base, hc_eps,
sinkhorn_iters)`` with ``projected`` FP32 ``[M, (2 + hc) * hc]`` = ``s @
hc_fn^T`` and ``rstd`` FP32 ``[M]`` = ``rsqrt(mean(s^2) + rms_eps)`` (``s`` a
token's hc streams flattened) returns ``(pre [M, hc], post [M, hc], comb [M,
hc, hc])`` FP32: steps 2-4 of ``mixes.reference.mhc_mixes_ref`` on ``mixes
= projected * rstd``, in its order of operations (comb indexed [source,
target]; softmax along target; the first column normalisation, then
``sinkhorn_iters - 1`` rounds of rows then columns, each ``+ hc_eps``). It
matches the reference within FP32 rounding (``exp`` and the sigmoid are not
torch's), not bit for bit. ``hc`` is a power of two (Triton's block shapes).
``out=(pre, post, comb)``: write there (every element of the first M rows is
written; nothing else is touched).

**Layout.** One program holds ``BLOCK_M`` tokens in one warp, about a thread
per token: each token's (2 + hc) * hc values stay in registers from the load
through the last Sinkhorn round; the rounds are reductions within a token's
hc x hc block, never across tokens. Grid: ``ceil(M / BLOCK_M)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 32  # tokens per program: one warp, a token per lane
NUM_WARPS = 1


@triton.jit(do_not_specialize=["rows", "iters"])
def user_mixes_kernel(proj_ptr, rstd_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr,
                      rows, hc_eps, iters, HC: tl.constexpr, BLOCK_M: tl.constexpr):
    n_mix: tl.constexpr = (2 + HC) * HC
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = m < rows
    h = tl.arange(0, HC)
    rstd = tl.load(rstd_ptr + m, mask=live, other=0.0)
    row = proj_ptr + m[:, None] * n_mix
    pre = tl.load(row + h[None, :], mask=live[:, None], other=0.0) * rstd[:, None]
    pre = tl.sigmoid(pre * tl.load(scale_ptr) + tl.load(base_ptr + h)[None, :]) + hc_eps
    post = tl.load(row + HC + h[None, :], mask=live[:, None], other=0.0) * rstd[:, None]
    post = 2 * tl.sigmoid(post * tl.load(scale_ptr + 1) + tl.load(base_ptr + HC + h)[None, :])
    st = h[:, None] * HC + h[None, :]  # [source, target] within a token's block
    logits = tl.load(proj_ptr + m[:, None, None] * n_mix + 2 * HC + st[None, :, :],
                     mask=live[:, None, None], other=0.0) * rstd[:, None, None]
    logits = logits * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * HC + st)[None, :, :]
    e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
    comb = e / tl.sum(e, axis=2)[:, :, None] + hc_eps
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    r = 1
    while r < iters:  # a runtime bound (the interpreter takes no range() of a scalar arg)
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
        r += 1
    tl.store(pre_ptr + m[:, None] * HC + h[None, :], pre, mask=live[:, None])
    tl.store(post_ptr + m[:, None] * HC + h[None, :], post, mask=live[:, None])
    tl.store(comb_ptr + m[:, None, None] * (HC * HC) + st[None, :, :], comb,
             mask=live[:, None, None])


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or \
            tuple(t.shape) != shape or t.device != device or not t.is_contiguous():
        got = f"{t.dtype} {list(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) \
            else type(t).__name__
        raise ValueError(f"{name} must be a contiguous float32 {list(shape)} tensor on "
                         f"{device}, got {got}")


def launch_user_mixes(projected: torch.Tensor, rstd: torch.Tensor, hc_scale: torch.Tensor,
                      hc_base: torch.Tensor, hc_eps: float, sinkhorn_iters: int,
                      out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(pre, post, comb)`` of the projected mixes (module docstring); ``ValueError``
    naming the argument for a shape, dtype or device the kernel cannot take."""
    if not isinstance(projected, torch.Tensor) or projected.ndim != 2:
        raise ValueError(f"projected must be [M, (2 + hc) * hc], got "
                         f"{getattr(projected, 'shape', type(projected).__name__)}")
    rows, n_mix = projected.shape
    hc = next((c for c in range(1, 65) if (2 + c) * c == n_mix), None)
    if hc is None or hc & (hc - 1):
        raise ValueError(f"projected's width {n_mix} must be (2 + hc) * hc for a power-of-two "
                         "hc")
    device = projected.device
    _check("projected", projected, (rows, n_mix), device)
    _check("rstd", rstd, (rows,), device)
    _check("hc_scale", hc_scale, (3,), device)
    _check("hc_base", hc_base, (n_mix,), device)
    if isinstance(sinkhorn_iters, bool) or not isinstance(sinkhorn_iters, int) or \
            sinkhorn_iters < 1:
        raise ValueError(f"sinkhorn_iters must be an int >= 1, got {sinkhorn_iters!r}")
    if not 0 < hc_eps < float("inf"):
        raise ValueError(f"hc_eps must be a finite number > 0, got {hc_eps!r}")
    if out is None:
        out = (torch.empty(rows, hc, device=device), torch.empty(rows, hc, device=device),
               torch.empty(rows, hc, hc, device=device))
    for name, t, shape in zip(("out[0] (pre)", "out[1] (post)", "out[2] (comb)"), out,
                              ((rows, hc), (rows, hc), (rows, hc, hc)), strict=True):
        _check(name, t, shape, device)
    if rows:
        user_mixes_kernel[(triton.cdiv(rows, BLOCK_M),)](
            projected, rstd, hc_scale, hc_base, *out, rows, float(hc_eps), sinkhorn_iters,
            HC=hc, BLOCK_M=BLOCK_M, num_warps=NUM_WARPS)
    return out
