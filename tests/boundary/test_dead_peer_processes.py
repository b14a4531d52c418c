"""A dead peer is told from a slow one at every host wait (docs/FAILURES.md §4),
across real processes on CPU (gloo, Triton interpreter, tp = 2, the gather
transport), and the liveness marks that make it possible.

* A rank killed (``os._exit``) right after construction, during the first
  call's compile, or between steps: the survivor's compile barrier (a step's or
  ``precompile``'s), all-gather, reset and collective close each name it within
  10 s, far inside their own bounds (900 s, ``host_timeout_s``). A rank frozen
  between steps (SIGSTOP: gloo sees no closed connection) is named by the
  all-gather's wait itself.
* A rank that sleeps 15 s (three liveness bounds, past the 10 s in which a dead
  rank is named) inside its first compile (and later, longer than the
  liveness bound, before a collective close) is waited for, never named, and
  the step is exact.

The rendezvous store lives in the test process (as torchrun's agent hosts it),
so either rank may die: which one, M and the inputs are drawn per run.
"""

import os
import random
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from boundary_inputs import matches_reference, random_step
from survivors import report_and_exit, run_ranks, timed_error

from decode_boundary.boundary import liveness
from decode_boundary.boundary.all_reduce import BoundaryAllReduce
from decode_boundary.boundary.step_guard import COMPILE_TIMEOUT_S, StepGuard

HIDDEN, HC, CAP, EPS = 64, 2, 4, 1e-6
TARGET_S = 10.0  # the target: every survivor names the dead rank within this
HOST_TIMEOUT_S = 120.0  # far above the target: only the liveness marks can name it in time
COMPILE_S = 2.0  # the survivor's simulated compile while its peer dies
SLOW_S = 3 * liveness.LIVENESS_TIMEOUT_S  # the slow rank's first compile: 15 s > TARGET_S


def _inputs(seed: int, m: int) -> dict:
    return random_step(m, 2, seed, hc=HC, h=HIDDEN)  # every rank draws every rank's partial


def _step(ar, d: dict, rank: int):
    return ar(d["xs"][rank].clone(), residual=d["residual"], post=d["post"], comb=d["comb"],
              pre=d["pre"], norm_weight=d["gamma"], norm_eps=EPS)


def _exact(d: dict, out) -> bool:
    return matches_reference(d, out, EPS)


def _join(rank: int, port: int) -> BoundaryAllReduce:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    ar = BoundaryAllReduce(HIDDEN, HC, CAP, 2, group=dist.group.WORLD, residual_only=False,
                           device=torch.device("cpu"))
    ar.host_timeout_s = HOST_TIMEOUT_S
    return ar


def _first_compile(hook) -> None:
    """Run ``hook()`` inside this process's first compile (before its barrier):
    where a rank JIT-compiles its kernels on a GPU."""
    real = StepGuard.compile_variants  # every compile of a call or precompile passes here
    calls = []

    def compile_variants(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            hook()
        return real(self, *args, **kwargs)

    StepGuard.compile_variants = compile_variants


def _store_host():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=60))


# ----------------------------------------------------------------------- a dead rank


def _dies(rank: int, port: int, scenario: str, dead: int, m: int, seed: int, results) -> None:
    def body() -> dict:
        ar = _join(rank, port)
        d = _inputs(seed, m)
        out = {}
        if scenario == "before_first_call":
            if rank == dead:
                os._exit(3)
            first = (lambda: ar.precompile(m)) if seed % 2 else (lambda: _step(ar, d, rank))
            out["compile barrier"] = timed_error(first)
        elif scenario == "while_compiling":
            _first_compile((lambda: (time.sleep(0.5), os._exit(3))) if rank == dead else
                           (lambda: time.sleep(COMPILE_S)))
            message, seconds = timed_error(lambda: _step(ar, d, rank))
            out["compile barrier"] = message, seconds - COMPILE_S  # the wait after compiling
        else:  # between steps
            out["first step exact"] = _exact(d, _step(ar, d, rank))
            if rank == dead and scenario == "frozen_between_steps":
                os.kill(os.getpid(), signal.SIGSTOP)  # its connections stay open: gloo waits
            if rank == dead:
                os._exit(3)
            time.sleep(0.3)
            d = _inputs(seed + 1, m)
            out["all-gather"] = timed_error(lambda: _step(ar, d, rank))
            if scenario == "between_steps":
                out["reset"] = timed_error(lambda: ar.reset(collective=True))
                out["close"] = timed_error(lambda: ar.close(collective=True))
        return out

    report_and_exit(rank, results, body)


@pytest.mark.parametrize("scenario", ["before_first_call", "while_compiling", "between_steps",
                                      "frozen_between_steps"])
