"""The consumer / finalize references against independent FP64 formulas.

Tolerances (per element, ``ulp`` = BF16 ulp of the FP64 value):

* reduced, residual_out, prenorm: the reference accumulates a handful of
  terms in FP32 (relative error <= n * 2^-24 of the sum of |terms|), then rounds
  once to BF16 (<= ulp / 2). So |ref - exact| <= ulp/2 + n * 2^-24 * sum|terms|.
* layer_input: from the reference's BF16 prenorm (a <= 2^-8 relative
  perturbation of the exact prenorm, which moves the result by < 1 ulp, the
  ulp being >= 2^-8 of |value|) and one final rounding (<= ulp / 2):
  <= 1.5 ulp, plus FP32 slack.
* the MXFP8 of layer_input: byte for byte the independent FP64/integer
  quantization (tests/helpers/independent_ref.py).

An eps that matters (eps = 1 next to mean squares below, near and above it, and
all-zero rows), with an exact bar: tests/boundary/test_consumer_numerics.py.
"""

import pytest
import torch
from independent_ref import assert_mxfp8_equal

from decode_boundary.boundary.reference import (
    consumer_ref,
    moe_finalize_ref,
    reduce_ref,
)
from decode_boundary.gemm.reference import bf16_ulp


def inputs(m, hc, h, tp, seed):
    g = torch.Generator().manual_seed(seed)
    partials = [torch.randn(m, h, generator=g).bfloat16() for _ in range(tp)]
    residual = torch.randn(m, hc, h, generator=g).bfloat16()
    post = torch.rand(m, hc, generator=g) * 2
    comb = torch.rand(m, hc, hc, generator=g)
    pre = torch.rand(m, hc, generator=g)
    gamma = (1 + 0.1 * torch.randn(h, generator=g)).bfloat16()
    return partials, residual, post, comb, pre, gamma


def within(ref, exact, slack):
    ref, exact = ref.double(), exact.double()
    err = (ref - exact).abs()
    tol = bf16_ulp(exact) / 2 + slack
    assert bool((err <= tol).all()), f"max excess {(err - tol).max().item()}"


@pytest.mark.parametrize("tp,hc", [(1, 1), (2, 4), (4, 3)])
def test_consumer_ref_against_fp64(tp, hc):
    m, h, eps = 3, 256, 1e-6
    partials, residual, post, comb, pre, gamma = inputs(m, hc, h, tp, seed=tp * 10 + hc)
    residual_out, layer_input, quantized = consumer_ref(partials, residual, post, comb, pre,
                                                        gamma, eps, quantize=True)

    stack = torch.stack([x.double() for x in partials])
    reduced = reduce_ref(partials)
    within(reduced, stack.sum(0), tp * 2.0**-24 * stack.abs().sum(0))

    red, res = reduced.double(), residual.double()
    terms = [red[:, None, :] * post.double()[:, :, None]]  # [m, t, h]
    terms += [res[:, s, None, :] * comb.double()[:, s, :, None] for s in range(hc)]
    exact_mixed = sum(terms)
    mag = sum(t.abs() for t in terms)
    within(residual_out, exact_mixed, (hc + 1) * 2.0**-24 * mag)

    mixed = residual_out.double()
    prenorm = (mixed * pre.double()[:, :, None]).sum(1)
    rstd = torch.rsqrt((prenorm**2).mean(-1, keepdim=True) + eps)
    exact = prenorm * rstd * gamma.double()
    err = (layer_input.double() - exact).abs()
    pre_mag = (mixed.abs() * pre.double()[:, :, None]).sum(1) * rstd * gamma.double().abs()
    assert bool((err <= 1.5 * bf16_ulp(exact) + (hc + 4) * 2.0**-24 * pre_mag + 1e-30).all())

    # Its MXFP8 against the independent FP64/integer quantization (not against
    # quantize_mxfp8_ref, which consumer_ref itself calls).
    assert_mxfp8_equal(quantized.data, quantized.scale, layer_input)


def test_residual_only_and_signed_zero():
    partials, residual, post, comb, _, gamma = inputs(2, 2, 64, 2, seed=5)
    flipped = [torch.where(x == 0, torch.zeros_like(x), x) for x in partials]
    flipped[0][0, :4] = -0.0  # a -0 partial must not change anything (publish makes it +0)
    flipped[1][0, :4] = 0.0
    a = consumer_ref(partials, residual, post, comb, None, gamma, 1e-6)
    assert a[1] is None and a[2] is None
    b = consumer_ref(flipped, residual, post, comb, None, gamma, 1e-6)
    zero_partials = [p.clone() for p in partials]
    for p in zero_partials:
        p[0, :4] = 0.0
    c = consumer_ref(zero_partials, residual, post, comb, None, gamma, 1e-6)
    assert torch.equal(b[0].view(torch.int16), c[0].view(torch.int16))
    assert reduce_ref(flipped)[0, :4].view(torch.int16).eq(0).all()


def test_consumer_ref_errors():
    partials, residual, post, comb, pre, gamma = inputs(2, 2, 64, 2, seed=1)
    with pytest.raises(ValueError, match="partials"):
        consumer_ref([], residual, post, comb, pre, gamma, 1e-6)
    with pytest.raises(ValueError, match="comb"):
        consumer_ref(partials, residual, post, comb[:, :1], pre, gamma, 1e-6)
    with pytest.raises(ValueError, match="post"):
        consumer_ref(partials, residual, post.double(), comb, pre, gamma, 1e-6)
    with pytest.raises(ValueError, match="quantize"):
        consumer_ref(partials, residual, post, comb, None, gamma, 1e-6, quantize=True)


def test_moe_finalize_ref_against_fp64():
    g = torch.Generator().manual_seed(3)
    m, k, h, rows = 4, 3, 64, 7
    gemm2 = torch.randn(rows, h, generator=g).bfloat16()
    w = torch.rand(m, k, generator=g)
    idx = torch.randint(-1, rows, (m, k), generator=g, dtype=torch.int32)
    idx[0] = -1  # a token with no local expert: only the shared output
    shared = torch.randn(m, h, generator=g).bfloat16()
    out = moe_finalize_ref(gemm2, w, idx, shared)
    picked = gemm2.double()[idx.clamp(min=0).long()] * (idx >= 0)[..., None]
    terms = w.double()[..., None] * picked
    exact = terms.sum(1) + shared.double()
    mag = terms.abs().sum(1) + shared.double().abs()
    within(out, exact, (k + 1) * 2.0**-24 * mag)
    assert torch.equal(out[0], shared[0])
    with pytest.raises(ValueError, match="past"):
        moe_finalize_ref(gemm2, w, torch.full_like(idx, rows), shared)
