"""MoE finalize fused with the publish: build this rank's partial from the
expert outputs and store it straight into every peer's mailbox.

``partial[m] = bf16(+0 + sum_k w[m, k] * gemm2_permuted[idx[m, k]] + shared[m])``
in FP32, k in order, products rounded before the add (launched with
``enable_fp_fusion=False``), idx -1 = expert on another rank: bit-identical to
:func:`.reference.moe_finalize_ref`. The partial is also written to a local
tensor (the NCCL fallback gathers it; callers may inspect it).

**Memory consistency.** As the publish kernel (:mod:`.publish_kernel`; both
store through ``common.mailbox_store.publish_row``): plain unicast stores of
data that is its own flag, NEXT (``stage_ptr + STAGE_NEXT``) read after the
grid wait, ACTIVE (``stage_ptr + STAGE_ACTIVE``) stored once per grid.

**What the caller must guarantee.** As the publish kernel; in addition the
indices lie in [-1, rows of ``gemm2_permuted``) (checked on the host only when
not capturing a CUDA graph, since it costs a sync).

**Why it is CUDA-graph safe.** As the publish kernel: addresses and stage live
on the device; the grid depends only on M.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import env
from ..common.compiled import load_module
from ..common.contract import STAGE_ACTIVE, STAGE_NEXT
from ..common.mailbox_store import publish_row
from ..common.rounding import to_bf16_rne
from .publish_kernel import PUBLISH_WARPS, publish_block

_NEXT, _ACTIVE = tl.constexpr(STAGE_NEXT), tl.constexpr(STAGE_ACTIVE)  # stage_state indices


@triton.jit
def finalize_publish_kernel(
    gemm2_ptr, weights_ptr, idx_ptr, shared_ptr, partial_ptr,
    peer_ptrs_ptr, stage_ptr, rank, capacity,
    TP: tl.constexpr, TOP_K: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr,
    PUBLISH: tl.constexpr, USE_PDL: tl.constexpr,
):
    m = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < HIDDEN
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the expert GEMM wrote gemm2_permuted
    row_off = m.to(tl.int64) * HIDDEN
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        j = tl.load(idx_ptr + m * TOP_K + k)
        w = tl.load(weights_ptr + m * TOP_K + k).to(tl.float32)
        present = j >= 0
        rows = tl.load(gemm2_ptr + tl.maximum(j, 0).to(tl.int64) * HIDDEN + cols,
                       mask=mask & present, other=0.0).to(tl.float32)
        acc = tl.where(present, acc + w * rows, acc)
    acc = acc + tl.load(shared_ptr + row_off + cols, mask=mask, other=0.0).to(tl.float32)
    partial = to_bf16_rne(acc)
    tl.store(partial_ptr + row_off + cols, partial, mask=mask)
    if PUBLISH:
        stage = tl.load(stage_ptr + _NEXT)
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
        publish_row(partial, peer_ptrs_ptr, stage, rank, m, cols, mask, capacity,
                    TP=TP, HIDDEN=HIDDEN)
        if (m == 0) & (chunk == 0):
            tl.store(stage_ptr + _ACTIVE, stage)


def check_finalize_inputs(gemm2_permuted, expert_weights, idx, shared_output, hidden, top_k,
                          device, capacity) -> None:
    """Raise a clear ValueError for inputs the finalize kernel cannot take."""
    if shared_output.dtype != torch.bfloat16 or shared_output.ndim != 2:
        raise ValueError(f"shared_output must be bf16 [M, {hidden}], got {shared_output.dtype} "
                         f"{list(shared_output.shape)}")
    m = shared_output.shape[0]
    checks = (
        (gemm2_permuted, "gemm2_permuted", (torch.bfloat16,), (gemm2_permuted.shape[0], hidden)),
        (expert_weights, "expert_weights", (torch.float32, torch.bfloat16), (m, top_k)),
        (idx, "expanded_idx_to_permuted_idx", (torch.int32, torch.int64), (m, top_k)),
        (shared_output, "shared_output", (torch.bfloat16,), (m, hidden)),
    )
    for t, name, dtypes, shape in checks:
        if t.dtype not in dtypes or tuple(t.shape) != tuple(shape) or t.device != device:
            raise ValueError(f"{name} must be {' or '.join(map(str, dtypes))} {list(shape)} on "
                             f"{device}, got {t.dtype} {list(t.shape)} on {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if not 0 < m <= capacity:
        raise ValueError(f"M = {m} must be in [1, capacity = {capacity}]")


def finalize_publish(gemm2_permuted, expert_weights, idx, shared_output, peer_ptrs, stage_state,
                     rank: int, capacity: int, publish: bool = True,
                     compile_only: bool = False) -> torch.Tensor:
    """Launch the fused finalize + publish; returns the partial [M, H] bf16.
    ``publish=False`` only computes the partial (NCCL fallback);
    ``compile_only``: compile, launch nothing (the partial is then unwritten)."""
    m, hidden = shared_output.shape
    partial = torch.empty_like(shared_output)
    block = publish_block(hidden)
    pdl = env.use_pdl(shared_output.device)
    if publish and (peer_ptrs is None or stage_state is None):
        raise ValueError("publishing needs peer_ptrs and stage_state")
    grid = (m, triton.cdiv(hidden, block))
    kernel = finalize_publish_kernel.warmup if compile_only else finalize_publish_kernel[grid]
    compiled = kernel(
        gemm2_permuted, expert_weights, idx, shared_output, partial,
        peer_ptrs if publish else partial, stage_state if publish else partial, rank, capacity,
        TP=peer_ptrs.numel() if publish else 1, TOP_K=idx.shape[1], HIDDEN=hidden, BLOCK_H=block,
        PUBLISH=publish, USE_PDL=pdl,
        num_warps=PUBLISH_WARPS, enable_fp_fusion=False, launch_pdl=pdl,
        **(dict(grid=grid) if compile_only else {}),
    )
    if compile_only:
        load_module(compiled)
    return partial
