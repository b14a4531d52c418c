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

``TABLE`` holds the tactics ``decode-boundary tune`` chose inside the decode
chain per (N, K, groups) and row bucket, one entry for both input kinds.
Shapes it does not hold get :func:`heuristic_tactic`, shaped like its
entries. Every selection here is a function of (N, K, groups, rows) only: the
FP32 summation order depends on the whole tactic, so a tactic that followed
the input kind would make a BF16 input and its ``quantize_mxfp8`` give
different bits.

**Batch-invariant mode** (:func:`tactic_for` with ``batch_invariant``;
docs/DESIGN.md §7.1). The tables change the summation order with the row
count (split-K, CUDA-core or tensor-core products, block), so a row's bits
depend on how many rows share its launch. The mode runs one
:class:`ReductionOrder` per (N, K, groups) at every row count
(``INVARIANT_ORDERS``, else :func:`heuristic_order`): the same weight block,
split-K, K-pieces and warps, always on tensor cores; only the activation tile
(16, 32 or 64 rows: :func:`dot_tile`) follows the row count. A tensor-core
product of one output element does not depend on the other rows of its tile
(each is its own chain of MMAs over K) nor on the tile's height, so a row
gets the same bits for every M and any batch-mates (held on the GPU by
tests/gemm/test_batch_invariant_gpu.py). The CUDA-core tiles are never used
there: their products are another rounding order.
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

    @property
    def backend(self) -> str:
        """The kernel a tactic runs (``hopper.tactics.HopperTactic``: ``"cute"``)."""
        return "triton"


LOW_BATCH_MAX_ROWS = 8
# Above this many rows a BF16 input is quantized by quantize_mxfp8 first: every
# program quantizing its own K-slice costs more than the extra launch there.
PROLOGUE_MAX_ROWS = 16
WIDE_LOW_LATENCY_MAX_ROWS = 48
SMALL_BUCKETS = (1, 2, 4, 8, 16, 32, 48)  # TABLE's row buckets; powers of two above
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
# gains registers and loses a resident program per SM, which can push a grid into a
# second wave.
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
    """TABLE's bucket of ``rows``: 1, 2, 4, 8, 16, 32, 48, then powers of two."""
    if rows < 1:
        raise ValueError(f"rows must be positive, got {rows}")
    for bucket in SMALL_BUCKETS:
        if rows <= bucket:
            return bucket
    return 1 << (rows - 1).bit_length()


def _t(block_n, rows_tile, split_k=1, num_warps=4, chunk_k=256) -> Tactic:
    return Tactic(block_n, rows_tile, split_k, num_warps, chunk_k)


