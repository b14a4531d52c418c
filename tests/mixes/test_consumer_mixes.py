"""The consumer with the next sublayer's mHC mixes (``consume(mixes=...)``,
docs/DESIGN.md §5.1): pre / post / comb against the independent FP64
computation, everything else bit for bit against the path without mixes given
the same pre, both collapses ("previous": V4.1, "same": V4), serial and
cooperative launches, stale scratch, and the argument checks.

Bar for pre / post / comb: 1e-5 absolute, the FP32 reference's own bar
(tests/mixes/test_mhc_mixes.py gives the derivation). The kernel's dots are sums of
per-chunk tree sums, not the reference's order, which changes them by FP32
rounding of the same size (length hc * H = 1024 here; 20480 at H = 5120 adds a
factor ~sqrt(20) to a typical ~1e-7 relative error: still far below 1e-5
after a sigmoid of slope <= 1/4 and normalisations). The parameters make every
step visible above the bar (few Sinkhorn rounds, a large hc_eps, checked: the
result with one round less misses it)."""

import pytest
import torch
import triton
import triton.language as tl
from independent_ref import mhc_mixes_fp64

from decode_boundary.boundary import consumer, consumer_tactics
from decode_boundary.boundary.consumer import consume, holds_mix_weights, sumsq_columns
from decode_boundary.boundary.consumer_inputs import MhcMixes
from decode_boundary.boundary.consumer_kernel import FULL, RESIDUAL_ONLY
from decode_boundary.boundary.consumer_tactics import ConsumerTactic, fuses_mixes
from decode_boundary.boundary.reference import consumer_ref
from decode_boundary.common.contract import mix_columns
from decode_boundary.common.tagged_words import tag_word
from decode_boundary.mixes.mhc_combine import combine_pre_post, pre_from_shares
from decode_boundary.mixes.mixes_kernel import _split_bf16
from decode_boundary.mixes.reference import mhc_mixes_ref
from decode_boundary.mxfp8.format import mxfp8_scale_bytes

TP, M, HC, H = 2, 3, 4, 256
EPS = 1e-6
BAR = 1e-5
SERIAL = [ConsumerTactic(64, 2, False), ConsumerTactic(128, 4, False),
          ConsumerTactic(256, 4, False)]


def step(seed, m=M):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(m, H, generator=g).bfloat16() for _ in range(TP)]
    residual = torch.randn(m, HC, H, generator=g).bfloat16()
    residual[1] = 0  # with a zero partial below: a zero token, only eps keeps rsqrt finite
    for x in xs:
        x[1] = 0
    n = (2 + HC) * HC
    return dict(xs=xs, residual=residual, post=torch.rand(m, HC, generator=g) * 2,
                comb=torch.rand(m, HC, HC, generator=g), pre=torch.rand(m, HC, generator=g),
                gamma=(1 + 0.1 * torch.randn(H, generator=g)).bfloat16(),
                hc_fn=torch.randn(n, HC * H, generator=g) * 0.2,
                hc_scale=torch.rand(3, generator=g) + 0.5,
                hc_base=torch.randn(n, generator=g) * 0.5)


def scratch(poison=True, m=M):
    """The consumer's scratch as a mailbox holds it, poisoned: NaN under an old tag."""
    fill = float("nan") if poison else 0.0
    stale = int(torch.tensor(fill).view(torch.int32).to(torch.int64) & 0xFFFFFFFF)
    return dict(generation=torch.zeros(m + 1, dtype=torch.int32),
                status=torch.zeros(1, dtype=torch.int32), wait_bound=100_000,
                sumsq=torch.full((m + 1, sumsq_columns(H)), stale, dtype=torch.int64),
                prenorm=torch.full((m + 1, H), fill, dtype=torch.bfloat16),
                mix_words=torch.full((m + 1, mix_columns(H, HC)), stale, dtype=torch.int64))


def mxfp8_buffers(m=M):
    return (torch.full((m, H), float("nan")).to(torch.float8_e4m3fn),
            torch.full((mxfp8_scale_bytes(m, H),), 0xAB, dtype=torch.uint8))


def launch(d, s, tactic, collapse=None, hc_eps=0.1, iters=3, pre=None):
    """One gathered consume of step ``d``; with ``collapse``, its mixes."""
    m = d["residual"].shape[0]
    mixes = None if collapse is None else MhcMixes(d["hc_fn"], d["hc_scale"], d["hc_base"],
                                                   hc_eps, iters, collapse)
    given_pre = pre if pre is not None else (None if collapse == "same" else d["pre"])
    q = mxfp8_buffers(m)
    out = consume(torch.stack(d["xs"]), TP, m, mode=FULL, lamport=False, tactic=tactic,
                  residual=d["residual"], post=d["post"], comb=d["comb"], pre=given_pre,
                  norm_weight=d["gamma"], eps=EPS, mxfp8_out=q, mixes=mixes, **s)
    mixes = () if out.mixes is None else (out.mixes,)
    return (out.residual_out, out.layer_input, *mixes, q)


