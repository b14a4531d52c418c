"""BoundaryAllReduce in the Triton interpreter: tp ranks simulated in one
process (their mailboxes are separate CPU buffers reached by address).

Exactness promised and checked: reduced / residual_out bit for bit against the
reference, layer_input within 1 BF16 ulp (length-H sum and rsqrt), the MXFP8
bytes (scale padding included) equal to the independent FP64/integer MXFP8
(tests/helpers/independent_ref.py) of the kernel's own layer_input, and all ranks
bit-identical. An eps that matters, zero rows and the cooperative path over
several chunks: tests/boundary/test_consumer_numerics.py.
"""

import functools

import pytest
import torch
import triton
import triton.language as tl
from boundary_inputs import random_step
from consumer_checks import assert_consumer_outputs
from independent_ref import assert_mxfp8_equal

from decode_boundary.boundary.all_reduce import BoundaryAllReduce
from decode_boundary.boundary.consumer import consume, sumsq_columns
from decode_boundary.boundary.consumer_kernel import (
    FULL,
    NORM_TIMEOUT_BIT,
    _publish_partial,
    _wait_partials,
)
from decode_boundary.boundary.consumer_tactics import ConsumerTactic
from decode_boundary.boundary.reference import consumer_ref, moe_finalize_ref, reduce_ref
from decode_boundary.boundary.spec import BoundarySpec
from decode_boundary.mxfp8.format import mxfp8_scale_bytes

H, HC, CAP, TOP_K, EPS = 128, 4, 4, 2, 1e-6


def bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.uint8)


step_inputs = functools.partial(random_step, hc=HC, h=H)


def mxfp8_buffers(m, h=H):
    data = torch.full((m, h), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)  # poison: NaN
    return data, torch.full((mxfp8_scale_bytes(m, h),), 0xAB, dtype=torch.uint8)


def run_step(ars, d, residual_only=False, quantize=False):
    for ar, x in zip(ars, d["xs"], strict=True):
        ar.publish(x)
    outs = []
    for ar, x in zip(ars, d["xs"], strict=True):
        q = mxfp8_buffers(x.shape[0]) if quantize else None
        pre = None if residual_only else d["pre"]
        res_out, layer, *_ = ar(x, residual=d["residual"], post=d["post"], comb=d["comb"],
                                pre=pre, norm_weight=d["gamma"], norm_eps=EPS, mxfp8_out=q)
        outs.append((res_out, layer, q))
    return outs


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("variant", ["full", "residual_only", "mxfp8"])
def test_variants_match_reference(tp, variant):
    m = 3 if tp < 4 else 2
    ars = BoundaryAllReduce.simulated(tp, H, HC, CAP, TOP_K, quantize_layer_input=True)
    d = step_inputs(m, tp, seed=tp * 7 + len(variant))
    outs = run_step(ars, d, residual_only=variant == "residual_only", quantize=variant == "mxfp8")
    pre = None if variant == "residual_only" else d["pre"]
    ref_res, ref_layer, _ = consumer_ref(d["xs"], d["residual"], d["post"], d["comb"], pre,
                                         d["gamma"], EPS)
    for res_out, layer, q in outs:
        assert_consumer_outputs(res_out, layer, ref_res, ref_layer)
        assert torch.equal(bits(res_out), bits(outs[0][0]))
        if variant == "residual_only":
            assert layer is None
            continue
        assert torch.equal(bits(layer), bits(outs[0][1]))
        if q is not None:
            # Bytes and the whole scale buffer, padding included (the caller's 0xAB
            # must be gone), against the independent FP64/integer MXFP8.
            assert_mxfp8_equal(q[0], q[1], layer)
    for ar in ars:
        assert ar.mailbox.buffer.view(torch.int16).eq(-32768).all(), "slots not re-armed"


def test_plain_sum_and_several_steps_with_a_fast_peer():
    """Rank 0 publishes step k+1 before rank 1 consumed step k: the stages keep
    them apart; every step exact, stages rotate through 0, 1, 2, 0."""
    ars = BoundaryAllReduce.simulated(2, H, HC, CAP, TOP_K)
    steps = [step_inputs(1 + k % 3, 2, seed=100 + k) for k in range(4)]
    steps[0]["xs"][1][0, 0] = -0.0
    results = {}
    ars[0].publish(steps[0]["xs"][0])
    ars[1].publish(steps[0]["xs"][1])
    for k, d in enumerate(steps):
        results[k, 0] = ars[0].plain_sum(d["xs"][0])
        if k + 1 < len(steps):
            ars[0].publish(steps[k + 1]["xs"][0])  # rank 0 runs ahead into stage k+1
        results[k, 1] = ars[1].plain_sum(d["xs"][1])
        if k + 1 < len(steps):
            ars[1].publish(steps[k + 1]["xs"][1])
        for r in range(2):
            assert torch.equal(bits(results[k, r]), bits(reduce_ref(d["xs"])))
            assert int(ars[r].mailbox.stage_state[0]) == (k + 1) % 3


