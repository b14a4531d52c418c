"""Combining a token's mHC mixes from its shares (``reference.mhc_mixes_ref``'s
last steps; docs/DESIGN.md §5.1): device functions shared by the kernels that
may finish the mixes — the consumer (:mod:`decode_boundary.boundary.consumer_kernel`),
the mixes kernel, and the GEMM that follows the consumer
(:mod:`decode_boundary.gemm.mxfp8_gemm_kernel`, ``FINISH_MIXES``).

A token's *mix row* (int64 tagged words, :mod:`.tagged_words`) holds one
``SLOTS``-wide share per chunk of its columns: the (2 + HC) * HC dots of that
chunk's residual_out with hc_fn, then its sum of squares. The combining
program polls the row until every share carries the launch's tag (bounded: a
timeout sets ``NORM_TIMEOUT_BIT`` and makes the totals NaN), sums the shares
in one fixed tree (the same bits in every program and kernel that does it),
and computes pre, post and comb (sigmoid, softmax, ``rounds`` Sinkhorn
rounds) in FP32 on scalars: every thread computes all of it (on register
vectors each 4-wide row sum would be a block reduction with a barrier, ~40 of
them in a row); the Sinkhorn rounds are a run-time loop (the code runs once
per launch, cold in the instruction cache). The shares' sums become scalars
through ``TOTALS_OFF`` (one store, one barrier, broadcast loads).

Every kernel that combines a token gets the same bits, whatever its
``num_warps`` and whether it compiles with FMA contraction (the consumer does
not, the GEMM does): with ``USE_PTX`` each operation is one that neither LLVM
nor ptxas may rewrite — products as ``mul.rn`` (never contracted into the add
after them), exp and sigmoid from ``ex2.approx.ftz`` and ``rcp.approx.ftz``
(single MUFU instructions; the non-ftz ``ex2`` and ``div.full`` that
``tl.exp`` / ``tl.sigmoid`` lower to are expanded by ptxas, with FFMAs where
contraction is allowed), the mean's division as ``div.rn`` (correctly
rounded), and the shares summed in a tree fixed by their indices
(:func:`_pairwise_sum`). tests/boundary/test_boundary_ptx.py compiles the combine both
ways and compares the SASS.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..common.tagged_words import bit_or, f32_nan, gave_up, probe_partials, spin, tag_word, untag


@triton.jit
def finish_token_mixes(mix_ptr, generation_ptr, status_ptr, hc_scale_ptr, hc_base_ptr,
                       pre_out_ptr, post_out_ptr, comb_out_ptr, m, eps, hc_eps, rounds,
                       wait_bound, HC: tl.constexpr, HIDDEN: tl.constexpr,
                       CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr, SLOTS: tl.constexpr,
                       MIX_ROW: tl.constexpr, TOTALS_OFF: tl.constexpr,
                       USE_PTX: tl.constexpr):
    """Token m's pre, post and comb from the shares a consumer launch left
    (``COMBINE=False``), by a later kernel: after its grid wait, the
    consumer's grid has completed, so every share is there and the poll's
    first probe finds them. Their tag is ``generation[m]`` itself (the
    consumer's chunk 0 advanced it to the launch's tag before it ended)."""
    tag = tl.load(generation_ptr + m, volatile=True)
    combine_shares(mix_ptr, status_ptr, hc_scale_ptr, hc_base_ptr, pre_out_ptr, post_out_ptr,
                   comb_out_ptr, m, tag, eps, hc_eps, rounds, wait_bound, HC, HIDDEN, CHUNKS,
                   CHUNKS_P2, SLOTS, MIX_ROW, TOTALS_OFF, USE_PTX)


@triton.jit
def _probe_mix_row(ptrs, live, tag, UNUSED: tl.constexpr):
    """One volatile poll of a token's mix row [chunks, SLOTS]: (the words, per
    chunk 1 where a word does not carry ``tag`` yet)."""
    words, hole = probe_partials(ptrs, live, tag, UNUSED)
    return words, tl.reduce(hole, 1, bit_or)


@triton.jit
def _share_totals(mix_ptr, status_ptr, m, tag, wait_bound, CHUNKS: tl.constexpr,
                  CHUNKS_P2: tl.constexpr, SLOTS: tl.constexpr, MIX_ROW: tl.constexpr,
                  USE_PTX: tl.constexpr):
    """Poll token m's mix row until every chunk's share carries ``tag``
    (bounded: a timeout sets ``NORM_TIMEOUT_BIT`` and makes the totals NaN) and
    sum the shares over the chunks in one fixed tree: [SLOTS] FP32, the same
    bits in every program that calls it."""
    c = tl.arange(0, CHUNKS_P2)[:, None]
    j = tl.arange(0, SLOTS)[None, :]
    words, flags = spin(_probe_mix_row, mix_ptr + m * MIX_ROW + c * SLOTS + j,
                         (c < CHUNKS) & (j < SLOTS), tag, status_ptr, wait_bound, 0, False,
                         USE_PTX)
    stale = gave_up(flags, status_ptr)
    return tl.where(stale, f32_nan(), _pairwise_sum(untag(words), CHUNKS_P2, SLOTS))


@triton.jit
def _pairwise_sum(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """sum over axis 0 of x [ROWS, COLS] (ROWS a power of two) in one tree
    fixed by the indices, not by the layout: row i plus row i + ROWS / 2,
    halving until one is left. (``tl.sum`` orders its adds by the threads and
    warps the rows are spread over: two kernels with different ``num_warps``
    would sum the shares in different orders; a two-element sum is one add,
    the same either way.)"""
    for level in tl.static_range(ROWS.bit_length() - 1):
        x = tl.sum(tl.reshape(x, (2, ROWS >> (level + 1), COLS)), axis=0)
    return tl.reshape(x, (COLS,))


_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _exp(x, USE_PTX: tl.constexpr):
    """e^x: with ``USE_PTX`` ``ex2.approx.ftz`` of ``x * log2(e)`` (a result
    below the normal range reads 0), else ``tl.exp``."""
    if USE_PTX:
        scaled = _mul(x, tl.full(x.shape, _LOG2E, tl.float32), USE_PTX)
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [scaled],
                                         dtype=tl.float32, is_pure=True, pack=1)
    return tl.exp(x)


@triton.jit
def _sigmoid(x, USE_PTX: tl.constexpr):
    """1 / (1 + e^-x): with ``USE_PTX`` from :func:`_exp` and
    :func:`_reciprocal`, else ``tl.sigmoid``."""
    if USE_PTX:
        return _reciprocal(1.0 + _exp(-x, USE_PTX), USE_PTX)
    return tl.sigmoid(x)


@triton.jit
def _mul(a, b, USE_PTX: tl.constexpr):
    """a * b rounded on its own: with ``USE_PTX`` one ``mul.rn.f32``, which
    neither LLVM nor ptxas contracts with a following add into an FMA, so the
    combine has the spec's roundings also in a kernel compiled with FMA
    contraction (the GEMM that finishes the mixes); else ``a * b``."""
    if USE_PTX:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)
    return a * b


@triton.jit
def _row_sum(x, s, HC: tl.constexpr):
    """sum_t x[s, t], t in order, of a flat [HC, HC] tuple of scalars."""
    total = x[s * HC]
    for t in tl.static_range(1, HC):
        total = total + x[s * HC + t]
    return total


@triton.jit
def _reciprocal(x, USE_PTX: tl.constexpr):
    """1 / x for a normalisation's sum (>= hc_eps >= ``MIN_HC_EPS``, a normal
    FP32 number, so the reciprocal is finite): with ``USE_PTX`` one
    ``rcp.approx.ftz`` (<= 1 ulp), without the range checks of ``div.full``
    that lengthen every Sinkhorn round's dependent chain; else ``1.0 / x``
    (exact in the interpreter)."""
    if USE_PTX:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)
    return 1.0 / x


@triton.jit
def _normalise_rows(comb, hc_eps, HC: tl.constexpr, USE_PTX: tl.constexpr):
    """comb[s, t] / (sum_t comb[s, t] + hc_eps), on a flat tuple of scalars (as
    comb[s, t] times the sum's reciprocal)."""
    out = ()
    for s in tl.static_range(HC):
        inverse = _reciprocal(_row_sum(comb, s, HC) + hc_eps, USE_PTX)
        for t in tl.static_range(HC):
            out = out + (_mul(comb[s * HC + t], inverse, USE_PTX),)
    return out


@triton.jit
def _normalise_columns(comb, hc_eps, HC: tl.constexpr, USE_PTX: tl.constexpr):
    """comb[s, t] / (sum_s comb[s, t] + hc_eps), on a flat tuple of scalars (as
    comb[s, t] times the sum's reciprocal)."""
    inverses = ()
    for t in tl.static_range(HC):
        total = comb[t]
        for s in tl.static_range(1, HC):
            total = total + comb[s * HC + t]
        inverses = inverses + (_reciprocal(total + hc_eps, USE_PTX),)
    out = ()
    for s in tl.static_range(HC):
        for t in tl.static_range(HC):
            out = out + (_mul(comb[s * HC + t], inverses[t], USE_PTX),)
    return out


@triton.jit
def combine_shares(mix_ptr, status_ptr, hc_scale_ptr, hc_base_ptr, pre_out_ptr, post_out_ptr,
                   comb_out_ptr, m, tag, eps, hc_eps, rounds, wait_bound, HC: tl.constexpr,
                   HIDDEN: tl.constexpr, CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr,
                   SLOTS: tl.constexpr, MIX_ROW: tl.constexpr, TOTALS_OFF: tl.constexpr,
                   USE_PTX: tl.constexpr):
    """Token m's pre, post and comb from the shares in one go
    (:func:`combine_pre_post`, then :func:`combine_comb`). Returns pre."""
    pre, logits = combine_pre_post(mix_ptr, status_ptr, hc_scale_ptr, hc_base_ptr, pre_out_ptr,
                                    post_out_ptr, m, tag, eps, hc_eps, wait_bound, HC, HIDDEN,
                                    CHUNKS, CHUNKS_P2, SLOTS, MIX_ROW, TOTALS_OFF, USE_PTX)
    combine_comb(logits, comb_out_ptr, m, hc_eps, rounds, HC, USE_PTX)
    return pre


@triton.jit
def combine_pre_post(mix_ptr, status_ptr, hc_scale_ptr, hc_base_ptr, pre_out_ptr, post_out_ptr,
                      m, tag, eps, hc_eps, wait_bound, HC: tl.constexpr, HIDDEN: tl.constexpr,
                      CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr, SLOTS: tl.constexpr,
                      MIX_ROW: tl.constexpr, TOTALS_OFF: tl.constexpr, USE_PTX: tl.constexpr):
    """Wait for every chunk's share of token m's mixes (bounded: a timeout sets
    ``NORM_TIMEOUT_BIT`` and makes them NaN), sum them in one fixed tree, and
    compute pre and post as ``reference.mhc_mixes_ref`` does; store them.
    Returns (pre as a tuple of HC scalars, comb's HC * HC logits [source,
    target] flat, for :func:`combine_comb`)."""
    NMIX: tl.constexpr = (2 + HC) * HC
    # The parameters first: their loads overlap the poll instead of following it.
    scale = (tl.load(hc_scale_ptr), tl.load(hc_scale_ptr + 1), tl.load(hc_scale_ptr + 2))
    base = ()
    for i in tl.static_range(NMIX):
        base = base + (tl.load(hc_base_ptr + i),)
    totals = _share_totals(mix_ptr, status_ptr, m, tag, wait_bound, CHUNKS, CHUNKS_P2, SLOTS,
                           MIX_ROW, USE_PTX)
    row = mix_ptr + m * MIX_ROW
    # The totals live one per thread group; every thread needs all of them.
    tl.store(row + TOTALS_OFF + tl.arange(0, SLOTS), tag_word(totals, tag))
    # This program's own stores, ordered by the CTA barrier: plain loads see them (from
    # L1; volatile ones would each be a system-scope round trip).
    tl.debug_barrier()
    total = ()
    for i in tl.static_range(NMIX + 1):
        total = total + (untag(tl.load(row + TOTALS_OFF + i)),)
    rstd = _mix_rstd(total[NMIX], eps, HC, HIDDEN, USE_PTX)
    pre = ()
    for t in tl.static_range(HC):
        pre = pre + (_pre_of(total[t], rstd, scale[0], base[t], hc_eps, USE_PTX),)
    for t in tl.static_range(HC):
        post = 2 * _sigmoid(_mul(_mul(total[HC + t], rstd, USE_PTX), scale[1], USE_PTX)
                            + base[HC + t], USE_PTX)
        tl.store(pre_out_ptr + m * HC + t, pre[t])
        tl.store(post_out_ptr + m * HC + t, post)
    logits = ()
    for i in tl.static_range(HC * HC):
        logits = logits + (_mul(_mul(total[2 * HC + i], rstd, USE_PTX), scale[2], USE_PTX)
                           + base[2 * HC + i],)
    return pre, logits


@triton.jit
def _mix_rstd(squares, eps, HC: tl.constexpr, HIDDEN: tl.constexpr, USE_PTX: tl.constexpr):
    """rsqrt(mean(s^2) + eps) of a token's HC * HIDDEN streams, from their sum of
    squares (one expression for every program that needs it: the same bits; the
    mean correctly rounded, ``div.rn``, with ``USE_PTX``)."""
    if USE_PTX:
        mean = tl.inline_asm_elementwise("div.rn.f32 $0, $1, $2;", "=r,r,r",
                                         [squares, tl.full(squares.shape, HC * HIDDEN,
                                                           tl.float32)],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        mean = squares / (HC * HIDDEN)
    return tl.math.rsqrt(mean + eps)


@triton.jit
def _pre_of(total, rstd, scale, base, hc_eps, USE_PTX: tl.constexpr):
    """One stream's pre from its summed dot (one expression: the same bits in
    every program that computes it)."""
    return _sigmoid(_mul(_mul(total, rstd, USE_PTX), scale, USE_PTX) + base, USE_PTX) + hc_eps


@triton.jit
def pre_from_shares(mix_ptr, status_ptr, hc_scale_ptr, hc_base_ptr, m, tag, eps, hc_eps,
                     wait_bound, HC: tl.constexpr, HIDDEN: tl.constexpr, CHUNKS: tl.constexpr,
                     CHUNKS_P2: tl.constexpr, SLOTS: tl.constexpr, MIX_ROW: tl.constexpr,
                     USE_PTX: tl.constexpr):
    """``SAME_PRE``: token m's pre computed by a program that does not combine,
    from the shares themselves (no hand-off from chunk 0, one L2 round trip
    less on the token's critical path): :func:`_share_totals` as in
    :func:`combine_pre_post`, so the same totals; the HC + 1 of them the pre
    needs come out of the [SLOTS] vector as masked sums (x plus zeros: exact),
    then the same expressions. Returns pre as a tuple of HC scalars (NaN where
    the poll gave up)."""
    NMIX: tl.constexpr = (2 + HC) * HC
    scale = tl.load(hc_scale_ptr)
    base = ()
    for t in tl.static_range(HC):
        base = base + (tl.load(hc_base_ptr + t),)
    totals = _share_totals(mix_ptr, status_ptr, m, tag, wait_bound, CHUNKS, CHUNKS_P2, SLOTS,
                           MIX_ROW, USE_PTX)
    k = tl.arange(0, SLOTS)
    rstd = _mix_rstd(tl.sum(tl.where(k == NMIX, totals, 0.0), axis=0), eps, HC, HIDDEN,
                     USE_PTX)
    pre = ()
    for t in tl.static_range(HC):
        pre = pre + (_pre_of(tl.sum(tl.where(k == t, totals, 0.0), axis=0), rstd, scale,
                             base[t], hc_eps, USE_PTX),)
    return pre


@triton.jit
def no_logits(HC: tl.constexpr):
    """HC * HC zeros: the comb logits of a program that does not combine."""
    logits = ()
    for _ in tl.static_range(HC * HC):
        logits = logits + (0.0,)
    return logits


@triton.jit
def combine_comb(logits, comb_out_ptr, m, hc_eps, rounds, HC: tl.constexpr,
                  USE_PTX: tl.constexpr):
    """comb [source, target] from its logits (flat s * HC + t): a softmax over
    t, ``+ hc_eps``, the column normalisation, then ``rounds`` Sinkhorn rounds
    (rows, then columns; run time), as ``reference.mhc_mixes_ref``; stored."""
    e = ()
    for s in tl.static_range(HC):
        top = logits[s * HC]
        for t in tl.static_range(1, HC):
            top = tl.maximum(top, logits[s * HC + t])
        for t in tl.static_range(HC):
            e = e + (_exp(logits[s * HC + t] - top, USE_PTX),)
    comb = ()
    for s in tl.static_range(HC):
        inverse = _reciprocal(_row_sum(e, s, HC), USE_PTX)  # >= 1: the top logit's term
        for t in tl.static_range(HC):
            comb = comb + (_mul(e[s * HC + t], inverse, USE_PTX) + hc_eps,)
    comb = _normalise_columns(comb, hc_eps, HC, USE_PTX)
    r = 0
    while r < rounds:
        comb = _normalise_columns(_normalise_rows(comb, hc_eps, HC, USE_PTX), hc_eps, HC,
                                  USE_PTX)
        r += 1
    for i in tl.static_range(HC * HC):
        tl.store(comb_out_ptr + m * HC * HC + i, comb[i])