def bits(t):
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16) \
        if t.dtype in (torch.float32, torch.bfloat16) else t.view(torch.uint8)


def assert_same_bits(a, b, what):
    assert torch.equal(bits(a), bits(b)), what


def check_mixes(res_out, mixes, d, hc_eps, iters):
    """pre / post / comb of the kernel against the spec (mhc_mixes_ref, FP32)
    and FP64 of its own residual_out, within the bar."""
    args = (res_out, d["hc_fn"], d["hc_scale"], d["hc_base"], EPS, hc_eps, iters)
    for want in (mhc_mixes_fp64(*args), mhc_mixes_ref(*args)):
        for got, exp, name in zip(mixes, want, ("pre", "post", "comb"), strict=True):
            assert got.dtype == torch.float32 and got.shape == exp.shape, name
            err = (got.double() - exp.double()).abs().max().item()
            assert err <= BAR, (name, err)


@pytest.mark.parametrize("collapse", ["previous", "same"])
@pytest.mark.parametrize("tactic", SERIAL)
def test_mixes_and_the_rest_of_the_step(collapse, tactic):
    """pre / post / comb within the bar; residual_out bit-exact to the
    reference; layer_input and its MXFP8 bit-exact to the consumer without
    mixes given the pre the collapse used (the given one or, "same", the
    kernel's own)."""
    d = step(1)
    s = scratch()
    res_out, layer, mixes, q = launch(d, s, tactic, collapse)
    assert s["status"].item() == 0
    ref_res, _, _ = consumer_ref(d["xs"], d["residual"], d["post"], d["comb"], d["pre"],
                                 d["gamma"], EPS)
    assert_same_bits(res_out, ref_res, "residual_out")
    check_mixes(res_out, mixes, d, 0.1, 3)
    used_pre = d["pre"] if collapse == "previous" else mixes[0]
    plain_res, plain_layer, plain_q = launch(d, scratch(), tactic, pre=used_pre)
    assert_same_bits(res_out, plain_res, "residual_out vs no mixes")
    assert_same_bits(layer, plain_layer, "layer_input vs no mixes")
    assert_same_bits(q[0], plain_q[0], "MXFP8 data")
    assert torch.equal(q[1], plain_q[1]), "MXFP8 scales"
    if collapse == "same":  # the collapse did take the new pre, not the given one
        _, other_layer, _ = launch(d, scratch(), tactic, pre=d["pre"])
        assert not torch.equal(bits(layer), bits(other_layer))


def test_the_bar_sees_a_missing_round_and_the_released_values_pass():
    """With 3 rounds and hc_eps = 0.1 a round less moves comb past the bar (so
    the bar checks the rounds); the released values (20 rounds, hc_eps 1e-6)
    are within it."""
    d = step(2)
    res_out, _, mixes, _ = launch(d, scratch(), SERIAL[0], "previous")
    fewer = mhc_mixes_fp64(res_out, d["hc_fn"], d["hc_scale"], d["hc_base"], EPS, 0.1, 2)
    assert (mixes[2].double() - fewer[2]).abs().max().item() > 10 * BAR
    res_out, _, mixes, _ = launch(d, scratch(), SERIAL[1], "previous", hc_eps=1e-6, iters=20)
    check_mixes(res_out, mixes, d, 1e-6, 20)
    assert bool(torch.isfinite(mixes[2]).all())


@pytest.mark.parametrize("early", [False, True], ids=["hc_fn-late", "hc_fn-early"])
@pytest.mark.parametrize("collapse", ["previous", "same"])
def test_cooperative_launches_give_the_serial_bits(collapse, early,
                                                   cooperative_in_the_interpreter):
    """The GPU default's path (chunk 0 sums the shares; with "same" every
    program sums them for its own pre), with hc_fn loaded early (the
    ``MIX_WEIGHTS_EARLY`` variant: where it sits against the grid wait, which
    the interpreter has not, tests/boundary/test_boundary_ptx.py checks) or late, gives
    the serial launch's bits, on one poisoned scratch reused by launches of 4,
    then 2 chunks: none takes a stale share."""
    s = scratch()
    for launch_no, block in enumerate((64, 128), start=1):
        d = step(10 + launch_no)
        got = launch(d, s, ConsumerTactic(block, 2, True, mix_weights_early=early), collapse)
        assert s["status"].item() == 0
        assert s["generation"][:M].eq(launch_no).all()
        want = launch(d, scratch(), ConsumerTactic(block, 2, False), collapse)
        for a, b, what in zip(got[:2] + got[2] + got[3], want[:2] + want[2] + want[3],
                              ("residual_out", "layer", "pre", "post", "comb", "q", "scale"),
                              strict=True):
            assert_same_bits(a, b, what)


