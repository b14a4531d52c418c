"""References for the tests that share no code with the package: FP64 and
integer arithmetic written from the specs (docs/DESIGN.md §4 MXFP8, §5 the
consumer, §7 the GEMM), so a bug in a shared helper (``common/rounding.py``,
``mxfp8/format.py``) cannot hide on both sides of a comparison.

* :func:`bf16_rne`: one rounding of FP64 values to BF16, nearest even, from
  ``frexp`` and ``round`` (no bit tricks, no dtype cast that could round).
* :func:`e4m3_values` / :func:`e4m3_code`: e4m3fn decoded from its fields and
  encoded by nearest-value search in the table of all 127 non-negative finite
  codes, ties to the even code.
* :func:`quantize_mxfp8_fp64`: MXFP8 of a tensor (scale byte from ``frexp`` of
  the FP32 quotient amax/448: the smallest power of two >= it; elements by
  :func:`e4m3_code`), with :func:`swizzle` / :func:`unswizzle` built by a
  reshape/permute of the padded scale matrix (not the offset formula).
* :func:`gemm_fp64`: the FP64 product of decoded MXFP8 operands and
  ``sum_k |a_k w_k|``.
* :func:`check_rounded_once`: the bar "``out`` is the BF16 round-to-nearest-even
  of some value within ``eps`` of the FP64 result": exact (one allowed value)
  wherever the interval [exact - eps, exact + eps] does not straddle a BF16
  rounding boundary, and only there the neighbour 1 ulp away (more than one
  only where eps exceeds an ulp of the result: a sum that cancels).
"""

from __future__ import annotations

import math

import torch

U = 2.0**-24  # FP32 unit roundoff
E4M3_MAX = 448.0
GROUP = 32


def gamma(n: int) -> float:
    """Bound on the relative error of an FP32 sum of n terms in any order
    (Higham's gamma_{n-1}, rounded up to gamma_n): |fl(sum) - sum| <= gamma(n) * sum |x_i|."""
    return n * U / (1 - n * U)


# ----------------------------------------------------------------------- BF16


def bf16_rne(x: torch.Tensor) -> torch.Tensor:
    """FP64 ``x`` rounded once to BF16, nearest even (8 significant bits,
    subnormals at 2^-133 steps, +-inf past the largest finite value)."""
    x = x.double()
    finite = torch.isfinite(x) & (x != 0)
    safe = torch.where(finite, x, torch.ones_like(x))
    _, exponent = torch.frexp(safe)  # |x| in [2^(e-1), 2^e)
    ulp_exp = torch.clamp(exponent.double() - 8, min=-133.0)  # BF16 ulp of that binade
    ulp = torch.exp2(ulp_exp)
    rounded = torch.round(safe / ulp) * ulp  # torch.round: half to even; both steps exact
    largest = (2 - 2.0**-7) * 2.0**127
    rounded = torch.where(rounded.abs() > largest, torch.copysign(torch.full_like(x, math.inf),
                                                                  rounded), rounded)
    out = torch.where(finite, rounded, x)
    return out.to(torch.bfloat16)  # exact: every value is a BF16 value (or inf / nan / 0)


def check_rounded_once(out: torch.Tensor, exact: torch.Tensor, eps, what: str = "out",
                       min_strict: float = 0.5) -> int:
    """Assert every element of BF16 ``out`` is ``bf16_rne(v)`` for some v in
    [exact - eps, exact + eps] (``eps`` >= 0, broadcastable). RNE is monotonic,
    so the allowed values are the BF16 values from bf16_rne(exact - eps) to
    bf16_rne(exact + eps): one value unless the interval straddles a rounding
    boundary, then the neighbour 1 ulp away too (more only where eps exceeds an
    ulp of the result, e.g. a sum that cancels). Also asserts that at least
    ``min_strict`` of the elements have a single allowed value (so the check is
    sharp enough to tell rounding modes apart). Returns the number of elements
    allowed more than one value."""
    exact = exact.double().cpu()
    eps = torch.as_tensor(eps, dtype=torch.float64).expand_as(exact)
    got = out.reshape(exact.shape).double().cpu()
    lo, hi = bf16_rne(exact - eps).double(), bf16_rne(exact + eps).double()
    assert not bool(got.isnan().any()), f"{what}: NaN where FP64 gives {exact[got.isnan()][:4]}"
    ok = (got >= lo) & (got <= hi)
    if not bool(ok.all()):
        idx = tuple(int(i) for i in (~ok).nonzero()[0])
        raise AssertionError(
            f"{what}{list(idx)} = {got[idx].item()!r}, allowed {lo[idx].item()!r} .. "
            f"{hi[idx].item()!r} (FP64 {exact[idx].item()!r}, eps {eps[idx].item():.3g}); "
            f"{int((~ok).sum())} of {ok.numel()} elements wrong")
    loose = int((lo != hi).sum())
    assert ok.numel() - loose >= min_strict * ok.numel(), \
        f"{what}: only {ok.numel() - loose} of {ok.numel()} elements pinned exactly"
    return loose


