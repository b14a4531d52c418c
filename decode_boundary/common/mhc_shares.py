"""The shares of the next mHC mixes for a group of tokens, on tensor cores
(``reference.mhc_mixes_ref``'s dots; docs/DESIGN.md §5.1): device functions
of the kernels that compute them from a finished ``residual_out`` — the
mixes kernel (:mod:`decode_boundary.boundary.mixes_kernel`) and the GEMM
after the consumer (:mod:`decode_boundary.gemm.mxfp8_gemm_kernel`,
``FINISH_MIXES`` with ``SHARES``). The consumer's own per-token shares
(:mod:`decode_boundary.boundary.consumer_mixes`) load hc_fn the same way.

**Layout.** ``streams``: ``residual_out`` BF16 ``[M, HC, H]``; ``hc_fn``
FP32 ``[(2 + HC) * HC, HC * H]``; the mix rows int64 ``[rows, MIX_ROW]``
(``common.contract.mix_columns``: a ``SLOTS``-word share per chunk of
``BLOCK_H`` columns, then the combining program's sums). A *group program*
``(chunk, group)`` owns chunk ``chunk``'s columns of ``TOKENS`` tokens: it
holds that chunk's hc_fn (``chunk_parts``), computes the chunk's (2 + HC) *
HC dots and the sum of squares for every live token of its group and stores
them tagged into each token's row at ``chunk * SLOTS`` (the consumer's
shares, word for word in layout), then combines the tokens ``i`` of its
group with ``i = chunk mod CHUNKS`` (``common.mhc_combine``: a bounded poll
of the token's shares, one fixed sum, scalar sigmoid / softmax / Sinkhorn).
``COOPERATIVE=False`` (the interpreter, whose programs run one by one): one
program per group walks every chunk, then combines every token, so no poll
waits for a program that has not run.

**Tags.** A token's tag is ``generation[m]`` as the full-mode consumer
before left it (it advances it once per launch), read after the kernel's grid
wait: no earlier launch tagged that row with it, so a share that carries it
is this step's.

**The dots.** residual_out is BF16; hc_fn's FP32 columns are split into
three BF16 parts, hi + mid + lo = the value exactly for 2^-110 <= |x| <
3.39e38 and 0 (below, lo loses bits under BF16's subnormals, <= 2^-134
absolute; above, hi overflows), so each product is exact and only the
tensor cores' FP32 accumulation rounds: three BF16 MMAs per stream (an FP32
FMA dot took 18 µs of a 24 µs kernel at 4 warps; ``tf32x3`` lost 2 bits of
hc_fn and took ~5 µs; benchmarks/NOTES.md "V4-family mixes" items 4 and 6).
Without ``USE_PTX`` (the interpreter, whose BF16 dot is wrong, or PTX
switched off) the same parts are multiplied as FP32 (BF16 values, exact in
TF32 too). The sum of squares multiplies with ``mul.rn`` (``_mul``), so it
does not depend on the kernel's FMA contraction (the GEMM contracts, the
mixes kernel does not). The dots are not the reference's summation order:
pre/post/comb match it within FP32 rounding, not bit for bit.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .mhc_combine import _combine_mixes, _mul
from .tagged_words import _tagged

SHARE_TOKENS = 16  # tokens per group program: tl.dot's smallest M
# sm_90: 255 registers with the parts held (the mixes kernel), no spills, 16 KB shared
# (64 x 4: 168, but twice the shares to poll).
SHARE_BLOCK_H, SHARE_WARPS = 128, 4


@triton.jit
def _load_mix_weights(hc_fn_ptr, cols, cmask, HC: tl.constexpr, HIDDEN: tl.constexpr,
                      SLOTS: tl.constexpr):
    """Columns ``cols`` of ``hc_fn`` FP32 [(2 + HC) * HC, HC * H], one [SLOTS,
    BLOCK_H] tile per stream t (row j = mix j, rows >= (2 + HC) * HC zero), as
    a tuple."""
    NMIX: tl.constexpr = (2 + HC) * HC
    j = tl.arange(0, SLOTS)[:, None]
    fn = ()
    for t in tl.static_range(HC):
        fn = fn + (tl.load(hc_fn_ptr + j.to(tl.int64) * (HC * HIDDEN) + t * HIDDEN
                           + cols[None, :], mask=(j < NMIX) & cmask[None, :], other=0.0),)
    return fn


@triton.jit
def _split_bf16(fn, HC: tl.constexpr):
    """hc_fn's FP32 tiles as three BF16 tiles each, hi + mid + lo = the value
    exactly (8 + 8 + 8 significand bits; each remainder is exact in FP32): the
    dots' products with residual_out (BF16) are then exact on BF16 tensor
    cores. Flat tuple: stream t's parts at 3t .. 3t + 2, hi first."""
    parts = ()
    for t in tl.static_range(HC):
        hi = fn[t].to(tl.bfloat16)
        rest = fn[t] - hi.to(tl.float32)
        mid = rest.to(tl.bfloat16)
        parts = parts + (hi, mid, (rest - mid.to(tl.float32)).to(tl.bfloat16))
    return parts


@triton.jit
def chunk_parts(hc_fn_ptr, chunk, HC: tl.constexpr, HIDDEN: tl.constexpr,
                BLOCK_H: tl.constexpr, SLOTS: tl.constexpr):
    """Chunk ``chunk``'s columns of hc_fn, loaded and split (``_split_bf16``):
    what a group program holds (a weight: loaded before its grid wait)."""
    cols = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
    return _split_bf16(_load_mix_weights(hc_fn_ptr, cols, cols < HIDDEN, HC, HIDDEN, SLOTS), HC)


