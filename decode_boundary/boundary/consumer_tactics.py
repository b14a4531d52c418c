"""The all-reduce's tactics in one place: the consumer's tables
(:class:`ConsumerTactic`, per collapse of the mixes fused in it, the (largest
M, tactic) rows :func:`consumer_tactic` looks up), the row thresholds that
decide where the next mixes run and who publishes, and the rules that read
them (what ``decode-boundary tune`` calls too)."""

from __future__ import annotations

from typing import NamedTuple

import triton

from .. import env
from ..common.contract import mix_slots
from ..mixes.handoff import MixesPlacement
from ..mixes.mixes_kernel import MIXES_KERNEL_BLOCK_H, MIXES_KERNEL_WARPS
from .consumer_kernel import Collapse


class ConsumerTactic(NamedTuple):
    """Columns per program, warps, and whether the programs of a token share the
    RMSNorm through the tagged hand-off (``cooperative``) or one program per
    token walks the row chunk by chunk (only for the full mode; the others never
    need a whole row). ``mix_weights_early`` (fused mixes, cooperative): each
    program loads its hc_fn columns before its grid wait and holds them, as the
    GEMMs hold their weights; else after its slots are in. ``release_late``
    (fused mixes, cooperative): the kernel after it is released only once this
    program has stored its share, not right after the grid wait: that keeps the
    next GEMM's programs and weight stream out of the share and norm hand-off's
    round trips, but starts the stream later."""

    block_h: int
    warps: int
    cooperative: bool = True
    mix_weights_early: bool = False
    release_late: bool = False


# (largest M, tactic): the first entry whose M covers the step's tokens; chosen inside
# the decode chain (``decode-boundary tune``). Each line says why it wins there.
# Without the mixes in the consumer:
CONSUMER_TACTICS = (
    (8, ConsumerTactic(512, 4)),  # few tokens: fewest programs in each token's norm hand-off
    (16, ConsumerTactic(256, 2)),  # 9-16 tokens: twice the programs, to spread the rows
    (1 << 30, ConsumerTactic(512, 4)),  # more tokens: enough programs at 512 columns
)
# V4.1's next mixes fused in the consumer (every program needs its columns of hc_fn,
# FP32 (2 + hc) * hc rows):
MIXES_TACTICS = (
    (1, ConsumerTactic(128, 4, mix_weights_early=True, release_late=True)),  # held; late release
    (8, ConsumerTactic(128, 4, mix_weights_early=True)),  # hc_fn held before the grid wait
    (1 << 30, ConsumerTactic(256, 4)),  # hc_fn after the wait: held, it costs programs per SM
)
# V4's collapse (the same sublayer's pre: every program polls the shares, then a second
# norm round trip):
SAME_PRE_MIXES_TACTICS = (
    (1, ConsumerTactic(256, 8, mix_weights_early=True)),  # one token: 8 warps, hc_fn held
    (8, ConsumerTactic(128, 4, mix_weights_early=True)),  # hc_fn held before the grid wait
    (16, ConsumerTactic(128, 4, release_late=True)),  # the next GEMM waits for the shares
    (1 << 30, ConsumerTactic(256, 4)),  # beyond 16 tokens V4.1's choice
)

# Batch-invariant mode (docs/DESIGN.md §7.1): the (columns, warps) of the consumer at
# every M, whatever the table's entry (its other fields, which change no sum, stay):
# the sum of squares and the mixes' shares follow them. The mixes kernel's shares in
# the consumer's order (its CONSUMER_ORDER) need the consumer's shape to be its own.
INVARIANT_CONSUMER = (MIXES_KERNEL_BLOCK_H, MIXES_KERNEL_WARPS)

# Beyond this many tokens V4.1's next mixes come from the mixes kernel after the
# consumer (mixes_kernel.py: hc_fn read once per 16 tokens, not once per token): the
# chain's crossover (docs/EXPERIMENTS.md).
MIXES_FUSED_MAX_ROWS = 32
# From this many tokens on, V4.1's mixes on the all-reduce's side stream
# (mixes_placement="side_stream", what "auto" picks) take less of the step than
# inline: below, the side kernel's SM time and the join cost more (docs/EXPERIMENTS.md).
MIXES_ASIDE_MIN_ROWS = 32
# Up to this many rows the publishing GEMM's epilogue publishes wo_b's partial
# (decode_boundary.publishing_linear); above, the plain GEMM and the publish kernel
# would run: in the chain the epilogue wins at every M up to the 64-row capacity
# (docs/EXPERIMENTS.md).
PUBLISH_EPILOGUE_MAX_ROWS = 64