# (N, K, groups) -> {row bucket: tactic}; buckets above 64 take the 64 entry. The
# fastest tactic inside the decode chain (``decode-boundary tune``), one for both input
# kinds: the FP32 summation order follows the whole tactic, so one tactic per (N, K,
# groups, rows) keeps mxfp8_mm(layer, x) and mxfp8_mm(layer, quantize_mxfp8(x)) in the
# same bits. Tuned in the chain, each GEMM runs on the input kind the chain feeds it
# (a BF16 input up to PROLOGUE_MAX_ROWS rows is quantized in the prologue, which
# favours fewer, wider programs). Other shapes take heuristic_tactic.
TABLE: dict[tuple[int, int, int], dict[int, Tactic]] = {
    (5120, 2048, 1): {  # V4.1-Flash wo_b at TP 4
        1: _t(8, 1, 1, 4, 1024),  # 640 narrow programs over the whole K: no split-K sum
        2: _t(16, 2, 1, 4, 512),  # 320 programs over the whole K: no split-K sum
        4: _t(128, 16, 6, 8, 128),  # BF16 in: wide blocks, fewer programs quantize K
        8: _t(128, 16, 6, 8, 128),  # as at 4 rows: the same 16-row tile
        16: _t(64, 16, 4, 4, 128),  # wgmma-wide blocks, 512-element K-slices
        32: _t(64, 32, 4, 4, 128),  # the 16-row layout on a 32-row tile
        48: _t(64, 64, 4, 4, 128),  # a masked 64-row tile: Triton tiles are powers of two
        64: _t(64, 64, 4, 4, 128),  # the 32-row layout on a 64-row tile
    },
    (8192, 1280, 1): {  # V4.1-Flash wq_b at TP 4, MXFP8 in
        1: _t(16, 1, 1, 4, 512),  # 512 programs over the whole (short) K: no split-K sum
        2: _t(16, 2, 1, 2, 512),  # 512 programs over the whole (short) K, on 2 warps
        4: _t(64, 16, 5, 4, 128),  # 640 programs of 256-element K-slices
        8: _t(64, 16, 5, 4, 128),  # as at 4 rows: the same 16-row tile
        16: _t(64, 16, 5, 4, 128),  # as at 4 rows: the same 16-row tile
        32: _t(64, 32, 3, 4, 128),  # 3 splits: 384 programs of 448-element K-slices
        48: _t(64, 64, 3, 4, 64),  # 64-wide pieces keep the 64-row tile's registers down
        64: _t(64, 64, 3, 4, 64),  # as at 48 rows
    },
    (1792, 5120, 1): {  # fused_wqa_wkv of V4.1-Flash, MXFP8 in
        1: _t(4, 1, 1, 4, 1024),  # 4 warps: fewer registers beside the consumer still running
        2: _t(8, 2, 1, 4, 1024),  # 224 programs over the whole K: no split-K sum
        4: _t(64, 16, 14, 4, 128),  # long K, narrow N: 14 splits give 392 programs
        8: _t(64, 16, 10, 4, 128),  # 10 splits: 512-element K-slices, 280 programs
        16: _t(64, 16, 10, 4, 128),  # as at 8 rows: the same 16-row tile
        32: _t(64, 32, 14, 4, 128),  # 14 splits: 392 programs of 384-element K-slices
        48: _t(64, 64, 14, 4, 64),  # 64-wide pieces keep the 64-row tile's registers down
        64: _t(64, 64, 14, 4, 128),  # 128-wide pieces beside wo_a's 256-wide ones in the chain
    },
    (2048, 4096, 2): {  # V4.1-Flash wo_a at TP 4: 2 groups in one launch, BF16 in
        1: _t(8, 1, 1, 8, 1024),  # 8 warps: faster in the chain than 4
        2: _t(8, 2, 2, 4, 1024),  # 2 splits: 512 programs over half the K each
        4: _t(128, 16, 16, 8, 256),  # 256-wide pieces: faster in the chain than 128
        8: _t(128, 16, 16, 8, 256),  # as at 4 rows: the same 16-row tile
        16: _t(64, 16, 8, 4, 256),  # 256-wide pieces: faster in the chain than 128
        32: _t(64, 32, 11, 4, 128),  # 11 splits: 352 programs of 384-element K-slices
        48: _t(64, 64, 8, 4, 128),  # a masked 64-row tile, 512-element K-slices
        64: _t(64, 64, 8, 4, 256),  # 256-wide pieces beside fused_wqa_wkv's 128 in the chain
    },
    (7168, 4096, 1): {  # V4-Pro wo_b at TP 4, BF16 in
        1: _t(8, 1, 1, 4, 1024),  # 896 narrow programs over the whole K: no split-K sum
        2: _t(8, 2, 2, 4, 1024),  # 2 splits: 1792 programs over half the K each
        4: _t(64, 16, 11, 4, 128),  # 11 splits: 384-element K-slices
        8: _t(64, 16, 11, 4, 128),  # as at 4 rows: the same 16-row tile
        16: _t(64, 16, 11, 4, 128),  # as at 4 rows: the same 16-row tile
        32: _t(64, 32, 8, 4, 128),  # 8 splits: 512-element K-slices
        48: _t(64, 64, 8, 4, 128),  # 4 warps under the register cap; 8 warps spill there
        64: _t(64, 64, 8, 4, 128),  # as at 48 rows
    },
    (5120, 4096, 1): {  # V4.1-Flash wo_b at TP 2, BF16 in
        1: _t(8, 1, 1, 8, 1024),  # 8 warps: faster in the TP-2 chain than 4
        2: _t(8, 2, 1, 4, 1024),  # 640 programs over the whole K: no split-K sum
        4: _t(128, 16, 11, 8, 128),  # BF16 in: wide blocks, fewer programs quantize K
        8: _t(128, 16, 11, 8, 128),  # as at 4 rows: the same 16-row tile
        16: _t(64, 16, 11, 4, 128),  # 11 splits: 384-element K-slices
        32: _t(64, 32, 8, 4, 128),  # 8 splits: 512-element K-slices
        48: _t(64, 64, 8, 4, 64),  # 64-wide pieces keep the 64-row tile's registers down
        64: _t(64, 64, 8, 4, 64),  # as at 48 rows
    },
}


