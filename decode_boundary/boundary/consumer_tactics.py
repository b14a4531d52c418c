"""The consumer's tactic tables: :class:`ConsumerTactic` and, per collapse of
the fused mixes, the (largest M, tactic) rows ``consumer.consumer_tactic``
looks up."""

from __future__ import annotations

from typing import NamedTuple


class ConsumerTactic(NamedTuple):
    """Columns per program, warps, and whether the programs of a token share the
    RMSNorm through the tagged hand-off (``cooperative``) or one program per
    token walks the row chunk by chunk (only for the full mode; the others never
    need a whole row). ``mix_weights_early`` (fused mixes, cooperative): each
    program loads its hc_fn columns before its grid wait and holds them, as the
    GEMMs hold their weights; else after its slots are in. ``release_late``
    (fused mixes, cooperative): the kernel after it is released only once this
    program has stored its share, not right after the grid wait (at one token
    that kept the next GEMM's programs and weight stream out of the share and
    norm hand-off's round trips; at 4-16 tokens the stream then started too
    late: benchmarks/NOTES.md "V4-family mixes" item 21)."""

    block_h: int
    warps: int
    cooperative: bool = True
    mix_weights_early: bool = False
    release_late: bool = False


# (largest M, tactic), re-pinned from `benchmarks/allreduce.py --sweep`. Measured on
# 2 x H200, H = 5120, tagged norm hand-off (2026-11-29, results/allreduce-sweep-*-2017):
# M = 1 fastest at (512, 4) 4.03 us, M = 8 at (256, 2) / (512, 4) 4.18, M = 16 at (256, 2)
# 4.76 ((512, 4) 5.49), M = 32 at (512, 4) 6.10 ((1024, 4) 8.13), M = 64 at (512, 4) 12.02
# ((1024, 4) 12.69); serial tactics 11-14 us.
CONSUMER_TACTICS = (
    (8, ConsumerTactic(512, 4)),
    (16, ConsumerTactic(256, 2)),
    (1 << 30, ConsumerTactic(512, 4)),
)


# With the next sublayer's mixes every program needs its columns of hc_fn (FP32,
# (2 + hc) * hc rows). Measured on one H200 (H = 5120, hc = 4, the consumer alone:
# benchmarks/consumer_mixes.py --sweep, results/consumer_mixes-5ad65b0.json and
# -50d727a.json): 128 x 4 fastest at M = 1 and 8, 256 x 4 at 4 and 16, with hc_fn
# loaded after the slots are in. Holding it from before the grid wait lost or tied
# there, but *in the chain* (benchmarks/NOTES.md "V4-family mixes" item 10: the late
# loads queue behind fused_wqa_wkv's and the next wo_a's weight streams) it wins up
# to 8 tokens: V4.1 21.0 -> 19.9 / 26.5 -> 25.5 / 27.3 -> 25.1 / 27.4 -> 26.1 us per
# step at M = 1 / 2 / 4 / 8, V4 20.0 -> 18.6 ... 29.9 -> 28.4, and loses at 16 (34.3 ->
# 38.4: 128 registers of hc_fn per thread, fewer programs per SM).
# At one token the next GEMM is released only after each program's share
# (release_late): 15.89-15.94 against 16.28-16.37 us per step, three alternating rounds
# in the chain (benchmarks/chain_sweep.py --consumer-only, 13e3c42; NOTES "V4-family
# mixes" item 21); at 4 and 8 tokens it lost 0.8-1.0 us, at 16 0.5.
MIXES_TACTICS = (
    (1, ConsumerTactic(128, 4, mix_weights_early=True, release_late=True)),
    (8, ConsumerTactic(128, 4, mix_weights_early=True)),
    (1 << 30, ConsumerTactic(256, 4)),
)
# V4's collapse (the same sublayer's pre: every program polls the shares, then a
# second norm round trip) prefers 128 x 4 at M = 16 too, in every sweep that timed it:
# 16.41 vs 17.12 us at 256 x 4 (consumer_mixes-ff01822), 20.5-21.7 vs 21.9-23.6
# (-50d727a), 23.6 vs 24.2 (-5ad65b0); beyond 16 tokens not swept: V4.1's table.
# In the chain (chain_sweep --consumer-only, 13e3c42, three alternating rounds against
# the table): at one token 256 x 8 with hc_fn held, 17.76-17.80 vs 18.05-18.15 us per
# step; at 16 the next GEMM released after each program's share, 29.37-29.44 vs
# 29.64-29.77 (NOTES "V4-family mixes" item 21).
SAME_PRE_MIXES_TACTICS = (
    (1, ConsumerTactic(256, 8, mix_weights_early=True)),
    (8, ConsumerTactic(128, 4, mix_weights_early=True)),
    (16, ConsumerTactic(128, 4, release_late=True)),
    (1 << 30, ConsumerTactic(256, 4)),
)
