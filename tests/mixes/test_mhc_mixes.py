"""The reference of a sublayer's mHC mixes (``mixes.reference.mhc_mixes_ref``,
docs/DESIGN.md §5.1) against an independent FP64 computation
(tests/helpers/independent_ref.py ``mhc_mixes_fp64``), the properties the spec
implies, and its argument checks.

Bars: the reference is FP32. Its dots are length hc * H = 1024 sums of
products of values of magnitude ~1 (streams) and ~0.05 (hc_fn): an FP32 error
of at most ~1e-5 relative to the sum of |terms|, far below what moves a sigmoid
or a softmax by 1e-5 absolute. The Sinkhorn rounds are divisions by sums of
positive numbers, each rounding adding a relative ~6e-8: 20 rounds stay well
inside 1e-5. So pre, post and comb agree with FP64 within 1e-5 absolute, and a
wrong orientation, a missing round or a missing eps moves them by far more
(checked below)."""

import pytest
import torch
from independent_ref import mhc_mixes_fp64

from decode_boundary.mixes.reference import mhc_mixes_ref

HC, H = 4, 256
HC_EPS, ITERS = 1e-6, 20
BAR = 1e-5  # pre / post / comb against FP64 (the docstring says why)


def params(seed, hc=HC, h=H, fn_std=0.05):
    g = torch.Generator().manual_seed(seed)
    n = (2 + hc) * hc
    return dict(hc_fn=torch.randn(n, hc * h, generator=g) * fn_std,
                hc_scale=torch.rand(3, generator=g) + 0.5,
                hc_base=torch.randn(n, generator=g) * 0.5)


def streams(seed, m=5, hc=HC, h=H):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(m, hc, h, generator=g).bfloat16()
    s[0] = 0  # an all-zero token: only rms_eps keeps rsqrt finite
    return s


# The released values (rms_eps 1e-20 / 1e-6, hc_eps 1e-6, 20 rounds) and values at which
# each step is visible above the bar: after 20 rounds Sinkhorn has converged, and the
# limit does not depend on which axis the softmax normalised (the two differ by a
# diagonal scaling) nor on one round more or less, and hc_eps = 1e-6 is below the bar;
# with 1-2 rounds and hc_eps = 0.1 each of them moves the result.
@pytest.mark.parametrize("rms_eps,hc_eps,iters", [(1e-20, HC_EPS, ITERS), (1e-6, HC_EPS, ITERS),
                                                   (1.0, HC_EPS, ITERS), (1e-6, 0.1, 1),
                                                   (1e-6, 0.1, 2), (1e-6, 0.1, 3)])
def test_mixes_match_fp64(rms_eps, hc_eps, iters):
    s, p = streams(1), params(2, fn_std=0.2)
    pre, post, comb = mhc_mixes_ref(s, **p, rms_eps=rms_eps, hc_eps=hc_eps,
                                    sinkhorn_iters=iters)
    want = mhc_mixes_fp64(s, **p, rms_eps=rms_eps, hc_eps=hc_eps, iters=iters)
    for got, exp, name in zip((pre, post, comb), want, ("pre", "post", "comb"), strict=True):
        assert got.dtype == torch.float32 and got.shape == exp.shape, name
        err = (got.double() - exp).abs().max().item()
        assert err <= 1e-5, (name, err)
    assert bool(torch.isfinite(comb).all())


def test_spec_properties():
    """pre in (hc_eps, 1 + hc_eps), post in (0, 2); comb positive, its columns
    summing to 1 up to hc_eps (the last step divides by them) and its rows
    within the convergence of 20 rounds."""
    pre, post, comb = mhc_mixes_ref(streams(3), **params(4), rms_eps=1e-6, hc_eps=HC_EPS,
                                    sinkhorn_iters=ITERS)
    assert bool(((pre > HC_EPS) & (pre < 1 + HC_EPS)).all())
    assert bool(((post > 0) & (post < 2)).all())
    assert bool((comb > 0).all())
    assert torch.allclose(comb.sum(dim=-2), torch.ones(5, HC), atol=1e-5)
    assert torch.allclose(comb.sum(dim=-1), torch.ones(5, HC), atol=1e-3)


