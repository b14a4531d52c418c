"""The low-row MXFP8 GEMM kernel (Triton, Hopper): ``out = a @ weight``,
optionally grouped (``wo_a``), optionally quantizing BF16 activations in its
prologue, optionally publishing ``out`` into the boundary mailbox from its
epilogue. Only the kernel and its device helpers live here; ``launcher.py``
checks the operands, owns the split-K workspace and launches it.

**Structure: weight-row owners, everything in flight at once.** A program owns
``BLOCK_N`` weight rows (output columns) and a contiguous K-slice of them
(the whole K unless ``SPLIT_K`` > 1). Before the PDL grid wait it issues
*every* load of that slice (e4m3 bytes and scale bytes) into registers, in
16-byte vectors: the slice is cut into PIECES (<= 8, ``tactics.MAX_PIECES``)
pieces of CHUNK elements (a power of two: ``tl.arange`` needs one), the last
one masked at the slice's end, each held in its own registers (the piece loop
is unrolled at compile time; a run-time loop would serialize them). Nothing
it loads there is written by the previous kernel, so the weight stream
overlaps the previous kernel's tail. Many small programs (wo_b at M = 1: 640
of 8 rows x 2048) keep enough bytes in flight per SM; no shared memory, no
software pipeline. After the wait the activation is loaded the same way where
it fits (``A_UPFRONT``: ``tactics.activation_upfront``, at most
``MAX_UPFRONT_BYTES_PER_THREAD`` per thread, less for a BF16 input): every piece's loads are issued
back to back before the first product, because a product ends in a cross-warp
sum (a CTA barrier) and a load placed after a barrier is issued only once it
passes: per-piece loads would cost one L2 round trip per piece (the timeline's
stamps showed it as body time after the weights had arrived).

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
  wrong, docs/DESIGN.md §8.1) and the products are summed along K per output
  with ``tl.sum``, not ``tl.dot`` (numpy's matmul would sum a row in an order
  that follows the tile's height): the same exact values.

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
(M, G*K/32), or BF16); out BF16 [M, N] contiguous; K % 32 == 0; M >= 1; every
pointer 16-byte aligned, peer mailbox addresses included.

**Deterministic split-K** (``SPLIT_K`` > 1, only where too few programs would
otherwise stream a short weight). Each split stores its FP32 partial tile to a
workspace (FP32 [blocks, SPLIT_K, ROWS, BLOCK_N]) and arrives on the block's
int32 counter (integer ``atomic_add``, acq_rel, GPU scope, after a CTA barrier
so all threads' stores precede the release). The program that sees
``SPLIT_K - 1`` sums the partials (read at L2, ``.cg``) in split order
0..S-1 (bits independent of who arrives last), writes the block and stores 0
to the counter, re-armed for the next launch or graph replay: counters are
zero at every launch. No float atomics. Must not race with another launch
sharing the workspace and counters (the launcher's cache: one per device and
size) on a different stream; on one stream, order or the PDL wait serializes
them.

**PDL.** Before ``gdc_wait`` a program reads only weights and weight scales,
which no kernel still in flight when it starts may write (the previous one, or
an earlier one still running under PDL). It then releases its dependents
(``gdc_launch_dependents``) and waits; activations, workspace, counters, the
stage word and every store come after the wait. The dependents may therefore
start before this grid's stores: they must read ``out`` (the consumer also
ACTIVE and the mailbox) only after their own grid wait, which returns once
this whole grid has completed and its memory is visible.

**Publishing epilogue** (PUBLISH; the mailbox of docs/CONTRACTS.md). The
program that writes an output block (after any split-K reduction, so each
value is published once) stores it to ``out`` and the same BF16 bits, -0 turned
into +0, to ``mailbox_p[s, RANK, m, col]`` of every peer p through
``publish_row`` (plain unicast stores, 16 bytes wide where ``BLOCK_N`` >= 8; no
fence, no release), where ``s = stage_state[STAGE_NEXT]`` is read by every
program right after its grid wait (volatile: the previous consumer's advance,
ordered before this grid by stream order and the grid wait, is seen, and the
load is not hoisted above the wait; read there, its round trip overlaps the
products instead of following them). The
writer of block (0, 0) then stores ``stage_state[STAGE_ACTIVE] = s``, a plain
store program-ordered only after its own stores. None of these stores is
ordered for another program: the local consumer, the PDL dependent, reads
ACTIVE and the mailbox only after this grid completed; a peer's consumer is
not ordered after this grid at all and spins until no element of its slots is
the sentinel -0 (a 16-byte store may land in pieces). The three-stage mailbox
(docs/DESIGN.md §6) keeps stage ``s`` apart from the one a lagging peer still
consumes and clears.

**MXFP8 output** (``QUANT_OUT``; ``wo_a`` feeding ``wo_b``). The program that
writes an output block (the split-K reducer, where there is one) rounds it to
BF16 as always and then quantizes those BF16 values with ``quantize_groups``,
the quantizer's own device function, into e4m3 data [M, N] and swizzled
exponents over (M, N/32) instead of storing BF16: byte for byte
``quantize_mxfp8`` of the BF16 output (zero padding included), so the next
GEMM gets the MXFP8 operand it would otherwise quantize in its prologue or in
a quantizer launch. Groups of 32 run along the output columns, so a program
must own whole groups: ``BLOCK_N % 32 == 0`` (the launcher checks it). Not
with PUBLISH (the mailbox holds BF16).

**Finishing the consumer's mixes** (``FINISH_MIXES``; ``mixes.handoff.MixesFinish``).
The consumer right before this GEMM may leave the combine of the next mHC
mixes (summing each token's shares, then pre, post and comb) to it, so that
this grid's wait no longer waits for the consumer's serial combine. The grid
then has M more columns in front (``pid_n < M``; in front so they are
dispatched with the first weight owners): the one at split 0, row block 0
combines token ``pid_n`` (``mixes.mhc_combine.finish_token_mixes``) after
the grid wait, while the weight owners run their products; the copies at
other grid positions exit at once. They load nothing before the
wait and write only pre, post, comb and the mix row's totals words (and,
should a share be missing after the bound, ``NORM_TIMEOUT_BIT`` in the status
word, the mixes then NaN). The
shares are complete at the wait (the consumer's grid has completed), so the
poll's first probe finds them; their tag is ``generation[m]``. Its roundings
do not depend on this kernel's FMA contraction or warps (mhc_combine's
docstring): the same bits as the consumer's own combine. pre / post / comb
are complete only when this grid is: a kernel that reads them before its own
grid wait (the next consumer reads post / comb / pre there) must not be
inside this GEMM's PDL window.
"""