def test_a_dead_rank_is_named_within_seconds_at_every_host_wait(scenario):
    rng = random.Random()
    dead, m, seed = rng.randrange(2), rng.randint(1, CAP), rng.randrange(1 << 30)
    survivor = 1 - dead
    host = _store_host()
    got, procs = run_ranks(_dies, 2, (host.port, scenario, dead, m, seed), reports=1,
                           timeout_s=120)
    context = (scenario, dict(dead=dead, m=m, seed=seed), got)
    # (A frozen rank is killed by run_ranks once the survivor reported.)
    assert procs[dead].exitcode == (-signal.SIGKILL if "frozen" in scenario else 3), context
    assert set(got) == {survivor}, context
    out = got[survivor]
    assert isinstance(out, dict), context
    waits = {name: value for name, value in out.items() if isinstance(value, tuple)}
    assert set(waits) == {
        "before_first_call": {"compile barrier"}, "while_compiling": {"compile barrier"},
        "between_steps": {"all-gather", "reset", "close"},
        "frozen_between_steps": {"all-gather"}}[scenario], context
    if "between_steps" in scenario:
        assert out["first step exact"] is True, context
    expected = {"compile barrier": "did not reach the compile barrier",
                "all-gather": "gather transport's all-gather failed",
                "reset": "did not reach the reset-a barrier",
                "close": "did not reach the close barrier"}
    for name, (message, seconds) in waits.items():
        print(f"{scenario}: rank {survivor} named dead rank {dead} at its {name} after "
              f"{seconds:.2f} s (M={m})")
        assert f"rank(s) [{dead}]" in message and expected[name] in message, (name, context)
        assert "liveness mark went stale" in message, (name, context)
        # Named by the liveness bound, long before the wait's own bound would have.
        assert seconds < TARGET_S, (name, seconds, context)
        assert seconds < min(HOST_TIMEOUT_S, COMPILE_TIMEOUT_S) / 4, (name, context)


# ----------------------------------------------------------------------- a slow rank


def _slow(rank: int, port: int, slow: int, m: int, seed: int, close_late_s: float,
          results) -> None:
    def body() -> dict:
        ar = _join(rank, port)
        if rank == slow:
            _first_compile(lambda: time.sleep(SLOW_S))
        d = _inputs(seed, m)
        start = time.monotonic()
        try:
            out = _step(ar, d, rank)
        except RuntimeError as error:  # must not happen: reported, not raised
            return {"step": str(error), "step_s": time.monotonic() - start}
        report = {"step": "no error", "step_s": time.monotonic() - start,
                  "exact": _exact(d, out), "digest": int(out[0].view(torch.int16).sum())}
        if rank == slow:
            time.sleep(close_late_s)  # alive, but later than the liveness bound
        report["close"], report["close_s"] = timed_error(lambda: ar.close(collective=True))
        return report

    report_and_exit(rank, results, body)


def test_a_slow_rank_is_waited_for_and_the_step_is_exact():
    rng = random.Random()
    slow, m, seed = rng.randrange(2), rng.randint(1, CAP), rng.randrange(1 << 30)
    close_late_s = liveness.LIVENESS_TIMEOUT_S + 2 + rng.random()
    host = _store_host()
    got, procs = run_ranks(_slow, 2, (host.port, slow, m, seed, close_late_s), reports=2,
                           timeout_s=180, exit_s=10)  # both exit on their own after reporting
    context = (dict(slow=slow, m=m, seed=seed), got)
    assert set(got) == {0, 1}, context
    fast = 1 - slow
    for out in got.values():
        assert isinstance(out, dict), context
        assert out["step"] == "no error" and out["exact"] is True, context
        assert out["close"] == "no error", context
    assert got[0]["digest"] == got[1]["digest"], context
    print(f"rank {fast} waited {got[fast]['step_s']:.2f} s for slow rank {slow} at the compile "
          f"barrier, {got[fast]['close_s']:.2f} s at the close barrier (M={m})")
    # The fast rank really waited (its peer was alive, only slow), at both barriers.
    assert got[fast]["step_s"] > SLOW_S - 1, context
    assert got[fast]["close_s"] > close_late_s - 1, context
    for p in procs:
        assert p.exitcode == 0, context


# ----------------------------------------------------------------------- the marks


class _Group:
    group_name = "liveness-test"