@pytest.mark.parametrize("tp", [2, 4])
def test_finalize_matches_reference(tp):
    m, rows = 2, 5
    g = torch.Generator().manual_seed(tp)
    ars = BoundaryAllReduce.simulated(tp, H, HC, CAP, TOP_K, quantize_layer_input=True)
    d = step_inputs(m, tp, seed=tp + 50)
    moe = []
    for _ in range(tp):
        idx = torch.randint(-1, rows, (m, TOP_K), generator=g, dtype=torch.int32)
        moe.append((torch.randn(rows, H, generator=g).bfloat16(),
                    torch.rand(m, TOP_K, generator=g), idx,
                    torch.randn(m, H, generator=g).bfloat16()))
    partials = [ar.publish_finalize(*args) for ar, args in zip(ars, moe, strict=True)]
    want_partials = [moe_finalize_ref(*args) for args in moe]
    for p, w in zip(partials, want_partials, strict=True):
        assert torch.equal(bits(p), bits(w))
    q = mxfp8_buffers(m)
    res_out, layer, *_ = ars[0](partials[0], residual=d["residual"], post=d["post"],
                                comb=d["comb"], pre=d["pre"], norm_weight=d["gamma"],
                                norm_eps=EPS, mxfp8_out=q)
    for ar, p in zip(ars[1:], partials[1:], strict=True):
        ar(p, residual=d["residual"], post=d["post"], comb=d["comb"], pre=d["pre"],
           norm_weight=d["gamma"], norm_eps=EPS)
    ref_res, ref_layer, _ = consumer_ref(want_partials, d["residual"], d["post"], d["comb"],
                                         d["pre"], d["gamma"], EPS)
    assert_consumer_outputs(res_out, layer, ref_res, ref_layer)
    assert_mxfp8_equal(q[0], q[1], layer)


def test_missing_peer_is_named_then_reset_recovers():
    ars = BoundaryAllReduce.simulated(4, H, HC, CAP, TOP_K, wait_timeout_s=3e-6)
    d = step_inputs(2, 4, seed=9)
    for r in (0, 2):  # ranks 1 and 3 never publish
        ars[r].publish(d["xs"][r])
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1, 3\]"):
        ars[0].plain_sum(d["xs"][0])
    assert int(ars[0].mailbox.status[0]) == 0b1010
    with pytest.raises(RuntimeError, match=r"\[1, 3\]"):
        ars[0].check()  # sticky until reset
    for ar in ars:
        ar.reset(collective=True)
    ars[0].check()
    d = step_inputs(2, 4, seed=10)
    outs = run_step(ars, d)
    ref_res, _, _ = consumer_ref(d["xs"], d["residual"], d["post"], d["comb"], d["pre"],
                                 d["gamma"], EPS)
    for res_out, _, _ in outs:
        assert torch.equal(bits(res_out), bits(ref_res))


def scratch(h=H, poison=False):
    """Per-token norm scratch as the mailbox holds it (poisoned: must not leak)."""
    fill = float("nan") if poison else 0.0
    # Poisoned partials carry the previous generation's tag (0): stale, never used.
    stale_nan = torch.tensor(fill).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return dict(generation=torch.zeros(CAP, dtype=torch.int32),
                status=torch.zeros(1, dtype=torch.int32), wait_bound=1000,
                sumsq=torch.full((CAP, sumsq_columns(h)), int(stale_nan), dtype=torch.int64),
                prenorm=torch.full((CAP, h), fill, dtype=torch.bfloat16))


def test_gathered_mode_matches_mailbox_mode():
    """The NCCL fallback's consumer path (already gathered partials) gives the
    same bits as the mailbox path."""
    d = step_inputs(3, 2, seed=21)
    gathered = torch.stack(d["xs"])
    res_out, layer, *_ = consume(gathered, 2, 3, mode=FULL, **scratch(),
                             residual=d["residual"], post=d["post"], comb=d["comb"],
                             pre=d["pre"], norm_weight=d["gamma"], eps=EPS, lamport=False)
    ars = BoundaryAllReduce.simulated(2, H, HC, CAP, TOP_K)
    (want_res, want_layer, _), _ = run_step(ars, d)
    assert torch.equal(bits(res_out), bits(want_res))
    assert torch.equal(bits(layer), bits(want_layer))