from __future__ import annotations

import triton
import triton.language as tl

from decode_boundary.common.contract import STAGE_ACTIVE, STAGE_NEXT
from decode_boundary.common.mailbox_store import publish_row
from decode_boundary.common.rounding import quantize_groups, swizzled_offset, to_bf16_rne
from decode_boundary.common.timeline import END, MARK1, MARK2, START, WAITED, stamp, stamp_after
from decode_boundary.mixes.mhc_combine import finish_token_mixes

_STAGE_NEXT = tl.constexpr(STAGE_NEXT)
_STAGE_ACTIVE = tl.constexpr(STAGE_ACTIVE)


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
def _fetch_activation(a_ptr, as_ptr, rows, row_live, a_k0, k0, k_end, CH: tl.constexpr,
                      A_K: tl.constexpr, A_K_TILES: tl.constexpr, A_BF16: tl.constexpr):
    """The loads of activation rows ``rows`` [R], weight K from ``k0``
    (activation column ``a_k0 + k``): (BF16 values or e4m3 bytes [R, CH], UE8M0
    exponent bytes [R, CH/32]; zeros with ``A_BF16``, whose exponents come from
    :func:`_decode_activation`)."""
    k = k0 + tl.arange(0, CH)
    g = k0 // 32 + tl.arange(0, CH // 32)
    live = row_live[:, None] & (k < k_end)[None, :]
    x = tl.load(a_ptr + rows[:, None].to(tl.int64) * A_K + a_k0 + k[None, :], mask=live,
                other=0.0)
    if A_BF16:
        exponent = tl.zeros((rows.shape[0], CH // 32), dtype=tl.uint8)
    else:
        exponent = tl.load(as_ptr + swizzled_offset(rows[:, None], a_k0 // 32 + g[None, :],
                                                    A_K_TILES),
                           mask=row_live[:, None] & (g * 32 < k_end)[None, :], other=0)
    return x, exponent


@triton.jit
def _decode_activation(x, exponent, CH: tl.constexpr, A_BF16: tl.constexpr,
                       HARDWARE: tl.constexpr):
    """FP32 values [R, CH] and UE8M0 exponents [R, CH/32] (int32) of fetched
    activations; with ``A_BF16`` quantized here exactly as ``quantize_mxfp8`` does."""
    R: tl.constexpr = x.shape[0]
    if A_BF16:
        q, e = quantize_groups(tl.reshape(x.to(tl.float32), (R, CH // 32, 32)), HARDWARE)
        q = tl.reshape(q, (R, CH))
    else:
        q, e = x, exponent.to(tl.int32)
    return q.to(tl.float32), e


@triton.jit
def _fetch_piece(a_ptr, as_ptr, row0, M, a_k0, k0, k_end, CH: tl.constexpr,
                 ROWS: tl.constexpr, A_K: tl.constexpr, A_K_TILES: tl.constexpr,
                 A_BF16: tl.constexpr):
    """One K-piece's activation loads: one [ROWS, CH] tile (tensor cores) or a
    tuple of ROWS one-row tiles (CUDA cores, which take the rows one by one)."""
    if ROWS >= 16:
        rows = row0 + tl.arange(0, ROWS)
        fetched = _fetch_activation(a_ptr, as_ptr, rows, rows < M, a_k0, k0, k_end, CH, A_K,
                                    A_K_TILES, A_BF16)
    else:
        fetched = ()
        for r in tl.static_range(ROWS):
            row = row0 + r + tl.zeros((1,), dtype=tl.int32)
            fetched += (_fetch_activation(a_ptr, as_ptr, row, row < M, a_k0, k0, k_end, CH,
                                          A_K, A_K_TILES, A_BF16),)
    return fetched


@triton.jit
def _chunk(acc, w, ws, fetched, CH: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
           A_BF16: tl.constexpr, INTERPRETER: tl.constexpr):
    """acc [BLOCK_N, ROWS] += W_chunk . A_chunk^T (module docstring: the products);
    ``fetched``: the piece's activation loads (:func:`_fetch_piece`)."""
    if ROWS >= 16:
        a, sa = _decode_activation(fetched[0], fetched[1], CH, A_BF16, not INTERPRETER)
        af = _scaled(a, sa, ROWS, CH)
        wf = _scaled(w, ws, BLOCK_N, CH)
        if INTERPRETER:
            # numpy's matmul blocks by the operands' shapes, so a row's sum would change
            # with the tile's height; the same exact products summed along K per output
            # (numpy's pairwise sum, fixed by K alone) keep a row's bits (batch-invariant
            # mode: tactics.py).
            acc = acc + tl.sum(wf[:, None, :] * af[None, :, :], axis=2)
        else:
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
            a, sa = _decode_activation(fetched[r][0], fetched[r][1], CH, A_BF16,
                                       not INTERPRETER)
            a = tl.reshape(a, (CH,))
            sums = tl.sum(tl.reshape(wf * a[None, :], (BLOCK_N, CH // 32, 32)), axis=2)
            part = tl.sum(sums * (sw * _exp2(tl.reshape(sa, (CH // 32,)))[None, :]), axis=1)
            acc = tl.where(lane[None, :] == r, acc + part[:, None], acc)
    return acc


@triton.jit
def _write_block(vals, out_ptr, out_scale_ptr, row0, col0, M, N: tl.constexpr, is_first_block,
                 peer_ptrs_ptr, stage_ptr, stage, PUBLISH: tl.constexpr, QUANT_OUT: tl.constexpr,
                 TP: tl.constexpr, RANK: tl.constexpr, CAPACITY: tl.constexpr,
                 HIDDEN: tl.constexpr, INTERPRETER: tl.constexpr):
    """Store FP32 ``vals`` [BLOCK_N, ROWS] (out^T) as BF16, or with QUANT_OUT as
    the MXFP8 of those BF16 values (module docstring); publish when PUBLISH into
    stage ``stage`` (the NEXT word, read by the kernel after its wait). Rows
    from ``row0``, columns from ``col0``."""
    rows = row0 + tl.arange(0, vals.shape[1])
    cols = col0 + tl.arange(0, vals.shape[0])
    out = to_bf16_rne(vals, not INTERPRETER)  # cvt.rn on the GPU
    if QUANT_OUT:
        _write_quantized(out, out_ptr, out_scale_ptr, row0, col0, M, N, INTERPRETER)
    else:
        mask = rows[None, :] < M
        tl.store(out_ptr + rows[None, :].to(tl.int64) * N + cols[:, None], out, mask=mask)
    if PUBLISH:
        publish_row(out, peer_ptrs_ptr, stage, RANK, rows[None, :], cols[:, None],
                    rows[None, :] < M, CAPACITY, TP=TP, HIDDEN=HIDDEN, TILE=True)
        if is_first_block:
            tl.store(stage_ptr + _STAGE_ACTIVE, stage)


@triton.jit
def _write_quantized(out, data_ptr, scale_ptr, row0, col0, M, N: tl.constexpr,
                     INTERPRETER: tl.constexpr):
    """QUANT_OUT: the BF16 block ``out`` [BLOCK_N, ROWS] (out^T; rows from
    ``row0``, columns from ``col0``) as MXFP8 rows: e4m3 into ``data_ptr``
    [M, N], exponents into the 128x4-swizzled ``scale_ptr`` over (M, N/32),
    byte for byte what ``quantize_mxfp8`` writes for these BF16 values, its
    zero padding included: the programs of the last row block zero the padding
    rows below the next multiple of 128 at their groups, and the owners of the
    last columns the padding groups up to a multiple of 4."""
    BLOCK_N: tl.constexpr = out.shape[0]
    ROWS: tl.constexpr = out.shape[1]
    GROUPS_N: tl.constexpr = N // 32
    N_TILES: tl.constexpr = (GROUPS_N + 3) // 4
    rows = row0 + tl.arange(0, ROWS)
    cols = col0 + tl.arange(0, BLOCK_N)
    # Groups of 32 run along the output columns, out^T's first axis: transposed
    # once here, in the epilogue, so quantize_groups sees [ROWS, groups, 32].
    x = tl.reshape(tl.trans(out.to(tl.float32)), (ROWS, BLOCK_N // 32, 32))
    q, exponent = quantize_groups(x, not INTERPRETER)
    live = rows[:, None] < M
    tl.store(data_ptr + rows[:, None].to(tl.int64) * N + cols[None, :],
             tl.reshape(q, (ROWS, BLOCK_N)), mask=live)
    groups = col0 // 32 + tl.arange(0, BLOCK_N // 32)
    tl.store(scale_ptr + swizzled_offset(rows[:, None], groups[None, :], N_TILES),
             exponent.to(tl.uint8), mask=live)
    padded_rows = tl.cdiv(M, 128) * 128
    pad = M + tl.arange(0, 128)  # every padding row: M .. the next multiple of 128
    if row0 + ROWS >= M:
        tl.store(scale_ptr + swizzled_offset(pad[:, None], groups[None, :], N_TILES),
                 tl.zeros((128, BLOCK_N // 32), dtype=tl.uint8),
                 mask=(pad < padded_rows)[:, None])
    if GROUPS_N % 4 != 0:  # noqa: SIM102 (a compile-time test, then a run-time one)
        if col0 + BLOCK_N == N:
            extra = GROUPS_N + tl.arange(0, 4)
            tail = (extra < N_TILES * 4)[None, :]
            tl.store(scale_ptr + swizzled_offset(rows[:, None], extra[None, :], N_TILES),
                     tl.zeros((ROWS, 4), dtype=tl.uint8), mask=live & tail)
            if row0 + ROWS >= M:
                tl.store(scale_ptr + swizzled_offset(pad[:, None], extra[None, :], N_TILES),
                         tl.zeros((128, 4), dtype=tl.uint8),
                         mask=(pad < padded_rows)[:, None] & tail)


@triton.jit
def _finish_mixes_program(mix_ptr, generation_ptr, status_ptr, hc_scale_ptr, hc_base_ptr,
                          pre_out_ptr, post_out_ptr, comb_out_ptr, m, mix_eps, hc_eps,
                          mix_rounds, wait_bound, stamp_ptr, slot, TIMELINE: tl.constexpr,
                          USE_PDL: tl.constexpr, HC: tl.constexpr,
                          MIX_HIDDEN: tl.constexpr, MIX_CHUNKS: tl.constexpr,
                          MIX_CHUNKS_P2: tl.constexpr, SLOTS: tl.constexpr,
                          MIX_ROW: tl.constexpr, TOTALS_OFF: tl.constexpr,
                          USE_PTX: tl.constexpr):
    """``FINISH_MIXES``: token m's next mixes, combined from the shares the
    consumer before this GEMM left (``mixes.mhc_combine``), by a program that
    loads no weight. Timeline marks: WAITED and MARK2 at the grid wait, MARK1
    once combined."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # the consumer's grid has completed: every share is in
    stamp(stamp_ptr, slot, WAITED, TIMELINE)
    stamp(stamp_ptr, slot, MARK2, TIMELINE)
    finish_token_mixes(mix_ptr, generation_ptr, status_ptr, hc_scale_ptr, hc_base_ptr,
                       pre_out_ptr, post_out_ptr, comb_out_ptr, m, mix_eps, hc_eps, mix_rounds,
                       wait_bound, HC, MIX_HIDDEN, MIX_CHUNKS, MIX_CHUNKS_P2, SLOTS, MIX_ROW,
                       TOTALS_OFF, USE_PTX)
    stamp(stamp_ptr, slot, MARK1, TIMELINE)


@triton.jit(do_not_specialize=["M", "stamp_base", "mix_rounds", "wait_bound"])
def mxfp8_gemm_kernel(
    w_ptr, w_scale_ptr, a_ptr, a_scale_ptr, out_ptr, out_scale_ptr,
    partial_ptr, counter_ptr, peer_ptrs_ptr, stage_ptr, stamp_ptr, stamp_base,
    M,
    mix_ptr, generation_ptr, status_ptr, hc_scale_ptr, hc_base_ptr, pre_out_ptr, post_out_ptr,
    comb_out_ptr, mix_eps, hc_eps, mix_rounds, wait_bound,
    N: tl.constexpr, K: tl.constexpr, GROUPS: tl.constexpr,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, SPLIT_K: tl.constexpr,
    K_SLICE: tl.constexpr, CHUNK: tl.constexpr, PIECES: tl.constexpr,
    A_UPFRONT: tl.constexpr, A_BF16: tl.constexpr, USE_PDL: tl.constexpr, INTERPRETER: tl.constexpr,
    PUBLISH: tl.constexpr, TP: tl.constexpr, RANK: tl.constexpr,
    CAPACITY: tl.constexpr, HIDDEN: tl.constexpr, TIMELINE: tl.constexpr = False,
    QUANT_OUT: tl.constexpr = False,
    FINISH_MIXES: tl.constexpr = False, HC: tl.constexpr = 1, MIX_HIDDEN: tl.constexpr = 1,
    MIX_CHUNKS: tl.constexpr = 1, MIX_CHUNKS_P2: tl.constexpr = 1, SLOTS: tl.constexpr = 1,
    MIX_ROW: tl.constexpr = 1, TOTALS_OFF: tl.constexpr = 0, USE_PTX: tl.constexpr = False,
):
    W_K_TILES: tl.constexpr = (K // 32 + 3) // 4
    A_K: tl.constexpr = GROUPS * K
    A_K_TILES: tl.constexpr = (A_K // 32 + 3) // 4
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    # common.timeline's slot of this program (a diagnostic; compiled out by default).
    slot = stamp_base + (pid_m * tl.num_programs(1) + pid_k) * tl.num_programs(0) + pid_n
    stamp(stamp_ptr, slot, START, TIMELINE)
    if FINISH_MIXES:
        # The grid's first M columns finish the tokens' mixes (first: dispatched before
        # the weight owners, so they wait at the grid dependency like them, and combine
        # while the products run; the consumer no longer ends with the combine).
        if pid_n < M:
            if (pid_k == 0) & (pid_m == 0):
                _finish_mixes_program(mix_ptr, generation_ptr, status_ptr, hc_scale_ptr,
                                      hc_base_ptr, pre_out_ptr, post_out_ptr, comb_out_ptr, pid_n,
                                      mix_eps, hc_eps, mix_rounds, wait_bound, stamp_ptr, slot,
                                      TIMELINE, USE_PDL, HC, MIX_HIDDEN, MIX_CHUNKS,
                                      MIX_CHUNKS_P2, SLOTS, MIX_ROW, TOTALS_OFF, USE_PTX)
            else:
                # Its copies at the other (split, row block) positions have nothing to do:
                # they leave at once (a program that exits has released its dependents),
                # not holding a slot until the grid wait. Every mark set (a diagnostic).
                stamp(stamp_ptr, slot, WAITED, TIMELINE)
                stamp(stamp_ptr, slot, MARK2, TIMELINE)
                stamp(stamp_ptr, slot, MARK1, TIMELINE)
            stamp(stamp_ptr, slot, END, TIMELINE)
            return
        pid_n -= M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = pid_k * K_SLICE
    k_end = tl.minimum(k0 + K_SLICE, K)
    a_k0 = (pid_n * BLOCK_N) // (N // GROUPS) * K  # this group's first activation column

    # The whole weight slice, PIECES CHUNK-wide pieces (the last one masked), before
    # the grid wait (nothing here is the previous kernel's); static_range unrolls
    # the loop, so every piece is its own registers and all loads are in flight.
    pieces = ()
    for i in tl.static_range(PIECES):
        pieces += (_load_weight(w_ptr, w_scale_ptr, cols, k0 + i * CHUNK, k_end, CHUNK, K,
                                W_K_TILES),)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    stamp(stamp_ptr, slot, WAITED, TIMELINE)

    row0 = pid_m * ROWS
    # A_UPFRONT: every piece's activation loads are issued here, back to back, before
    # the first product: a product's cross-warp sum is a barrier, and loads placed
    # after one wait for it, so per-piece loads cost one L2 round trip per piece.
    stage = tl.full((), 0, tl.int32)
    if PUBLISH:
        # Read here, not in the epilogue: its round trip then overlaps the products.
        # Volatile and after the wait: the previous consumer's advance is seen (and
        # nothing can advance it again before this grid ends: the next consumer
        # waits for it).
        stage = tl.load(stage_ptr + _STAGE_NEXT, volatile=True)
    fetched = ()
    if A_UPFRONT:
        for i in tl.static_range(PIECES):
            fetched += (_fetch_piece(a_ptr, a_scale_ptr, row0, M, a_k0, k0 + i * CHUNK, k_end,
                                     CHUNK, ROWS, A_K, A_K_TILES, A_BF16),)
    if TIMELINE:
        # MARK2 (after the activation loads are issued: its reduction is a barrier): the
        # weight slice is in, as far as its scale bytes tell (each piece's
        # are loaded after its e4m3 bytes; a reduction over the e4m3 bytes themselves
        # would unpack them all at once and change the kernel's registers).
        arrived = tl.full((), 0, tl.int32)
        for i in tl.static_range(PIECES):
            arrived = arrived | tl.max(pieces[i][1].to(tl.int32))
        stamp_after(stamp_ptr, slot, MARK2, arrived, TIMELINE)
    acc = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
    for i in tl.static_range(PIECES):
        w, ws = pieces[i]
        if A_UPFRONT:
            piece = fetched[i]
        else:
            piece = _fetch_piece(a_ptr, a_scale_ptr, row0, M, a_k0, k0 + i * CHUNK, k_end,
                                 CHUNK, ROWS, A_K, A_K_TILES, A_BF16)
        acc = _chunk(acc, w, ws, piece, CHUNK, BLOCK_N, ROWS, A_BF16, INTERPRETER)
    stamp(stamp_ptr, slot, MARK1, TIMELINE)  # products done

    rows = row0 + tl.arange(0, ROWS)
    is_first_block = (pid_n == 0) & (pid_m == 0)
    if SPLIT_K == 1:
        _write_block(acc, out_ptr, out_scale_ptr, row0, pid_n * BLOCK_N, M, N, is_first_block,
                     peer_ptrs_ptr, stage_ptr, stage, PUBLISH, QUANT_OUT, TP, RANK, CAPACITY,
                     HIDDEN, INTERPRETER)
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
            _write_block(total, out_ptr, out_scale_ptr, row0, pid_n * BLOCK_N, M, N, is_first_block,
                         peer_ptrs_ptr, stage_ptr, stage, PUBLISH, QUANT_OUT, TP, RANK,
                         CAPACITY, HIDDEN, INTERPRETER)
    stamp(stamp_ptr, slot, END, TIMELINE)