class ReductionOrder(NamedTuple):
    """A tactic less its activation tile: what fixes an output element's FP32
    summation order on tensor cores (module docstring, batch-invariant mode)."""

    block_n: int
    split_k: int
    num_warps: int
    chunk_k: int


def _o(block_n, split_k, num_warps=4, chunk_k=128) -> ReductionOrder:
    return ReductionOrder(block_n, split_k, num_warps, chunk_k)


# (N, K, groups) -> the one order of batch-invariant mode. V4.1-Flash's TP-4 shapes: chosen
# inside its chain by decode-boundary tune --batch-invariant (bench/tune_invariant.py: the
# geometric mean over M of the mode's step over the default's); V4-Pro's wo_b: a standalone
# sweep's, not yet tuned in a chain. Each line says why it is there.
INVARIANT_ORDERS: dict[tuple[int, int, int], ReductionOrder] = {
    (5120, 2048, 1): _o(64, 4),  # wo_b at TP 4: the tables' 16-64-row order
    (8192, 1280, 1): _o(64, 3),  # wq_b at TP 4: 3 splits lose at 1 row, 5 at 32-64 rows more
    (1792, 5120, 1): _o(64, 10),  # fused_wqa_wkv: the descent's pick, level with 14 splits
    (2048, 4096, 2): _o(64, 11),  # wo_a at TP 4: 11 splits; the tables' 8 lose at 32-64 rows
    (7168, 4096, 1): _o(64, 11),  # V4-Pro wo_b at TP 4: the 16-row order
}


def dot_tile(rows: int) -> int:
    """The tensor-core activation tile of ``rows`` rows in batch-invariant mode:
    the smallest of ``DOT_TILES`` that holds them, 64 above (over row blocks)."""
    if rows < 1:
        raise ValueError(f"rows must be positive, got {rows}")
    return next((t for t in DOT_TILES if rows <= t), DOT_TILES[-1])


def heuristic_order(n: int, k: int, groups: int = 1) -> ReductionOrder:
    """The order of a shape ``INVARIANT_ORDERS`` does not hold: 64 weight rows
    (wgmma) x ~384-element K-slices in 128-wide pieces, 4 warps, as the tables'
    tensor-core entries; narrower blocks and other splits until one fits (at
    the 64-row tile, the largest the order runs on)."""
    _check_shape(n, k, groups)
    return order_of(_first_fitting_dot(n, k, groups, DOT_TILES[-1], _split_for(k, 384)))


def with_tile(order: ReductionOrder, rows_tile: int) -> Tactic:
    """The tactic of ``order`` on activation tile ``rows_tile``."""
    return Tactic(order.block_n, rows_tile, order.split_k, order.num_warps, order.chunk_k)


def order_of(tactic: Tactic) -> ReductionOrder:
    """``tactic`` less its activation tile."""
    return ReductionOrder(tactic.block_n, tactic.split_k, tactic.num_warps, tactic.chunk_k)


def invariant_order(n: int, k: int, groups: int = 1) -> ReductionOrder:
    """The order batch-invariant mode runs for (N, K, groups)."""
    return INVARIANT_ORDERS.get((n, k, groups)) or heuristic_order(n, k, groups)


def invariant_tactic(n: int, k: int, rows: int, groups: int = 1) -> Tactic:
    """What batch-invariant mode runs for ``rows`` rows: the shape's one order
    on :func:`dot_tile` of the rows."""
    return with_tile(invariant_order(n, k, groups), dot_tile(rows))


