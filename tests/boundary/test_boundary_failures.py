"""Failures of one rank's step never become a silent wrong result (docs/FAILURES.md),
in the Triton interpreter with tp ranks simulated in one process.

A rank whose input fails its checks raises ``ValueError`` before anything of the
step reaches a peer, and aborts the step: its poison goes where its partial would
have gone, so every peer's consumer sums NaN and names it (``check()`` raises
``RuntimeError``). After ``reset(collective=True)`` on every rank the next steps
are bit-identical to a fresh group's. The randomized test runs many such steps.
"""

import contextlib
import functools
import math
import os
import random
import time

import pytest
import torch
from boundary_inputs import random_step
from consumer_checks import assert_consumer_outputs

from decode_boundary.boundary.all_reduce import BoundaryAllReduce
from decode_boundary.boundary.consumer import consume, status_error, sumsq_columns
from decode_boundary.boundary.consumer_kernel import ABORT_BIT, FULL, PLAIN, RESIDUAL_ONLY
from decode_boundary.boundary.reference import consumer_ref, reduce_ref
from decode_boundary.common.contract import ABORT_BITS, SENTINEL_BITS
from decode_boundary.gemm.linear import Mxfp8Linear
from decode_boundary.mxfp8.format import mxfp8_scale_bytes
from decode_boundary.mxfp8.quantize_kernel import quantize_mxfp8
from decode_boundary.publishing_linear import PublishingMxfp8Linear

# NaN sums in the interpreter make numpy warn; that NaN is the point here.
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered"),
              pytest.mark.filterwarnings("ignore:All-NaN slice encountered")]

H, HC, CAP, TOP_K, EPS = 64, 2, 3, 2, 1e-6


def bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.uint8)


step_inputs = functools.partial(random_step, hc=HC, h=H)


def mxfp8_buffers(m, h=H):
    return (torch.zeros(m, h, dtype=torch.uint8).view(torch.float8_e4m3fn),
            torch.zeros(mxfp8_scale_bytes(m, h), dtype=torch.uint8))


def group(tp, **kwargs):
    kwargs.setdefault("quantize_layer_input", True)
    kwargs.setdefault("residual_only", False)
    return BoundaryAllReduce.simulated(tp, H, HC, CAP, TOP_K, **kwargs)


@contextlib.contextmanager
def deferred_check(ar):
    """Run a call whose status check would raise, keeping its outputs; the
    caller then calls ``BoundaryAllReduce.check`` itself."""
    ar.launches.guard.check = lambda: None
    try:
        yield
    finally:
        del ar.launches.guard.check


def call_kwargs(d, rank, mode, quantize):
    m = d["xs"][rank].shape[0]
    kw = dict(x=d["xs"][rank], residual=d["residual"], post=d["post"], comb=d["comb"],
              pre=d["pre"], norm_weight=d["gamma"], norm_eps=EPS,
              mxfp8_out=mxfp8_buffers(m) if quantize else None)
    if mode == RESIDUAL_ONLY:
        kw.update(pre=None, norm_weight=None, mxfp8_out=None)
    return kw


def reduce_call(ar, kw, mode):
    if mode == PLAIN:
        return (ar.plain_sum(kw["x"]), None)
    return ar(**kw)[:2]  # (residual_out, layer_input)


# What a rank may get wrong, as a change of its call's arguments; x cases apply in
# every mode, the others where the mode reads the argument.
def _x_rows(kw):
    return dict(x=torch.zeros(CAP + 1, H, dtype=torch.bfloat16))