@triton.jit
def _store_shares(streams_ptr, hc_fn_ptr, mix_ptr, fn, chunk, tokens, live, tags,
                  HC: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr,
                  SLOTS: tl.constexpr, MIX_ROW: tl.constexpr, HELD: tl.constexpr,
                  USE_PTX: tl.constexpr):
    """Chunk ``chunk``'s share of every live token's mixes, tagged into its
    row: the dots, then the sum of squares (word (2 + HC) * HC), then +0.0.
    ``fn``: with ``HELD`` the chunk's hc_fn tiles as 3 * HC BF16 parts
    (:func:`chunk_parts`); else each stream's columns are loaded and split
    here, one stream at a time (a quarter of the registers)."""
    NMIX: tl.constexpr = (2 + HC) * HC
    offs = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = offs[None, :]
    rows = tokens[:, None]
    acc = tl.zeros((rows.shape[0], SLOTS), dtype=tl.float32)
    squares = tl.zeros((rows.shape[0],), dtype=tl.float32)
    for t in tl.static_range(HC):
        s = tl.load(streams_ptr + (rows * HC + t).to(tl.int64) * HIDDEN + cols,
                    mask=live[:, None] & (cols < HIDDEN), other=0.0)
        if HELD:
            parts = (fn[t * 3], fn[t * 3 + 1], fn[t * 3 + 2])
        else:
            j = tl.arange(0, SLOTS)[:, None]
            tile = tl.load(hc_fn_ptr + j.to(tl.int64) * (HC * HIDDEN) + t * HIDDEN + cols,
                           mask=(j < NMIX) & (cols < HIDDEN), other=0.0)
            parts = _split_bf16((tile,), 1)
        for part in tl.static_range(3):  # the smallest first
            if USE_PTX:
                acc = tl.dot(s, tl.trans(parts[2 - part]), acc)
            else:  # the interpreter's BF16 dot is wrong: FP32 operands
                acc = tl.dot(s.to(tl.float32), tl.trans(parts[2 - part].to(tl.float32)),
                             acc, input_precision="tf32")  # BF16 values: exact in TF32
        wide = s.to(tl.float32)
        squares = squares + tl.sum(_mul(wide, wide, USE_PTX), axis=1)
    j = tl.arange(0, SLOTS)[None, :]
    part = tl.where(j < NMIX, acc, tl.where(j == NMIX, squares[:, None], 0.0))
    tl.store(mix_ptr + rows * MIX_ROW + chunk * SLOTS + j, _tagged(part, tags[:, None]),
             mask=live[:, None])


@triton.jit
def group_shares(streams_ptr, hc_fn_ptr, generation_ptr, mix_ptr, fn, chunk, group, m_total,
                 HC: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr,
                 TOKENS: tl.constexpr, SLOTS: tl.constexpr, MIX_ROW: tl.constexpr,
                 HELD: tl.constexpr, COOPERATIVE: tl.constexpr, USE_PTX: tl.constexpr):
    """A group program's shares, after its grid wait (module docstring): chunk
    ``chunk``'s (``fn``: its parts, held with ``HELD``, else loaded here) for
    the live tokens of ``group``; without ``COOPERATIVE`` every chunk's. Returns the first
    of its tokens to combine and the step to the next (:func:`group_combine`)."""
    CHUNKS: tl.constexpr = (HIDDEN + BLOCK_H - 1) // BLOCK_H
    tokens = group * TOKENS + tl.arange(0, TOKENS)
    live = tokens < m_total
    tags = tl.load(generation_ptr + tokens, mask=live, other=0)
    if COOPERATIVE:
        _store_shares(streams_ptr, hc_fn_ptr, mix_ptr, fn, chunk, tokens, live, tags, HC, HIDDEN,
                      BLOCK_H, SLOTS, MIX_ROW, HELD, USE_PTX)
        first, step = chunk, CHUNKS
    else:
        for c in range(CHUNKS):
            _store_shares(streams_ptr, hc_fn_ptr, mix_ptr, fn, c, tokens, live, tags, HC, HIDDEN,
                          BLOCK_H, SLOTS, MIX_ROW, False, USE_PTX)
        tl.debug_barrier()  # this program's stores precede its polls (group_combine)
        first, step = tl.full((), 0, tl.int32), 1
    return first, step


@triton.jit
def group_combine(generation_ptr, mix_ptr, status_ptr, hc_scale_ptr, hc_base_ptr, pre_out_ptr,
                  post_out_ptr, comb_out_ptr, group, first, step, m_total, eps, hc_eps, rounds,
                  wait_bound, HC: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr,
                  TOKENS: tl.constexpr, SLOTS: tl.constexpr, MIX_ROW: tl.constexpr,
                  TOTALS_OFF: tl.constexpr, CHUNKS_P2: tl.constexpr, USE_PTX: tl.constexpr):
    """Combine the live tokens ``first``, ``first + step``, ... of ``group``
    (:func:`group_shares`'s answer) from their shares."""
    CHUNKS: tl.constexpr = (HIDDEN + BLOCK_H - 1) // BLOCK_H
    i = first
    while i < TOKENS:
        m = group * TOKENS + i
        if m < m_total:
            _combine_mixes(mix_ptr, status_ptr, hc_scale_ptr, hc_base_ptr, pre_out_ptr,
                           post_out_ptr, comb_out_ptr, m, tl.load(generation_ptr + m), eps,
                           hc_eps, rounds, wait_bound, HC, HIDDEN, CHUNKS, CHUNKS_P2, SLOTS,
                           MIX_ROW, TOTALS_OFF, USE_PTX)
        i += step