# ----------------------------------------------------------------------- e4m3


def e4m3_values(codes: torch.Tensor) -> torch.Tensor:
    """FP64 values of e4m3fn bytes (sign | 4 exponent bits, bias 7 | 3 mantissa
    bits; exponent 0: subnormals m/8 * 2^-6; 0x7F / 0xFF: NaN)."""
    c = codes.to(torch.int64)
    sign = (c >> 7) & 1
    e = ((c >> 3) & 0xF).double()
    m = (c & 7).double()
    magnitude = torch.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * torch.exp2(e - 7))
    value = torch.where(sign == 1, -magnitude, magnitude)
    return torch.where((c & 0x7F) == 0x7F, torch.full_like(value, math.nan), value)


_E4M3_TABLE = e4m3_values(torch.arange(0x7F))  # codes 0..126: 0 .. 448, ascending


def e4m3_code(v: torch.Tensor) -> torch.Tensor:
    """e4m3fn byte (int64) of FP64 ``v`` (finite, |v| <= 448): the nearest
    table value, ties to the even code (even last mantissa bit), sign kept
    (also on a zero)."""
    a = v.abs().contiguous()
    hi = torch.searchsorted(_E4M3_TABLE, a).clamp(max=0x7E)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - _E4M3_TABLE[lo], _E4M3_TABLE[hi] - a
    pick = torch.where(d_hi < d_lo, hi, torch.where(d_lo < d_hi, lo,
                                                    torch.where(lo % 2 == 0, lo, hi)))
    return pick | (torch.signbit(v).to(torch.int64) << 7)


# ----------------------------------------------------------------------- MXFP8


def scale_bytes_fp64(amax: torch.Tensor, has_nan: torch.Tensor) -> torch.Tensor:
    """UE8M0 byte (int64) per group: q = amax / 448 rounded to FP32; 0 for q = 0,
    1 for an FP32-subnormal q, else 127 + the exponent of the smallest power of
    two >= q; 254 for inf / NaN groups."""
    q = (amax.double() / E4M3_MAX).float().double()  # one FP32 rounding of the quotient
    mant, ex = torch.frexp(torch.where(torch.isfinite(q) & (q > 0), q, torch.ones_like(q)))
    power = torch.where(mant == 0.5, ex - 1, ex).to(torch.int64)  # 2^power >= q, smallest
    byte = (power + 127).clamp(0, 254)
    byte = torch.where(q < 2.0**-126, torch.ones_like(byte), byte)
    byte = torch.where(q == 0, torch.zeros_like(byte), byte)
    return torch.where(torch.isinf(q) | has_nan, torch.full_like(byte, 254), byte)


