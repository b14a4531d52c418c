"""Tactics of the MXFP8 GEMM kernel and the tables that pin them: one place.

A :class:`Tactic` fixes everything a compiled kernel depends on besides the
shape and the input kind (the kind picks the kernel variant, never the tactic):
weight rows per program, activation rows per program
(1..8 on CUDA cores, 16..64 on tensor cores: mxfp8_gemm_kernel.py), split-K
and warps. Row ranges (docs/DESIGN.md §7):

* ``1 .. LOW_BATCH_MAX_ROWS`` (8): the low-latency GEMM;
* ``.. WIDE_LOW_LATENCY_MAX_ROWS`` (48): wide tiles of 16, 32 and 64 rows
  (48 rows run a masked 64-row tile: Triton tiles are powers of two);
* above: 64-row tiles over a grid of row blocks, pinned per row range for the
  tabled shapes so a choice never changes between process starts.

``TABLE`` holds the measured winners of ``benchmarks/gemm_sweep.py`` on one
H200 per (N, K, groups) and row bucket (benchmarks/NOTES.md), one entry for
both input kinds. Unpinned shapes get :func:`heuristic_tactic`, shaped like
those winners. Every selection here is a function of (N, K, groups, rows)
only: the FP32 summation order depends on the whole tactic, so a tactic that
followed the input kind would make a BF16 input and its ``quantize_mxfp8``
give different bits.
"""

from __future__ import annotations

from typing import NamedTuple


class Tactic(NamedTuple):
    block_n: int  # weight rows (output columns) per program
    rows_tile: int  # activation rows per program: 1..8 CUDA cores, 16/32/64 tensor cores
    split_k: int  # programs per output block, reduced deterministically in split order
    num_warps: int
    # K per piece (a power of two >= 32): a program's K-slice is 1..MAX_PIECES
    # pieces, all loaded before the grid wait; one tl.dot (tensor cores) or one
    # group-sum pass (CUDA cores) per piece. Part of the summation order.
    chunk_k: int = 256


LOW_BATCH_MAX_ROWS = 8
# Above this many rows a BF16 input is quantized by quantize_mxfp8 first: every
# program quantizing its own K-slice costs more than the extra launch there
# (measured: wo_b M = 32 20.4 µs in the prologue, 7.9 µs on MXFP8 input).
PROLOGUE_MAX_ROWS = 16
WIDE_LOW_LATENCY_MAX_ROWS = 48
SMALL_BUCKETS = (1, 2, 4, 8, 16, 32, 48)  # autotuner row buckets; powers of two above
FMA_TILES = (1, 2, 4, 8)  # CUDA-core row tiles
DOT_TILES = (16, 32, 64)  # tensor-core row tiles (tl.dot needs >= 16)
BLOCK_NS = (4, 8, 16, 32, 64, 128, 256)
SPLIT_KS = tuple(range(1, 17))
WARPS = (1, 2, 4, 8)
CHUNKS = (32, 64, 128, 256, 512, 1024, 2048, 4096)
MAX_PIECES = 8
# Weight bytes a thread holds before the grid wait (its whole slice); above this
# the upcast spills. Tensor-core tiles hold the BF16 upcast as well: half as much.
MAX_FMA_BYTES_PER_THREAD = 512
MAX_DOT_BYTES_PER_THREAD = 256
# Activation bytes a thread may hold for every K-piece at once: up to this, all the
# pieces' activation loads are issued together right after the grid wait
# (mxfp8_gemm_kernel.py, A_UPFRONT); above it each piece's loads follow the previous
# piece's products. Speed only: the products and their order are the same.
MAX_UPFRONT_BYTES_PER_THREAD = 128
# A BF16 activation is quantized in the prologue, which keeps each held piece's FP32
# upcast and group maxima live as well: above 48 B per thread the compiled kernel
# gains 20-45 registers and loses a resident program per SM (sm_90 compile of every
# table tactic), which put wo_b at M = 16 into a second wave (+4 µs per step);
# benchmarks/NOTES.md attempt 8.
MAX_UPFRONT_BF16_BYTES_PER_THREAD = 48


