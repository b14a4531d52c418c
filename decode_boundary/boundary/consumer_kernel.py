"""Consume: wait for every rank's partial in this rank's mailbox, reduce, and
apply mHC, RMSNorm and MXFP8 quantization in the same kernel (design.md §5-6).

Grid: (tokens, column chunks). Each program owns ``BLOCK_H`` columns of one
token: it waits for those columns of every rank's slot, sums them in rank
order, mixes the residual streams and writes ``residual_out`` for its columns,
then re-arms the slots it consumed. The RMSNorm needs the whole row, so with
the layer input requested each program also writes its BF16 ``prenorm``
columns to a scratch row and bumps a per-token counter; the program that
arrives last normalises (and quantizes) the full row. That keeps M = 1 spread
over H / BLOCK_H SMs without any program waiting for another program.

Modes (``MODE``): 0 = plain sum (``reduced`` only; the benchmark's baseline of
the fusion), 1 = residual-only (mHC mixing), 2 = full (mixing, collapse with
``pre``, RMSNorm, optional MXFP8). ``LAMPORT=False`` reads an already gathered
[tp, M, H] buffer (the NCCL fallback) with the same arithmetic.

The FP32 operation order is that of :mod:`.reference` (launch with
``enable_fp_fusion=False``): ``reduced`` and ``residual_out`` are bit-exact;
``layer_input`` may differ from the reference by 1 BF16 ulp (tree-ordered
length-H sum of squares, approximate ``rsqrt`` on the GPU); its MXFP8 bytes
equal ``quantize_mxfp8_ref`` of the kernel's own ``layer_input``.

**Memory consistency.** Mailbox slots are polled with volatile loads
(``ld.volatile``: not served from L1, so a peer's NVLink store becomes visible)
until no element is -0; every element is checked because a peer's 16-byte
store may land in pieces, and each element is its own flag, so no acquire is
needed before using it. ACTIVE is read with a plain load after the grid
dependency wait (the publisher's grid has completed). Re-arming the slots
(-0 stores) and advancing NEXT are plain stores: the next reader of either is
a later kernel on this GPU (kernel boundary), and a peer writes this stage
again only three boundaries later, after our later publishes, which follow this
kernel's completion in stream order. The last-program hand-off for the norm
uses ``debug_barrier`` + an ``acq_rel`` gpu-scope counter ``atomic_add`` (the
barrier makes every thread's scratch stores precede the release; the winner's
acquire + its threads' volatile loads see all chunks), then resets the counter
with a plain store read only by a later launch. The status word is set with an
``atomic_or`` (several programs may time out together).

**What the caller must guarantee.** Every rank publishes exactly once per
consume into stage NEXT (publish kernel, finalize kernel or a publishing GEMM)
and consumes once; residual, post, comb, pre and gamma are not written by the
kernel that immediately precedes this one and that kernel triggers its
dependents only after its own grid wait (they are loaded before the grid
dependency wait); output and scratch buffers are not in use by another kernel.

**Why it is CUDA-graph safe.** The stage is read and advanced on the device,
the counter is reset by the program that used it, the timeout and status live
in device memory; no host value changes between replays, and the grid depends
only on M, fixed per captured graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import env
from ..mxfp8.format import mxfp8_scale_bytes
from ..mxfp8.quantize_kernel import quantize_groups, swizzled_offset
from .publish_kernel import to_bf16_rne

PLAIN, RESIDUAL_ONLY, FULL = 0, 1, 2  # MODE values (host side)
_PLAIN, _FULL = tl.constexpr(PLAIN), tl.constexpr(FULL)
# (largest M, columns per program, warps). Small M spreads a token over more SMs;
# 256 columns per warp keep a thread's rank/stream rows in its own registers
# (8 contiguous BF16 = one 16-byte load each), so picking a row needs no shared memory.
CONSUMER_TACTICS = ((4, 512, 2), (1 << 30, 1024, 4))
SENTINEL = tl.constexpr(-32768)  # -0.0 in BF16 as int16


@triton.jit
def _bf16_bits_to_f32(bits):
    """Sign-extended int32 BF16 bits -> FP32 (exact)."""
    return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def _row(bits, idx, i):
    """Row ``i`` of 2-D integer ``bits`` [R, C] (rows indexed by ``idx``),
    picked by an integer sum so every bit, the sign of zero included, survives."""
    return tl.sum(tl.where(idx[:, None] == i, bits, 0), axis=0)


@triton.jit
def _now(spins, USE_PTX: tl.constexpr):
    """Nanoseconds from ``%globaltimer`` on the GPU; the spin count otherwise."""
    if USE_PTX:
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [],
                                         dtype=tl.int64, is_pure=False, pack=1)
    return spins.to(tl.int64)


@triton.jit
def _wait_slots(slot, smask, ranks, status_ptr, wait_bound, USE_PTX: tl.constexpr):
    """Volatile loads of ``slot`` [TP, BLOCK_H] until no element is -0 or the
    bound passes (or another program already reported a failure); a rank still
    missing then sets its bit in the status word. Returns int32 BF16 bits."""
    bits = tl.load(slot, mask=smask, other=0.0, volatile=True).to(tl.int16, bitcast=True)
    pending = tl.max(tl.where(smask & (bits == SENTINEL), 1, 0)) > 0
    if pending:
        spins = 0
        start = _now(spins, USE_PTX)
        go = pending
        while go:
            bits = tl.load(slot, mask=smask, other=0.0, volatile=True).to(tl.int16, bitcast=True)
            pending = tl.max(tl.where(smask & (bits == SENTINEL), 1, 0)) > 0
            spins += 1
            healthy = tl.load(status_ptr, volatile=True) == 0
            go = pending & healthy & ((_now(spins, USE_PTX) - start) <= wait_bound)
        if pending:
            missing = tl.max(tl.where(smask & (bits == SENTINEL), 1, 0), axis=1)
            tl.atomic_or(status_ptr, tl.sum(missing << ranks))
    return bits.to(tl.int32)


@triton.jit
def consumer_kernel(
    mailbox_ptr, stage_ptr, status_ptr, counter_ptr, prenorm_ptr,
    residual_ptr, post_ptr, comb_ptr, pre_ptr, gamma_ptr,
    out_ptr, layer_ptr, qdata_ptr, qscale_ptr,
    eps, capacity, wait_bound,
    TP: tl.constexpr, HC: tl.constexpr, HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_ROW: tl.constexpr,
    MODE: tl.constexpr, QUANT: tl.constexpr, LAMPORT: tl.constexpr,
    USE_PTX: tl.constexpr, USE_PDL: tl.constexpr,
):
    TP_P2: tl.constexpr = triton.next_power_of_2(TP)
    HC_P2: tl.constexpr = triton.next_power_of_2(HC)
    CHUNKS: tl.constexpr = (HIDDEN + BLOCK_H - 1) // BLOCK_H
    m = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < HIDDEN
    hcs = tl.arange(0, HC_P2)
    hmask = hcs < HC
    # Inputs that earlier kernels produced: load them while the publisher runs.
    if MODE != _PLAIN:
        res_off = (m * HC + hcs[:, None]).to(tl.int64) * HIDDEN + cols[None, :]
        res_mask = hmask[:, None] & cmask[None, :]
        res = tl.load(residual_ptr + res_off, mask=res_mask, other=0.0)
        res_bits = res.to(tl.int16, bitcast=True).to(tl.int32)
        post = tl.load(post_ptr + m * HC + hcs, mask=hmask, other=0.0)
        comb = tl.load(comb_ptr + m * HC * HC + hcs[:, None] * HC + hcs[None, :],
                       mask=hmask[:, None] & hmask[None, :], other=0.0)
        comb_bits = comb.to(tl.int32, bitcast=True)
    if MODE == _FULL:
        pre_bits = tl.load(pre_ptr + m * HC + hcs, mask=hmask, other=0.0).to(tl.int32, bitcast=True)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    stage = 0
    if LAMPORT:
        stage = tl.load(stage_ptr + 1)
    ranks = tl.arange(0, TP_P2)
    slot_row = ((stage * TP + ranks).to(tl.int64) * capacity + m) * HIDDEN
    slot = mailbox_ptr + slot_row[:, None] + cols[None, :]
    smask = (ranks[:, None] < TP) & cmask[None, :]
    if LAMPORT:
        bits = _wait_slots(slot, smask, ranks, status_ptr, wait_bound, USE_PTX)
        # Re-arm the consumed slots; the values are in registers now.
        tl.store(slot, tl.full([TP_P2, BLOCK_H], SENTINEL, tl.int16).to(tl.bfloat16, bitcast=True),
                 mask=smask)
        if (m == 0) & (chunk == 0):
            tl.store(stage_ptr, (stage + 1) % 3)
    else:
        bits = tl.load(slot, mask=smask, other=0.0).to(tl.int16, bitcast=True).to(tl.int32)

    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for r in tl.static_range(TP):
        acc = acc + _bf16_bits_to_f32(_row(bits, ranks, r))
    reduced = to_bf16_rne(acc)
    if MODE == _PLAIN:
        tl.store(out_ptr + m.to(tl.int64) * HIDDEN + cols, reduced, mask=cmask)
    else:
        # mixed[t] = reduced * post[t] + sum_s residual[s] * comb[s, t], s in order.
        mix = reduced.to(tl.float32)[None, :] * post[:, None]
        for s in tl.static_range(HC):
            comb_s = _row(comb_bits, hcs, s).to(tl.float32, bitcast=True)
            mix = mix + _bf16_bits_to_f32(_row(res_bits, hcs, s))[None, :] * comb_s[:, None]
        mixed = to_bf16_rne(mix)
        tl.store(out_ptr + res_off, mixed, mask=res_mask)
    if MODE == _FULL:
        mixed_bits = mixed.to(tl.int16, bitcast=True).to(tl.int32)
        pre_acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for t in tl.static_range(HC):
            pre_t = tl.sum(tl.where(hcs == t, pre_bits, 0)).to(tl.float32, bitcast=True)
            pre_acc = pre_acc + _bf16_bits_to_f32(_row(mixed_bits, hcs, t)) * pre_t
        row_off = m.to(tl.int64) * HIDDEN
        tl.store(prenorm_ptr + row_off + cols, to_bf16_rne(pre_acc), mask=cmask)
        tl.debug_barrier()  # every thread's prenorm stores precede the release below
        arrived = tl.atomic_add(counter_ptr + m, 1, sem="acq_rel", scope="gpu")
        if arrived == CHUNKS - 1:
            _norm_row(prenorm_ptr, gamma_ptr, layer_ptr, qdata_ptr, qscale_ptr, m, eps,
                      HIDDEN, BLOCK_ROW, QUANT)
            tl.store(counter_ptr + m, 0)


@triton.jit
def _norm_row(prenorm_ptr, gamma_ptr, layer_ptr, qdata_ptr, qscale_ptr, m, eps,
              HIDDEN: tl.constexpr, BLOCK_ROW: tl.constexpr, QUANT: tl.constexpr):
    """RMSNorm (and MXFP8) of token ``m``'s full prenorm row, by the last program."""
    GROUPS: tl.constexpr = BLOCK_ROW // 32
    cols = tl.arange(0, BLOCK_ROW)
    cmask = cols < HIDDEN
    row_off = m.to(tl.int64) * HIDDEN
    # Volatile: other programs wrote these through L2 during this launch.
    p = tl.load(prenorm_ptr + row_off + cols, mask=cmask, other=0.0, volatile=True).to(tl.float32)
    gamma = tl.load(gamma_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    mean_sq = tl.sum(p * p, axis=0) / HIDDEN
    rstd = tl.math.rsqrt(mean_sq + eps)
    y = to_bf16_rne((p * rstd) * gamma)
    tl.store(layer_ptr + row_off + cols, y, mask=cmask)
    if QUANT:
        K_TILES: tl.constexpr = (HIDDEN // 32 + 3) // 4
        q, exponent = quantize_groups(tl.reshape(y.to(tl.float32), (1, GROUPS, 32)))
        tl.store(qdata_ptr + row_off + cols, tl.reshape(q, (BLOCK_ROW,)), mask=cmask)
        groups = tl.arange(0, GROUPS)
        tl.store(qscale_ptr + swizzled_offset(m, groups, K_TILES),
                 tl.reshape(exponent, (GROUPS,)).to(tl.uint8), mask=groups < HIDDEN // 32)


def consumer_tactic(m: int, hidden: int) -> tuple[int, int]:
    """(columns per program, warps) for M tokens (table above)."""
    block, warps = next((b, w) for limit, b, w in CONSUMER_TACTICS if m <= limit)
    return min(block, triton.next_power_of_2(hidden)), warps


def _need(t, name, dtype, shape, device):
    if t is None:
        raise ValueError(f"{name} is required here: expected {dtype} {list(shape)}")
    if t.dtype != dtype or tuple(t.shape) != tuple(shape) or t.device != device:
        raise ValueError(f"{name} must be {dtype} {list(shape)} on {device}, got {t.dtype} "
                         f"{list(t.shape)} on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def consume(
    mailbox: torch.Tensor,
    tp: int,
    m: int,
    *,
    mode: int,
    stage_state: torch.Tensor | None = None,
    status: torch.Tensor | None = None,
    counter: torch.Tensor | None = None,
    prenorm: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    post: torch.Tensor | None = None,
    comb: torch.Tensor | None = None,
    pre: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    mxfp8_out: tuple[torch.Tensor, torch.Tensor] | None = None,
    wait_bound: int = 0,
    lamport: bool = True,
    tactic: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the consumer for ``m`` tokens. Returns (``reduced`` [M, H] in plain
    mode / ``residual_out`` [M, hc, H], ``layer_input`` [M, H] or None).

    ``mailbox``: BF16 [3, tp, capacity, H] (Lamport) or [tp, M, H] (gathered).
    ``wait_bound``: nanoseconds with PTX (``%globaltimer``), spins without.
    ``tactic``: (columns per program, warps), default from ``CONSUMER_TACTICS``.
    """
    device = mailbox.device
    hidden = mailbox.shape[-1]
    if mailbox.dtype != torch.bfloat16 or not mailbox.is_contiguous():
        raise ValueError(f"mailbox must be contiguous bf16, got {mailbox.dtype}")
    capacity = mailbox.shape[-2]
    if lamport:
        _need(mailbox, "mailbox", torch.bfloat16, (3, tp, capacity, hidden), device)
        _need(stage_state, "stage_state", torch.int32, (2,), device)
        _need(status, "status", torch.int32, (1,), device)
    else:
        _need(mailbox, "mailbox", torch.bfloat16, (tp, m, hidden), device)
    if not 0 < m <= capacity:
        raise ValueError(f"M = {m} must be in [1, capacity = {capacity}]")
    if mode == PLAIN:
        out = torch.empty(m, hidden, dtype=torch.bfloat16, device=device)
        hc = 1
    else:
        if residual is None or residual.ndim != 3:
            raise ValueError(f"residual must be bf16 [{m}, hc, {hidden}]")
        hc = residual.shape[1]
        _need(residual, "residual", torch.bfloat16, (m, hc, hidden), device)
        _need(post, "post", torch.float32, (m, hc), device)
        _need(comb, "comb", torch.float32, (m, hc, hc), device)
        out = torch.empty(m, hc, hidden, dtype=torch.bfloat16, device=device)
    layer_input = None
    quant = mxfp8_out is not None
    if mode == FULL:
        _need(pre, "pre", torch.float32, (m, hc), device)
        _need(norm_weight, "norm_weight", torch.bfloat16, (hidden,), device)
        # Scratch rows: at least one per token (the mailbox capacity in Lamport mode).
        rows = counter.shape[0] if counter is not None else 0
        _need(counter, "counter", torch.int32, (max(rows, m),), device)
        _need(prenorm, "prenorm scratch", torch.bfloat16, (rows, hidden), device)
        layer_input = torch.empty(m, hidden, dtype=torch.bfloat16, device=device)
        if quant:
            if hidden % 32:
                raise ValueError(f"MXFP8 output needs hidden % 32 == 0, got {hidden}")
            data, scale = mxfp8_out
            _need(data, "mxfp8_out data", torch.float8_e4m3fn, (m, hidden), device)
            need = mxfp8_scale_bytes(m, hidden)
            if (scale.dtype != torch.uint8 or scale.ndim != 1 or scale.numel() < need
                    or scale.device != device or not scale.is_contiguous()):
                raise ValueError(f"mxfp8_out scale must be contiguous 1-D uint8 with >= {need} "
                                 f"bytes on {device} (128x4 swizzled for [{m}, {hidden}])")
    elif quant:
        raise ValueError("mxfp8_out needs the layer input: pass pre and norm_weight")
    block, warps = tactic or consumer_tactic(m, hidden)
    dummy = out  # stands in for pointers a mode does not touch
    pdl = env.use_pdl(device)
    consumer_kernel[(m, triton.cdiv(hidden, block))](
        mailbox, _or(stage_state, dummy), _or(status, dummy), _or(counter, dummy),
        _or(prenorm, dummy), _or(residual, dummy), _or(post, dummy), _or(comb, dummy),
        _or(pre, dummy), _or(norm_weight, dummy), out, _or(layer_input, dummy),
        mxfp8_out[0] if quant else dummy, mxfp8_out[1] if quant else dummy,
        float(eps), capacity, int(wait_bound),
        TP=tp, HC=hc, HIDDEN=hidden, BLOCK_H=block,
        BLOCK_ROW=triton.next_power_of_2(hidden), MODE=mode, QUANT=quant, LAMPORT=lamport,
        USE_PTX=env.use_ptx(device), USE_PDL=pdl,
        num_warps=warps, enable_fp_fusion=False, launch_pdl=pdl,
    )
    return out, layer_input


def _or(t, default):
    return default if t is None else t