def quantize_mxfp8_fp64(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 bytes uint8 [rows, K], scale bytes uint8 [rows, K/32]) of a float
    tensor [..., K] by docs/DESIGN.md §4, in FP64/integer arithmetic."""
    k = x.shape[-1]
    xd = x.reshape(-1, k).double().cpu()
    rows = xd.shape[0]
    grouped = xd.view(rows, k // GROUP, GROUP)
    nan = grouped.isnan()
    amax = torch.where(nan, torch.zeros_like(grouped), grouped.abs()).amax(-1)
    byte = scale_bytes_fp64(amax, nan.any(-1))
    scaled = grouped / torch.exp2(byte.double() - 127)[..., None]  # a power of two: exact
    clamped = scaled.clamp(-E4M3_MAX, E4M3_MAX)
    code = e4m3_code(torch.where(nan, torch.zeros_like(clamped), clamped))
    code = torch.where(nan, torch.full_like(code, 0x7F), code)
    return code.view(rows, k).to(torch.uint8), byte.to(torch.uint8)


def swizzle(scales: torch.Tensor) -> torch.Tensor:
    """[rows, G] scale bytes -> the 1-D 128x4 layout (rows padded to 128, groups
    to 4, zeros): tiles [row tile][K tile], each 32 lines of 16 bytes, line i
    holding rows i, i+32, i+64, i+96 with 4 groups each."""
    rows, groups = scales.shape
    r_pad, g_pad = -(-rows // 128) * 128, -(-groups // 4) * 4
    padded = torch.zeros(r_pad, g_pad, dtype=torch.uint8)
    padded[:rows, :groups] = scales.cpu()
    # row = rt*128 + quarter*32 + i, group = kt*4 + j  ->  order (rt, kt, i, quarter, j)
    tiles = padded.view(r_pad // 128, 4, 32, g_pad // 4, 4)
    return tiles.permute(0, 3, 2, 1, 4).reshape(-1)


def unswizzle(buf: torch.Tensor, rows: int, groups: int) -> torch.Tensor:
    """Inverse of :func:`swizzle`: the [rows, G] scale bytes."""
    r_pad, g_pad = -(-rows // 128) * 128, -(-groups // 4) * 4
    tiles = buf.cpu()[: r_pad * g_pad].view(r_pad // 128, g_pad // 4, 32, 4, 4)
    return tiles.permute(0, 3, 2, 1, 4).reshape(r_pad, g_pad)[:rows, :groups]


def mxfp8_bytes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 bytes [rows, K], whole swizzled scale buffer) of ``x``."""
    data, scales = quantize_mxfp8_fp64(x)
    return data, swizzle(scales)


def assert_mxfp8_equal(data: torch.Tensor, scale_buf: torch.Tensor, x: torch.Tensor,
                       what: str = "mxfp8") -> None:
    """``data`` (e4m3) and ``scale_buf`` (swizzled, padding included) are the
    MXFP8 of ``x`` byte for byte."""
    want_data, want_scales = quantize_mxfp8_fp64(x)
    got = data.reshape(want_data.shape).view(torch.uint8).cpu()
    bad = got != want_data
    assert not bool(bad.any()), (f"{what}: {int(bad.sum())} element bytes differ, first at "
                                 f"{bad.nonzero()[0].tolist()}")
    rows, groups = want_scales.shape
    got_scales = unswizzle(scale_buf, rows, groups)
    assert torch.equal(got_scales, want_scales), \
        f"{what}: scale bytes differ at {(got_scales != want_scales).nonzero()[:4].tolist()}"
    assert torch.equal(scale_buf.cpu(), swizzle(want_scales)), f"{what}: scale padding differs"