@pytest.mark.parametrize("tactic", [ConsumerTactic(32, 1, False), ConsumerTactic(64, 2, False),
                                    ConsumerTactic(256, 4, False), ConsumerTactic(256, 1, True)])
def test_every_tactic_matches_reference(tactic):
    """However the row is split (serial walk, or one cooperative program per
    token when it holds the whole row): residual_out exact, layer_input within
    1 ulp, MXFP8 of the kernel's own layer_input, scratch re-armed."""
    h, m = 256, 2
    d = step_inputs(m, 2, seed=33, h=h)
    s = scratch(h, poison=True)
    q = mxfp8_buffers(m, h)
    res_out, layer, *_ = consume(torch.stack(d["xs"]), 2, m, mode=FULL, **s, residual=d["residual"],
                             post=d["post"], comb=d["comb"], pre=d["pre"],
                             norm_weight=d["gamma"], eps=EPS, mxfp8_out=q, lamport=False,
                             tactic=tactic)
    ref_res, ref_layer, _ = consumer_ref(d["xs"], d["residual"], d["post"], d["comb"], d["pre"],
                                         d["gamma"], EPS)
    assert_consumer_outputs(res_out, layer, ref_res, ref_layer)
    assert_mxfp8_equal(q[0], q[1], layer)  # scale padding included
    assert s["generation"][:m].eq(1).all() and s["generation"][m:].eq(0).all()
    tags = s["sumsq"] >> 32
    assert tags[:m].eq(1).all() and tags[m:].eq(0).all(), "each launch rewrites its rows"
    assert s["status"].item() == 0


@pytest.mark.parametrize("h", [128, 96])
def test_scratch_reused_across_tactics_and_ragged_chunks(h):
    """One scratch through launches whose tactics cut the row differently (one
    32-column unit per chunk, one chunk for the whole row, 64-column chunks that
    do not divide H = 96): each launch rewrites the token's whole row with its
    own tag, so none reads a partial of the launch before, and every one matches
    the reference."""
    s = scratch(h, poison=True)
    tactics = [ConsumerTactic(32, 1, False), ConsumerTactic(256, 4, False),
               ConsumerTactic(64, 2, False), ConsumerTactic(128, 1, True),
               ConsumerTactic(32, 1, False)]
    m = 3
    for step, tactic in enumerate(tactics, start=1):
        d = step_inputs(m, 2, seed=40 + step, h=h)
        q = mxfp8_buffers(m, h)
        res_out, layer, *_ = consume(torch.stack(d["xs"]), 2, m, mode=FULL, **s,
                                 residual=d["residual"], post=d["post"], comb=d["comb"],
                                 pre=d["pre"], norm_weight=d["gamma"], eps=EPS, mxfp8_out=q,
                                 lamport=False, tactic=tactic)
        ref_res, ref_layer, _ = consumer_ref(d["xs"], d["residual"], d["post"], d["comb"],
                                             d["pre"], d["gamma"], EPS)
        assert_consumer_outputs(res_out, layer, ref_res, ref_layer)
        # Every tactic's bytes and scale buffer, padding included (3 groups of 96: a
        # padding group per row), against the independent FP64/integer MXFP8.
        assert_mxfp8_equal(q[0], q[1], layer, str(tactic))
        assert s["generation"][:m].eq(step).all() and s["generation"][m:].eq(0).all()
        assert (s["sumsq"][:m] >> 32).eq(step).all(), tactic
        assert s["status"].item() == 0


def test_check_names_the_missing_rank_before_a_norm_timeout():
    """A norm timeout next to a missing rank is the rank's doing: the error names
    the rank; a norm timeout alone says the programs did not meet."""
    ar = BoundaryAllReduce.simulated(2, H, HC, CAP, TOP_K)[0]
    ar.mailbox.status.fill_(NORM_TIMEOUT_BIT | 0b10)
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] did not publish"):
        ar.check()
    ar.mailbox.status.fill_(NORM_TIMEOUT_BIT)
    with pytest.raises(RuntimeError, match="did not meet for the RMSNorm"):
        ar.check()