def test_orientation_rounds_and_eps_are_each_visible():
    """Each plausible mistake moves the result by far more than the bar."""
    s, p = streams(5), params(6, fn_std=0.2)
    kw = dict(rms_eps=1e-6, hc_eps=HC_EPS)
    pre, post, comb = mhc_mixes_ref(s, **p, **kw, sinkhorn_iters=ITERS)
    _, _, one_round = mhc_mixes_ref(s, **p, **kw, sinkhorn_iters=1)
    assert (comb - one_round).abs().max() > 1e-3  # the rounds matter
    # comb is [source, target]: softmax along target. Transposed logits give another matrix.
    t = dict(p, hc_base=torch.cat([p["hc_base"][:2 * HC],
                                   p["hc_base"][2 * HC:].view(HC, HC).t().reshape(-1)]))
    t["hc_fn"] = torch.cat([p["hc_fn"][:2 * HC],
                            p["hc_fn"][2 * HC:].view(HC, HC, -1).transpose(0, 1)
                            .reshape(HC * HC, -1)])
    _, _, transposed = mhc_mixes_ref(s, **t, **kw, sinkhorn_iters=ITERS)
    assert (transposed.transpose(-1, -2) - comb).abs().max() > 1e-3
    # rms_eps enters: at eps = 1 the small token's mixes shrink visibly.
    small = s * 0.01
    a = mhc_mixes_ref(small.bfloat16(), **p, rms_eps=1e-6, hc_eps=HC_EPS, sinkhorn_iters=ITERS)
    b = mhc_mixes_ref(small.bfloat16(), **p, rms_eps=1.0, hc_eps=HC_EPS, sinkhorn_iters=ITERS)
    assert (a[0] - b[0])[1:].abs().max() > 1e-3
    # The zero token: mixes are 0, so pre / post come from the bases alone.
    base = p["hc_base"]
    assert torch.allclose(pre[0], torch.sigmoid(base[:HC]) + HC_EPS)
    assert torch.allclose(post[0], 2 * torch.sigmoid(base[HC:2 * HC]))


def test_bad_arguments_are_refused():
    s, p = streams(7), params(8)
    with pytest.raises(ValueError, match=r"hc_fn must be float32 \[24, 1024\]"):
        mhc_mixes_ref(s, **dict(p, hc_fn=p["hc_fn"][:, :-1]), rms_eps=1e-6, hc_eps=HC_EPS,
                      sinkhorn_iters=ITERS)
    with pytest.raises(ValueError, match="hc_scale must be float32"):
        mhc_mixes_ref(s, **dict(p, hc_scale=p["hc_scale"].double()), rms_eps=1e-6,
                      hc_eps=HC_EPS, sinkhorn_iters=ITERS)
    with pytest.raises(ValueError, match="sinkhorn_iters"):
        mhc_mixes_ref(s, **p, rms_eps=1e-6, hc_eps=HC_EPS, sinkhorn_iters=0)
    with pytest.raises(ValueError, match="streams must be"):
        mhc_mixes_ref(s[0], **p, rms_eps=1e-6, hc_eps=HC_EPS, sinkhorn_iters=ITERS)


def _sinkhorn(logits, hc_eps, iters, reciprocal):
    """The kernel's comb from [N, hc, hc] logits: softmax over the target,
    then the normalisations, each as a product with ``reciprocal(sum)``."""
    e = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
    comb = e * reciprocal(e.sum(dim=-1, keepdim=True)) + hc_eps
    comb = comb * reciprocal(comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb * reciprocal(comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb * reciprocal(comb.sum(dim=-2, keepdim=True) + hc_eps)
    return comb


def test_the_gpu_combines_reciprocals_stay_inside_the_bar():
    """On the GPU the combine normalises by ``rcp.approx.ftz.f32`` (within 1
    ulp; consumer_mixes._reciprocal), which the interpreter cannot show: FP32
    Sinkhorn rounds whose every reciprocal is off by one ulp, up or down at
    random, stay within a tenth of the 1e-5 bar of FP64 over 4096 tokens of
    wide logits, while reciprocals off by 2^-12 relative miss it."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(4096, HC, HC, generator=g) * 3
    want = _sinkhorn(logits.double(), HC_EPS, ITERS, torch.reciprocal)

    def off(relative):  # up or down by ``relative`` at random
        def reciprocal(x):
            r = torch.reciprocal(x)
            up = torch.rand(r.shape, generator=g) < 0.5
            return torch.where(up, r * (1 + relative), r * (1 - relative))
        return reciprocal

    def one_ulp(x):  # the neighbouring FP32 value, up or down at random
        r = torch.reciprocal(x)
        up = torch.rand(r.shape, generator=g) < 0.5
        return torch.where(up, torch.nextafter(r, torch.full_like(r, float("inf"))),
                           torch.nextafter(r, torch.zeros_like(r)))

    err = (_sinkhorn(logits, HC_EPS, ITERS, one_ulp).double() - want).abs().max().item()
    assert err < BAR / 10, err
    coarse = (_sinkhorn(logits, HC_EPS, ITERS, off(2.0 ** -12)).double() - want).abs().max()
    assert coarse > BAR, coarse.item()
