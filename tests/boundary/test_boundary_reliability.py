"""Reliability of the boundary all-reduce's entry points (CPU, interpreter, gloo).

* NVLink multicast is off before the first collective of a construction, and an
  NCCL group that may have been created before it was off is refused.
* Geometry is compared across ranks at construction: a mismatch (or a rank
  refusing its own arguments) raises the same ValueError on every rank; per-step
  M is checked against capacity on every rank.
* Environment switches, publish-target and stage ranges, the wait bound's unit
  taken with the kernel variant, the 30-rank limit of the status word, and
  ``close()`` (local by default, collective on request).
"""

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist

from decode_boundary import env
from decode_boundary.bench.launch import RankContext, launch
from decode_boundary.boundary import all_reduce as all_reduce_module
from decode_boundary.boundary import consumer as consumer_module
from decode_boundary.boundary.all_reduce import MAX_TP, BoundaryAllReduce
from decode_boundary.boundary.mailbox import simulated_mailboxes
from decode_boundary.boundary.step_guard import StepGuard
from decode_boundary.common.contract import (
    MAILBOX_MAX_ELEMENTS,
    STAGES,
    check_mailbox_size,
    check_publish_target,
    check_stage,
)
from decode_boundary.env import NO_MULTICAST_ENV

HIDDEN, HC, CAP, TOP_K = 64, 2, 4, 2
COLLECTIVES = ("all_gather_object", "all_gather_into_tensor", "all_reduce", "barrier",
               "broadcast", "broadcast_object_list", "all_gather")


class FakeGroup:
    """Stands in for a ProcessGroup where no collective may run."""

    group_name = "fake"


