"""Recovery across real processes on CPU (gloo, Triton interpreter, the gather
transport): after a refused input on any rank and ``reset(collective=True)``
on every rank, the next steps give the reference bits on every rank, and
every host collective of a step is entered by every rank in one order (the
hang this guards against: a rank that never compiled the refused step's
variant entered the compile barrier at the next step while its peer, which
had, entered the all-gather).

* Refusal patterns (tp = 2): the reported one (rank 1's ``post`` of the wrong
  shape at the first step of M = 3), on rank 0 instead, at a new M and at a compiled
  M, two in a row, right after a reset, ``precompile`` after a refusal.
* The guard (tp = 2 and 3): ranks forced into different collectives (a rank
  that forgot its compiled variants: the compile barrier against the
  all-gather; a rank one compile barrier ahead: two numbers of one barrier)
  raise ``CollectiveMismatch`` within seconds on every rank, naming each rank
  and where it waits; a reset recovers.
* A seeded random fault run (tp = 3): 200 steps of random M, a bad input on a
  random rank in about one step of ten, a reset after each failure: every step
  gives the reference bits on every rank or raises on every rank, none waits
  10 s.

The ranks run every case in one set of processes (:mod:`rank_cases`), each
case bounded to ``CASE_S``: a hang fails the test, naming its case.
"""

import hashlib
import os
import random
import re
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from boundary_inputs import matches_reference, random_step
from rank_cases import report_cases, run_cases

from decode_boundary.boundary import host_wait
from decode_boundary.boundary.all_reduce import BoundaryAllReduce
from decode_boundary.boundary.step_guard import variant_digest

HIDDEN, HC, CAP, EPS = 64, 2, 4, 1e-6
CASE_S = 30.0  # a case (or a step of the random run) that takes longer is a hang
STEP_S = 10.0  # the longest any step (with its reset) may wait
HOST_TIMEOUT_S = 20.0
STEP, RESET = "step", ("reset",)  # the ops of a case (_op)


# ----------------------------------------------------------------------- one rank's side


def _bad(kind: str, kw: dict) -> dict:
    """A call's arguments ``kw`` with one input that its checks refuse."""
    m = kw["x"].shape[0]
    if kind == "post":  # as reported: refused by the consumer's layout checks
        return {"post": torch.rand(m, HC + 1)}
    if kind == "residual":  # refused by the plan
        return {"residual": kw["residual"][:, :1].contiguous()}
    if kind == "eps":
        return {"norm_eps": -1.0}
    if kind == "x":
        return {"x": kw["x"].float()}
    return {"comb": kw["comb"].bfloat16()}


BAD_KINDS = ("post", "residual", "eps", "x", "comb")


def _outcome(call) -> tuple:
    """("ok", value) or ("error", "Type: message"), and the seconds taken."""
    start = time.monotonic()
    try:
        value = ("ok", call())
    except Exception as error:  # noqa: BLE001 - the parent judges it
        value = ("error", f"{type(error).__name__}: {error}")
    return (*value, time.monotonic() - start)


def _step(ar, rank: int, world: int, m: int, seed: int, bad: tuple | None):
    """One full step at M = ``m`` (``bad``: (rank, kind) refused): (exact,
    digest of both outputs) on success."""
    d = random_step(m, world, seed, hc=HC, h=HIDDEN)
    kw = dict(x=d["xs"][rank].clone(), residual=d["residual"], post=d["post"], comb=d["comb"],
              pre=d["pre"], norm_weight=d["gamma"], norm_eps=EPS)
    if bad is not None and bad[0] == rank:
        kw.update(_bad(bad[1], kw))
    out = ar(**kw)
    bits = torch.cat([out.residual_out.view(torch.int16).flatten(),
                      out.layer_input.view(torch.int16).flatten()])
    return matches_reference(d, out, EPS), hashlib.sha1(bits.numpy().tobytes()).hexdigest()


def _join(rank: int, port: int, world: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))


def _make() -> BoundaryAllReduce:
    ar = BoundaryAllReduce(HIDDEN, HC, CAP, 2, group=dist.group.WORLD, residual_only=False,
                           device=torch.device("cpu"))
    ar.host_timeout_s = HOST_TIMEOUT_S
    return ar


def _force(ar, rank: int, world: int, how: str) -> None:
    """The test hook: the last rank's host state made to differ from its peers'."""
    if rank != world - 1:
        return
    if how == "forget compiled":  # its next step enters the compile barrier alone
        ar._guard.compiled.clear()
    else:  # "one barrier ahead": its next compile barrier has the next number
        host_wait.number(ar.group, "compile")


def _op(ar, rank: int, world: int, op: tuple, seed: int):
    """One op of a case: (STEP, m, bad), RESET, ("precompile", rows) or
    ("force", how)."""
    if op[0] == STEP:
        return _step(ar, rank, world, op[1], seed, op[2])
    if op == RESET:
        return ar.reset(collective=True)
    if op[0] == "precompile":
        return ar.precompile(op[1])
    return _force(ar, rank, world, op[1])


