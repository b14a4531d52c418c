"""The consumer's early-input contract (``boundary/consumer.py`` module
docstring): residual, post, comb, pre and norm_weight are read before the
kernel's grid-dependency wait, so ``consume`` refuses one that shares memory
with the partial, the mailbox (or gathered buffer), an MXFP8 output buffer or
the stage / status / scratch words, before launching anything."""

import pytest
import torch

from decode_boundary.boundary.consumer import consume, sumsq_columns
from decode_boundary.boundary.consumer_inputs import (
    EARLY_INPUTS,
    _byte_span,
    check_early_inputs,
)
from decode_boundary.boundary.consumer_kernel import FULL, PLAIN, RESIDUAL_ONLY
from decode_boundary.boundary.consumer_tactics import ConsumerTactic
from decode_boundary.mxfp8.format import mxfp8_scale_bytes

H, HC, CAP, M, TP = 64, 2, 4, 2, 2
SERIAL = ConsumerTactic(32, 1, False)


def test_byte_span_and_overlap_rules():
    buf = torch.zeros(100, dtype=torch.float32)
    base = buf.data_ptr()
    assert _byte_span(buf[10:20]) == (base + 40, base + 80)
    assert _byte_span(buf[:0]) is None
    strided = buf.view(10, 10)[:, 2]  # 10 elements, 10 apart: 2 .. 92
    assert not strided.is_contiguous()
    assert _byte_span(strided) == (base + 8, base + 8 + 91 * 4)
    # Adjacent, empty and absent tensors never overlap.
    check_early_inputs(dict(residual=buf[:10], post=None, comb=buf[5:5]),
                       dict(mailbox=buf[10:20], partial=None))
    with pytest.raises(ValueError, match="residual overlaps mailbox in memory.*before its "
                                         "grid-dependency wait"):
        check_early_inputs(dict(residual=buf[:11]), dict(mailbox=buf[10:20]))
    # A strided early input whose elements straddle the later buffer.
    with pytest.raises(ValueError, match="pre overlaps sumsq"):
        check_early_inputs(dict(pre=strided), dict(sumsq=buf[40:45]))
    assert EARLY_INPUTS == ("residual", "post", "comb", "pre", "norm_weight")


def step(seed=7):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(M, H, generator=g).bfloat16() for _ in range(TP)]
    return dict(xs=xs, gathered=torch.stack(xs),
                residual=torch.randn(M, HC, H, generator=g).bfloat16(),
                post=torch.rand(M, HC, generator=g) * 2, comb=torch.rand(M, HC, HC, generator=g),
                pre=torch.rand(M, HC, generator=g),
                norm_weight=(1 + 0.1 * torch.randn(H, generator=g)).bfloat16())


def scratch():
    return dict(generation=torch.zeros(CAP, dtype=torch.int32),
                status=torch.zeros(1, dtype=torch.int32), wait_bound=1000,
                sumsq=torch.zeros(CAP, sumsq_columns(H), dtype=torch.int64),
                prenorm=torch.zeros(CAP, H, dtype=torch.bfloat16))


def run(d, s, mode=FULL, **extra):
    inputs = {name: d[name] for name in EARLY_INPUTS}
    if mode == RESIDUAL_ONLY:
        inputs.update(pre=None, norm_weight=None)
    return consume(d["gathered"], TP, M, mode=mode, **s, **inputs, eps=1e-6, lamport=False,
                   tactic=SERIAL, **extra)


def test_separate_buffers_pass_and_partial_changes_nothing():
    d = step()
    plain = run(d, scratch())
    checked = run(d, scratch(), partial=d["xs"][0])
    for a, b in zip(plain[:2], checked[:2], strict=True):  # residual_out, layer_input
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_residual_aliasing_the_partial_is_refused():
    """The residual written by the kernel that produced the partial (here: the
    same allocation, overlapping its last row): refused once ``partial`` is given."""
    d = step()
    buf = torch.zeros(M * H + M * HC * H, dtype=torch.bfloat16)
    x = buf[:M * H].view(M, H)
    x.copy_(d["xs"][0])
    d["residual"] = buf[(M - 1) * H:(M - 1) * H + M * HC * H].view(M, HC, H)
    with pytest.raises(ValueError, match="residual overlaps partial"):
        run(d, scratch(), partial=x)
    run(d, scratch())  # without partial= nothing names it: the caller's contract


