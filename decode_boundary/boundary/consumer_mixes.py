"""The consumer's part of the next sublayer's mHC mixes (``MIXES``, docs/DESIGN.md
§5.1; spec: ``reference.mhc_mixes_ref``), device functions of
:mod:`.consumer_kernel`. Every program holds its columns of ``hc_fn``
(FP32, loaded before the grid wait: a weight) and, after writing its
``residual_out``, publishes its share into the token's mix row of ``mix_ptr``
(int64 words tagged like the norm's: ``SLOTS`` per chunk, the (2 + HC) * HC
dots of its columns and streams with ``hc_fn``, then its sum of squares of
``residual_out``). The chunk-0 program polls the row (bounded, as the norm
hand-off), sums the shares in one fixed tree (the same bits for a serial and a
cooperative launch of one ``BLOCK_H``), and computes pre, post and comb:
sigmoid, softmax and ``SINKHORN_ITERS`` normalisations in FP32 on its own, and
stores them. ``NEXT_MIXES`` (V4.1): nobody else waits, the collapse uses the
given ``pre``. ``SAME_PRE`` (V4): chunk 0 also stores the pre as ``HC``
tagged words (``PRE_OFF``) that the token's other programs poll before their
collapse; then the norm hand-off as without mixes. Chunk 0 advances the
generation only after seeing every sumsq unit, which every program writes
after its mix share: so every program had read the generation before. The
dots are not the reference's summation order: pre/post/comb match it within
FP32 rounding, not bit for bit; given those values, everything else is the
path without mixes, bit for bit.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .tagged_words import _bit_or, _f32_nan, _gave_up, _probe_partials, _spin, _tagged, _untagged

# MIXES values: none; the next sublayer's mixes out, the collapse with the given
# pre (V4.1); the mixes out and the collapse with the pre just computed (V4).
NO_MIXES, NEXT_MIXES, SAME_PRE = 0, 1, 2
_NO_MIXES, _SAME_PRE = tl.constexpr(NO_MIXES), tl.constexpr(SAME_PRE)


@triton.jit
def _load_mix_weights(hc_fn_ptr, cols, cmask, HC: tl.constexpr, HIDDEN: tl.constexpr,
                      SLOTS: tl.constexpr, MIXES: tl.constexpr):
    """This chunk's columns of ``hc_fn`` FP32 [(2 + HC) * HC, HC * H], one
    [SLOTS, BLOCK_H] tile per stream t (row j = mix j, rows >= (2 + HC) * HC
    zero), as a tuple; empty without mixes."""
    fn = ()
    if MIXES != _NO_MIXES:
        NMIX: tl.constexpr = (2 + HC) * HC
        j = tl.arange(0, SLOTS)[:, None]
        for t in tl.static_range(HC):
            fn = fn + (tl.load(hc_fn_ptr + j.to(tl.int64) * (HC * HIDDEN) + t * HIDDEN
                               + cols[None, :], mask=(j < NMIX) & cmask[None, :], other=0.0),)
    return fn


@triton.jit
def _publish_mix_partials(mix_ptr, m, chunk, streams, fn, tag, HC: tl.constexpr,
                          SLOTS: tl.constexpr, MIX_ROW: tl.constexpr):
    """This chunk's share of the next sublayer's mixes, tagged into token m's
    mix row at ``chunk * SLOTS``: word j < (2 + HC) * HC = sum over its columns
    and streams of residual_out * hc_fn[j] (FP32, each product rounded), word
    (2 + HC) * HC = its sum of squares of residual_out, the rest +0.0."""
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
    tl.store(mix_ptr + m * MIX_ROW + chunk * SLOTS + j, _tagged(part, tag))


@triton.jit
def _probe_mix_row(ptrs, live, tag, UNUSED: tl.constexpr):
    """One volatile poll of a token's mix row [chunks, SLOTS]: (the words, per
    chunk 1 where a word does not carry ``tag`` yet)."""
    words, hole = _probe_partials(ptrs, live, tag, UNUSED)
    return words, tl.reduce(hole, 1, _bit_or)


@triton.jit
def _pick(values, index, i):
    """values[i] of a register vector, exactly (the others contribute +0.0)."""
    return tl.sum(tl.where(index == i, values, 0.0), axis=0)


@triton.jit
def _combine_mixes(mix_ptr, status_ptr, hc_scale_ptr, hc_base_ptr, pre_out_ptr, post_out_ptr,
                   comb_out_ptr, m, tag, eps, hc_eps, wait_bound, HC: tl.constexpr,
                   HIDDEN: tl.constexpr, CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr,
                   SLOTS: tl.constexpr, MIX_ROW: tl.constexpr, PRE_OFF: tl.constexpr,
                   SINKHORN_ITERS: tl.constexpr, MIXES: tl.constexpr, USE_PTX: tl.constexpr):
    """Wait for every chunk's share of token m's mixes (bounded: a timeout sets
    ``NORM_TIMEOUT_BIT`` and makes them NaN), sum them in one fixed tree, and
    compute pre, post and comb as ``reference.mhc_mixes_ref`` does; store them
    (and with ``SAME_PRE`` the pre, tagged, for the token's other programs).
    Returns pre as a [HC] vector."""
    NMIX: tl.constexpr = (2 + HC) * HC
    c = tl.arange(0, CHUNKS_P2)[:, None]
    j = tl.arange(0, SLOTS)[None, :]
    words, flags = _spin(_probe_mix_row, mix_ptr + m * MIX_ROW + c * SLOTS + j,
                         (c < CHUNKS) & (j < SLOTS), tag, status_ptr, wait_bound, 0, False,
                         USE_PTX)
    stale = _gave_up(flags, status_ptr)
    totals = tl.where(stale, _f32_nan(), tl.sum(_untagged(words), axis=0))  # [SLOTS]
    slot = tl.arange(0, SLOTS)
    rstd = tl.math.rsqrt(_pick(totals, slot, NMIX) / (HC * HIDDEN) + eps)
    mixes = totals * rstd
    t = tl.arange(0, HC)
    # [HC, SLOTS] selections: row t takes mixes[offset + t], exactly.
    pick_pre = tl.sum(tl.where(slot[None, :] == t[:, None], mixes[None, :], 0.0), axis=1)
    pick_post = tl.sum(tl.where(slot[None, :] == HC + t[:, None], mixes[None, :], 0.0), axis=1)
    st = t[:, None] * HC + t[None, :]  # [source, target] -> flat index
    pick_comb = tl.sum(tl.where(slot[None, None, :] == 2 * HC + st[:, :, None],
                                mixes[None, None, :], 0.0), axis=2)
    scale0 = tl.load(hc_scale_ptr)
    scale1 = tl.load(hc_scale_ptr + 1)
    scale2 = tl.load(hc_scale_ptr + 2)
    pre = tl.sigmoid(pick_pre * scale0 + tl.load(hc_base_ptr + t)) + hc_eps
    post = 2 * tl.sigmoid(pick_post * scale1 + tl.load(hc_base_ptr + HC + t))
    logits = pick_comb * scale2 + tl.load(hc_base_ptr + 2 * HC + st)
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    comb = e / tl.sum(e, axis=1)[:, None] + hc_eps
    comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    for _ in range(SINKHORN_ITERS - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    tl.store(pre_out_ptr + m * HC + t, pre)
    tl.store(post_out_ptr + m * HC + t, post)
    tl.store(comb_out_ptr + m * HC * HC + st, comb)
    if MIXES == _SAME_PRE:
        tl.store(mix_ptr + m * MIX_ROW + PRE_OFF + t, _tagged(pre, tag))
    return pre


@triton.jit
def _wait_pre(mix_ptr, status_ptr, m, tag, wait_bound, HC: tl.constexpr,
              MIX_ROW: tl.constexpr, PRE_OFF: tl.constexpr, USE_PTX: tl.constexpr):
    """Poll the pre that token m's chunk-0 program publishes (``SAME_PRE``)
    until it carries ``tag`` (bounded: then ``NORM_TIMEOUT_BIT`` and NaN)."""
    t = tl.arange(0, HC)
    words, flags = _spin(_probe_partials, mix_ptr + m * MIX_ROW + PRE_OFF + t, t < HC, tag,
                         status_ptr, wait_bound, 0, False, USE_PTX)
    stale = _gave_up(flags, status_ptr)
    return tl.where(stale, _f32_nan(), _untagged(words))


@triton.jit
def _scalars(vector, HC: tl.constexpr):
    """A [HC] register vector as a tuple of scalars (exact)."""
    t = tl.arange(0, HC)
    out = ()
    for i in tl.static_range(HC):
        out = out + (_pick(vector, t, i),)
    return out