def decode_mxfp8(data: torch.Tensor, scale_buf: torch.Tensor) -> torch.Tensor:
    """FP64 values [rows, K] of e4m3 ``data`` with its swizzled scales."""
    rows, k = data.shape
    scales = unswizzle(scale_buf, rows, k // GROUP).to(torch.int64)
    values = e4m3_values(data.contiguous().view(torch.uint8).cpu()).view(rows, k // GROUP, GROUP)
    return (values * torch.exp2(scales.double() - 127)[..., None]).view(rows, k)


# ----------------------------------------------------------------------- GEMM


def gemm_fp64(a: torch.Tensor, w: torch.Tensor, groups: int = 1):
    """(FP64 a @ w^T [M, N], sum_k |a_k w_k| [M, N]) of FP64 values ``a``
    [M, G*K] and ``w`` [N, K] (grouped: group g of the output columns takes
    activation columns [g*K, (g+1)*K))."""
    rows = a.shape[0]
    n, k = w.shape
    av = a.view(rows, groups, k)
    wv = w.view(groups, n // groups, k)
    exact = torch.einsum("mgk,gnk->mgn", av, wv).reshape(rows, n)
    mag = torch.einsum("mgk,gnk->mgn", av.abs(), wv.abs()).reshape(rows, n)
    return exact, mag


def layer_values(layer) -> torch.Tensor:
    """FP64 [N, K] weight of an MXFP8 layer (column-major [K, N] e4m3 view,
    swizzled (N, K/32) scales), decoded independently."""
    return decode_mxfp8(layer.weight.t(), layer.weight_scale)


def check_gemm(out: torch.Tensor, a_values: torch.Tensor, w_values: torch.Tensor,
               groups: int = 1, exact_sums: bool = False, depth: int | None = None,
               what: str = "gemm", min_strict: float = 0.5) -> int:
    """The GEMM bar: ``out`` is the FP64 product rounded once to BF16 (nearest
    even). ``exact_sums``: the operands make every FP32 partial sum exact (asserted
    here), so the bar is exact for every element; otherwise FP32 accumulation may
    move the sum by gamma(depth) * sum|a w| before the rounding (``depth``: the
    most FP32 additions one product goes through, K in any order; see
    :func:`summation_depth`), and an element whose interval straddles a BF16
    rounding boundary may take the neighbour 1 ulp away (check_rounded_once).
    Returns the count of such elements."""
    exact, mag = gemm_fp64(a_values, w_values, groups)
    k = w_values.shape[1]
    if exact_sums:
        assert_fp32_exact(a_values, w_values, groups)
        eps = torch.zeros_like(exact)
    else:
        eps = gamma(min(k, depth or k)) * mag + 2.0**-50 * mag  # + the FP64 sum's own error
    return check_rounded_once(out, exact, eps, what, min_strict)


def summation_depth(k: int, tactic) -> int:
    """Most FP32 additions a product goes through in the GEMM kernel's order
    (gemm/mxfp8_gemm_kernel.py): CUDA-core tiles sum 32 products per group,
    then a piece's groups, then the pieces and the splits; tensor-core tiles
    sum a piece's CHUNK products in tl.dot (any order), then pieces and splits."""
    chunk = tactic.chunk_k
    pieces = -(-(-(-(k // 32) // tactic.split_k) * 32) // chunk)
    per_piece = 32 + chunk // 32 if tactic.rows_tile <= 8 else chunk
    return per_piece + pieces + tactic.split_k


def assert_fp32_exact(a: torch.Tensor, w: torch.Tensor, groups: int = 1) -> None:
    """Precondition of an exact GEMM bar, checked without forming the products:
    every product a_k w_k of output (m, n) is a multiple of u = (smallest
    lowest-set-bit of row m of a) x (that of row n of w), and sum_k |a_k w_k|
    < 2^24 u (u >= 2^-126, sums < 2^127), so every FP32 partial sum, in any
    order, is an exact FP32 value."""
    rows = a.shape[0]
    n, k = w.shape
    a_unit = _unit(a.view(rows, groups, k))  # [rows, groups]
    w_unit = _unit(w.view(groups, n // groups, k))  # [groups, n / groups]
    unit = (a_unit[:, :, None] * w_unit[None]).reshape(rows, n)
    mag = torch.einsum("mgk,gnk->mgn", a.view(rows, groups, k).abs(),
                       w.view(groups, n // groups, k).abs()).reshape(rows, n)
    ok = (mag == 0) | ((mag < 2.0**24 * unit) & (unit >= 2.0**-126) & (mag < 2.0**127))
    assert bool(ok.all()), "operands do not make the FP32 sums exact"


def _unit(x: torch.Tensor) -> torch.Tensor:
    """Smallest lowest-set-bit value over the nonzero entries of the last dim."""
    nz = x != 0
    low = torch.where(nz, _lowest_bit(torch.where(nz, x, torch.ones_like(x))),
                      torch.full_like(x, math.inf))
    return low.amin(-1)


def assert_sum_exact(terms: torch.Tensor, what: str = "terms") -> None:
    """Assert that every FP32 sum of ``terms`` [..., n] (FP64 values) along the
    last dim is exact, in any order: each term is an FP32 value, every nonzero
    term is a multiple of the smallest lowest-set-bit among them, and sum |t| is
    below 2^24 of that unit, so every partial sum is an FP32 value."""
    assert torch.equal(terms.float().double(), terms), f"{what}: not FP32 values"
    nz = terms != 0
    lowest = torch.where(nz, _lowest_bit(torch.where(nz, terms, torch.ones_like(terms))),
                         torch.full_like(terms, math.inf))
    unit = lowest.amin(-1)
    mag = terms.abs().sum(-1)
    ok = (mag == 0) | (mag < 2.0**24 * unit)
    assert bool(ok.all()), f"{what}: the FP32 sums are not exact"


def _lowest_bit(p: torch.Tensor) -> torch.Tensor:
    """2^j of the lowest set bit of each (nonzero) FP64 value's significand."""
    mant, ex = torch.frexp(p.abs())
    m = (mant * 2.0**53).to(torch.int64)  # the significand as an integer < 2^53
    return (m & -m).double() * torch.exp2(ex.double() - 53)


# ----------------------------------------------------------------------- consumer


def consumer_fp64(partials, residual, post, comb, pre, norm_weight, eps: float,
                  exact_sums: bool = True):
    """docs/DESIGN.md §5 in FP64 with its BF16 rounding points (each an FP64
    value rounded once): reduced, residual_out (mixed) and prenorm as BF16,
    then the RMSNorm in FP64. Returns (residual_out BF16 [M, hc, H], prenorm
    FP64 [M, H], layer_input FP64 [M, H] before its rounding, and the bound
    ``eps_layer`` [M, H] an FP32 computation of that last step may be off by).

    ``exact_sums``: assert that every FP32 sum before the norm is exact for
    these inputs (then an FP32 implementation's reduced / residual_out /
    prenorm must equal these bits). The norm's bound: the FP32 sum of H
    squares in any order (gamma(H + 1) relative, also covering / H and
    + eps), an rsqrt within 4 FP32 ulps (the interpreter's 1 / sqrt rounds
    twice, the GPU's rsqrt.approx is within 2^-22.9), and two products:
    |error| <= |y| * (gamma(H + 1) / 2 + 8u)."""
    xs = torch.stack([x.double().cpu() for x in partials])  # [tp, M, H]
    res, post, comb = residual.double().cpu(), post.double().cpu(), comb.double().cpu()
    if exact_sums:
        assert_sum_exact(xs.movedim(0, -1), "partials")
    reduced = bf16_rne(xs.sum(0)).double()
    hc = res.shape[1]
    mixed = []
    for t in range(hc):
        terms = torch.stack([reduced * post[:, t, None]] +
                            [res[:, s] * comb[:, s, t, None] for s in range(hc)], -1)
        if exact_sums:
            assert_sum_exact(terms, "mixing")
        mixed.append(bf16_rne(terms.sum(-1)))
    residual_out = torch.stack(mixed, 1)
    if pre is None:
        return residual_out, None, None, None
    pre = pre.double().cpu()
    terms = torch.stack([mixed[t].double() * pre[:, t, None] for t in range(hc)], -1)
    if exact_sums:
        assert_sum_exact(terms, "collapse")
    prenorm = bf16_rne(terms.sum(-1)).double()
    h = prenorm.shape[-1]
    mean_sq = (prenorm * prenorm).sum(-1, keepdim=True) / h
    y = prenorm / torch.sqrt(mean_sq + eps) * norm_weight.double().cpu()
    return residual_out, prenorm, y, y.abs() * (gamma(h + 1) / 2 + 8 * U)


def mhc_mixes_fp64(streams, hc_fn, hc_scale, hc_base, rms_eps: float, hc_eps: float,
                   iters: int):
    """A sublayer's mHC mixes (docs/DESIGN.md §5.1) in FP64, token by token and
    entry by entry with Python floats for the 4 x 4 part (not the package's
    tensor code): (pre, post, comb) as FP64 tensors."""
    m, hc, h = streams.shape
    s = streams.double().reshape(m, hc * h)
    fn = hc_fn.double()
    scale = [float(v) for v in hc_scale]
    base = [float(v) for v in hc_base]
    pre = torch.empty(m, hc, dtype=torch.float64)
    post = torch.empty(m, hc, dtype=torch.float64)
    comb = torch.empty(m, hc, hc, dtype=torch.float64)

    def sigmoid(v):
        return 1.0 / (1.0 + math.exp(-v))

    for t in range(m):
        r = 1.0 / math.sqrt(float((s[t] * s[t]).sum()) / (hc * h) + rms_eps)
        mixes = [float((fn[j] * s[t]).sum()) * r for j in range((2 + hc) * hc)]
        for i in range(hc):
            pre[t, i] = sigmoid(mixes[i] * scale[0] + base[i]) + hc_eps
            post[t, i] = 2.0 * sigmoid(mixes[hc + i] * scale[1] + base[hc + i])
        logit = [[mixes[2 * hc + a * hc + b] * scale[2] + base[2 * hc + a * hc + b]
                  for b in range(hc)] for a in range(hc)]  # [source][target]
        c = []
        for row in logit:
            top = max(row)
            e = [math.exp(v - top) for v in row]
            c.append([v / sum(e) + hc_eps for v in e])

        def by_columns(c):
            sums = [sum(c[a][b] for a in range(hc)) + hc_eps for b in range(hc)]
            return [[c[a][b] / sums[b] for b in range(hc)] for a in range(hc)]

        c = by_columns(c)
        for _ in range(iters - 1):
            c = [[v / (sum(row) + hc_eps) for v in row] for row in c]
            c = by_columns(c)
        comb[t] = torch.tensor(c, dtype=torch.float64)
    return pre, post, comb