def _run_ops(ar, rank: int, world: int, ops: list[tuple], seed: int) -> list:
    """Each op's :func:`_outcome`, then a digest of the variants compiled at
    the end (the host state every rank must agree on)."""
    report = [_outcome(lambda i=i, op=op: _op(ar, rank, world, op, seed + i))
              for i, op in enumerate(ops)]
    digests = sorted(variant_digest(key) for key in ar.compiled_variants)
    return [*report, hashlib.sha1(" ".join(digests).encode()).hexdigest()]


def _patterns_rank(rank: int, port: int, world: int, cases: dict, results) -> None:
    _join(rank, port, world)
    held = []  # never closed: the last close would mark this rank "closed" to its peers

    def case(ops, seed):
        held.append(_make())  # a fresh instance per case: each starts with nothing compiled
        return _run_ops(held[-1], rank, world, ops, seed)

    report_cases(rank, results, ((name, lambda ops=ops, seed=1000 * i: case(ops, seed))
                                 for i, (name, ops) in enumerate(cases.items())))


def _fault_rank(rank: int, port: int, world: int, seed: int, steps: int, results) -> None:
    _join(rank, port, world)
    ar = _make()
    rng = random.Random(seed)  # every rank draws the same run

    def step(i: int):
        m = rng.randint(1, CAP)
        bad = (rng.randrange(world), rng.choice(BAD_KINDS)) if rng.random() < 0.1 else None
        kind, value, seconds = _outcome(lambda: _step(ar, rank, world, m, seed + i, bad))
        reset = None
        if kind == "error":  # as an engine does after any error of a step
            reset = _outcome(lambda: ar.reset(collective=True))
            seconds += reset[2]
        return dict(m=m, bad=bad, kind=kind, value=value, reset=reset, seconds=seconds)

    cases = [(f"step {i}", lambda i=i: step(i)) for i in range(steps)]
    ops = [(STEP, 3, None), ("force", "forget compiled"), (STEP, 3, None), RESET,
           (STEP, 3, None)]
    cases.append(("forced mismatch", lambda: _run_ops(ar, rank, world, ops, seed)))
    report_cases(rank, results, cases)


# ----------------------------------------------------------------------- the parent's side


def _store_host():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=60))


def _check_step(outs: dict[int, tuple], bad: tuple | None, context) -> None:
    """Every rank's outcome of one step: the reference bits everywhere (the
    same on every rank), or, with ``bad`` = (rank, kind), ValueError on that
    rank and RuntimeError naming it on every other."""
    if bad is None:
        assert all(o[0] == "ok" and o[1][0] is True for o in outs.values()), context
        assert len({o[1][1] for o in outs.values()}) == 1, context
        return
    for rank, o in outs.items():
        assert o[0] == "error", context
        if rank == bad[0]:
            assert o[1].startswith("ValueError"), context
        else:
            assert o[1].startswith("RuntimeError") and \
                f"rank(s) [{bad[0]}] aborted this step" in o[1], context


def _check_mismatch(outs: dict[int, tuple], where: dict[int, str], context) -> dict:
    """Every rank raised the mismatch within seconds, naming itself and a rank
    in another collective (``where``: rank -> the tag of its wait), every
    rank named by some message, each as where it waits; returns {rank: (tag,
    number)} as the messages say (all alike). A rank may also be named as in
    no collective yet: it had not reached its own when the first rank raised."""
    names = {"gather": "the gather transport's all-gather",
             "compile": "the compile barrier of BoundaryAllReduce"}
    named: dict[int, set] = {rank: set() for rank in where}
    for me, o in outs.items():
        assert o[0] == "error" and o[1].startswith("CollectiveMismatch"), context
        assert "different host collectives" in o[1] and "reset(collective=True)" in o[1], context
        assert o[2] < STEP_S, context
        found = {int(r): (tag, int(seq)) for r, tag, seq in re.findall(
            r"rank (\d+) in (?:the [^(]*) \(([\w-]+) #(\d+) of epoch", o[1])}
        assert me in found and len(set(found.values())) > 1, (me, o[1], context)
        for rank, (tag, seq) in found.items():
            assert tag == where[rank] and names[tag] in o[1], (rank, o[1], context)
            named[rank].add((tag, seq))
    assert all(len(seen) == 1 for seen in named.values()), (named, context)
    return {rank: seen.pop() for rank, seen in named.items()}