BAD_X = {
    "x_dtype": lambda kw: dict(x=kw["x"].float()),
    "x_rows": _x_rows,
    "x_hidden": lambda kw: dict(x=kw["x"][:, : H // 2].contiguous()),
    "x_noncontiguous": lambda kw: dict(x=torch.zeros(kw["x"].shape[0], 2 * H,
                                                     dtype=torch.bfloat16)[:, ::2]),
}
BAD_MIX = {  # residual-only and full
    "residual_shape": lambda kw: dict(residual=kw["residual"][:, :1].contiguous()),
    "residual_missing": lambda kw: dict(residual=None),
    "post_dtype": lambda kw: dict(post=kw["post"].double()),
    "comb_shape": lambda kw: dict(comb=kw["comb"][:, :1].contiguous()),
}
BAD_FULL = {
    "pre_shape": lambda kw: dict(pre=kw["pre"][:, :1].contiguous()),
    "norm_weight_shape": lambda kw: dict(norm_weight=kw["norm_weight"][:8]),
    "eps_nan": lambda kw: dict(norm_eps=math.nan),
    "eps_negative": lambda kw: dict(norm_eps=-1.0),
    "mxfp8_scale": lambda kw: dict(mxfp8_out=(mxfp8_buffers(kw["x"].shape[0])[0],
                                              torch.zeros(3, dtype=torch.uint8))),
    "mxfp8_not_a_pair": lambda kw: dict(mxfp8_out=mxfp8_buffers(kw["x"].shape[0])[0]),
}


def bad_cases(mode):
    cases = dict(BAD_X)
    if mode != PLAIN:
        cases.update(BAD_MIX)
    if mode == FULL:
        cases.update(BAD_FULL)
    return cases


def assert_poisoned(out, mode, q=None):
    first, layer = out
    assert first.isnan().all(), "an aborted step left a finite output"
    if mode == FULL:
        assert layer.isnan().all()
        if q is not None:  # e4m3fn NaN: 0x7F / 0xFF
            assert (q[0].view(torch.uint8) & 0x7F).eq(0x7F).all()


def assert_exact(outs, d, mode):
    if mode == PLAIN:
        want = reduce_ref(d["xs"])
        for first, _ in outs:
            assert torch.equal(bits(first), bits(want))
        return
    pre = d["pre"] if mode == FULL else None
    ref_res, ref_layer, _ = consumer_ref(d["xs"], d["residual"], d["post"], d["comb"], pre,
                                         d["gamma"], EPS)
    for first, layer in outs:
        assert_consumer_outputs(first, layer if mode == FULL else None, ref_res, ref_layer)
        if mode == FULL:
            assert torch.equal(bits(layer), bits(outs[0][1]))


def good_step(ars, d, mode):
    for ar, x in zip(ars, d["xs"], strict=True):
        ar.publish(x)
    return [reduce_call(ar, call_kwargs(d, r, mode, False), mode) for r, ar in enumerate(ars)]


def bad_step(ars, d, mode, bad, case, entry, quantize=True):
    """One step where the ranks of ``bad`` get ``case`` wrong, entering by
    ``entry``: "call" (nothing published before the call), "split" (a valid
    publish, then a call whose consumer argument is wrong) or "publish" (the
    x given to publish is wrong). The good ranks publish first and consume
    last. Returns the good ranks' outputs."""
    for r, ar in enumerate(ars):
        if r not in bad:
            ar.publish(d["xs"][r])
    for r in bad:
        ar = ars[r]
        kw = call_kwargs(d, r, mode, quantize)
        change = bad_cases(mode)[case](kw)
        with pytest.raises(ValueError) as raised:
            if entry == "publish":
                ar.publish(change.get("x", kw["x"]))
            else:
                if entry == "split":
                    ar.publish(kw["x"])
                kw.update(change)
                reduce_call(ar, kw, mode)
        assert "aborted this step" in "".join(getattr(raised.value, "__notes__", []))
    outs = {}
    for r, ar in enumerate(ars):
        if r in bad:
            continue
        kw = call_kwargs(d, r, mode, quantize)
        with deferred_check(ar):
            outs[r] = (reduce_call(ar, kw, mode), kw["mxfp8_out"])
        with pytest.raises(RuntimeError, match=rf"rank\(s\) \[{', '.join(map(str, sorted(bad)))}\] "
                                               "aborted this step"):
            ar.check()
    return outs


CASES = [("x_rows", "call"), ("x_dtype", "publish"), ("residual_shape", "call"),
         ("post_dtype", "split"), ("comb_shape", "call"), ("pre_shape", "split"),
         ("norm_weight_shape", "call"), ("eps_nan", "split"), ("mxfp8_scale", "call")]


# Each case at tp = 2 and at tp = 4, the bad rank varying from case to case (the
# randomized test below mixes more).
@pytest.mark.parametrize("tp,bad_rank,case,entry", [
    (tp, i % tp, case, entry) for i, (case, entry) in enumerate(CASES) for tp in (2, 4)])
def test_bad_input_on_one_rank_poisons_the_step_and_reset_recovers(tp, bad_rank, case, entry):
    m = 2
    ars, fresh = group(tp), group(tp)
    assert_exact(good_step(ars, step_inputs(m, tp, seed=1), FULL), step_inputs(m, tp, 1), FULL)
    d = step_inputs(m, tp, seed=2)
    outs = bad_step(ars, d, FULL, {bad_rank}, case, entry)
    assert set(outs) == set(range(tp)) - {bad_rank}
    for out, q in outs.values():
        assert_poisoned(out, FULL, q)
    # The aborting rank refuses every step until the reset; so do peers that saw it.
    for ar in ars:
        with pytest.raises(RuntimeError, match=r"reset\(collective=True\)"):
            ar.publish(d["xs"][0])
    for ar in ars:
        ar.reset(collective=True)
    for seed in (3, 4):
        d = step_inputs(m, tp, seed=seed)
        got, want = good_step(ars, d, FULL), good_step(fresh, d, FULL)
        for (a, b), (c, e) in zip(got, want, strict=True):
            assert torch.equal(bits(a), bits(c)) and torch.equal(bits(b), bits(e))
        assert_exact(got, d, FULL)


def test_peer_that_consumed_before_the_abort_meets_it_at_its_next_step():
    """A valid publish, then a consumer argument rejected: a peer that already
    consumed the step has a correct result, and its next step sees the abort at
    once (the poison went into the next stage too) instead of timing out."""
    ars = group(2)
    d = step_inputs(2, 2, seed=5)
    for ar, x in zip(ars, d["xs"], strict=True):
        ar.publish(x)
    first = reduce_call(ars[0], call_kwargs(d, 0, FULL, False), FULL)  # consumed first
    assert_exact([first], d, FULL)
    kw = call_kwargs(d, 1, FULL, False)
    kw.update(BAD_MIX["comb_shape"](kw))
    with pytest.raises(ValueError, match="comb"):
        ars[1](**kw)
    d = step_inputs(2, 2, seed=6)
    ars[0].publish(d["xs"][0])
    start = time.monotonic()
    with deferred_check(ars[0]):
        out = reduce_call(ars[0], call_kwargs(d, 0, FULL, False), FULL)
    assert time.monotonic() - start < 0.5 * ars[0].wait_timeout_s  # no wait for the bound
    assert_poisoned(out, FULL)
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] aborted"):
        ars[0].check()
    for ar in ars:
        ar.reset(collective=True)
    d = step_inputs(1, 2, seed=7)
    assert_exact(good_step(ars, d, FULL), d, FULL)


def test_every_rank_rejecting_then_reset():
    ars = group(3)
    d = step_inputs(1, 3, seed=8)
    assert bad_step(ars, d, PLAIN, {0, 1, 2}, "x_rows", "call") == {}
    for ar in ars:
        ar.reset(collective=True)
    assert_exact(good_step(ars, d, PLAIN), d, PLAIN)


def test_protocol_error_after_a_publish_aborts_too():
    """Reducing another tensor than the published one: the published partial is
    replaced by the poison, the peer raises naming the rank."""
    ars = group(2)
    d = step_inputs(1, 2, seed=9)
    for ar, x in zip(ars, d["xs"], strict=True):
        ar.publish(x)
    with pytest.raises(RuntimeError, match="other than the published"):
        ars[0].plain_sum(d["xs"][0].clone())
    with deferred_check(ars[1]):
        out = ars[1].plain_sum(d["xs"][1])
    assert out.isnan().all()
    with pytest.raises(RuntimeError, match=r"\[0\] aborted"):
        ars[1].check()


def test_finalize_with_bad_indices_on_one_rank():
    ars = group(2)
    g = torch.Generator().manual_seed(10)
    m, rows = 2, 3
    moe = [(torch.randn(rows, H, generator=g).bfloat16(), torch.rand(m, TOP_K, generator=g),
            torch.randint(-1, rows, (m, TOP_K), generator=g, dtype=torch.int32),
            torch.randn(m, H, generator=g).bfloat16()) for _ in range(2)]
    moe[1][2][0, 0] = -3  # below -1: not an index
    d = step_inputs(m, 2, seed=11)
    partial = ars[0].publish_finalize(*moe[0])
    with pytest.raises(ValueError, match=r"must lie in \[-1, 3\)"):
        ars[1].publish_finalize(*moe[1])
    with deferred_check(ars[0]):
        res, layer, *_ = ars[0](partial, residual=d["residual"], post=d["post"], comb=d["comb"],
                                pre=d["pre"], norm_weight=d["gamma"], norm_eps=EPS)
    assert res.isnan().all() and layer.isnan().all()
    with pytest.raises(RuntimeError, match=r"\[1\] aborted"):
        ars[0].check()


def test_publishing_gemm_rejecting_its_input_aborts_the_step():
    hidden, k = 128, 64
    ars = BoundaryAllReduce.simulated(2, hidden, HC, CAP, TOP_K)
    g = torch.Generator().manual_seed(12)
    linears = [Mxfp8Linear.from_float(torch.randn(hidden, k, generator=g).bfloat16())
               for _ in range(2)]
    x = quantize_mxfp8(torch.randn(2, k, generator=g).bfloat16())
    wrong = quantize_mxfp8(torch.randn(2, 2 * k, generator=g).bfloat16())
    out = PublishingMxfp8Linear(ars[0])(linears[0], x)
    with pytest.raises(ValueError, match="K="):
        PublishingMxfp8Linear(ars[1])(linears[1], wrong)
    with deferred_check(ars[0]):
        reduced = ars[0].plain_sum(out)
    assert reduced.isnan().all()
    with pytest.raises(RuntimeError, match=r"\[1\] aborted"):
        ars[0].check()
    for ar in ars:
        ar.reset(collective=True)
    outs = [PublishingMxfp8Linear(ar)(lin, x) for ar, lin in zip(ars, linears, strict=True)]
    sums = [ar.plain_sum(o) for ar, o in zip(ars, outs, strict=True)]
    assert torch.equal(bits(sums[0]), bits(reduce_ref(outs))) and torch.equal(sums[0], sums[1])


def test_the_custom_op_checks_before_it_launches():
    """``boundary_reduce`` called directly (what a compiled graph runs) with a
    residual of the wrong shape: nothing is published, the step is aborted."""
    ars = group(2)
    d = step_inputs(1, 2, seed=13)
    ars[0].publish(d["xs"][0])
    box = ars[1].mailbox
    with pytest.raises(ValueError, match="residual"):
        torch.ops.decode_boundary.boundary_reduce(
            ars[1].handle, d["xs"][1], True, FULL, d["residual"][:, :1].contiguous(),
            d["post"], d["comb"], d["pre"], d["gamma"], EPS, box.stage_state, box.status,
            box.generation, box.sumsq, box.prenorm, None, None, None, None, None, None)
    # Rank 1's slot in rank 0's mailbox holds the poison, not x.
    slot = ars[0].mailbox.buffer[0, 1, :CAP].view(torch.int16)
    assert slot.eq(ABORT_BITS).all()
    with deferred_check(ars[0]):
        assert ars[0].plain_sum(d["xs"][0]).isnan().all()


def test_single_rank_rejection_leaves_the_instance_usable():
    ar = group(1)[0]
    d = step_inputs(2, 1, seed=14)
    ar.publish(d["xs"][0])
    kw = call_kwargs(d, 0, FULL, False)
    kw.update(BAD_FULL["pre_shape"](kw))
    with pytest.raises(ValueError, match="pre"):
        ar(**kw)
    assert ar.mailbox.buffer.view(torch.int16).eq(SENTINEL_BITS).all(), "publish not wiped"
    d = step_inputs(1, 1, seed=15)
    assert_exact(good_step([ar], d, FULL), d, FULL)


def test_status_word_layout():
    assert status_error(ABORT_BIT | 0b100, 4, 1.0).startswith("rank(s) [2] aborted")
    assert "did not publish" in status_error(0b100, 4, 1.0)
    assert status_error(0, 4, 1.0) is None


def test_timed_out_wait_yields_nan_not_a_finite_sum():
    """Rank 1 never publishes: rank 0's outputs are NaN (the wait gave up),
    never a sum with rank 1's part missing."""
    ars = group(2, wait_timeout_s=3e-3)
    d = step_inputs(2, 2, seed=16)
    ars[0].publish(d["xs"][0])
    with deferred_check(ars[0]):
        out = reduce_call(ars[0], call_kwargs(d, 0, FULL, True), FULL)
    assert_poisoned(out, FULL)
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] did not publish"):
        ars[0].check()


