"""Tactics of the MXFP8 GEMM kernel and the tables that pin them: one place.

A :class:`Tactic` fixes everything a compiled kernel depends on besides the
shape. Row ranges (design.md §1, seed 004):

* ``1 .. LOW_BATCH_MAX_ROWS`` (8): the low-latency GEMM, a 16-row activation
  tile (the smallest ``tl.dot`` side; rows above M are masked);
* ``.. WIDE_LOW_LATENCY_MAX_ROWS`` (48): wide tiles of 16, 32 and 64 rows (48
  rows run a masked 64-row tile: Triton tiles are powers of two);
* above: the same kernel with a grid over 32- or 64-row tiles, with tactics
  pinned per row range for the DSV4.1 shapes so a choice never changes
  between process starts.

``LOW_BATCH_TACTICS`` holds the measured winners of ``benchmarks/gemm_variants.py``
on one H200 (benchmarks/NOTES.md; V4-Flash ``wo_b`` copies ``wo_b``'s, unmeasured);
the wide and pinned tables are derived from it.
Unpinned shapes get :func:`heuristic_tactic`, which is reasoned, not measured:
enough CTAs (>= ~200 of 132 SMs) that each SM keeps two 64x128-byte weight blocks
in registers plus its L2 prefetches in flight (Little's law: ~36 KB per SM at
4.8 TB/s and ~1 us latency). ``benchmarks/gemm.py`` (without ``--quick``) and
``benchmarks/gemm_variants.py`` print the measured best; re-pin from those.
"""

from __future__ import annotations

from typing import NamedTuple


class Tactic(NamedTuple):
    block_n: int  # output columns per CTA (the weight rows it streams)
    block_k: int  # K elements per main-loop step (a multiple of 128: 4+ scale groups)
    rows_tile: int  # activation rows per CTA (16, 32 or 64; masked above M)
    split_k: int  # CTAs per output block, reduced deterministically in split order
    num_warps: int
    prefetch: bool  # prefetch the CTA's weight slice into L2 before the PDL wait
    # Main-loop structure: 0 = register double-buffering (the first K-block
    # loaded before the PDL wait); >= 2 = Triton's software pipeline with that
    # many stages (tl.range num_stages), prologue after the PDL wait.
    num_stages: int = 0


LOW_BATCH_MAX_ROWS = 8
WIDE_LOW_LATENCY_MAX_ROWS = 48
SMALL_BUCKETS = (1, 2, 4, 8, 16, 32, 48)  # autotuner row buckets; powers of two above
TARGET_CTAS = 200  # see the module docstring
BLOCK_NS = (64, 128)  # the autotuner's sweep; tables may also pin 16 and 32 (row-owner tiles)
BLOCK_KS = (128, 256)
SPLIT_KS = (1, 2, 4, 8, 16)
MAX_ELEMS_PER_THREAD = 128  # e4m3 weight elements per thread per block (no spills at 128)


STAGES = (0, 2, 3, 4, 5, 6)  # valid num_stages values


def _t(block_n, split_k, rows_tile=16, block_k=128, num_warps=4, prefetch=True,
       num_stages=0) -> Tactic:
    return Tactic(block_n, block_k, rows_tile, split_k, num_warps, prefetch, num_stages)


# (N, K) -> tactic for 1..8 rows (DSV4.1-Flash TP4 shapes, V4-Flash and V4-Pro wo_b).
# Measured winners of benchmarks/gemm_variants.py on one H200 (2026-11-29, µs at M=1 / 8;
# see benchmarks/NOTES.md): more, shorter CTAs win because each CTA's load -> upcast
# -> wgmma -> split-K hand-off is latency-bound, not bandwidth-bound.
LOW_BATCH_TACTICS: dict[tuple[int, int], Tactic] = {
    (5120, 2048): _t(64, 16),  # wo_b: 1280 CTAs, 1 K-block each; 8.94 / 9.55
    (8192, 1280): _t(64, 4),  # wq_b: 512 CTAs; 9.48 / 9.72
    (1792, 5120): _t(64, 20, block_k=256, num_warps=8),  # fused_wqa_wkv, one-shot: 11.45 / 11.77
    (1024, 4096): _t(64, 16, block_k=256, num_warps=8),  # wo_a, one-shot: 4.45 / 4.63
    (4096, 2048): _t(64, 16),  # V4-Flash wo_b: not measured; wo_b's structure
    (7168, 4096): _t(64, 4),  # V4-Pro wo_b: 448 CTAs, 8 K-blocks each; 21.71 / 22.27
    (5120, 4096): _t(64, 16),  # DSV4.1-Flash wo_b at TP 2: 17.02 / 17.55
}

# The 5..8-row bucket that the autotuner is offered only this tactic for under
# pinned_tactics() (seed 004: split-K choices tuned in isolation lose in the chain).
PINNED_MIN_ROWS = 5

# (N, K) -> tactic for 9..16 rows (one 16-row tile) where it differs from the
# low-batch one (benchmarks/gemm_variants.py prints measured candidates).
WIDE_16_TACTICS: dict[tuple[int, int], Tactic] = {}

# (N, K) -> {rows tile: tactic} for 9..48 rows.
WIDE_TACTICS: dict[tuple[int, int], dict[int, Tactic]] = {
    shape: {tile: (WIDE_16_TACTICS.get(shape) if tile == 16 else None)
            or tactic._replace(rows_tile=tile) for tile in (16, 32, 64)}
    for shape, tactic in LOW_BATCH_TACTICS.items()
}