def test_consume_needs_a_positive_wait_bound():
    d = step_inputs(1, 2, seed=3)
    with pytest.raises(ValueError, match="wait_bound"):
        consume(torch.stack(d["xs"]), 2, 1, mode=FULL, **dict(scratch(), wait_bound=0),
                residual=d["residual"], post=d["post"], comb=d["comb"], pre=d["pre"],
                norm_weight=d["gamma"], eps=EPS, lamport=False)


def test_cooperative_tactic_refused_where_programs_cannot_meet():
    d = step_inputs(1, 2, seed=3)
    with pytest.raises(ValueError, match="interpreter"):
        consume(torch.stack(d["xs"]), 2, 1, mode=FULL, **scratch(), residual=d["residual"],
                post=d["post"], comb=d["comb"], pre=d["pre"], norm_weight=d["gamma"], eps=EPS,
                lamport=False, tactic=ConsumerTactic(32, 1, True))


def test_publish_protocol_errors():
    ar = BoundaryAllReduce.simulated(1, H, HC, CAP, TOP_K)[0]
    d = step_inputs(2, 1, seed=1)
    x = d["xs"][0]
    args = dict(residual=d["residual"], post=d["post"], comb=d["comb"], pre=d["pre"],
                norm_weight=d["gamma"], norm_eps=EPS)
    ar.mark_published(x)
    with pytest.raises(RuntimeError, match="still unreduced"):
        ar.mark_published(x)
    with pytest.raises(RuntimeError, match="still unreduced"):
        ar.finalize(torch.zeros(1, H).bfloat16(), torch.ones(2, TOP_K),
                    torch.zeros(2, TOP_K, dtype=torch.int32), x, **args)
    with pytest.raises(RuntimeError, match="other than the published"):
        ar(x.clone(), **args)
    ar.reset()
    target = ar.publish_target()
    assert (target.rank, target.tp, target.capacity, target.hidden) == (0, 1, CAP, H)
    assert target.peer_ptrs.dtype == torch.int64 and target.stage_state.dtype == torch.int32
    ar.close()
    with pytest.raises(RuntimeError, match="closed"):
        ar(x, **args)