def k_pieces(k: int, tactic: Tactic) -> tuple[int, int]:
    """(K elements per split, CHUNK-wide pieces covering one split's slice; the
    last piece is masked past the slice's end)."""
    groups = -(-(k // 32) // tactic.split_k)
    k_slice = groups * 32
    return k_slice, -(-k_slice // tactic.chunk_k)


def activation_upfront(tactic: Tactic, k: int, bf16_input: bool) -> bool:
    """Whether the kernel issues every piece's activation loads at once
    (``MAX_UPFRONT_BYTES_PER_THREAD``, ``MAX_UPFRONT_BF16_BYTES_PER_THREAD``)."""
    _, pieces = k_pieces(k, tactic)
    held = tactic.rows_tile * pieces * tactic.chunk_k * (2 if bf16_input else 1)
    limit = MAX_UPFRONT_BF16_BYTES_PER_THREAD if bf16_input else MAX_UPFRONT_BYTES_PER_THREAD
    return held <= limit * 32 * tactic.num_warps


def fits(tactic: Tactic, n: int, k: int, groups: int = 1) -> bool:
    """Whether the kernel can run ``tactic`` on an (N, K) weight of ``groups`` groups."""
    if k % 32 or k <= 0 or n <= 0 or groups < 1 or n % groups:
        return False
    t = tactic
    if t.block_n not in BLOCK_NS or (n // groups) % t.block_n or t.num_warps not in WARPS:
        return False
    if t.rows_tile not in FMA_TILES + DOT_TILES or t.split_k not in SPLIT_KS:
        return False
    if t.chunk_k not in CHUNKS:
        return False
    dot = t.rows_tile in DOT_TILES
    if dot and t.block_n < 16:
        return False
    k_slice, pieces = k_pieces(k, t)
    if pieces > MAX_PIECES or (t.split_k > 1 and (t.split_k - 1) * k_slice >= k):
        return False  # an empty split would only add latency
    if pieces > 1 and (pieces - 1) * t.chunk_k >= k_slice:
        return False  # an empty piece likewise
    limit = MAX_DOT_BYTES_PER_THREAD if dot else MAX_FMA_BYTES_PER_THREAD
    return t.block_n * pieces * t.chunk_k <= limit * 32 * t.num_warps


def rows_tiles_for(rows: int) -> tuple[int, ...]:
    """Activation tiles a kernel may use for ``rows`` rows (smallest first)."""
    if rows < 1:
        raise ValueError(f"rows must be positive, got {rows}")
    if rows <= LOW_BATCH_MAX_ROWS:
        return (1 << (rows - 1).bit_length(), 16)
    if rows <= 16:
        return (16,)
    if rows <= 32:
        return (32,)
    return (64,)


def is_valid(tactic: Tactic, n: int, k: int, rows: int, groups: int = 1) -> bool:
    """Whether ``tactic`` is one offered for (N, K, groups) at ``rows`` rows."""
    return tactic.rows_tile in rows_tiles_for(rows) and fits(tactic, n, k, groups)


def row_bucket(rows: int) -> int:
    """Autotuner bucket of ``rows``: 1, 2, 4, 8, 16, 32, 48, then powers of two."""
    if rows < 1:
        raise ValueError(f"rows must be positive, got {rows}")
    for bucket in SMALL_BUCKETS:
        if rows <= bucket:
            return bucket
    return 1 << (rows - 1).bit_length()


def _t(block_n, rows_tile, split_k=1, num_warps=4, chunk_k=256) -> Tactic:
    return Tactic(block_n, rows_tile, split_k, num_warps, chunk_k)


# (N, K, groups) -> {row bucket: tactic}; buckets above 64 take the 64 entry.
# Measured winners of benchmarks/gemm_sweep.py on one H200 (2026-12-01,
# results/gemm_sweep-NVIDIA_H200-2026-12-01-0911.json; µs in benchmarks/NOTES.md).
# One table for MXFP8 and BF16 activations: the kernel's FP32 summation order
# depends on the whole tactic (block_n, rows_tile, split_k, num_warps, chunk_k),
# so a tactic chosen per input kind made mxfp8_mm(layer, x) and
# mxfp8_mm(layer, quantize_mxfp8(x)) differ in bits (the prologue's quantization
# itself is byte-identical to quantize_mxfp8). With one tactic per (N, K, groups,
# rows) the bits do not depend on the input kind. The sweep measured a winner
# per kind at <= 16 rows (PROLOGUE_MAX_ROWS; above it a BF16 input is quantized
# first and runs as MXFP8); the merged table keeps, per shape, the kind the
# decode chain feeds it:
# * wo_b-type (5120, 2048, 1), (7168, 4096, 1), (5120, 4096, 1) and the grouped
#   wo_a (2048, 4096, 2) take BF16 activations in the chain (attention output,
#   wo_a's output): buckets <= 16 are the BF16-in winners (the prologue favours
#   wider blocks: every program quantizes its K-slice), 32.. the MXFP8-in ones;
# * wq_b (8192, 1280, 1) and fused_wqa_wkv (1792, 5120, 1) take MXFP8 in the
#   chain: every bucket is the MXFP8-in winner, except fused_wqa_wkv's 1-row
#   entry: 4 warps, not the 2 that won alone, measured 0.4 µs faster in the chain
#   (benchmarks/chain_regs.py, NOTES attempt 17: fewer registers per thread, 78 vs
#   160, beside the consumer and wo_b still running); likewise wo_a's 1-row entry:
#   8 warps, 1.05 µs faster in the chain than 4 (16.24-16.28 vs 17.28-17.32 µs);
#   and TP-2 wo_b's (5120, 4096) 1-row entry: 8 warps, the TP-2 chain 24.96-25.07 vs
#   26.15-26.17 µs (chain_regs --tp-shapes 2, 2026-12-04); wo_a's 4- to 16-row
#   entries: 256-wide pieces, chosen inside the chain (chain_sweep, three alternating
#   rounds against the tables, 2026-12-04: M = 8 24.24 vs 24.73 µs, 16 28.03 vs 28.69;
#   the bench 22.4 / 24.3 / 28.0 at M = 4 / 8 / 16 against 22.9 / 24.8 / 28.9); and
#   the 64-row entries of wo_a and fused_wqa_wkv: 256- and 128-wide pieces together
#   (benchmarks/tactic_ab.py, three alternating rounds in the bench's path: 51.0-51.3
#   vs 53.4-53.6 µs; wo_a's alone did not move the bench). fused_wqa_wkv's tile spills
#   8 registers (32 bytes) under the launcher's register cap; uncapped (173 registers,
#   two programs per SM) it lost the gain (53.6 µs).
# V4-Pro wo_b at 48 rows: the 4-warp 64-row tile under the launcher's register cap
#   (31.1 µs, gemm_sweep 2026-12-04) instead of the 8-warp one (34 µs, spills if capped).
# Shapes: DSV4.1-Flash TP-4 wo_b, wq_b, fused_wqa_wkv, grouped wo_a; V4-Pro
# wo_b; DSV4.1-Flash wo_b at TP 2. Others take heuristic_tactic.
TABLE: dict[tuple[int, int, int], dict[int, Tactic]] = {
    (5120, 2048, 1): {1: _t(8, 1, 1, 4, 1024), 2: _t(16, 2, 1, 4, 512),
                      4: _t(128, 16, 6, 8, 128), 8: _t(128, 16, 6, 8, 128),
                      16: _t(64, 16, 4, 4, 128),
                      32: _t(64, 32, 4, 4, 128), 48: _t(64, 64, 4, 4, 128),
                      64: _t(64, 64, 4, 4, 128)},
    (8192, 1280, 1): {1: _t(16, 1, 1, 4, 512), 2: _t(16, 2, 1, 2, 512), 4: _t(64, 16, 5, 4, 128),
                      8: _t(64, 16, 5, 4, 128), 16: _t(64, 16, 5, 4, 128),
                      32: _t(64, 32, 3, 4, 128), 48: _t(64, 64, 3, 4, 64),
                      64: _t(64, 64, 3, 4, 64)},
    (1792, 5120, 1): {1: _t(4, 1, 1, 4, 1024), 2: _t(8, 2, 1, 4, 1024),
                      4: _t(64, 16, 14, 4, 128), 8: _t(64, 16, 10, 4, 128),
                      16: _t(64, 16, 10, 4, 128), 32: _t(64, 32, 14, 4, 128),
                      48: _t(64, 64, 14, 4, 64), 64: _t(64, 64, 14, 4, 128)},
    (2048, 4096, 2): {1: _t(8, 1, 1, 8, 1024), 2: _t(8, 2, 2, 4, 1024),
                      4: _t(128, 16, 16, 8, 256), 8: _t(128, 16, 16, 8, 256),
                      16: _t(64, 16, 8, 4, 256),
                      32: _t(64, 32, 11, 4, 128), 48: _t(64, 64, 8, 4, 128),
                      64: _t(64, 64, 8, 4, 256)},
    (7168, 4096, 1): {1: _t(8, 1, 1, 4, 1024), 2: _t(8, 2, 2, 4, 1024),
                      4: _t(64, 16, 11, 4, 128), 8: _t(64, 16, 11, 4, 128),
                      16: _t(64, 16, 11, 4, 128),
                      32: _t(64, 32, 8, 4, 128), 48: _t(64, 64, 8, 4, 128),
                      64: _t(64, 64, 8, 4, 128)},
    (5120, 4096, 1): {1: _t(8, 1, 1, 8, 1024), 2: _t(8, 2, 1, 4, 1024),
                      4: _t(128, 16, 11, 8, 128), 8: _t(128, 16, 11, 8, 128),
                      16: _t(64, 16, 11, 4, 128),
                      32: _t(64, 32, 8, 4, 128), 48: _t(64, 64, 8, 4, 64),
                      64: _t(64, 64, 8, 4, 64)},
}

# The 5..8-row bucket and above are offered only their pinned tactic under
# pinned_tactics() (split-K choices tuned on one GEMM alone lose in the chain of
# the three projections, so the chain-measured table wins there).
PINNED_MIN_ROWS = 5


def table_tactic(n: int, k: int, rows: int, groups: int = 1) -> Tactic | None:
    """The pinned tactic of (N, K, groups) at ``rows`` rows (either input kind), or None."""
    return TABLE.get((n, k, groups), {}).get(min(row_bucket(rows), 64))


def _split_for(k: int, target_slice: int) -> int:
    """The split-K count whose K-slice is nearest ``target_slice``."""
    return max(1, min(max(SPLIT_KS), round(k / target_slice)))


def heuristic_tactic(n: int, k: int, rows: int, groups: int = 1) -> Tactic:
    """The tactic of an unpinned shape, shaped like the measured winners
    (TABLE): 1-2 rows on CUDA cores, 8 weight rows x the whole K in 1024-wide
    pieces, 4 warps; more rows on tensor cores, 64 weight rows (wgmma) x a
    ~384-element K-slice in 128-wide pieces, 4 warps. Falls back to narrower
    blocks and more splits until one fits."""
    if k % 32 or k <= 0 or n <= 0 or groups < 1 or n % groups or (n // groups) % 16:
        raise ValueError(f"no MXFP8 GEMM tactic for N={n}, K={k}, groups={groups} "
                         "(need K % 32 == 0 and (N / groups) % 16 == 0)")
    if rows <= 2:
        base = [_t(block_n, rows, split, 4, chunk) for split in (1, 2, 4, 8, 16)
                for block_n in (8, 4) for chunk in (1024, 2048, 4096)]
    else:
        tile = 16 if rows <= 16 else 32 if rows <= 32 else 64
        split = _split_for(k, 384 if tile < 64 else 512)
        base = [_t(block_n, tile, sp, 4, chunk) for block_n in (64, 32, 16)
                for sp in (split, *SPLIT_KS) for chunk in (128, 64, 256)]
    for t in base:
        if fits(t, n, k, groups):
            return t
    raise ValueError(f"no MXFP8 GEMM tactic fits N={n}, K={k}, groups={groups}")


def default_tactic(n: int, k: int, rows: int, groups: int = 1) -> Tactic:
    """What runs without an autotuner entry (either input kind): the pinned
    tactic, else the heuristic."""
    pinned = table_tactic(n, k, rows, groups)
    return pinned if pinned is not None else heuristic_tactic(n, k, rows, groups)


def valid_tactics(n: int, k: int, rows: int, groups: int = 1) -> list[Tactic]:
    """Every valid tactic of (N, K, groups, rows), the default first."""
    out = [default_tactic(n, k, rows, groups)]
    for tile in rows_tiles_for(rows):
        for block_n in BLOCK_NS:
            for split_k in SPLIT_KS:
                for warps in WARPS:
                    for chunk in CHUNKS:
                        t = Tactic(block_n, tile, split_k, warps, chunk)
                        if t not in out and is_valid(t, n, k, rows, groups):
                            out.append(t)
    return out


def sweep_tactics(n: int, k: int, rows: int, groups: int = 1,
                  limit: int = 12) -> list[Tactic]:
    """What the autotuner times: the default, then its neighbours (half or
    double the block, the split-K count +-1 and x/÷2, the other warp count and
    chunk), valid ones only, at most ``limit``."""
    base = default_tactic(n, k, rows, groups)
    out = [base]
    b, sp, w, c = base.block_n, base.split_k, base.num_warps, base.chunk_k
    for t in (base._replace(block_n=b * 2, num_warps=max(w, 8 if b >= 64 else w)),
              base._replace(block_n=b // 2), base._replace(split_k=sp + 1),
              base._replace(split_k=sp - 1), base._replace(split_k=sp * 2),
              base._replace(split_k=sp // 2), base._replace(num_warps=w * 2),
              base._replace(num_warps=w // 2), base._replace(chunk_k=c * 2),
              base._replace(chunk_k=c // 2), base._replace(rows_tile=rows_tiles_for(rows)[-1]),
              base._replace(rows_tile=rows_tiles_for(rows)[0])):
        if t not in out and is_valid(t, n, k, rows, groups):
            out.append(t)
    return out[:limit]