def invariant_candidates(n: int, k: int, groups: int = 1, limit: int = 6
                         ) -> list[ReductionOrder]:
    """The orders ``decode-boundary tune --batch-invariant`` times for a shape,
    the current one first: the tables' tensor-core orders (their 4-64-row
    entries), the 64-row entry's with fewer or more splits and with 64-wide
    pieces, the heuristic's; those that fit, at most ``limit``."""
    out = [invariant_order(n, k, groups)]
    out += [order_of(default_tactic(n, k, rows, groups)) for rows in (4, 16, 32, 64)
            if default_tactic(n, k, rows, groups).rows_tile in DOT_TILES]
    base = order_of(default_tactic(n, k, 64, groups))
    out += [base._replace(split_k=max(1, base.split_k // 2)),
            base._replace(split_k=base.split_k + 2), base._replace(chunk_k=64),
            heuristic_order(n, k, groups)]
    fitting = [o for o in dict.fromkeys(out) if fits(with_tile(o, DOT_TILES[-1]), n, k, groups)]
    return fitting[:limit]


def tactic_for(n: int, k: int, rows: int, groups: int = 1,
               batch_invariant: bool = False) -> Tactic:
    """The tactic of (N, K, groups) at ``rows`` rows (either input kind):
    :func:`invariant_tactic` in batch-invariant mode, else :func:`default_tactic`."""
    if batch_invariant:
        return invariant_tactic(n, k, rows, groups)
    return default_tactic(n, k, rows, groups)


def table_tactic(n: int, k: int, rows: int, groups: int = 1) -> Tactic | None:
    """TABLE's tactic of (N, K, groups) at ``rows`` rows (either input kind), or None."""
    return TABLE.get((n, k, groups), {}).get(min(row_bucket(rows), 64))


def _split_for(k: int, target_slice: int) -> int:
    """The split-K count whose K-slice is nearest ``target_slice``."""
    return max(1, min(max(SPLIT_KS), round(k / target_slice)))


def heuristic_tactic(n: int, k: int, rows: int, groups: int = 1) -> Tactic:
    """The tactic of a shape TABLE does not hold, shaped like its entries:
    1-2 rows on CUDA cores, 8 weight rows x the whole K in 1024-wide pieces,
    4 warps; more rows on tensor cores, 64 weight rows (wgmma) x a
    ~384-element K-slice in 128-wide pieces, 4 warps. Falls back to narrower
    blocks and more splits until one fits."""
    _check_shape(n, k, groups)
    if rows > 2:
        tile = 16 if rows <= 16 else 32 if rows <= 32 else 64
        return _first_fitting_dot(n, k, groups, tile, _split_for(k, 384 if tile < 64 else 512))
    base = [_t(block_n, rows, split, 4, chunk) for split in (1, 2, 4, 8, 16)
            for block_n in (8, 4) for chunk in (1024, 2048, 4096)]
    return _first_fitting(base, n, k, groups)


def _check_shape(n: int, k: int, groups: int) -> None:
    """``ValueError`` for a shape no MXFP8 GEMM tactic can take."""
    if k % 32 or k <= 0 or n <= 0 or groups < 1 or n % groups or (n // groups) % 16:
        raise ValueError(f"no MXFP8 GEMM tactic for N={n}, K={k}, groups={groups} "
                         "(need K % 32 == 0 and (N / groups) % 16 == 0)")


def _first_fitting_dot(n: int, k: int, groups: int, tile: int, split: int) -> Tactic:
    """The first tensor-core tactic on ``tile`` that fits: 64 weight rows, then
    32 and 16; ``split`` K-slices, then every split of ``SPLIT_KS``; 128-wide
    pieces, then 64 and 256; 4 warps."""
    return _first_fitting([_t(block_n, tile, sp, 4, chunk) for block_n in (64, 32, 16)
                           for sp in (split, *SPLIT_KS) for chunk in (128, 64, 256)],
                          n, k, groups)


def _first_fitting(candidates: list[Tactic], n: int, k: int, groups: int) -> Tactic:
    """The first of ``candidates`` that fits (N, K, groups)."""
    for t in candidates:
        if fits(t, n, k, groups):
            return t
    raise ValueError(f"no MXFP8 GEMM tactic fits N={n}, K={k}, groups={groups}")


def default_tactic(n: int, k: int, rows: int, groups: int = 1) -> Tactic:
    """What ``mxfp8_mm`` runs (either input kind): TABLE's tactic, else the
    heuristic."""
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
    """The default, then its neighbours (half or double the block, the split-K
    count +-1 and x/÷2, the other warp count and chunk, the other row tile),
    valid ones only, at most ``limit``: what ``decode-boundary tune`` times
    first for a GEMM."""
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