# (N, K) -> ((max rows, tactic), ...) above 48 rows, ascending.
PINNED_TACTICS: dict[tuple[int, int], tuple[tuple[int, Tactic], ...]] = {
    shape: (
        (64, tactic._replace(rows_tile=64)),
        (128, tactic._replace(rows_tile=64, split_k=max(1, tactic.split_k // 2))),
        (1 << 30, _t(128, 1, rows_tile=64, num_warps=8)),
    )
    for shape, tactic in LOW_BATCH_TACTICS.items()
}


def row_bucket(rows: int) -> int:
    """Autotuner bucket of ``rows``: 1, 2, 4, 8, 16, 32, 48, then powers of two."""
    if rows < 1:
        raise ValueError(f"rows must be positive, got {rows}")
    for bucket in SMALL_BUCKETS:
        if rows <= bucket:
            return bucket
    return 1 << (rows - 1).bit_length()


def rows_tiles_for(rows: int) -> tuple[int, ...]:
    """Activation tiles a kernel may use for ``rows`` rows (smallest first)."""
    if rows <= LOW_BATCH_MAX_ROWS:
        return (16,)
    if rows <= WIDE_LOW_LATENCY_MAX_ROWS:
        return (16 if rows <= 16 else 32 if rows <= 32 else 64,)
    return (64, 32)


def fits(tactic: Tactic, n: int, k: int) -> bool:
    """Whether the kernel can run ``tactic`` on an (N, K) weight at all."""
    k_blocks = -(-k // tactic.block_k)
    return (
        tactic.rows_tile in (16, 32, 64)
        and tactic.block_n in (16, 32, 64, 128)
        and n % tactic.block_n == 0
        and k % 32 == 0
        and tactic.block_k % 128 == 0
        and tactic.block_k <= 1024
        and tactic.num_stages in STAGES
        and tactic.split_k <= k_blocks
        # every split gets at least one K-block (an empty split would only add latency)
        and (tactic.split_k - 1) * -(-k_blocks // tactic.split_k) < k_blocks
        and tactic.block_n * tactic.block_k <= MAX_ELEMS_PER_THREAD * tactic.num_warps * 32
        and tactic.num_warps in (1, 2, 4, 8)
    )


def is_valid(tactic: Tactic, n: int, k: int, rows: int) -> bool:
    """Whether ``tactic`` is one offered for (N, K) at ``rows`` rows."""
    return tactic.rows_tile in rows_tiles_for(rows) and fits(tactic, n, k)


def heuristic_tactic(n: int, k: int, rows: int) -> Tactic:
    """The tactic of an unpinned shape: 64 columns per CTA, the smallest split-K
    reaching TARGET_CTAS (split 1 is valid for every N % 64 == 0)."""
    if n % 64 or k % 32 or n <= 0 or k <= 0:
        raise ValueError(f"no MXFP8 GEMM tactic for N={n}, K={k} (need N % 64 == 0, K % 32 == 0)")
    tile = rows_tiles_for(rows)[0]
    m_tiles = -(-rows // tile)
    valid = [t for t in (_t(64, s, rows_tile=tile) for s in SPLIT_KS) if is_valid(t, n, k, rows)]
    for tactic in valid:
        if (n // 64) * m_tiles * tactic.split_k >= TARGET_CTAS:
            return tactic
    return valid[-1]


def table_tactic(n: int, k: int, rows: int) -> Tactic | None:
    """The pinned tactic of (N, K) at ``rows`` rows, or None where none is pinned."""
    if rows <= LOW_BATCH_MAX_ROWS:
        return LOW_BATCH_TACTICS.get((n, k))
    if rows <= WIDE_LOW_LATENCY_MAX_ROWS:
        return WIDE_TACTICS.get((n, k), {}).get(rows_tiles_for(rows)[0])
    for max_rows, tactic in PINNED_TACTICS.get((n, k), ()):
        if rows <= max_rows:
            return tactic
    return None


def default_tactic(n: int, k: int, rows: int) -> Tactic:
    """What runs without an autotuner entry: the pinned tactic, else the heuristic."""
    pinned = table_tactic(n, k, rows)
    return pinned if pinned is not None else heuristic_tactic(n, k, rows)


def valid_tactics(n: int, k: int, rows: int) -> list[Tactic]:
    """Every valid tactic of (N, K, rows), the default first."""
    out = [default_tactic(n, k, rows)]
    for tile in rows_tiles_for(rows):
        for block_n in BLOCK_NS:
            for block_k in BLOCK_KS:
                for split_k in SPLIT_KS:
                    for num_warps in (4, 8):
                        for prefetch in (True, False):
                            t = Tactic(block_n, block_k, tile, split_k, num_warps, prefetch)
                            if t not in out and is_valid(t, n, k, rows):
                                out.append(t)
    return out


def sweep_tactics(n: int, k: int, rows: int) -> list[Tactic]:
    """A small measured sweep: the default plus its split-K and block-shape
    neighbours (its rows tile, the smallest valid warp count, prefetch on)."""
    keep = []
    for t in valid_tactics(n, k, rows):
        smallest_warps = 4 if t.block_n * t.block_k <= MAX_ELEMS_PER_THREAD * 128 else 8
        if not keep or (t.prefetch and t.num_warps == smallest_warps
                        and t.rows_tile == keep[0].rows_tile):
            keep.append(t)
    return keep