@pytest.mark.parametrize("m", [3, 33])
def test_mixes_kernel_after_the_consumer(m, monkeypatch):
    """Beyond ``MIXES_FUSED_MAX_ROWS`` (here 0) V4.1's mixes come from the mixes
    kernel: within the bar of the spec of the consumer's own residual_out, on
    one poisoned scratch reused by two steps (the second takes none of the
    first's shares: they carry the older generation), 3 token groups at M =
    33 (the fewest tokens for 3 groups of 16, the last partial); everything
    else is the consumer without mixes, bit for bit. V4's collapse stays fused
    (it needs the pre inside the consumer)."""
    monkeypatch.setattr(consumer_tactics, "MIXES_FUSED_MAX_ROWS", 0)
    assert not fuses_mixes(m, HC, "previous") and fuses_mixes(m, HC, "same")
    s = scratch(m=m)
    for launch_no in (1, 2):
        d = step(20 + launch_no, m)
        res_out, layer, mixes, q = launch(d, s, SERIAL[1], "previous")
        assert s["status"].item() == 0 and s["generation"][:m].eq(launch_no).all()
        check_mixes(res_out, mixes, d, 0.1, 3)
        plain_res, plain_layer, plain_q = launch(d, scratch(m=m), SERIAL[1])
        for a, b, what in ((res_out, plain_res, "residual_out"), (layer, plain_layer, "layer"),
                           (q[0], plain_q[0], "MXFP8 data"), (q[1], plain_q[1], "scales")):
            assert_same_bits(a, b, what)


def test_mixes_kernel_cooperative_gives_the_serial_bits(cooperative_in_the_interpreter,
                                                        monkeypatch):
    """The GPU default's grid (a program per 128 columns and 16 tokens; here 2
    chunks, so each program combines 8 of its group's tokens) gives the
    serial launch's bits, at M = 20 (two groups, the second partial)."""
    monkeypatch.setattr(consumer_tactics, "MIXES_FUSED_MAX_ROWS", 0)
    d = step(30, 20)
    got = launch(d, scratch(m=20), ConsumerTactic(64, 2, True), "previous")
    want = launch(d, scratch(m=20), ConsumerTactic(64, 2, False), "previous")
    for a, b, what in zip(got[:2] + got[2], want[:2] + want[2],
                          ("residual_out", "layer", "pre", "post", "comb"), strict=True):
        assert_same_bits(a, b, what)
    check_mixes(got[0], got[2], d, 0.1, 3)


def test_which_mixes_the_consumer_fuses(monkeypatch):
    """The mixes kernel only where it can run: V4.1, beyond MIXES_FUSED_MAX_ROWS,
    hc 2-4 (its dot needs >= 16 slots; hc = 8's tiles would not fit in shared
    memory); and a cooperative tactic whose mixes kernel would have more than
    one chunk is refused in the interpreter (its programs run one by one)."""
    monkeypatch.setattr(consumer_tactics, "MIXES_FUSED_MAX_ROWS", 16)
    assert fuses_mixes(16, 4, "previous") and not fuses_mixes(17, 4, "previous")
    assert not fuses_mixes(64, 2, "previous") and fuses_mixes(64, 1, "previous")
    assert fuses_mixes(64, 8, "previous") and fuses_mixes(64, 4, "same")
    monkeypatch.setattr(consumer_tactics, "MIXES_FUSED_MAX_ROWS", 0)
    d = step(5)
    with pytest.raises(ValueError, match="cooperative programs wait for each other"):
        launch(d, scratch(), ConsumerTactic(256, 4, True), "previous")


def test_which_tactics_hold_hc_fn_from_before_the_wait():
    """Only a cooperative tactic that asks for it, and only while the held tile
    fits (hc <= 4: 32 slots; hc = 8's 128 slots would spill)."""
    early = ConsumerTactic(128, 4, True, mix_weights_early=True)
    assert holds_mix_weights(early, 4) and holds_mix_weights(early, 2)
    assert not holds_mix_weights(early, 8)
    assert not holds_mix_weights(early._replace(cooperative=False), 4)
    assert not holds_mix_weights(early._replace(mix_weights_early=False), 4)