def test_peer_watch_judges_marks_by_its_own_clock(monkeypatch):
    store, now = dist.HashStore(), [100.0]
    monkeypatch.setattr(liveness.time, "monotonic", lambda: now[0])
    key = liveness.mark_key(_Group.group_name, 1)
    watch = liveness.PeerWatch(_Group.group_name, store, 5.0)
    assert watch.gone([1]) == {}  # no mark yet: no verdict, ever
    now[0] += 60
    assert watch.gone([1]) == {}
    store.set(key, "7:1")
    for _ in range(8):  # a mark that changes each second is alive, however long
        now[0] += 1.0
        store.set(key, f"7:{int(now[0])}")
        assert watch.gone([1]) == {}
    now[0] += 3.0
    assert watch.gone([1]) == {}  # unchanged for 3 s: within the bound
    now[0] += 2.5
    verdict = watch.gone([1])  # unchanged for 5.5 s: stale
    assert set(verdict) == {1} and "went stale: unchanged for 5.5 s" in verdict[1], verdict
    assert watch.gone([1]) == {}  # read again only CHECK_S later
    store.set(key, liveness.CLOSED)
    now[0] += 1.0
    assert "has closed" in watch.gone([1])[1]
    patient = liveness.PeerWatch(_Group.group_name, store, 5.0, closed_is_gone=False)
    assert patient.gone([1]) == {}  # the construction barrier: closed is no verdict


def test_bound_from_the_argument_the_environment_or_the_default(monkeypatch):
    monkeypatch.delenv(liveness.LIVENESS_ENV, raising=False)
    assert liveness.bound() == liveness.LIVENESS_TIMEOUT_S
    assert liveness.bound(3.5) == 3.5 and liveness.bound(float("inf")) == float("inf")
    monkeypatch.setenv(liveness.LIVENESS_ENV, "7.25")
    assert liveness.bound() == 7.25 and liveness.bound(4) == 4.0
    for bad in ("soon", "1", "nan"):
        monkeypatch.setenv(liveness.LIVENESS_ENV, bad)
        with pytest.raises(ValueError, match=liveness.LIVENESS_ENV):
            liveness.bound()
    for bad in (1.0, -3, float("nan"), "5", True):
        with pytest.raises(ValueError, match="liveness_timeout_s"):
            liveness.bound(bad)


def test_the_heartbeat_lives_while_held_and_marks_closed_when_released():
    store, group = dist.HashStore(), _Group()
    key = liveness.mark_key(group.group_name, 0)

    class Owner:
        pass

    owners = [Owner(), Owner()]
    holds = [liveness.hold(group, store, 0, owner) for owner in owners]
    assert holds[0]._beat is holds[1]._beat  # one heartbeat per group and process
    thread = holds[0]._beat._thread
    first = store.get(key)
    time.sleep(2.5 * liveness.HEARTBEAT_S)
    assert store.get(key) not in (first, liveness.CLOSED.encode())
    holds[0].release()
    holds[0].release()  # once only: the other holder still holds
    time.sleep(1.5 * liveness.HEARTBEAT_S)
    assert thread.is_alive() and store.get(key) != liveness.CLOSED.encode()
    del owners[1]  # the last holder collected: released
    thread.join(2 * liveness.HEARTBEAT_S)
    assert not thread.is_alive() and store.get(key) == liveness.CLOSED.encode()
    assert thread.daemon  # never keeps a process alive at exit


# ----------------------------------------------------------------------- exiting


_HELD = []


def _exits(rank: int, port: int, closes: int, seed: int, results) -> None:
    """A good step, then rank ``closes`` closes its all-reduce and the other does
    not; both leave the process the ordinary way (interpreter exit)."""
    ar = _join(rank, port)
    d = _inputs(seed, 2)
    exact = _exact(d, _step(ar, d, rank))
    if rank == closes:
        ar.close()
    else:
        _HELD.append(ar)  # still held at interpreter exit
    dist.destroy_process_group()
    results.put((rank, {"exact": exact}))
    results.close()
    results.join_thread()


def test_the_heartbeat_keeps_no_process_alive_and_marks_it_closed():
    closes, seed = random.randrange(2), random.randrange(1 << 30)
    host = _store_host()
    got, procs = run_ranks(_exits, 2, (host.port, closes, seed), reports=2, timeout_s=120,
                           exit_s=15)
    assert set(got) == {0, 1} and all(out["exact"] for out in got.values()), got
    # Both exited on their own (run_ranks kills only what is still alive after exit_s),
    # one closed, the other with its all-reduce (and heartbeat) still held at exit.
    assert [p.exitcode for p in procs] == [0, 0], (closes, [p.exitcode for p in procs])
    # The marks under the default group's prefix of the store, as the ranks saw it.
    marks = {key: host.get(key) for key in host.list_keys() if "/alive/" in key}
    assert sorted(marks) == sorted(next(k for k in marks if k.endswith(
        liveness.mark_key("0", rank))) for rank in (0, 1)), marks
    assert set(marks.values()) == {liveness.CLOSED.encode()}, marks
