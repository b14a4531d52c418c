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