PATTERNS = {
    "reported: rank 1 refuses the first step of M = 3":
        [(STEP, 3, (1, "post")), RESET, (STEP, 3, None), (STEP, 3, None)],
    "rank 0 refuses": [(STEP, 3, (0, "post")), RESET, (STEP, 3, None), (STEP, 3, None)],
    "a refusal at the first step of a new M":
        [(STEP, 1, None), (STEP, 2, (1, "residual")), RESET, (STEP, 2, None), (STEP, 1, None)],
    "a refusal at a compiled M":
        [(STEP, 2, None), (STEP, 2, (0, "x")), RESET, (STEP, 2, None), (STEP, 3, None)],
    "two refusals in a row": [(STEP, 4, (1, "eps")), RESET, (STEP, 4, (0, "comb")), RESET,
                              (STEP, 4, None), (STEP, 4, None)],
    "a refusal right after a reset":
        [(STEP, 1, None), RESET, (STEP, 1, (1, "post")), RESET, (STEP, 1, None)],
    # The first precompile: before the reset, refused on both (both steps failed).
    "precompile after a refusal":
        [(STEP, 2, (1, "post")), ("precompile", [1, 2]), RESET, ("precompile", [1, 2, 3, 4]),
         (STEP, 1, None), (STEP, 2, None), (STEP, 3, None), (STEP, 4, None)],
    "forced: the compile barrier against the all-gather":
        [(STEP, 3, None), ("force", "forget compiled"), (STEP, 3, None), RESET,
         (STEP, 3, None)],
    "forced: two numbers of one compile barrier":
        [("precompile", 2), ("force", "one barrier ahead"), ("precompile", 2), RESET,
         (STEP, 2, None)],
}
# Where each rank waits in a forced case's mismatch (the op after the force).
FORCED = {"forced: the compile barrier against the all-gather": {0: "gather", 1: "compile"},
          "forced: two numbers of one compile barrier": {0: "compile", 1: "compile"}}


def test_every_refusal_pattern_recovers_by_reset_and_a_mismatch_is_an_error():
    world = 2
    host = _store_host()
    got = run_cases(_patterns_rank, world, (host.port, world, PATTERNS), list(PATTERNS), CASE_S)
    for name, ops in PATTERNS.items():
        reports = got[name]
        for rank, report in reports.items():
            assert isinstance(report, list), (name, rank, report)
        for i, op in enumerate(ops):
            outs = {rank: report[i] for rank, report in reports.items()}
            context = (name, i, op, outs)
            assert all(o[2] < STEP_S for o in outs.values()), context
            after = ops[i - 1] if i > 0 else ("start",)
            if after[0] == "force":
                numbers = _check_mismatch(outs, FORCED[name], context)
                if FORCED[name][0] == FORCED[name][1]:  # one rank a number ahead
                    assert numbers[1][1] == numbers[0][1] + 1, context
            elif op[0] == STEP:
                _check_step(outs, op[2], context)
            elif op[0] == "precompile" and after[0] == STEP and after[2]:
                assert all(o[0] == "error" and "reset(collective=True)" in o[1]
                           for o in outs.values()), context
            else:
                assert all(o[0] == "ok" for o in outs.values()), context
        assert len({report[-1] for report in reports.values()}) == 1, (name, "host state")
        longest = max(o[2] for report in reports.values() for o in report[:-1])
        print(f"{name}: recovered; longest op {longest:.2f} s")


def test_a_random_fault_run_recovers_at_every_step():
    world, steps = 3, 200
    seed = int(os.environ.get("DECODE_BOUNDARY_FAULT_SEED", random.randrange(1 << 30)))
    print(f"fault run seed {seed} (DECODE_BOUNDARY_FAULT_SEED={seed} repeats it)")
    host = _store_host()
    cases = [f"step {i}" for i in range(steps)] + ["forced mismatch"]
    try:
        got = run_cases(_fault_rank, world, (host.port, world, seed, steps), cases, CASE_S)
    except AssertionError as error:
        raise AssertionError(f"seed {seed}: {error}") from None
    failures = 0
    for i in range(steps):
        outs = got[f"step {i}"]
        assert all(isinstance(o, dict) for o in outs.values()), (seed, i, outs)
        first = outs[0]
        context = (f"seed {seed}", i, outs)
        assert all((o["m"], o["bad"]) == (first["m"], first["bad"]) for o in outs.values())
        _check_step({r: (o["kind"], o["value"]) for r, o in outs.items()}, first["bad"], context)
        if first["bad"] is not None:
            failures += 1
            assert all(o["reset"][0] == "ok" for o in outs.values()), context
        assert all(o["seconds"] < STEP_S for o in outs.values()), context
    forced = got["forced mismatch"]
    assert all(isinstance(r, list) for r in forced.values()), (seed, forced)
    where = {0: "gather", 1: "gather", 2: "compile"}
    _check_mismatch({r: report[2] for r, report in forced.items()}, where, (seed, forced))
    for report in forced.values():
        assert report[0][0] == report[3][0] == "ok" and report[4][0] == "ok", (seed, forced)
        assert report[4][1][0] is True, (seed, forced)
    slowest = max(o["seconds"] for i in range(steps) for o in got[f"step {i}"].values())
    print(f"seed {seed}: {steps} steps, {failures} refused and recovered; slowest {slowest:.2f} s")
