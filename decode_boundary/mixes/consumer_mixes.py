"""The consumer's part of the next sublayer's mHC mixes (``MIXES``, docs/DESIGN.md
§5.1; spec: ``reference.mhc_mixes_ref``), device functions of
:mod:`.consumer_kernel`. Every program, after writing its ``residual_out``,
loads its columns of ``hc_fn`` (FP32) and publishes its share into the
token's mix row of ``mix_ptr`` (int64 words tagged like the norm's: ``SLOTS``
per chunk, the (2 + HC) * HC dots of its columns and streams with ``hc_fn``,
then its sum of squares of ``residual_out``). Where it loads its ``hc_fn``
columns is the tactic's ``mix_weights_early``: before its grid wait (held in
registers, 128 per thread at 128 x 4; the tables' choice up to 8 tokens, where
in the chain the late loads queue behind the next GEMM's weight stream) or
only then (beyond: the held columns cost a wave).

The combine (summing the shares, then pre, post, comb) is
:mod:`decode_boundary.mixes.mhc_combine`, shared with the kernels that may
run it instead. ``COMBINE`` (the consumer kernel's constexpr) says whether
this launch runs it: ``False`` leaves it to the next GEMM's extra programs
(``consume(..., combine_mixes=False)``; only V4's pre is still computed
here), which the chain does: the next kernel's grid wait then no longer waits
for chunk 0's serial combine.
``NEXT_MIXES`` (V4.1): nobody here waits for the mixes, so every program
publishes its norm partial *before* its mix share (the hand-off does not wait
for the hc_fn loads and dots) and, with ``COMBINE``, chunk 0 combines after
its norm, off the token's critical path; the collapse uses the given ``pre``.
``SAME_PRE`` (V4): every program of the token needs the new pre for its
collapse, so every one polls the shares and sums them in the same tree
(``pre_from_shares``; with ``COMBINE`` chunk 0 computes pre and post and
stores them, ``combine_pre_post``, the same bits; a hand-off of chunk 0's pre
would cost one more L2 round trip); then
the norm hand-off as without mixes; with ``COMBINE`` comb's softmax and
Sinkhorn rounds (``combine_comb``) follow chunk 0's norm partial (its
collapse), while the token's other partials arrive. Chunk 0 advances the
generation only after seeing every sumsq unit, which every program writes
after reading the generation (its tag, read right after the grid wait, tags
its mix share too; a later kernel that combines finds the shares' tag in
``generation[m]``). The dots are not the reference's summation order:
pre/post/comb match it within FP32 rounding, not bit for bit. Given the same
pre, residual_out is the path without mixes bit for bit; layer_input and its
MXFP8 are too when both launches run a tactic of the same ``block_h`` and
``warps`` (the order of the sum of squares), else each layer_input element may
differ by one BF16 ulp (docs/DESIGN.md §5.1).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..common.tagged_words import tag_word

# MIXES values: none; the next sublayer's mixes out, the collapse with the given
# pre (V4.1); the mixes out and the collapse with the pre just computed (V4).
NO_MIXES, NEXT_MIXES, SAME_PRE = 0, 1, 2


@triton.jit
def load_mix_weights(hc_fn_ptr, cols, cmask, HC: tl.constexpr, HIDDEN: tl.constexpr,
                      SLOTS: tl.constexpr):
    """Columns ``cols`` of ``hc_fn`` FP32 [(2 + HC) * HC, HC * H], one [SLOTS,
    BLOCK_H] tile per stream t (row j = mix j, rows >= (2 + HC) * HC zero), as
    a tuple (also the mixes kernel's)."""
    NMIX: tl.constexpr = (2 + HC) * HC
    j = tl.arange(0, SLOTS)[:, None]
    fn = ()
    for t in tl.static_range(HC):
        fn = fn + (tl.load(hc_fn_ptr + j.to(tl.int64) * (HC * HIDDEN) + t * HIDDEN
                           + cols[None, :], mask=(j < NMIX) & cmask[None, :], other=0.0),)
    return fn


@triton.jit
def publish_mix_partials(mix_ptr, fn, m, chunk, streams, tag, HC: tl.constexpr,
                          SLOTS: tl.constexpr, MIX_ROW: tl.constexpr):
    """This chunk's share of the next sublayer's mixes, tagged into token m's
    mix row at ``chunk * SLOTS``: word j < (2 + HC) * HC = sum over its columns
    and streams of residual_out * hc_fn[j] (FP32, each product rounded), word
    (2 + HC) * HC = its sum of squares of residual_out, the rest +0.0. ``fn``:
    its columns of hc_fn (:func:`load_mix_weights`)."""
    NMIX: tl.constexpr = (2 + HC) * HC
    acc = tl.zeros(fn[0].shape, dtype=tl.float32)
    squares = tl.zeros(streams[0].shape, dtype=tl.float32)
    for t in tl.static_range(HC):
        v = streams[t].to(tl.float32)
        acc = acc + fn[t] * v[None, :]
        squares = squares + v * v
    j = tl.arange(0, SLOTS)
    part = tl.where(j < NMIX, tl.sum(acc, axis=1), tl.where(j == NMIX, tl.sum(squares, axis=0),
                                                            0.0))
    tl.store(mix_ptr + m * MIX_ROW + chunk * SLOTS + j, tag_word(part, tag))


