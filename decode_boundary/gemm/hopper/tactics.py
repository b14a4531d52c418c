"""Tactics of the CuTe DSL Hopper GEMM (``mxfp8_wgmma_kernel.py``) and the
tables that pin them. Plain Python: the dispatch reads them without the DSL.

A :class:`HopperTactic` fixes what a compiled variant depends on besides the
shape: 64-row warpgroups per CTA, activation rows per CTA (wgmma's N side),
the CTAs of a cluster that split K (reduced in distributed shared memory, in
rank order) and the TMA ring's stages. An output element's FP32 summation
order is fixed by K, ``K_TILE`` and ``split_k`` alone: the tokens tile (the
MMA's N) and the warpgroups only place it, so batch-invariant mode keeps
``split_k`` per shape and lets the tile follow M.

``TABLE`` holds, per (N, K, groups) and row bucket (``tactics.row_bucket``),
the CuTe tactic measured faster than the twin's tabled one (docs/PERFORMANCE.md);
a bucket it lacks runs the Triton twin in auto mode.
"""

from __future__ import annotations

from typing import NamedTuple

from decode_boundary.gemm.tactics import row_bucket

K_TILE = 128  # K per ring stage: four 32-groups, one 512-byte block of swizzled scales
SCALE_BLOCK = 512  # bytes of one 128-row x 4-group block of the swizzled scales: one TMA box
SMEM_BYTES = 227 * 1024  # shared memory per CTA on sm_90
TOKENS = (8, 16, 32, 64)  # activation rows per CTA: wgmma N
WARPGROUPS = (1, 2)
SPLITS = (1, 2, 4, 8)  # cluster sizes along K (8: the portable cluster limit)


class HopperTactic(NamedTuple):
    warpgroups: int  # 64 weight rows (output columns) each, per CTA
    tokens: int  # activation rows per CTA (wgmma N)
    split_k: int  # CTAs of a cluster splitting K, reduced in DSMEM in rank order
    stages: int  # TMA ring stages of K_TILE

    @property
    def backend(self) -> str:
        return "cute"


def smem_bytes(t: HopperTactic) -> int:
    """Shared memory one CTA of ``t`` allocates: the ring (weight and
    activation e4m3 tiles, two scale blocks), two BF16 activation tiles, the
    split-K exchange, barriers and alignment."""
    rows = 64 * t.warpgroups
    ring = t.stages * ((rows + t.tokens) * K_TILE + 2 * SCALE_BLOCK)
    exchange = rows * t.tokens * 4 if t.split_k > 1 else 0
    return ring + 2 * t.tokens * K_TILE * 2 + exchange + 4096


def fits(t: HopperTactic, n: int, k: int, groups: int = 1) -> bool:
    """Whether the kernel can run ``t`` on an (N, K) weight of ``groups`` groups:
    K a multiple of K_TILE split evenly, each group's rows a multiple of the
    CTA's, N a multiple of 128 (whole scale blocks), the shared memory."""
    if not isinstance(t, HopperTactic) or t.warpgroups not in WARPGROUPS or \
            t.tokens not in TOKENS or t.split_k not in SPLITS or t.stages < 2:
        return False
    if k <= 0 or k % K_TILE or n <= 0 or groups < 1 or n % groups or n % 128:
        return False
    if (n // groups) % (64 * t.warpgroups) or (k // K_TILE) % t.split_k:
        return False
    # Each CTA of a cluster reduces 1/split_k of every thread's accumulators.
    if t.split_k > 1 and (64 * t.tokens // 128) % t.split_k:
        return False
    return smem_bytes(t) <= SMEM_BYTES


def tokens_for(rows: int) -> int:
    """The smallest activation tile holding ``rows`` rows (64 above: row blocks)."""
    if rows < 1:
        raise ValueError(f"rows must be positive, got {rows}")
    return next((t for t in TOKENS if rows <= t), TOKENS[-1])


def max_stages(t: HopperTactic) -> int:
    """The most ring stages (up to 8) that fit ``t``'s other choices."""
    for stages in range(8, 1, -1):
        if smem_bytes(t._replace(stages=stages)) <= SMEM_BYTES:
            return stages
    return 2


def _h(warpgroups: int, tokens: int, split_k: int, stages: int = 0) -> HopperTactic:
    t = HopperTactic(warpgroups, tokens, split_k, stages or 2)
    return t if stages else t._replace(stages=max_stages(t))


# (N, K, groups) -> {row bucket: tactic}; buckets above 64 take the 64 entry. An entry is a
# measured win over the twin's tabled tactic; each line says why it is there. Empty: on the
# H100 the twin was faster at every TP-4 shape and row count measured (docs/PERFORMANCE.md).
TABLE: dict[tuple[int, int, int], dict[int, HopperTactic]] = {}

# (N, K, groups) -> batch-invariant mode's split on the CuTe path (the tile follows M); a
# shape here runs the CuTe kernel at every M in the mode's auto dispatch. Empty, as TABLE.
INVARIANT_SPLITS: dict[tuple[int, int, int], int] = {}


def table_tactic(n: int, k: int, rows: int, groups: int = 1) -> HopperTactic | None:
    """TABLE's tactic at ``rows`` rows, with the tokens tile of ``rows``, or None."""
    return TABLE.get((n, k, groups), {}).get(min(row_bucket(rows), 64))


def heuristic_tactic(n: int, k: int, rows: int, groups: int = 1,
                     split_k: int | None = None) -> HopperTactic | None:
    """A fitting tactic for a shape TABLE does not hold (None: none fits):
    two warpgroups where the weight rows allow, the fewest splits that give
    every SM a CTA (or ``split_k``), the deepest ring."""
    tokens = tokens_for(rows)
    m_blocks = -(-rows // tokens)
    for warpgroups in (2, 1):
        splits = (split_k,) if split_k is not None else SPLITS
        candidates = [HopperTactic(warpgroups, tokens, s, 2) for s in splits]
        candidates = [t._replace(stages=max_stages(t)) for t in candidates]
        fitting = [t for t in candidates if fits(t, n, k, groups)]
        if not fitting:
            continue
        for t in fitting:  # the fewest splits that reach 128 CTAs
            if n // (64 * t.warpgroups) * t.split_k * m_blocks >= 128:
                return t
        return fitting[-1]
    return None


def invariant_tactic(n: int, k: int, rows: int, groups: int = 1) -> HopperTactic | None:
    """Batch-invariant mode's CuTe tactic: the shape's one split
    (``INVARIANT_SPLITS``, else the heuristic's at 64 rows) with ``rows``'s tile."""
    split = INVARIANT_SPLITS.get((n, k, groups))
    if split is None:  # the heuristic's at one row: its 8-row tile bounds the split most
        at_one = heuristic_tactic(n, k, 1, groups)
        if at_one is None:
            return None
        split = at_one.split_k
    return heuristic_tactic(n, k, rows, groups, split_k=split)