@pytest.fixture
def no_collectives(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a collective ran")

    for name in COLLECTIVES:
        monkeypatch.setattr(dist, name, refuse)


@pytest.fixture
def fresh_env_state(monkeypatch):
    """No record of variables set late; the three variables absent."""
    monkeypatch.setattr(env, "_SET_LATE", {})
    for key in NO_MULTICAST_ENV:
        monkeypatch.delenv(key, raising=False)


# ------------------------------------------------------------------- multicast off, NCCL check


def test_nccl_group_created_before_multicast_was_off_is_refused(monkeypatch, fresh_env_state,
                                                                no_collectives):
    """torch.distributed initialized, NCCL_NVLS_ENABLE not yet 0, an NCCL group:
    the constructor raises before any collective, naming the three variables,
    and the environment is fixed for whatever comes next."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(RuntimeError, match="NCCL_NVLS_ENABLE=0") as err:
        BoundaryAllReduce(HIDDEN, HC, CAP, TOP_K, group=FakeGroup(), device="cpu")
    message = str(err.value)
    assert "before torch.distributed.init_process_group" in message
    assert all(f"{k}={v}" in message for k, v in NO_MULTICAST_ENV.items())
    assert {k: os.environ.get(k) for k in NO_MULTICAST_ENV} == NO_MULTICAST_ENV
    # A device-split backend with NCCL for CUDA is refused too.
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    with pytest.raises(RuntimeError, match="NVLS"):
        env.disable_multicast(FakeGroup())


def test_nccl_group_with_multicast_off_early_is_accepted(monkeypatch, fresh_env_state):
    """What bench/launch.py and an import of decode_boundary.env do: the variables set
    before torch.distributed is initialized, so any NCCL group is accepted; a
    gloo group is never refused."""
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    env.disable_multicast()  # before init_process_group
    assert env._SET_LATE == {}
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    env.disable_multicast(FakeGroup())
    # Variables already in the environment (exported by a launcher) count as early.
    monkeypatch.setattr(env, "_SET_LATE", {})
    env.disable_multicast(FakeGroup())
    # Set late, but the group is gloo: nothing of NCCL to distrust.
    for key in NO_MULTICAST_ENV:
        monkeypatch.delenv(key)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    env.disable_multicast(FakeGroup())
    assert set(env._SET_LATE) == set(NO_MULTICAST_ENV)


def _env_now() -> dict:
    return {k: os.environ.get(k) for k in NO_MULTICAST_ENV}


def _multicast_off_before_first_collective(ctx: RankContext) -> dict:
    """In a real rank: the variables removed, every collective recorded with the
    environment it ran under, then a construction over the (gloo) group."""
    for key in NO_MULTICAST_ENV:
        os.environ.pop(key, None)
    seen = []
    for name in COLLECTIVES:
        real = getattr(dist, name)

        def wrapped(*args, _real=real, _name=name, **kwargs):
            seen.append((_name, _env_now()))
            return _real(*args, **kwargs)

        setattr(dist, name, wrapped)
    ar = BoundaryAllReduce(HIDDEN, HC, CAP, TOP_K, group=ctx.group, device=torch.device("cpu"))
    transport = ar.transport
    ar.close()
    # The group existed before the variables were set again: with NCCL it is refused
    # (simulated: this gloo group's backend reported as NCCL), before any collective.
    before = len(seen)
    real_backend = dist.get_backend
    dist.get_backend = lambda group=None: "nccl"
    try:
        BoundaryAllReduce(HIDDEN, HC, CAP, TOP_K, group=ctx.group, device=torch.device("cpu"))
        refused = None
    except RuntimeError as e:
        refused = str(e)
    finally:
        dist.get_backend = real_backend
    return {"seen": seen, "transport": transport, "refused": refused,
            "collectives_after_refusal": len(seen) - before}


def test_construction_turns_multicast_off_before_its_first_collective():
    results = launch(_multicast_off_before_first_collective, 2, (), timeout_s=240)
    for rank, out in results.items():
        assert out["transport"] == "nccl", (rank, out)
        assert out["seen"], "the construction ran no collective"
        assert out["seen"][0][0] == "all_gather_object"  # the geometry exchange
        for name, seen_env in out["seen"]:
            assert seen_env == NO_MULTICAST_ENV, (rank, name, seen_env)
        assert out["refused"] is not None and "NCCL_NVLS_ENABLE=0" in out["refused"], out
        assert out["collectives_after_refusal"] == 0


# ------------------------------------------------------------------- geometry across ranks


def _mismatches_then_a_good_step(ctx: RankContext) -> dict:
    cpu = torch.device("cpu")
    out = {}
    # 1. Different hidden on rank 1: both ranks refuse, neither allocates.
    try:
        BoundaryAllReduce(HIDDEN if ctx.rank == 0 else 2 * HIDDEN, HC, CAP, TOP_K,
                          group=ctx.group, device=cpu)
        out["hidden"] = None
    except ValueError as e:
        out["hidden"] = str(e)
    # 2. Rank 1 alone refuses its own argument: rank 0 is told, and does not wait.
    try:
        BoundaryAllReduce(HIDDEN, HC, CAP, TOP_K, group=ctx.group, device=cpu,
                          wait_timeout_s=1.0 if ctx.rank == 0 else 0.0)
        out["refusal"] = None
    except ValueError as e:
        out["refusal"] = str(e)
    # 3. The group is still in step: a good construction and a step agree.
    ar = BoundaryAllReduce(HIDDEN, HC, CAP, TOP_K, group=ctx.group, device=cpu)
    # 4. M above capacity is refused on this rank, before anything is launched.
    try:
        ar.plain_sum(torch.zeros(CAP + 1, HIDDEN, dtype=torch.bfloat16))
        out["capacity"] = None
    except ValueError as e:
        out["capacity"] = str(e)
    ar.reset(collective=True)  # a rejected step is aborted on every rank (docs/FAILURES.md)
    xs = torch.arange(2 * 3 * HIDDEN).view(2, 3, HIDDEN).bfloat16() / 64
    out["sum_exact"] = torch.equal(ar.plain_sum(xs[ctx.rank].clone()).float(),
                                   xs.float().sum(0).bfloat16().float())
    # 5. close(): local (no barrier), idempotent; close(collective=True): one barrier.
    barriers = []
    real_barrier = dist.barrier
    dist.barrier = lambda *a, **k: (barriers.append(1), real_barrier(*a, **k))[1]
    try:
        ar.close()
        ar.close()
        out["local_close_barriers"] = len(barriers)
        try:
            ar.plain_sum(xs[ctx.rank].clone())
        except RuntimeError as e:
            out["after_close"] = str(e)
        other = BoundaryAllReduce(HIDDEN, HC, CAP, TOP_K, group=ctx.group, device=cpu)
        before = len(barriers)
        other.close(collective=True)
        out["collective_close_barriers"] = len(barriers) - before
    finally:
        dist.barrier = real_barrier
    out["retired"] = len(all_reduce_module._RETIRED)  # gather transport: nothing to keep
    return out


def test_geometry_mismatch_and_refusals_raise_on_every_rank():
    results = launch(_mismatches_then_a_good_step, 2, (), timeout_s=240)
    assert set(results) == {0, 1}
    for rank, out in results.items():
        message = out["hidden"]
        assert message is not None, (rank, out)
        assert "hidden_size: 64 on rank 0, 128 on rank 1" in message, message
        assert "different geometries" in message
        refusal = out["refusal"]
        assert refusal is not None and "rank 1: wait_timeout_s must be positive" in refusal
        assert "rank 0:" not in refusal
        assert out["capacity"] is not None and "capacity = 4" in out["capacity"], out
        assert out["sum_exact"], out
        assert out["local_close_barriers"] == 0
        assert "closed" in out["after_close"]
        assert out["collective_close_barriers"] == 1
        assert out["retired"] == 0


def test_geometry_message_groups_ranks_by_value():
    from decode_boundary.boundary.transport import check_same_geometry

    check_same_geometry([{"capacity": 4, "tp": 3}] * 3)
    with pytest.raises(ValueError, match=r"capacity: 4 on ranks \[0, 2\], 8 on rank 1"):
        check_same_geometry([{"capacity": 4}, {"capacity": 8}, {"capacity": 4}])
    with pytest.raises(ValueError, match="residual_only: True on rank 0, <missing> on rank 1"):
        check_same_geometry([{"residual_only": True}, {}])


# ------------------------------------------------------------------- environment switches


@pytest.mark.parametrize(("raw", "value"), [
    ("1", True), ("0", False), ("true", True), ("False", False), ("YES", True), ("no", False),
    (" On ", True), ("off\n", False), ("", None), ("  ", None), (None, None)])
def test_env_flag_spellings(monkeypatch, raw, value):
    if raw is None:
        monkeypatch.delenv("DECODE_BOUNDARY_TEST_FLAG", raising=False)
    else:
        monkeypatch.setenv("DECODE_BOUNDARY_TEST_FLAG", raw)
    for default in (False, True):
        want = default if value is None else value
        assert env.env_flag("DECODE_BOUNDARY_TEST_FLAG", default) is want


@pytest.mark.parametrize("raw", ["2", "y", "n", "enable", "truee", "-1", "0x1"])
def test_env_flag_rejects_anything_else(monkeypatch, raw):
    monkeypatch.setenv("DECODE_BOUNDARY_TEST_FLAG", raw)
    with pytest.raises(ValueError, match=rf"DECODE_BOUNDARY_TEST_FLAG={raw!r}"):
        env.env_flag("DECODE_BOUNDARY_TEST_FLAG")


def test_ptx_and_pdl_switches_read_false_as_false(monkeypatch):
    """DISABLE_PTX=false once switched PTX off; now false/no/off mean "not disabled"."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    gpu = torch.device("cuda", 0)  # only its type is looked at
    for raw, ptx in (("false", True), ("no", True), ("off", True), ("0", True), ("1", False),
                     ("yes", False)):
        monkeypatch.setenv("DECODE_BOUNDARY_DISABLE_PTX", raw)
        assert env.use_ptx(gpu) is ptx, raw
    monkeypatch.setenv("DECODE_BOUNDARY_DISABLE_PTX", "off")
    monkeypatch.setenv("DECODE_BOUNDARY_DISABLE_PDL", "false")
    assert env.use_pdl(gpu)
    monkeypatch.setenv("DECODE_BOUNDARY_DISABLE_PDL", "on")
    assert not env.use_pdl(gpu)
    monkeypatch.setenv("DECODE_BOUNDARY_DISABLE_PTX", "sometimes")
    with pytest.raises(ValueError, match="DECODE_BOUNDARY_DISABLE_PTX='sometimes'"):
        env.use_ptx(gpu)


def test_interpret_mode_reads_triton_interpret_as_triton_does(monkeypatch):
    from triton._C.libtriton import getenv_bool

    for raw in ("1", "0", "true", "false", "on", "off", "yes", "no", "y", "TRUE", "2", ""):
        monkeypatch.setenv("TRITON_INTERPRET", raw)
        assert env.interpret_mode() is bool(getenv_bool("TRITON_INTERPRET", False)), raw


# ------------------------------------------------------------------- publish target and stages


def test_publish_target_ranges():
    ar = BoundaryAllReduce.simulated(2, HIDDEN, HC, CAP, TOP_K)[1]
    target = ar.publish_target()
    cpu = torch.device("cpu")
    check_publish_target(target, HIDDEN, CAP, cpu)
    bad = [(dict(rank=-1), r"publish.rank -1 outside \[0, 2\)"),
           (dict(rank=2), r"publish.rank 2 outside \[0, 2\)"),
           (dict(rank=True), "publish.rank True"),
           (dict(tp=0), "publish.tp must be an int >= 1"),
           (dict(capacity=0), "publish.capacity must be an int >= 1"),
           (dict(hidden=0), "publish.hidden must be an int >= 1"),
           (dict(hidden=-8), "publish.hidden must be an int >= 1"),
           (dict(capacity=1.5), "publish.capacity must be an int")]
    for change, match in bad:
        with pytest.raises(ValueError, match=match):
            check_publish_target(dataclasses.replace(target, **change), HIDDEN, 1, cpu)
    with pytest.raises(ValueError, match="exceed the mailbox capacity"):
        check_publish_target(target, HIDDEN, CAP + 1, cpu)
    # Publishers address mailboxes with int32 offsets: a geometry past 2^31 elements is
    # refused, by the target check and before any mailbox is allocated.
    huge = MAILBOX_MAX_ELEMENTS // (STAGES * 2 * HIDDEN) + 1
    with pytest.raises(ValueError, match="exceeds 2147483647 elements"):
        check_publish_target(dataclasses.replace(target, capacity=huge), HIDDEN, 1, cpu)
    with pytest.raises(ValueError, match="exceeds 2147483647 elements"):
        BoundaryAllReduce.simulated(2, HIDDEN, HC, huge, TOP_K)
    check_mailbox_size(2, huge - 1, HIDDEN)  # the largest that fits
    for index, label in ((0, "NEXT"), (1, "ACTIVE")):
        for stage in (-1, STAGES):
            words = target.stage_state.clone()
            words[index] = stage
            with pytest.raises(ValueError, match=rf"stage_state\[{label}\] must be an int in"):
                check_publish_target(dataclasses.replace(target, stage_state=words), HIDDEN, 1,
                                     cpu)


def test_check_stage():
    assert [check_stage(s) for s in range(STAGES)] == list(range(STAGES))
    for bad in (-1, STAGES, True, 1.0, "0", None):
        with pytest.raises(ValueError, match=rf"stage must be an int in \[0, {STAGES}\)"):
            check_stage(bad)


# ------------------------------------------------------------------- wait bound and variant


class RecordingKernel:
    """Stands in for consumer_kernel: records (USE_PTX, wait_bound) of each launch."""

    def __init__(self):
        self.launches = []
        self.bound_at = consumer_module.consumer_kernel.arg_names.index("wait_bound")

    def __getitem__(self, grid):
        def launch_it(*args, **kwargs):
            self.launches.append((kwargs["USE_PTX"], args[self.bound_at]))

        return launch_it


def test_wait_bound_unit_is_decided_with_the_kernel_variant(monkeypatch):
    """The PTX decision may change between construction and launch (a switch
    flipped, a test's monkeypatch): the bound's unit follows the variant launched,
    because both come from one env.use_ptx call at the launch."""
    timeout = 0.25
    ar = BoundaryAllReduce.simulated(1, HIDDEN, HC, CAP, TOP_K, wait_timeout_s=timeout)[0]
    kernel = RecordingKernel()
    monkeypatch.setattr(consumer_module, "consumer_kernel", kernel)
    monkeypatch.setattr(env, "use_pdl", lambda device: False)
    answers = iter([True, False, True])  # a switch that changes at every read
    monkeypatch.setattr(env, "use_ptx", lambda device: next(answers))
    x = torch.ones(2, HIDDEN, dtype=torch.bfloat16)
    for _ in range(3):
        ar.plain_sum(x)
    spins = max(1, int(timeout * consumer_module.INTERPRETER_SPINS_PER_SECOND))
    assert kernel.launches == [(True, int(timeout * 1e9)), (False, spins),
                               (True, int(timeout * 1e9))]


# ------------------------------------------------------------------- 30 ranks at most


def test_more_than_30_ranks_refused(monkeypatch, no_collectives):
    assert MAX_TP == 30
    with pytest.raises(ValueError, match="at most 30 ranks, got tp = 31"):
        BoundaryAllReduce.simulated(31, 8, 1, 1, 1)
    assert len(BoundaryAllReduce.simulated(30, 8, 1, 1, 1)) == 30
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 32)
    with pytest.raises(ValueError, match="bit 30 reports a norm hand-off timeout"):
        BoundaryAllReduce(8, 1, 1, 1, group=FakeGroup(), device="cpu")


