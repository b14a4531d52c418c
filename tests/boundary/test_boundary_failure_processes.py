"""Failures across real processes on CPU (gloo, Triton interpreter): ranks on
one device take the gather transport (docs/FAILURES.md).

* A bad input on one rank: it raises ValueError at once, after taking part in
  the step's all-gather with the abort poison; its peer's outputs are NaN and
  its check names the rank; after reset(collective=True) on both, the next
  steps are bit-identical to those of a fresh all-reduce.
* A dead peer (``os._exit`` mid-run): the survivors' all-gather and their
  reset raise RuntimeError naming it within the bounds (``host_timeout_s``);
  one that dies before constructing is named by the survivors' construction.
"""

import os
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from survivors import report_and_exit, run_ranks, timed_error

from decode_boundary.bench.launch import RankContext, free_port, launch
from decode_boundary.boundary.all_reduce import BoundaryAllReduce
from decode_boundary.boundary.reference import consumer_ref

HIDDEN, HC, CAP, M, EPS = 64, 2, 3, 2, 1e-6
HOST_TIMEOUT_S = 3.0


def _inputs(world, seed):
    gen = torch.Generator().manual_seed(seed)  # every rank draws every rank's partial
    return dict(xs=torch.randn(world, M, HIDDEN, generator=gen).bfloat16(),
                residual=torch.randn(M, HC, HIDDEN, generator=gen).bfloat16(),
                post=torch.rand(M, HC, generator=gen), comb=torch.rand(M, HC, HC, generator=gen),
                pre=torch.rand(M, HC, generator=gen),
                gamma=(1 + 0.1 * torch.randn(HIDDEN, generator=gen)).bfloat16())


def _call(ar, d, rank, **change):
    kw = dict(x=d["xs"][rank].clone(), residual=d["residual"], post=d["post"], comb=d["comb"],
              pre=d["pre"], norm_weight=d["gamma"], norm_eps=EPS)
    kw.update(change)
    return ar(**kw)[:2]  # (residual_out, layer_input)


def _make(ctx):
    ar = BoundaryAllReduce(HIDDEN, HC, CAP, 2, group=ctx.group, residual_only=False,
                           device=torch.device("cpu"))
    ar.host_timeout_s = 20.0
    return ar


def _bad_input_then_reset(ctx: RankContext) -> dict:
    warnings.filterwarnings("ignore")
    ar = _make(ctx)
    out = {"transport": ar.transport}
    _call(ar, _inputs(ctx.world_size, 1), ctx.rank)  # a good step first
    d = _inputs(ctx.world_size, 2)
    if ctx.rank == 1:  # rank 1's residual is wrong
        start = time.monotonic()
        try:
            _call(ar, d, 1, residual=d["residual"][:, :1].contiguous())
        except ValueError as e:
            out["raised"] = str(e)
        out["raise_s"] = time.monotonic() - start
    else:
        ar.launches.guard.check = lambda: None  # keep the outputs, check after
        res, layer = _call(ar, d, 0)
        del ar.launches.guard.check
        out["nan"] = bool(res.isnan().all() and layer.isnan().all())
        try:
            ar.check()
        except RuntimeError as e:
            out["raised"] = str(e)
    ar.reset(collective=True)
    fresh = _make(ctx)
    out["exact"] = []
    for seed in (3, 4):
        d = _inputs(ctx.world_size, seed)
        (a, b), (c, e) = _call(ar, d, ctx.rank), _call(fresh, d, ctx.rank)
        ref_res, _, _ = consumer_ref(list(d["xs"]), d["residual"], d["post"], d["comb"], d["pre"],
                                     d["gamma"], EPS)
        out["exact"].append(torch.equal(a.view(torch.int16), c.view(torch.int16))
                            and torch.equal(b.view(torch.int16), e.view(torch.int16))
                            and torch.equal(a.view(torch.int16), ref_res.view(torch.int16)))
    out["digest"] = int(a.view(torch.int16).sum())
    return out


def test_bad_input_on_one_process_is_named_by_its_peer_and_reset_recovers():
    results = launch(_bad_input_then_reset, 2, (), timeout_s=120)
    assert results[0]["transport"] == results[1]["transport"] == "nccl"  # the gather path
    assert "residual must be" in results[1]["raised"] and results[1]["raise_s"] < 5
    assert results[0]["nan"]
    assert "rank(s) [1] aborted this step" in results[0]["raised"]
    for r in (0, 1):
        assert results[r]["exact"] == [True, True], results[r]
    assert results[0]["digest"] == results[1]["digest"]


# ----------------------------------------------------------------------- dead peer


def _survivor(rank: int, world: int, port: int, results) -> None:
    def body() -> dict:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
        ar = BoundaryAllReduce(HIDDEN, HC, CAP, 2, group=dist.group.WORLD, residual_only=True,
                               device=torch.device("cpu"))
        ar.host_timeout_s = HOST_TIMEOUT_S
        d = _inputs(world, 5)
        ar.plain_sum(d["xs"][rank].clone())  # one good step
        if rank == world - 1:
            os._exit(3)  # dies mid-run, without a word
        time.sleep(0.5)
        out = {}
        for name, call in (("gather", lambda: ar.plain_sum(d["xs"][rank].clone())),
                           ("reset", lambda: ar.reset(collective=True))):
            out[name], out[f"{name}_s"] = timed_error(call)
        return out

    report_and_exit(rank, results, body, linger_s=2 * HOST_TIMEOUT_S)


def test_dead_peer_is_named_by_the_gather_and_by_reset_within_the_bound():
    world = 3
    got, procs = run_ranks(_survivor, world, (world, free_port()), reports=world - 1,
                           timeout_s=90)
    assert procs[world - 1].exitcode == 3
    assert set(got) == {0, 1}, got
    for out in got.values():
        assert isinstance(out, dict), out
        # The all-gather fails at once (gloo sees the closed connection); naming the
        # rank takes a presence check of at most host_timeout_s.
        assert "rank(s) [2]" in out["gather"] and "gather transport" in out["gather"], out
        assert out["gather_s"] < 2 * HOST_TIMEOUT_S + 2, out
        assert "rank(s) [2] did not reach the reset-a barrier" in out["reset"], out
        assert HOST_TIMEOUT_S - 0.5 < out["reset_s"] < HOST_TIMEOUT_S + 2, out


def _construct_without_a_peer(rank: int, world: int, port: int, results) -> None:
    def body() -> dict:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
        if rank == world - 1:
            os._exit(3)  # never constructs
        BoundaryAllReduce.host_timeout_s = HOST_TIMEOUT_S  # the class default: before __init__
        construct, seconds = timed_error(
            lambda: BoundaryAllReduce(HIDDEN, HC, CAP, 2, group=dist.group.WORLD, device="cpu"))
        return {"construct": construct, "construct_s": seconds}

    report_and_exit(rank, results, body, linger_s=2 * HOST_TIMEOUT_S)


def test_a_peer_that_never_constructs_is_named_within_the_bound():
    world = 3
    got, procs = run_ranks(_construct_without_a_peer, world, (world, free_port()),
                           reports=world - 1, timeout_s=90)
    assert procs[world - 1].exitcode == 3
    assert set(got) == {0, 1}, got
    for out in got.values():
        assert isinstance(out, dict), out
        assert "rank(s) [2] did not reach the construction of BoundaryAllReduce" in \
            out["construct"], out
        assert HOST_TIMEOUT_S - 0.5 < out["construct_s"] < HOST_TIMEOUT_S + 2, out