def test_argument_checks():
    d = step(3)
    s = scratch()
    good = MhcMixes(d["hc_fn"], d["hc_scale"], d["hc_base"], 1e-6, 20, "previous")

    def call(mixes, tactic=SERIAL[0], **over):
        inputs = dict(residual=d["residual"], post=d["post"], comb=d["comb"], pre=d["pre"],
                      norm_weight=d["gamma"], eps=EPS, mixes=mixes, **s)
        inputs.update(over)
        return consume(torch.stack(d["xs"]), TP, M, mode=FULL, lamport=False, tactic=tactic,
                       **inputs)

    with pytest.raises(ValueError, match="hc_fn must be torch.float32"):
        call(good._replace(hc_fn=d["hc_fn"][:, :-1]))
    with pytest.raises(ValueError, match="hc_base must be"):
        call(good._replace(hc_base=d["hc_base"].double()))
    with pytest.raises(ValueError, match="collapse must be one of"):
        call(good._replace(collapse="next"))
    with pytest.raises(ValueError, match="pass pre=None"):
        call(good._replace(collapse="same"))
    with pytest.raises(ValueError, match="sinkhorn_iters must be an int >= 1"):
        call(good._replace(sinkhorn_iters=0))
    for tiny in (0.0, 1e-40, -1e-6):  # a subnormal sum's reciprocal would be inf
        with pytest.raises(ValueError, match=r"hc_eps must be .* >= 2\*\*-126"):
            call(good._replace(hc_eps=tiny))
    with pytest.raises(ValueError, match="mix_words scratch is required"):
        call(good, mix_words=None)
    with pytest.raises(ValueError, match=">= 64 columns"):
        call(good, tactic=ConsumerTactic(32, 1, False))
    with pytest.raises(ValueError, match="hc_scale overlaps mix_words"):
        call(good._replace(hc_scale=s["mix_words"].view(torch.float32)[0, :3]))
    # hc_fn may be read before the grid wait (mix_weights_early, the mixes kernel): never
    # memory the publisher writes, e.g. the partial it publishes.
    storage = torch.zeros(d["hc_fn"].numel() + 8, dtype=torch.float32)
    early_fn = storage[8:].view_as(d["hc_fn"]).copy_(d["hc_fn"])
    call(good._replace(hc_fn=early_fn), partial=storage.view(torch.bfloat16)[:16])  # adjacent
    with pytest.raises(ValueError, match="hc_fn overlaps partial"):
        call(good._replace(hc_fn=early_fn), partial=storage.view(torch.bfloat16)[:17])
    with pytest.raises(ValueError, match="mixes need the full mode"):
        consume(torch.stack(d["xs"]), TP, M, mode=RESIDUAL_ONLY, lamport=False,
                tactic=SERIAL[0], residual=d["residual"], post=d["post"], comb=d["comb"],
                mixes=good, **s)


def test_mixes_are_fp32_whatever_the_default_dtype():
    """Inference code often sets a BF16 default dtype: the mixes stay FP32."""
    d, s = step(4), scratch()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        _, _, mixes, _ = launch(d, s, SERIAL[0], "previous")
    finally:
        torch.set_default_dtype(previous)
    assert all(t.dtype == torch.float32 for t in mixes)