def test_gathered_poison_is_reported():
    """The gather transport's consumer (lamport=False) names a rank whose gathered
    partial is the abort poison, and sums NaN."""
    d = step_inputs(2, 3, seed=17)
    xs = [x.clone() for x in d["xs"]]
    xs[2] = torch.full_like(xs[2], 0).view(torch.int16).fill_(ABORT_BITS).view(torch.bfloat16)
    status = torch.zeros(1, dtype=torch.int32)
    scratch = dict(generation=torch.zeros(CAP, dtype=torch.int32), status=status,
                   sumsq=torch.zeros(CAP, sumsq_columns(H), dtype=torch.int64),
                   prenorm=torch.zeros(CAP, H, dtype=torch.bfloat16), wait_bound=100)
    out = consume(torch.stack(xs), 3, 2, mode=FULL, lamport=False, residual=d["residual"],
                  post=d["post"], comb=d["comb"], pre=d["pre"], norm_weight=d["gamma"], eps=EPS,
                  **scratch)
    res, layer = out.residual_out, out.layer_input
    assert res.isnan().all() and layer.isnan().all()
    assert status.item() == ABORT_BIT | 0b100


# -------------------------------------------------------------------- randomized


def test_random_bad_inputs_on_random_ranks_never_give_a_silent_mismatch():
    """Many simulated steps (tp 2..4, M 1..3, plain / residual-only / full),
    a quarter of them with random bad inputs on random ranks entering by
    random paths: every good step exact against the reference, every bad step
    NaN and named on every good rank, reset after each bad step."""
    rng = random.Random(int(os.environ.get("DECODE_BOUNDARY_TEST_SEED", "2024")))
    # A fixed number of steps, whatever the machine's speed (about 10 s on an idle core,
    # under 40 s on a loaded 2-core machine); DECODE_BOUNDARY_TEST_STEPS runs more locally.
    total = int(os.environ.get("DECODE_BOUNDARY_TEST_STEPS", "96"))
    groups = {tp: group(tp, residual_only=True) for tp in (2, 3, 4)}
    modes = [PLAIN] * 5 + [RESIDUAL_ONLY] * 3 + [FULL] * 2
    start = time.monotonic()
    bad_steps = 0
    seen = set()
    for steps in range(total):
        tp = rng.choice((2, 2, 2, 3, 4))
        ars, mode, m = groups[tp], rng.choice(modes), rng.randint(1, CAP)
        d = step_inputs(m, tp, seed=10_000 + steps)
        if rng.random() < 0.25:
            bad = set(rng.sample(range(tp), 1 if rng.random() < 0.8 else 2))
            case = rng.choice(sorted(bad_cases(mode)))
            entries = ["call", "publish"] if case in BAD_X else ["call", "split"]
            outs = bad_step(ars, d, mode, bad, case, rng.choice(entries), quantize=mode == FULL)
            for out, q in outs.values():
                assert_poisoned(out, mode, q)
            for ar in ars:
                ar.reset(collective=True)
            bad_steps += 1
            seen.add((tp, mode, "bad"))
        else:
            assert_exact(good_step(ars, d, mode), d, mode)
            seen.add((tp, mode, "good"))
    print(f"{total} steps ({bad_steps} aborted) in {time.monotonic() - start:.1f} s")
    # The draw covered what the test claims: bad steps often enough, and every tp with
    # every mode (good or bad), so a path never drawn cannot pass unseen.
    assert bad_steps >= total // 8
    assert {(tp, mode) for tp, mode, _ in seen} == {(tp, mode) for tp in groups
                                                     for mode in set(modes)}
