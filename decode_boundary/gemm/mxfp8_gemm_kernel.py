"""The low-latency MXFP8 GEMM (Triton, Hopper): ``out = a @ weight`` with an
optional epilogue that publishes ``out`` into the boundary mailbox.

**Product.** Hopper has no block-scaled MMA, so each e4m3 operand is upcast to
BF16 *times its power-of-two group scale*: e4m3 has 4 significant bits, so
``e4m3 * 2^(byte - 127)`` is exact in BF16 whenever it is a normal BF16 number,
i.e. for scale bytes 10..246 (byte 0, the scale of an all-zero group, is read
as 0; results below 2^-126 flush, above 2^128 overflow). The BF16 ``tl.dot``
accumulates in FP32 over K-blocks of ``block_k`` >= 128. Computed transposed,
``out^T[BLOCK_N, ROWS] = W[BLOCK_N, BLOCK_K] . A^T[BLOCK_K, ROWS]``: the weight
is the dot's M side and streams; the few activation rows are the N side.

**Layout contract** (the launcher checks it, the kernel assumes it): weight
e4m3 [N, K] K-contiguous (the column-major [K, N] view's storage), scales 1-D
128x4-swizzled over (N, K/32) and (M, K/32); activations e4m3 [M, K]
contiguous; out BF16 [M, N] contiguous; N % block_n == 0, K % 32 == 0; every
pointer 16-byte aligned (also what Triton specializes on: precompile relies
on it).

**Deterministic split-K.** ``split_k`` CTAs per output block each own a
contiguous range of K-blocks and store FP32 partials to a workspace. Each
then arrives on the block's int32 counter (partials of rows >= M are
neither stored nor read: at M = 1 a split moves 1/16 of the tile) (integer ``atomic_add``, acq_rel,
GPU scope, after a CTA barrier so all its threads' stores are ordered before
the release). The CTA that sees ``split_k - 1`` sums the partials in split
order 0..S-1 (so the bits do not depend on who arrives last), writes the
block and stores 0 to the counter: the next launch (stream order, or its
grid wait under PDL) finds it re-armed, which is what CUDA-graph replay needs.
No float atomics. What must not race: two launches sharing a workspace
concurrently (different streams); stream order or the PDL grid wait
serializes launches on one stream, because nothing is written before it.

**Main-loop structure** (``tactic.num_stages``). 0: register
double-buffering, block kb+1's weight loads issued before block kb's dot and
the first block loaded before the PDL wait. >= 2: ``tl.range(num_stages=S)``,
Triton's software pipeline (S - 1 K-blocks in flight through shared memory);
its prologue runs after the PDL wait. A "row-owner" tactic (small
``block_n``, split_k 1..4) streams long contiguous runs of BLOCK_N rows x its
K range; both structures compute the same sums in the same order.

**PDL.** Before ``gdc_wait`` the CTA only reads its weight and weight scales
(with num_stages 0 the first K-block into registers; with USE_PTX and
``prefetch`` its slice is prefetched into L2), which the previous kernel must
not write. Then it
releases its dependents and waits; activations, workspace, counters, the
stage word and every store come after the wait.

**Publishing epilogue** (PUBLISH; the boundary's mailbox, CONTRACTS.md). The
one CTA that writes an output block (after the split-K reduction, so each
value is published once) reads ``s = stage_state[NEXT]`` after its grid wait
(a volatile load: the previous consumer's advance is visible and the load is
not hoisted above the wait), and stores the same BF16 bits with -0 turned
into +0 (0x8000 is the consumer's "not yet written") to
``mailbox_p[s, RANK, m, col]`` of every peer p, itself included; ``cols``
are ``block_n``-aligned runs, so the stores vectorize to 16 bytes. The
writer of output block (0, 0) stores ``stage_state[ACTIVE] = s`` after its
own stores; the consumer, the PDL dependent, reads ACTIVE and the mailbox
only after this whole grid completed, so no other ordering is needed. TP,
RANK, CAPACITY and HIDDEN are compile-time constants (a publisher serves one
mailbox for its lifetime); the peer addresses are read at run time from the
``peer_ptrs`` int64 table.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from decode_boundary.boundary.publish_kernel import publish_row
from decode_boundary.env import interpret_mode, use_pdl, use_ptx
from decode_boundary.mxfp8.format import QuantizedActivation, mxfp8_scale_bytes
from decode_boundary.mxfp8.quantize_kernel import swizzled_offset, to_bf16_rne

from .tactics import fits


@triton.jit
def _load_block(ptr, scale_ptr, rows, row_mask, kb, K_GROUPS, K_TILES, BLOCK_K: tl.constexpr, K):
    """e4m3 [R, BLOCK_K/32, 32] elements and uint8 [R, BLOCK_K/32] scales of
    K-block ``kb`` of rows ``rows`` (groups past K and masked rows read 0)."""
    g = kb * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
    mask = row_mask[:, None] & (g[None, :] < K_GROUPS)
    e = tl.arange(0, 32)
    offs = rows[:, None, None].to(tl.int64) * K + g[None, :, None] * 32 + e[None, None, :]
    x = tl.load(ptr + offs, mask=mask[:, :, None], other=0.0)
    s = tl.load(scale_ptr + swizzled_offset(rows[:, None], g[None, :], K_TILES), mask=mask, other=0)
    return x, s


@triton.jit
def _upcast(x, s, R: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETER: tl.constexpr):
    """BF16 [R, BLOCK_K] of e4m3 ``x`` times 2^(s - 127): exact (module docstring).

    The interpreter's ``tl.dot`` multiplies BF16 *bit patterns* as integers, so
    there the operands stay FP32: the same (exact) values, FP32 products and sums.
    """
    scale = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    v = x.to(tl.float32) * scale[:, :, None]
    if not INTERPRETER:
        v = v.to(tl.bfloat16)
    return tl.reshape(v, (R, BLOCK_K))


@triton.jit
def _mma(acc, w, ws, a, sa, BLOCK_N: tl.constexpr, ROWS_TILE: tl.constexpr,
         BLOCK_K: tl.constexpr, INTERPRETER: tl.constexpr):
    """acc [BLOCK_N, ROWS_TILE] += upcast(w) . upcast(a)^T (one K-block)."""
    w_bf16 = _upcast(w, ws, BLOCK_N, BLOCK_K, INTERPRETER)
    a_bf16 = _upcast(a, sa, ROWS_TILE, BLOCK_K, INTERPRETER)
    return tl.dot(w_bf16, tl.trans(a_bf16), acc)


@triton.jit
def _prefetch_slice(w_ptr, cols, kb0, first, PER_SPLIT: tl.constexpr, BLOCK_K: tl.constexpr,
                    K: tl.constexpr, USE_PTX: tl.constexpr, PREFETCH: tl.constexpr):
    """Prefetch K-blocks kb0+first .. kb0+PER_SPLIT-1 of rows ``cols`` into L2,
    one ``prefetch.global.L2`` per 128-byte line (inline PTX: only with USE_PTX
    and PREFETCH), so the main loop's loads hit L2 while the previous kernel
    finishes."""
    if USE_PTX and PREFETCH:
        for step in range(first, PER_SPLIT):
            kb = kb0 + step
            line = tl.minimum(kb * BLOCK_K + tl.arange(0, BLOCK_K // 128) * 128, K - 32)
            addr = (w_ptr + cols[:, None].to(tl.int64) * K + line[None, :]).to(tl.int64)
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [addr],
                                      dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _write_block(vals, out_ptr, rows, cols, M, N: tl.constexpr, is_first_block,
                 peer_ptrs_ptr, stage_ptr, PUBLISH: tl.constexpr, TP: tl.constexpr,
                 RANK: tl.constexpr, CAPACITY: tl.constexpr, HIDDEN: tl.constexpr,
                 INTERPRETER: tl.constexpr):
    """Store FP32 ``vals`` [BLOCK_N, ROWS] (out^T) as BF16; publish when PUBLISH."""
    out = to_bf16_rne(vals, not INTERPRETER)  # cvt.rn on the GPU
    mask = rows[None, :] < M
    tl.store(out_ptr + rows[None, :].to(tl.int64) * N + cols[:, None], out, mask=mask)
    if PUBLISH:
        stage = tl.load(stage_ptr, volatile=True)
        publish_row(out, peer_ptrs_ptr, stage, RANK, rows[None, :], cols[:, None], mask,
                    CAPACITY, TP=TP, HIDDEN=HIDDEN, TILE=True)
        if is_first_block:
            tl.store(stage_ptr + 1, stage)


@triton.jit(do_not_specialize=["M"])
def mxfp8_gemm_kernel(
    w_ptr, w_scale_ptr, a_ptr, a_scale_ptr, out_ptr,
    partial_ptr, counter_ptr, peer_ptrs_ptr, stage_ptr,
    M,
    N: tl.constexpr, K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS_TILE: tl.constexpr,
    SPLIT_K: tl.constexpr, PREFETCH: tl.constexpr, NUM_STAGES: tl.constexpr,
    USE_PTX: tl.constexpr, USE_PDL: tl.constexpr, INTERPRETER: tl.constexpr,
    PUBLISH: tl.constexpr, TP: tl.constexpr, RANK: tl.constexpr,
    CAPACITY: tl.constexpr, HIDDEN: tl.constexpr,
):
    K_GROUPS: tl.constexpr = K // 32
    K_TILES: tl.constexpr = (K_GROUPS + 3) // 4
    K_BLOCKS: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    PER_SPLIT: tl.constexpr = (K_BLOCKS + SPLIT_K - 1) // SPLIT_K
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    # Every split runs PER_SPLIT steps (a compile-time trip count); steps past
    # K_BLOCKS (the last split when SPLIT_K does not divide it) load zeros.
    kb0 = pid_k * PER_SPLIT
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    all_cols = cols < N  # N % BLOCK_N == 0: a mask of the right shape, always true

    rows = pid_m * ROWS_TILE + tl.arange(0, ROWS_TILE)
    row_mask = rows < M
    acc = tl.zeros((BLOCK_N, ROWS_TILE), dtype=tl.float32)
    if NUM_STAGES == 0:
        # Independent of the previous kernel: this CTA's first weight block ...
        w, ws = _load_block(w_ptr, w_scale_ptr, cols, all_cols & (kb0 < K_BLOCKS), kb0,
                            K_GROUPS, K_TILES, BLOCK_K, K)
        _prefetch_slice(w_ptr, cols, kb0, 1, PER_SPLIT, BLOCK_K, K, USE_PTX, PREFETCH)
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        for step in range(PER_SPLIT):
            kb = kb0 + step
            # Register double-buffering: issue block kb+1's weight loads before
            # block kb's dot, so one block is always in flight behind the math.
            has_next = (step + 1 < PER_SPLIT) & (kb + 1 < K_BLOCKS)
            w_next, ws_next = _load_block(w_ptr, w_scale_ptr, cols, all_cols & has_next,
                                          kb + 1, K_GROUPS, K_TILES, BLOCK_K, K)
            a, sa = _load_block(a_ptr, a_scale_ptr, rows, row_mask, kb, K_GROUPS, K_TILES,
                                BLOCK_K, K)
            acc = _mma(acc, w, ws, a, sa, BLOCK_N, ROWS_TILE, BLOCK_K, INTERPRETER)
            w, ws = w_next, ws_next
    else:
        # Triton's software pipeline (NUM_STAGES - 1 K-blocks in flight through
        # shared memory). Its prologue sits after the PDL wait, so before it the
        # CTA only prefetches its whole slice into L2.
        _prefetch_slice(w_ptr, cols, kb0, 0, PER_SPLIT, BLOCK_K, K, USE_PTX, PREFETCH)
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        for step in tl.range(PER_SPLIT, num_stages=NUM_STAGES):
            kb = kb0 + step
            w, ws = _load_block(w_ptr, w_scale_ptr, cols, all_cols & (kb < K_BLOCKS), kb,
                                K_GROUPS, K_TILES, BLOCK_K, K)
            a, sa = _load_block(a_ptr, a_scale_ptr, rows, row_mask, kb, K_GROUPS, K_TILES,
                                BLOCK_K, K)
            acc = _mma(acc, w, ws, a, sa, BLOCK_N, ROWS_TILE, BLOCK_K, INTERPRETER)

    is_first_block = (pid_n == 0) & (pid_m == 0)
    if SPLIT_K == 1:
        _write_block(acc, out_ptr, rows, cols, M, N, is_first_block, peer_ptrs_ptr, stage_ptr,
                     PUBLISH, TP, RANK, CAPACITY, HIDDEN, INTERPRETER)
    else:
        # Workspace: FP32 [blocks, SPLIT_K, ROWS_TILE, BLOCK_N], one tile per split.
        block = pid_m * (N // BLOCK_N) + pid_n
        tile = tl.arange(0, ROWS_TILE)[None, :] * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
        partials = partial_ptr + (block * SPLIT_K).to(tl.int64) * (ROWS_TILE * BLOCK_N)
        real = row_mask[None, :]  # rows past M: neither stored nor read back
        tl.store(partials + pid_k * (ROWS_TILE * BLOCK_N) + tile, acc, mask=real)
        tl.debug_barrier()  # every thread's partial precedes the release below
        arrived = tl.atomic_add(counter_ptr + block, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            tl.debug_barrier()  # the acquire (one thread) covers the whole CTA's reads
            # .cg: read at L2, where the other CTAs' partials are.
            total = tl.load(partials + tile, mask=real, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                total += tl.load(partials + s * (ROWS_TILE * BLOCK_N) + tile, mask=real,
                                 other=0.0, cache_modifier=".cg")
            tl.store(counter_ptr + block, 0)  # re-armed for the next launch / graph replay
            _write_block(total, out_ptr, rows, cols, M, N, is_first_block, peer_ptrs_ptr,
                         stage_ptr, PUBLISH, TP, RANK, CAPACITY, HIDDEN, INTERPRETER)


# ``publish`` arguments below: any object with the attributes of
# ``decode_boundary.boundary.all_reduce.PublishTarget`` (CONTRACTS.md, Mailbox):
# ``peer_ptrs`` int64 [tp] mailbox base addresses (16-byte aligned) and
# ``stage_state`` int32 [2] = {NEXT, ACTIVE}, both on the GEMM's device, and
# ``rank``, ``tp``, ``capacity``, ``hidden`` (== the GEMM's N) of the BF16
# mailboxes [3, tp, capacity, hidden].
NO_PUBLISH = SimpleNamespace(peer_ptrs=None, stage_state=None, rank=0, tp=1, capacity=1, hidden=1)
ENABLE_FP_FUSION = False  # every launch and warmup alike (part of the compiled kernel's key)
_WORKSPACES: dict[tuple[torch.device, int], torch.Tensor] = {}
_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}
_DUMMIES: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def weight_operands(layer) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(e4m3 [N, K] storage, swizzled scales, N, K) of ``layer``, checked."""
    weight, scale = layer.weight, layer.weight_scale
    if weight.dtype != torch.float8_e4m3fn or weight.ndim != 2:
        raise ValueError(f"layer.weight must be a 2-D float8_e4m3fn [K, N] view, got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    k, n = weight.shape
    storage = weight.t()
    if not storage.is_contiguous():
        raise ValueError("layer.weight must be the column-major [K, N] view of a contiguous "
                         "[N, K] tensor (layer.weight.t().is_contiguous())")
    need = mxfp8_scale_bytes(n, k)
    if scale.dtype != torch.uint8 or scale.ndim != 1 or scale.numel() < need or \
            not scale.is_contiguous():
        raise ValueError(f"layer.weight_scale must be contiguous 1-D uint8 with >= {need} bytes "
                         f"(128x4 swizzled over ({n}, {k // 32})), got {scale.dtype} "
                         f"{tuple(scale.shape)}")
    return storage, scale, n, k


def _aligned(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.data_ptr() % 16:
            raise ValueError(f"GEMM operands must be 16-byte aligned; got {t.dtype} "
                             f"{tuple(t.shape)} at {t.data_ptr():#x}")


def _cached(cache: dict, device: torch.device, nbytes: int, make) -> torch.Tensor:
    """A buffer of >= nbytes for ``device``, sized to a power of two and kept
    forever (a captured graph may hold it); never allocated during capture."""
    size = max(4096, 1 << (nbytes - 1).bit_length())
    key = (device, size)
    buf = cache.get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("MXFP8 GEMM workspace missing during CUDA graph capture: call "
                               "decode_boundary.gemm.precompile(layer, rows) before capturing")
        buf = cache[key] = make(size, device)
    return buf


def _buffers(device: torch.device, n: int, rows: int, tactic, publish=None):
    """(partials, counters, peer_ptrs, stage_state) arguments of one launch."""
    if device not in _DUMMIES:
        _DUMMIES[device] = (torch.zeros(4, dtype=torch.float32, device=device),
                            torch.zeros(2, dtype=torch.int64, device=device),
                            torch.zeros(2, dtype=torch.int32, device=device))
    partials, peer_ptrs, stage_state = _DUMMIES[device]
    counters = _DUMMIES[device][2]
    if tactic.split_k > 1:
        m_tiles = -(-rows // tactic.rows_tile)
        nbytes = m_tiles * n * tactic.rows_tile * tactic.split_k * 4
        partials = _cached(_WORKSPACES, device, nbytes,
                           lambda size, d: torch.empty(size // 4, dtype=torch.float32, device=d))
        counters = _cached(_COUNTERS, device, m_tiles * (n // tactic.block_n) * 4,
                           lambda size, d: torch.zeros(size // 4, dtype=torch.int32, device=d))
    if publish is not None:
        peer_ptrs, stage_state = publish.peer_ptrs, publish.stage_state
    return partials, counters, peer_ptrs, stage_state


def _check_publish(publish, n: int, rows: int, device: torch.device) -> None:
    p = publish
    if p.peer_ptrs.dtype != torch.int64 or tuple(p.peer_ptrs.shape) != (p.tp,) or \
            p.peer_ptrs.device != device:
        raise ValueError(f"publish.peer_ptrs must be int64 [{p.tp}] on {device}, got "
                         f"{p.peer_ptrs.dtype} {tuple(p.peer_ptrs.shape)} on {p.peer_ptrs.device}")
    if p.stage_state.dtype != torch.int32 or tuple(p.stage_state.shape) != (2,) or \
            p.stage_state.device != device:
        raise ValueError(f"publish.stage_state must be int32 [2] on {device}, got "
                         f"{p.stage_state.dtype} {tuple(p.stage_state.shape)}")
    if not 0 <= p.rank < p.tp:
        raise ValueError(f"publish.rank {p.rank} outside [0, {p.tp})")
    if p.hidden != n or n % 8:
        raise ValueError(f"publish.hidden ({p.hidden}) must equal the GEMM's N ({n}), "
                         "a multiple of 8")
    if rows > p.capacity:
        raise ValueError(f"{rows} rows exceed the mailbox capacity {p.capacity}")


def _launch_config(layer, a_data, a_scale, out, tactic, publish):
    """(grid, positional args, keyword args) shared by launch and warmup, so a
    warmed-up kernel is exactly the one a launch looks up."""
    storage, w_scale, n, k = weight_operands(layer)
    rows = a_data.shape[0]
    device = storage.device
    if a_data.dtype != torch.float8_e4m3fn or tuple(a_data.shape) != (rows, k) or \
            not a_data.is_contiguous():
        raise ValueError(f"activation data must be contiguous float8_e4m3fn [rows, {k}], got "
                         f"{a_data.dtype} {tuple(a_data.shape)}")
    need = mxfp8_scale_bytes(rows, k)
    if a_scale.dtype != torch.uint8 or a_scale.ndim != 1 or a_scale.numel() < need:
        raise ValueError(f"activation scale must be 1-D uint8 with >= {need} bytes, got "
                         f"{a_scale.dtype} {tuple(a_scale.shape)}")
    if out.dtype != torch.bfloat16 or tuple(out.shape) != (rows, n) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous bfloat16 [{rows}, {n}], got {out.dtype} "
                         f"{tuple(out.shape)}")
    if not fits(tactic, n, k):
        raise ValueError(f"tactic {tactic} is not valid for N={n}, K={k}, rows={rows}")
    if any(t.device != device for t in (a_data, a_scale, out)):
        raise ValueError(f"weight, activations and out must share one device ({device})")
    _aligned(storage, w_scale, a_data, a_scale, out)
    if publish is not None:
        _check_publish(publish, n, rows, device)
    buffers = _buffers(device, n, rows, tactic, publish)
    grid = (n // tactic.block_n, tactic.split_k, -(-rows // tactic.rows_tile))
    pub = publish or NO_PUBLISH
    kwargs = dict(
        N=n, K=k, BLOCK_N=tactic.block_n, BLOCK_K=tactic.block_k, ROWS_TILE=tactic.rows_tile,
        SPLIT_K=tactic.split_k, PREFETCH=tactic.prefetch, NUM_STAGES=tactic.num_stages,
        USE_PTX=use_ptx(device),
        USE_PDL=use_pdl(device), INTERPRETER=interpret_mode(), PUBLISH=publish is not None,
        TP=pub.tp, RANK=pub.rank, CAPACITY=pub.capacity, HIDDEN=pub.hidden,
        num_warps=tactic.num_warps, num_stages=max(1, tactic.num_stages),
        launch_pdl=use_pdl(device), enable_fp_fusion=ENABLE_FP_FUSION,
    )
    return grid, (storage, w_scale, a_data, a_scale, out, *buffers, rows), kwargs


def launch_low_latency(layer, a: QuantizedActivation, out: torch.Tensor, tactic,
                       publish=None) -> torch.Tensor:
    """``out`` [rows, N] (BF16) = ``a`` (MXFP8 [rows, K]) @ ``layer.weight`` with
    ``tactic`` on the current stream; with ``publish``, also into the mailbox
    (module docstring). ``a.data`` must be 2-D [rows, K]."""
    grid, args, kwargs = _launch_config(layer, a.data, a.scale, out, tactic, publish)
    if args[-1]:
        mxfp8_gemm_kernel[grid](*args, **kwargs)
    return out


def warmup_low_latency(layer, rows: int, tactic, publish=None):
    """Compile (launch nothing) the kernel ``launch_low_latency`` runs for
    ``rows`` rows and ``tactic``, and allocate its workspace; returns the
    compiled kernel (None in the interpreter). Peer addresses are checked here,
    outside any capture: a host read of the table would synchronize."""
    storage, _, n, k = weight_operands(layer)
    device = storage.device
    a_data = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=device)
    a_scale = torch.empty(mxfp8_scale_bytes(rows, k), dtype=torch.uint8, device=device)
    out = torch.empty(rows, n, dtype=torch.bfloat16, device=device)
    if publish is not None and any(ptr % 16 for ptr in publish.peer_ptrs.tolist()):
        raise ValueError("publish.peer_ptrs must hold 16-byte aligned mailbox addresses")
    grid, args, kwargs = _launch_config(layer, a_data, a_scale, out, tactic, publish)
    return mxfp8_gemm_kernel.warmup(*args, grid=grid, **kwargs)