@triton.jit
def _split_kernel(fn_ptr, parts_ptr, HC: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    fn = ()
    for t in tl.static_range(HC):
        fn = fn + (tl.load(fn_ptr + t * ROWS * COLS + offs),)
    parts = _split_bf16(fn, HC)
    for i in tl.static_range(3 * HC):
        tl.store(parts_ptr + i * ROWS * COLS + offs, parts[i])


def _split_on(device):
    g = torch.Generator().manual_seed(5)
    hc, rows, cols = 2, 16, 32
    fn = torch.randn(hc, rows, cols, generator=g) * 10.0 ** torch.randint(-6, 3, (hc, rows, cols),
                                                                       generator=g)
    fn = fn.to(device)
    parts = torch.full((3 * hc, rows, cols), float("nan"), dtype=torch.bfloat16, device=device)
    _split_kernel[(1,)](fn, parts, HC=hc, ROWS=rows, COLS=cols)
    parts = parts.double().view(hc, 3, rows, cols)
    assert torch.equal(parts.sum(dim=1), fn.double())  # hi + mid + lo, exactly
    assert bool((parts[:, 1].abs() <= parts[:, 0].abs()).all())  # hi holds the leading bits
    assert not torch.equal(parts[:, 2], torch.zeros_like(parts[:, 2]))  # lo is used


def test_mixes_kernel_splits_hc_fn_into_three_bf16_parts_exactly():
    """The mixes kernel's dots run on BF16 tensor cores with hc_fn split as hi +
    mid + lo (``mixes_kernel._split_bf16``): the three parts add up to the FP32
    value exactly, at magnitudes 1e-6 .. 1e2, whatever rounding the casts do."""
    _split_on("cpu")


@pytest.mark.gpu
def test_gpu_mixes_kernel_splits_hc_fn_exactly():
    _split_on("cuda")


@triton.jit
def _pre_probe(mix_ptr, status_ptr, shares_ptr, scale_ptr, base_ptr, tag_ptr, pre_ptr,
               post_ptr, eps, hc_eps, bound, COMBINE: tl.constexpr, HC: tl.constexpr,
               HIDDEN: tl.constexpr, CHUNKS: tl.constexpr, SLOTS: tl.constexpr,
               MIX_ROW: tl.constexpr):
    """COMBINE: chunk 0's combine_pre_post on the row as it is; else program c
    publishes share c, then computes the pre as a V4 non-combining program."""
    chunk = tl.program_id(0)
    tag = tl.load(tag_ptr)
    if COMBINE:
        pre, _ = combine_pre_post(mix_ptr, status_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr,
                                   0, tag, eps, hc_eps, bound, HC, HIDDEN, CHUNKS, CHUNKS, SLOTS,
                                   MIX_ROW, CHUNKS * SLOTS, False)
    else:
        j = tl.arange(0, SLOTS)
        tl.store(mix_ptr + chunk * SLOTS + j, tag_word(tl.load(shares_ptr + chunk * SLOTS + j),
                                                      tag))
        pre = pre_from_shares(mix_ptr, status_ptr, scale_ptr, base_ptr, 0, tag, eps, hc_eps,
                               bound, HC, HIDDEN, CHUNKS, CHUNKS, SLOTS, MIX_ROW, False)
        for t in tl.static_range(HC):
            tl.store(pre_ptr + chunk * HC + t, pre[t])


def test_v4_pre_from_the_shares_is_chunk_0s_and_times_out_to_nan():
    """V4's programs that do not combine compute the collapse pre from the
    shares themselves. The interpreter runs program 0 to the end before program
    1 starts: program 0 finds chunk 1's share stale (older tag, NaN), gives up
    after the bound, flags the status word and returns NaN; program 1 sees both
    shares and returns pre bit for bit as chunk 0's combine computes it from the
    same row, and within FP32 rounding of the formula on the summed shares."""
    hc, hidden, chunks, slots = 2, 128, 2, 16  # (2 + hc) * hc = 8 dots + sum of squares
    nmix = (2 + hc) * hc
    g = torch.Generator().manual_seed(5)
    shares = torch.zeros(chunks, slots)
    shares[:, :nmix] = torch.randn(chunks, nmix, generator=g) * 3
    shares[:, nmix] = torch.rand(chunks, generator=g) * hidden
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn(nmix, generator=g)
    tag = 9
    stale = (tag - 1) << 32 | int(torch.tensor(float("nan")).view(torch.int32)) & 0xFFFFFFFF
    row = torch.full((1, chunks * slots + slots), stale, dtype=torch.int64)
    status = torch.zeros(1, dtype=torch.int32)
    pre = torch.full((chunks, hc), -1.0)
    post = torch.full((1, hc), -1.0)
    tags = torch.tensor([tag], dtype=torch.int32)
    eps, hc_eps = 1e-6, 1e-3
    args = (row, status, shares, scale, base, tags)
    constants = dict(HC=hc, HIDDEN=hidden, CHUNKS=chunks, SLOTS=slots, MIX_ROW=row.shape[1])
    _pre_probe[(chunks,)](*args, pre, post, eps, hc_eps, 50, COMBINE=False, **constants)
    assert status.item() == consumer.NORM_TIMEOUT_BIT
    assert pre[0].isnan().all() and not pre[1].isnan().any()
    status.zero_()
    chunk0 = torch.full((1, hc), -1.0)
    _pre_probe[(1,)](*args, chunk0, post, eps, hc_eps, 50, COMBINE=True, **constants)
    assert status.item() == 0
    assert torch.equal(pre[1].view(torch.int32), chunk0[0].view(torch.int32))
    totals = shares.double().sum(0)
    rstd = (totals[nmix] / (hc * hidden) + eps).rsqrt()
    want = torch.sigmoid(totals[:hc] * rstd * scale[0].double() + base[:hc].double()) + hc_eps
    torch.testing.assert_close(pre[1].double(), want, rtol=0, atol=1e-6)
