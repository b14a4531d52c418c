"""The low-row MXFP8 GEMM (Triton, Hopper): ``out = a @ weight``, optionally
grouped (``wo_a``), optionally quantizing BF16 activations in its prologue,
optionally publishing ``out`` into the boundary mailbox from its epilogue.

**Structure: weight-row owners, everything in flight at once.** A program owns
``BLOCK_N`` weight rows (output columns) and a contiguous K-slice of them
(the whole K unless ``SPLIT_K`` > 1). Before the PDL grid wait it issues
*every* load of that slice (e4m3 bytes and scale bytes) into registers, in
16-byte vectors: the slice is cut into PIECES (<= 8) pieces of CHUNK elements
(a power of two: ``tl.arange`` needs one), the last one masked at the slice's
end, each held in its own variable (a loop would serialize them). Nothing it
loads there is written by the previous kernel, so the weight stream overlaps
the previous kernel's tail. Many small programs (wo_b at M = 1: 640 of 8 rows x
2048) keep enough bytes in flight per SM; no shared memory, no software pipeline.

**Two products, one per row range** (``ROWS``, the activation tile):

* ``ROWS`` <= 8, CUDA cores: for each activation row, the unscaled e4m3
  products summed per 32-group in FP32 (exact products, as the reference),
  then the groups weighted by both scales and summed. The activation row is a
  1-D vector broadcast over the weight rows, so only it changes layout.
* ``ROWS`` >= 16, tensor cores: both operands upcast exactly to BF16 (e4m3 has
  4 significant bits, so ``e4m3 * 2^(byte-127)`` is a BF16 number for scale
  bytes 10..246) and one ``tl.dot`` per piece, FP32 accumulation, computed
  transposed ``out^T[BLOCK_N, ROWS] = W . A^T`` (the weight streams on the
  dot's M side). In the interpreter the operands stay FP32 (its BF16 dot is
  wrong, design.md §8.1): the same exact values.

Every product of two scaled e4m3 values is exact in FP32 (8 significant bits),
so products need no fixed rounding point; the only roundings are the FP32
sums, whose order is fixed by the tactic (``BLOCK_N``, ``ROWS``, ``SPLIT_K``,
``num_warps``) and K: the same bits on every run, and fused (publishing) and
plain launches of one tactic are bit-identical.

**BF16 activations** (``A_BF16``): each program quantizes the activation
columns of its slice with ``quantize_groups``, the quantizer kernel's own
device function, so its e4m3 bytes and exponents equal ``quantize_mxfp8``'s
and the output equals quantize-then-GEMM bit for bit.

**Grouped** (``GROUPS`` > 1, ``wo_a``): the weight is the row-stack of the
groups' [N/G, K] weights (scales swizzled over (N, K/32)), activations are
[M, G*K] with group g in columns [g*K, (g+1)*K), and out [M, N] is the
concatenation of the groups' outputs. A program's columns lie in one group
(``(N/G) % BLOCK_N == 0``).

**Layout contract** (the launcher checks it, the kernel assumes it): weight
e4m3 [N, K] K-contiguous (the column-major [K, N] view's storage), scales 1-D
128x4-swizzled; activations contiguous [M, G*K] (e4m3 + swizzled scales over
(M, G*K/32), or BF16); out BF16 [M, N] contiguous; K % 32 == 0; every pointer
16-byte aligned.

**Deterministic split-K** (``SPLIT_K`` > 1, only where too few programs would
otherwise stream a short weight). Each split stores its FP32 partial tile to a
workspace and arrives on the block's int32 counter (integer ``atomic_add``,
acq_rel, GPU scope, after a CTA barrier so all threads' stores precede the
release). The program that sees ``SPLIT_K - 1`` sums the partials in split
order 0..S-1 (bits independent of who arrives last), writes the block and
stores 0 to the counter, re-armed for the next launch or graph replay. No
float atomics. Must not race with another launch sharing the workspace on a
different stream; on one stream, order or the PDL wait serializes them.

**PDL.** Before ``gdc_wait`` a program reads only weights and weight scales.
It then releases its dependents and waits; activations, workspace, counters,
the stage word and every store come after the wait.

**Publishing epilogue** (PUBLISH; the mailbox of CONTRACTS.md). The program
that writes an output block (after any split-K reduction, so each value is
published once) reads ``s = stage_state[NEXT]`` after its grid wait (volatile:
the previous consumer's advance is visible and the load is not hoisted above
the wait) and stores the same BF16 bits, -0 turned into +0, to
``mailbox_p[s, RANK, m, col]`` of every peer p through ``publish_row``
(16-byte stores: ``BLOCK_N`` >= 8). The writer of block (0, 0) stores
``stage_state[ACTIVE] = s`` after its own stores; the consumer, the PDL
dependent, reads ACTIVE and the mailbox only after this grid completed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from decode_boundary.common.contract import NO_PUBLISH, check_publish_target
from decode_boundary.common.mailbox_store import publish_row
from decode_boundary.common.rounding import quantize_groups, swizzled_offset, to_bf16_rne
from decode_boundary.env import interpret_mode, use_pdl
from decode_boundary.mxfp8.format import QuantizedActivation, check_scale_buffer, mxfp8_scale_bytes

from .tactics import Tactic, fits, k_pieces


@triton.jit
def _exp2(byte):
    """2^(byte - 127) as FP32 (byte 0, the scale of an all-zero group, reads 0)."""
    return (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _load_weight(w_ptr, ws_ptr, cols, k0, k_end, CH: tl.constexpr, K: tl.constexpr,
                 K_TILES: tl.constexpr):
    """e4m3 [BLOCK_N, CH] and scale bytes [BLOCK_N, CH/32] of weight rows
    ``cols``, K from ``k0`` (groups at or past ``k_end`` read 0)."""
    k = k0 + tl.arange(0, CH)
    g = k0 // 32 + tl.arange(0, CH // 32)
    w = tl.load(w_ptr + cols[:, None].to(tl.int64) * K + k[None, :], mask=(k < k_end)[None, :],
                other=0.0)
    s = tl.load(ws_ptr + swizzled_offset(cols[:, None], g[None, :], K_TILES),
                mask=(g * 32 < k_end)[None, :], other=0)
    return w, s


@triton.jit
def _scaled(x, scale, R: tl.constexpr, CH: tl.constexpr):
    """FP32 [R, CH] of values ``x`` [R, CH] times their group scales [R, CH/32] (exact)."""
    v = tl.reshape(x.to(tl.float32), (R, CH // 32, 32)) * _exp2(scale)[:, :, None]
    return tl.reshape(v, (R, CH))


@triton.jit
def _load_activation(a_ptr, as_ptr, rows, row_live, a_k0, k0, k_end, CH: tl.constexpr,
                     A_K: tl.constexpr, A_K_TILES: tl.constexpr, A_BF16: tl.constexpr,
                     HARDWARE: tl.constexpr):
    """FP32 values [R, CH] and UE8M0 exponents [R, CH/32] of activation rows
    ``rows`` [R], weight K from ``k0`` (activation column ``a_k0 + k``); with
    ``A_BF16`` quantized here exactly as ``quantize_mxfp8`` does."""
    R: tl.constexpr = rows.shape[0]
    k = k0 + tl.arange(0, CH)
    g = k0 // 32 + tl.arange(0, CH // 32)
    live = row_live[:, None] & (k < k_end)[None, :]
    offs = rows[:, None].to(tl.int64) * A_K + a_k0 + k[None, :]
    if A_BF16:
        x = tl.load(a_ptr + offs, mask=live, other=0.0).to(tl.float32)
        q, exponent = quantize_groups(tl.reshape(x, (R, CH // 32, 32)), HARDWARE)
        q = tl.reshape(q, (R, CH))
    else:
        q = tl.load(a_ptr + offs, mask=live, other=0.0)
        exponent = tl.load(as_ptr + swizzled_offset(rows[:, None], a_k0 // 32 + g[None, :],
                                                    A_K_TILES),
                           mask=row_live[:, None] & (g * 32 < k_end)[None, :], other=0)
        exponent = exponent.to(tl.int32)
    return q.to(tl.float32), exponent


@triton.jit
def _chunk(acc, w, ws, a_ptr, as_ptr, row0, M, a_k0, k0, k_end,
           CH: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
           A_K: tl.constexpr, A_K_TILES: tl.constexpr, A_BF16: tl.constexpr,
           INTERPRETER: tl.constexpr):
    """acc [BLOCK_N, ROWS] += W_chunk . A_chunk^T (module docstring: the products)."""
    if ROWS >= 16:
        rows = row0 + tl.arange(0, ROWS)
        a, sa = _load_activation(a_ptr, as_ptr, rows, rows < M, a_k0, k0, k_end, CH, A_K,
                                 A_K_TILES, A_BF16, not INTERPRETER)
        af = _scaled(a, sa, ROWS, CH)
        wf = _scaled(w, ws, BLOCK_N, CH)
        if not INTERPRETER:
            af = af.to(tl.bfloat16)  # exact (module docstring)
            wf = wf.to(tl.bfloat16)
        acc = tl.dot(wf, tl.trans(af), acc)
    else:
        # Unscaled e4m3 products summed per 32-group (exact products, FP32 sums,
        # as the reference), then the groups weighted by both scales.
        wf = w.to(tl.float32)
        sw = _exp2(ws)
        lane = tl.arange(0, ROWS)
        for r in tl.static_range(ROWS):
            row = row0 + r + tl.zeros((1,), dtype=tl.int32)
            a, sa = _load_activation(a_ptr, as_ptr, row, row < M, a_k0, k0, k_end, CH, A_K,
                                     A_K_TILES, A_BF16, not INTERPRETER)
            a = tl.reshape(a, (CH,))
            sums = tl.sum(tl.reshape(wf * a[None, :], (BLOCK_N, CH // 32, 32)), axis=2)
            part = tl.sum(sums * (sw * _exp2(tl.reshape(sa, (CH // 32,)))[None, :]), axis=1)
            acc = tl.where(lane[None, :] == r, acc + part[:, None], acc)
    return acc


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
    N: tl.constexpr, K: tl.constexpr, GROUPS: tl.constexpr,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, SPLIT_K: tl.constexpr,
    K_SLICE: tl.constexpr, CHUNK: tl.constexpr, PIECES: tl.constexpr,
    A_BF16: tl.constexpr, USE_PDL: tl.constexpr, INTERPRETER: tl.constexpr,
    PUBLISH: tl.constexpr, TP: tl.constexpr, RANK: tl.constexpr,
    CAPACITY: tl.constexpr, HIDDEN: tl.constexpr,
):
    W_K_TILES: tl.constexpr = (K // 32 + 3) // 4
    A_K: tl.constexpr = GROUPS * K
    A_K_TILES: tl.constexpr = (A_K // 32 + 3) // 4
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = pid_k * K_SLICE
    k_end = tl.minimum(k0 + K_SLICE, K)
    a_k0 = (pid_n * BLOCK_N) // (N // GROUPS) * K  # this group's first activation column

    # The whole weight slice, before the grid wait (nothing here is the previous kernel's).
    # The whole weight slice in up to eight CHUNK-wide pieces, before the grid
    # wait (nothing here is the previous kernel's); the last piece is masked.
    w0, s0 = _load_weight(w_ptr, w_scale_ptr, cols, k0, k_end, CHUNK, K, W_K_TILES)
    if PIECES > 1:
        w1, s1 = _load_weight(w_ptr, w_scale_ptr, cols, k0 + CHUNK, k_end, CHUNK, K, W_K_TILES)
    if PIECES > 2:
        w2, s2 = _load_weight(w_ptr, w_scale_ptr, cols, k0 + 2 * CHUNK, k_end, CHUNK, K,
                              W_K_TILES)
    if PIECES > 3:
        w3, s3 = _load_weight(w_ptr, w_scale_ptr, cols, k0 + 3 * CHUNK, k_end, CHUNK, K,
                              W_K_TILES)
    if PIECES > 4:
        w4, s4 = _load_weight(w_ptr, w_scale_ptr, cols, k0 + 4 * CHUNK, k_end, CHUNK, K,
                              W_K_TILES)
    if PIECES > 5:
        w5, s5 = _load_weight(w_ptr, w_scale_ptr, cols, k0 + 5 * CHUNK, k_end, CHUNK, K,
                              W_K_TILES)
    if PIECES > 6:
        w6, s6 = _load_weight(w_ptr, w_scale_ptr, cols, k0 + 6 * CHUNK, k_end, CHUNK, K,
                              W_K_TILES)
    if PIECES > 7:
        w7, s7 = _load_weight(w_ptr, w_scale_ptr, cols, k0 + 7 * CHUNK, k_end, CHUNK, K,
                              W_K_TILES)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()

    row0 = pid_m * ROWS
    acc = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
    acc = _chunk(acc, w0, s0, a_ptr, a_scale_ptr, row0, M, a_k0, k0, k_end, CHUNK, BLOCK_N,
                 ROWS, A_K, A_K_TILES, A_BF16, INTERPRETER)
    if PIECES > 1:
        acc = _chunk(acc, w1, s1, a_ptr, a_scale_ptr, row0, M, a_k0, k0 + CHUNK, k_end,
                     CHUNK, BLOCK_N, ROWS, A_K, A_K_TILES, A_BF16, INTERPRETER)
    if PIECES > 2:
        acc = _chunk(acc, w2, s2, a_ptr, a_scale_ptr, row0, M, a_k0, k0 + 2 * CHUNK, k_end,
                     CHUNK, BLOCK_N, ROWS, A_K, A_K_TILES, A_BF16, INTERPRETER)
    if PIECES > 3:
        acc = _chunk(acc, w3, s3, a_ptr, a_scale_ptr, row0, M, a_k0, k0 + 3 * CHUNK, k_end,
                     CHUNK, BLOCK_N, ROWS, A_K, A_K_TILES, A_BF16, INTERPRETER)
    if PIECES > 4:
        acc = _chunk(acc, w4, s4, a_ptr, a_scale_ptr, row0, M, a_k0, k0 + 4 * CHUNK, k_end,
                     CHUNK, BLOCK_N, ROWS, A_K, A_K_TILES, A_BF16, INTERPRETER)
    if PIECES > 5:
        acc = _chunk(acc, w5, s5, a_ptr, a_scale_ptr, row0, M, a_k0, k0 + 5 * CHUNK, k_end,
                     CHUNK, BLOCK_N, ROWS, A_K, A_K_TILES, A_BF16, INTERPRETER)
    if PIECES > 6:
        acc = _chunk(acc, w6, s6, a_ptr, a_scale_ptr, row0, M, a_k0, k0 + 6 * CHUNK, k_end,
                     CHUNK, BLOCK_N, ROWS, A_K, A_K_TILES, A_BF16, INTERPRETER)
    if PIECES > 7:
        acc = _chunk(acc, w7, s7, a_ptr, a_scale_ptr, row0, M, a_k0, k0 + 7 * CHUNK, k_end,
                     CHUNK, BLOCK_N, ROWS, A_K, A_K_TILES, A_BF16, INTERPRETER)

    rows = row0 + tl.arange(0, ROWS)
    is_first_block = (pid_n == 0) & (pid_m == 0)
    if SPLIT_K == 1:
        _write_block(acc, out_ptr, rows, cols, M, N, is_first_block, peer_ptrs_ptr, stage_ptr,
                     PUBLISH, TP, RANK, CAPACITY, HIDDEN, INTERPRETER)
    else:
        # Workspace: FP32 [blocks, SPLIT_K, ROWS, BLOCK_N], one tile per split.
        block = pid_m * (N // BLOCK_N) + pid_n
        tile = tl.arange(0, ROWS)[None, :] * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
        partials = partial_ptr + (block * SPLIT_K).to(tl.int64) * (ROWS * BLOCK_N)
        real = rows[None, :] < M  # rows past M: neither stored nor read back
        tl.store(partials + pid_k * (ROWS * BLOCK_N) + tile, acc, mask=real)
        tl.debug_barrier()  # every thread's partial precedes the release below
        arrived = tl.atomic_add(counter_ptr + block, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            tl.debug_barrier()  # the acquire (one thread) covers the whole CTA's reads
            # .cg: read at L2, where the other programs' partials are.
            total = tl.load(partials + tile, mask=real, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                total += tl.load(partials + s * (ROWS * BLOCK_N) + tile, mask=real,
                                 other=0.0, cache_modifier=".cg")
            tl.store(counter_ptr + block, 0)  # re-armed for the next launch / graph replay
            _write_block(total, out_ptr, rows, cols, M, N, is_first_block, peer_ptrs_ptr,
                         stage_ptr, PUBLISH, TP, RANK, CAPACITY, HIDDEN, INTERPRETER)


# ``publish`` arguments below: a ``decode_boundary.common.contract.PublishTarget``
# (or any object with its attributes); ``NO_PUBLISH`` when the GEMM does not publish.
_WORKSPACES: dict[tuple[torch.device, int], torch.Tensor] = {}
_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}
_DUMMIES: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def weight_operands(layer) -> tuple[torch.Tensor, torch.Tensor, int, int, int]:
    """(e4m3 [N, K] storage, swizzled scales, N, K, groups) of ``layer``, checked.
    ``layer.groups`` (default 1) > 1 marks a grouped layer (module docstring)."""
    weight, scale = layer.weight, layer.weight_scale
    groups = getattr(layer, "groups", 1)
    if weight.dtype != torch.float8_e4m3fn or weight.ndim != 2:
        raise ValueError(f"layer.weight must be a 2-D float8_e4m3fn [K, N] view, got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    k, n = weight.shape
    storage = weight.t()
    if not storage.is_contiguous():
        raise ValueError("layer.weight must be the column-major [K, N] view of a contiguous "
                         "[N, K] tensor (layer.weight.t().is_contiguous())")
    check_scale_buffer(scale, n, k, "layer.weight_scale")
    if not isinstance(groups, int) or groups < 1 or n % groups:
        raise ValueError(f"layer.groups must be a positive int dividing N={n}, got {groups!r}")
    return storage, scale, n, k, groups


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


def _buffers(device: torch.device, n: int, rows: int, tactic: Tactic, publish=None):
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


def _check_activation(a, rows: int, a_k: int) -> bool:
    """Validate the activation operand; True when it is BF16 (quantized in the kernel)."""
    if isinstance(a, torch.Tensor):
        if a.dtype != torch.bfloat16 or tuple(a.shape) != (rows, a_k) or not a.is_contiguous():
            raise ValueError(f"activation must be contiguous bfloat16 [rows, {a_k}] (or an MXFP8 "
                             f"QuantizedActivation), got {a.dtype} {tuple(a.shape)}")
        return True
    data, scale = a.data, a.scale
    if data.dtype != torch.float8_e4m3fn or tuple(data.shape) != (rows, a_k) or \
            not data.is_contiguous():
        raise ValueError(f"activation data must be contiguous float8_e4m3fn [rows, {a_k}], got "
                         f"{data.dtype} {tuple(data.shape)}")
    check_scale_buffer(scale, rows, a_k, "activation scale")
    return False


def _launch_config(layer, a, out, tactic: Tactic, publish):
    """(grid, positional args, keyword args) shared by launch and warmup, so a
    warmed-up kernel is exactly the one a launch looks up. ``a`` is a BF16
    [rows, G*K] tensor or a QuantizedActivation (2-D data)."""
    storage, w_scale, n, k, groups = weight_operands(layer)
    bf16 = isinstance(a, torch.Tensor)
    rows = (a if bf16 else a.data).shape[0]
    device = storage.device
    a_bf16 = _check_activation(a, rows, groups * k)
    a_data, a_scale = (a, a) if a_bf16 else (a.data, a.scale)
    if out.dtype != torch.bfloat16 or tuple(out.shape) != (rows, n) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous bfloat16 [{rows}, {n}], got {out.dtype} "
                         f"{tuple(out.shape)}")
    if not fits(tactic, n, k, groups):
        raise ValueError(f"tactic {tactic} is not valid for N={n}, K={k}, groups={groups}")
    if any(t.device != device for t in (a_data, a_scale, out)):
        raise ValueError(f"weight, activations and out must share one device ({device})")
    _aligned(storage, w_scale, a_data, a_scale, out)
    if publish is not None:
        check_publish_target(publish, n, rows, device)
    buffers = _buffers(device, n, rows, tactic, publish)
    grid = (n // tactic.block_n, tactic.split_k, -(-rows // tactic.rows_tile))
    pub = publish or NO_PUBLISH
    k_slice, pieces = k_pieces(k, tactic)
    pdl = use_pdl(device)
    kwargs = dict(
        N=n, K=k, GROUPS=groups, BLOCK_N=tactic.block_n, ROWS=tactic.rows_tile,
        SPLIT_K=tactic.split_k, K_SLICE=k_slice, CHUNK=tactic.chunk_k, PIECES=pieces,
        A_BF16=a_bf16, USE_PDL=pdl, INTERPRETER=interpret_mode(), PUBLISH=publish is not None,
        TP=pub.tp, RANK=pub.rank, CAPACITY=pub.capacity, HIDDEN=pub.hidden,
        num_warps=tactic.num_warps, num_stages=1, launch_pdl=pdl,
    )
    return grid, (storage, w_scale, a_data, a_scale, out, *buffers, rows), kwargs


def launch_low_latency(layer, a, out: torch.Tensor, tactic: Tactic, publish=None) -> torch.Tensor:
    """``out`` [rows, N] (BF16) = ``a`` @ ``layer.weight`` with ``tactic`` on the
    current stream; ``a`` is MXFP8 (``QuantizedActivation``, 2-D data) or a BF16
    [rows, G*K] tensor quantized in the prologue; with ``publish``, also into
    the mailbox (module docstring)."""
    grid, args, kwargs = _launch_config(layer, a, out, tactic, publish)
    if args[-1]:
        mxfp8_gemm_kernel[grid](*args, **kwargs)
    return out


def warmup_low_latency(layer, rows: int, tactic: Tactic, publish=None, bf16_input: bool = False):
    """Compile (launch nothing) the kernel ``launch_low_latency`` runs for
    ``rows`` rows, ``tactic`` and the input kind, and allocate its workspace;
    returns the compiled kernel (None in the interpreter). Peer addresses are
    checked here, outside any capture: a host read of the table would synchronize."""
    storage, _, n, k, groups = weight_operands(layer)
    device = storage.device
    a_k = groups * k
    if bf16_input:
        a = torch.empty(rows, a_k, dtype=torch.bfloat16, device=device)
    else:
        a = QuantizedActivation(
            torch.empty(rows, a_k, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(mxfp8_scale_bytes(rows, a_k), dtype=torch.uint8, device=device),
            torch.bfloat16, torch.Size((rows, a_k)))
    out = torch.empty(rows, n, dtype=torch.bfloat16, device=device)
    if publish is not None and any(ptr % 16 for ptr in publish.peer_ptrs.tolist()):
        raise ValueError("publish.peer_ptrs must hold 16-byte aligned mailbox addresses")
    grid, args, kwargs = _launch_config(layer, a, out, tactic, publish)
    return mxfp8_gemm_kernel.warmup(*args, grid=grid, **kwargs)