# ------------------------------------------------------------------- close


def test_close_is_local_idempotent_and_keeps_a_peer_reachable_mailbox(monkeypatch):
    ars = BoundaryAllReduce.simulated(2, HIDDEN, HC, CAP, TOP_K)
    monkeypatch.setattr(all_reduce_module, "_RETIRED", [])
    barriers = []
    monkeypatch.setattr(StepGuard, "barrier", lambda guard: barriers.append(guard))
    # Simulated ranks (no group): the mailbox goes with its last reference.
    ars[0].close()
    ars[0].close()
    assert barriers == [] and all_reduce_module._RETIRED == []
    with pytest.raises(RuntimeError, match="closed"):
        ars[0].publish_target()
    # A mailbox that peers of a group store into outlives a local close.
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")

    def in_a_group():
        box = simulated_mailboxes(2, CAP, HIDDEN)[1]
        return BoundaryAllReduce(HIDDEN, HC, CAP, TOP_K, group=FakeGroup(), device="cpu",
                                 _mailbox=box), box

    grouped, box = in_a_group()
    grouped.close()
    assert barriers == [] and [box] == all_reduce_module._RETIRED
    # Collective close: one barrier per call, closed or not, and nothing kept.
    fresh, _ = in_a_group()
    fresh.close(collective=True)
    fresh.close(collective=True)
    guard = fresh.launches.guard
    assert barriers == [guard, guard] and [box] == all_reduce_module._RETIRED
    with BoundaryAllReduce.simulated(1, HIDDEN, HC, CAP, TOP_K)[0] as ar:
        pass
    assert ar.closed and len(barriers) == 2