@pytest.mark.parametrize("case,match", [
    ("dtype", "x must be bf16"),
    ("hidden", "x must be bf16"),
    ("capacity", "capacity"),
    ("noncontig", "contiguous"),
    ("device", "is on meta"),
    ("post", "post must be"),
    ("comb", "comb must be"),
    ("gamma", "norm_weight"),
    ("residual_only", "residual_only=False"),
    ("quant", "quantize_layer_input=False"),
    ("scale", "mxfp8_out scale"),
])
def test_bad_input_errors(case, match):
    ar = BoundaryAllReduce.simulated(1, H, HC, CAP, TOP_K, quantize_layer_input=case != "quant",
                                     residual_only=case != "residual_only")[0]
    d = step_inputs(2, 1, seed=2)
    kw = dict(x=d["xs"][0], residual=d["residual"], post=d["post"], comb=d["comb"],
              pre=d["pre"], norm_weight=d["gamma"], norm_eps=EPS, mxfp8_out=None)
    changes = {
        "dtype": dict(x=kw["x"].float()),
        "hidden": dict(x=torch.zeros(2, H // 2, dtype=torch.bfloat16)),
        "capacity": dict(x=torch.zeros(CAP + 1, H, dtype=torch.bfloat16)),
        "noncontig": dict(x=torch.zeros(H, 2, dtype=torch.bfloat16).t()),
        "device": dict(x=torch.zeros(2, H, dtype=torch.bfloat16, device="meta")),
        "post": dict(post=d["post"][:, :2]),
        "comb": dict(comb=d["comb"].bfloat16()),
        "gamma": dict(norm_weight=d["gamma"][:8]),
        "residual_only": dict(pre=None),
        "quant": dict(mxfp8_out=mxfp8_buffers(2)),
        "scale": dict(mxfp8_out=(mxfp8_buffers(2)[0], torch.zeros(16, dtype=torch.uint8))),
    }
    kw.update(changes[case])
    with pytest.raises(ValueError, match=match):
        ar(**kw)


def test_precompile_marks_every_variant_then_calls_compile_nothing_new():
    """precompile(rows) covers publish, finalize and each consumer mode, so a
    later call (e.g. one being captured) has nothing left to compile."""
    ars = BoundaryAllReduce.simulated(2, H, HC, CAP, TOP_K, quantize_layer_input=True)
    for ar in ars:
        ar.precompile([1, 2])
    compiled = set(ars[0].compiled_variants)
    assert ("publish",) in compiled and ("finalize", torch.float32, torch.int32) in compiled
    assert {key[1:3] for key in compiled if key[0] == "consume"} == {
        (0, False), (1, False), (2, False), (2, True)}
    run_step(ars, step_inputs(2, 2, seed=4), quantize=True)
    assert ars[0].compiled_variants == compiled


@triton.jit
def _handoff_probe(sumsq_ptr, status_ptr, partial_ptr, tag_ptr, total_ptr, bound,
                   UNITS: tl.constexpr, UNITS_P2: tl.constexpr, BLOCK_H: tl.constexpr):
    chunk = tl.program_id(0)
    tag = tl.load(tag_ptr)
    _publish_partial(sumsq_ptr, 0, chunk, tl.load(partial_ptr + chunk), tag, UNITS, BLOCK_H)
    total = _wait_partials(sumsq_ptr, status_ptr, 0, tag, bound, UNITS, UNITS_P2, False)
    tl.store(total_ptr + chunk, total)


def test_norm_handoff_waits_for_this_generation_of_every_unit():
    """The interpreter runs program 0 to the end before program 1 starts: program 0
    finds chunk 1's units stale (older tag, poisoned value), gives up after the
    bound and flags the status word without using them; program 1 then sees every
    unit tagged and gets the exact total. Units beyond a chunk's first are +0."""
    units, block = 4, 64  # H = 128 in two 64-column chunks of two units each
    tag = 7
    stale = (tag - 1) << 32 | int(torch.tensor(float("nan")).view(torch.int32)) & 0xFFFFFFFF
    sumsq = torch.full((1, units), stale, dtype=torch.int64)
    status = torch.zeros(1, dtype=torch.int32)
    partials = torch.rand(2) * 100
    total = torch.full((2,), float("nan"))
    _handoff_probe[(2,)](sumsq, status, partials, torch.tensor([tag], dtype=torch.int32), total,
                         50, UNITS=units, UNITS_P2=4, BLOCK_H=block)
    assert status.item() == NORM_TIMEOUT_BIT
    assert (sumsq >> 32).eq(tag).all()
    values = (sumsq & 0xFFFFFFFF).to(torch.int32).view(torch.float32)[0]
    assert torch.equal(values, torch.stack([partials[0], torch.tensor(0.0),
                                            partials[1], torch.tensor(0.0)]))
    assert total[1].item() == (partials[0] + partials[1]).item()


def test_capture_refuses_a_variant_not_compiled_then_precompile_covers_it(monkeypatch):
    """Under CUDA-graph capture (stood in for: ``capturing`` answers True) a kernel
    variant that was not compiled raises, naming it and precompile, before
    anything is launched or marked published; after precompile(rows) the same
    calls run under capture (with the right answer), and a variant precompile
    does not cover (a finalize with int64 indices) still raises, naming it."""
    ar = BoundaryAllReduce.simulated(1, H, HC, CAP, TOP_K, quantize_layer_input=True)[0]
    d = step_inputs(2, 1, seed=5)
    x = d["xs"][0]
    capturing = [True]
    monkeypatch.setattr(BoundarySpec, "capturing", property(lambda self: capturing[0]))
    with pytest.raises(RuntimeError, match=r"\('publish',\).* not compiled and a CUDA graph "
                                           r"is being captured; call precompile"):
        ar.publish(x)
    assert not ar.has_unreduced_publish and ar.compiled_variants == set()
    assert ar.mailbox.buffer.view(torch.int16).eq(-32768).all(), "nothing was published"
    capturing[0] = False
    ar.precompile([2])
    capturing[0] = True
    q = mxfp8_buffers(2)
    ar.publish(x)
    res_out, layer, *_ = ar(x, residual=d["residual"], post=d["post"], comb=d["comb"],
                            pre=d["pre"], norm_weight=d["gamma"], norm_eps=EPS, mxfp8_out=q)
    ref_res, ref_layer, _ = consumer_ref(d["xs"], d["residual"], d["post"], d["comb"], d["pre"],
                                         d["gamma"], EPS)
    assert_consumer_outputs(res_out, layer, ref_res, ref_layer)
    idx = torch.zeros(2, TOP_K, dtype=torch.int64)
    with pytest.raises(RuntimeError, match=r"\('finalize', torch.float32, torch.int64\)\] are "
                                           "not compiled"):
        ar.publish_finalize(torch.zeros(1, H).bfloat16(), torch.ones(2, TOP_K), idx, x)
    assert not ar.has_unreduced_publish