def mixes_kernel_takes(hc: int) -> bool:
    """Whether the mixes kernel serves hc streams: its dot needs >= 16 slots,
    and it holds hc x 3 BF16 parts of 128 x slots (hc = 2-4: 16 or 32 slots;
    hc = 8's 64 slots did not fit even as one FP32 tile per stream: 520 KB of
    shared memory)."""
    return 16 <= mix_slots(hc) <= 32


def fuses_mixes(m: int, hc: int, collapse: Collapse) -> bool:
    """Whether the consumer computes the next mixes of M tokens itself; else
    the mixes kernel does, right after it. V4's collapse needs them inside the
    consumer."""
    return collapse == Collapse.V4 or m <= MIXES_FUSED_MAX_ROWS or not mixes_kernel_takes(hc)


def side_stream_possible(hc: int, collapse: Collapse | None) -> bool:
    """Whether the next mixes of a consumer call may run on a side stream (the
    mixes kernel): only with V4.1's collapse (V4's needs them inside the
    consumer) and an hc the mixes kernel takes."""
    return collapse == Collapse.V4_1 and mixes_kernel_takes(hc)


def auto_placement(m: int, aside_possible: bool) -> MixesPlacement:
    """What ``mixes_placement="auto"`` resolves to for M tokens."""
    aside = m >= MIXES_ASIDE_MIN_ROWS and aside_possible
    return MixesPlacement.SIDE_STREAM if aside else MixesPlacement.NEXT_GEMM


def fused_collapse(m: int, hc: int, collapse: Collapse | None,
                   placement: MixesPlacement) -> Collapse | None:
    """The collapse of the mixes the consumer computes itself for M tokens
    (resolved ``placement``), or None where it computes none: what picks its
    table (:func:`consumer_table`)."""
    if collapse is None or placement == MixesPlacement.SIDE_STREAM or \
            not fuses_mixes(m, hc, collapse):
        return None
    return collapse


def consumer_table(fused: Collapse | None) -> tuple:
    """The table of the consumer with ``fused`` mixes (:func:`fused_collapse`)."""
    return {None: CONSUMER_TACTICS, Collapse.V4_1: MIXES_TACTICS,
            Collapse.V4: SAME_PRE_MIXES_TACTICS}[fused]


def runs_as(tactic: ConsumerTactic, hidden: int) -> ConsumerTactic:
    """What the consumer runs for ``tactic`` (a table's or a pinned one): no
    wider than the row, serial in the interpreter (which runs programs one
    after another, so they cannot wait for each other)."""
    tactic = tactic._replace(block_h=min(tactic.block_h, triton.next_power_of_2(hidden)))
    return tactic._replace(cooperative=False) if env.interpret_mode() else tactic


def table_entry(table: tuple, m: int) -> ConsumerTactic:
    """The entry of a (largest M, tactic) table that serves M tokens."""
    return next(t for limit, t in table if m <= limit)


def consumer_tactic(m: int, hidden: int, fused: Collapse | None = None,
                    batch_invariant: bool = False) -> ConsumerTactic:
    """The table's tactic for M tokens (``fused``: the collapse of the mixes
    fused in the consumer, :func:`consumer_table`), as it runs; in
    batch-invariant mode of the shape ``INVARIANT_CONSUMER``."""
    entry = table_entry(consumer_table(fused), m)
    if batch_invariant:
        entry = entry._replace(block_h=INVARIANT_CONSUMER[0], warps=INVARIANT_CONSUMER[1])
    return runs_as(entry, hidden)


def chosen_tactic(pinned: tuple | None, m: int, hidden: int, fused: Collapse | None,
                  batch_invariant: bool) -> ConsumerTactic:
    """The consumer's tactic for M tokens: ``pinned`` (a :class:`ConsumerTactic`
    or a tuple of its fields) where given, else :func:`consumer_tactic`; in
    batch-invariant mode a pinned one of another shape than its own is refused
    (:func:`check_invariant_tactic`). The one rule the all-reduce's plan, its
    deferred finish and the consumer's launcher apply."""
    tactic = ConsumerTactic(*(pinned or consumer_tactic(m, hidden, fused, batch_invariant)))
    if batch_invariant:
        check_invariant_tactic(tactic, hidden)
    return tactic


def check_invariant_tactic(tactic: ConsumerTactic, hidden: int) -> None:
    """``ValueError`` for a consumer tactic batch-invariant mode cannot run
    (another shape than ``INVARIANT_CONSUMER``, as it runs)."""
    want = runs_as(ConsumerTactic(*INVARIANT_CONSUMER), hidden)
    if (tactic.block_h, tactic.warps) != (want.block_h, want.warps):
        raise ValueError(f"batch-invariant mode runs the consumer at block_h {want.block_h} "
                         f"and {want.warps} warps at every M (the mixes kernel's order), got "
                         f"the tactic {tactic}")