def test_early_inputs_aliasing_mailbox_outputs_or_scratch_are_refused():
    d = step()
    # residual inside the gathered partials (the mailbox of the NCCL path)
    buf = torch.zeros(TP * M * H + M * HC * H, dtype=torch.bfloat16)
    gathered = buf[:TP * M * H].view(TP, M, H)
    gathered.copy_(d["gathered"])
    bad = dict(d, gathered=gathered,
               residual=buf[TP * M * H - H:TP * M * H - H + M * HC * H].view(M, HC, H))
    with pytest.raises(ValueError, match="residual overlaps mailbox"):
        run(bad, scratch())
    # norm_weight is a row of the serial tactic's prenorm scratch
    s = scratch()
    with pytest.raises(ValueError, match="norm_weight overlaps prenorm"):
        run(dict(d, norm_weight=s["prenorm"][1]), s)
    # comb over the generation words (int32 storage seen as float32)
    words = torch.zeros(CAP + M * HC * HC, dtype=torch.int32)
    s = dict(scratch(), generation=words[:CAP])
    comb = words[CAP - 1:CAP - 1 + M * HC * HC].view(torch.float32).view(M, HC, HC)
    with pytest.raises(ValueError, match="comb overlaps generation"):
        run(dict(d, comb=comb), s)
    # pre inside the MXFP8 output's scale buffer
    scale_bytes = mxfp8_scale_bytes(M, H)
    raw = torch.zeros(scale_bytes + 64, dtype=torch.uint8)
    data = torch.zeros(M, H, dtype=torch.float8_e4m3fn)
    pre = raw[scale_bytes - 4:scale_bytes - 4 + M * HC * 4].view(torch.float32).view(M, HC)
    with pytest.raises(ValueError, match="pre overlaps mxfp8_out_scale"):
        run(dict(d, pre=pre), scratch(), mxfp8_out=(data, raw[:scale_bytes]))
    # post over the status word, residual-only mode
    status = torch.zeros(1 + M * HC, dtype=torch.int32)
    post = status.view(torch.float32)[:M * HC].view(M, HC)
    with pytest.raises(ValueError, match="post overlaps status"):
        run(dict(d, post=post), dict(scratch(), status=status[:1]), mode=RESIDUAL_ONLY)


def test_plain_mode_reads_no_early_inputs():
    d = step()
    reduced, layer, *_ = consume(d["gathered"], TP, M, mode=PLAIN, lamport=False,
                             partial=d["gathered"][0])  # the partial is inside: nothing early
    assert layer is None and reduced.shape == (M, H)


def test_the_all_reduce_checks_the_partial_it_publishes():
    """BoundaryAllReduce passes its ``x`` as ``partial``: a residual aliasing the
    partial being reduced is refused with the contract's error, and the next
    step, with separate buffers, is the same as on a fresh all-reduce."""
    from decode_boundary.boundary.all_reduce import BoundaryAllReduce

    d = step()
    inputs = {name: d[name] for name in EARLY_INPUTS}
    buf = torch.zeros(M * HC * H, dtype=torch.bfloat16)
    residual = buf.view(M, HC, H)
    residual.copy_(d["residual"])
    x = buf[:M * H].view(M, H)  # the partial lives inside the residual's memory
    ar = BoundaryAllReduce(H, HC, CAP, 2, device="cpu")
    with pytest.raises(ValueError, match="residual overlaps partial"):
        ar(x, residual=residual, post=d["post"], comb=d["comb"], pre=d["pre"],
           norm_weight=d["norm_weight"], norm_eps=1e-6)
    ar.reset()
    fresh = BoundaryAllReduce(H, HC, CAP, 2, device="cpu")
    args = dict(post=d["post"], comb=d["comb"], pre=d["pre"], norm_weight=d["norm_weight"],
                norm_eps=1e-6)
    got = ar(d["xs"][0], residual=inputs["residual"], **args)
    want = fresh(d["xs"][0], residual=inputs["residual"], **args)
    for a, b in zip(got[:2], want[:2], strict=True):  # residual_out, layer_input
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert got.mxfp8 is None and got.mixes is None
