"""``decode-boundary tune --batch-invariant`` (decode_boundary/bench/tune_invariant.py):
its cost, the pins it times under, the ``INVARIANT_ORDERS`` lines it writes
(rendered and read back, and the tables' own lines reproduced), the chain and a
lone projection tuned in the interpreter with a fake timer and their checks run
for real; the whole command on a GPU."""

import inspect
import json
import math
import random

import pytest
import torch

from decode_boundary import cli
from decode_boundary.bench import tune_invariant as ti
from decode_boundary.bench.gemm import cancelling
from decode_boundary.gemm import selected_tactic, tactics
from decode_boundary.gemm.tactics import (
    INVARIANT_ORDERS,
    ReductionOrder,
    dot_tile,
    invariant_candidates,
    with_tile,
)
from decode_boundary.model.config import MODELS

TACTICS_SOURCE = inspect.getsource(tactics)


def test_invariant_rows_are_sorted_and_bounded():
    assert ti.invariant_rows([64, 1, 3, 3, 17]) == [1, 3, 17, 64]
    for bad in ([0], [65], []):
        with pytest.raises(ValueError, match="rows must be in 1..64"):
            ti.invariant_rows(bad)


def test_invariant_cost_is_the_geometric_mean_of_the_ratios():
    rng = random.Random()
    default = {m: rng.uniform(10, 60) for m in (1, 4, 16, 64)}
    ratios = {m: rng.uniform(0.8, 1.5) for m in default}
    got = ti.invariant_cost({m: default[m] * ratios[m] for m in default}, default)
    assert got == pytest.approx(math.prod(ratios.values()) ** (1 / len(ratios)), rel=1e-12)
    assert ti.invariant_cost(default, default) == pytest.approx(1.0)
    # One row count much worse and the rest better: the mean weighs each M alike.
    assert ti.invariant_cost({1: 2.0, 4: 0.5}, {1: 1.0, 4: 1.0}) == pytest.approx(1.0)
    for bad in ({}, {1: 1.0, 2: 1.0}):
        with pytest.raises(ValueError, match="same row counts"):
            ti.invariant_cost(bad, {1: 1.0})


def test_pinned_orders_pin_and_restore():
    """Within the block the mode selects the pinned order at every M (the tile
    still follows M); after it, also after an error, the orders are as they
    were, a shape the orders lacked gone again."""
    held, new = (5120, 2048, 1), (96, 128, 1)
    saved = dict(INVARIANT_ORDERS)
    choice = {"a": ReductionOrder(32, 2, 4, 64), "b": ReductionOrder(16, 1, 4, 128)}
    with pytest.raises(RuntimeError, match="inside"), \
            ti.pinned_orders({"a": held, "b": new}, choice):
        for rows in (1, 7, 33, 64, 200):
            assert selected_tactic(held, rows, True) == with_tile(choice["a"], dot_tile(rows))
            assert selected_tactic(new, rows, True) == with_tile(choice["b"], dot_tile(rows))
        raise RuntimeError("inside")
    assert saved == INVARIANT_ORDERS and new not in INVARIANT_ORDERS


def test_order_lines_reproduce_the_tables_and_read_back():
    """With nothing tuned the lines are INVARIANT_ORDERS' own source lines
    (one per entry, reason kept); a tuned entry gets a new reason and reads
    back as the winner; a new shape is appended with its slot's name."""
    comments = ti.order_comments(TACTICS_SOURCE)
    assert set(comments) == set(INVARIANT_ORDERS)
    current = ti.order_lines([], INVARIANT_ORDERS, comments)
    for line in current:
        assert line in TACTICS_SOURCE.splitlines()
    shape = next(iter(INVARIANT_ORDERS))
    winner = next(o for o in invariant_candidates(*shape) if o != INVARIANT_ORDERS[shape])
    runs = [{"shapes": {"wo_b": shape, "wq_b": (96, 128, 1)},
             "winner": {"wo_b": winner, "wq_b": ReductionOrder(32, 1, 4, 64)}}]
    lines = ti.order_lines(runs, INVARIANT_ORDERS, comments, " of a test")
    got = eval("{\n" + "\n".join(lines) + "\n}", {"_o": tactics._o})
    assert got == {**INVARIANT_ORDERS, shape: winner, (96, 128, 1): ReductionOrder(32, 1, 4, 64)}
    assert lines[len(INVARIANT_ORDERS)].endswith("# wq_b of a test: tensor cores, 3 programs, "
                                                 "128-element K-slices in 2 pieces")
    changed = next(line for line in lines if line.startswith(f"    {shape}"))
    assert changed not in current and "wo_b of a test: tensor cores" in changed


def test_order_source_omits_trailing_defaults():
    for order in {*INVARIANT_ORDERS.values(),
                  *(o for s in INVARIANT_ORDERS for o in invariant_candidates(*s))}:
        text = ti.order_source(order)
        assert eval(text, {"_o": tactics._o}) == order
    assert ti.order_source(ReductionOrder(64, 4, 4, 128)) == "_o(64, 4)"
    assert ti.order_source(ReductionOrder(64, 8, 4, 256)) == "_o(64, 8, 4, 256)"
    assert ti.order_source(ReductionOrder(64, 8, 8, 128)) == "_o(64, 8, 8)"


def test_tune_chain_in_the_interpreter(monkeypatch):
    """``tune_chain`` on the tiny model's chain, its timer reading what the
    chain would run: the default path costs the same whatever the orders, the
    mode's path more per slot whose order misses a random target. The target
    wins (descent, then the rounds against the current orders), the check of
    the winner runs for real (the reference, fused = unfused, the mode's tokens
    alone and as half the batch) and the orders are left as they were."""
    from decode_boundary.model.chain import AttentionBoundary

    counts, config = [1, 3], MODELS["tiny"]
    ab = AttentionBoundary(config, 2, 0, None, torch.device("cpu"), max(counts), seed=5)
    shapes = ti.gemm_slots(config, 2)
    rng = random.Random()
    target = {slot: rng.choice(invariant_candidates(*shape)[1:]) for slot, shape in shapes.items()}
    saved = dict(INVARIANT_ORDERS)
    paths = []

    def fake_graph_time_us(steps, device, join=None):
        chain = steps[0].func
        assert len(steps) == 1 and callable(join)
        paths.append(chain.batch_invariant)
        rows = steps[0].args[0].rows
        if not chain.batch_invariant:
            return 10.0 + rows
        misses = sum(selected_tactic(shape, rows, True) != with_tile(target[slot],
                                                                     dot_tile(rows))
                     for slot, shape in shapes.items())
        return (10.0 + rows) * (1.1 + misses) + rng.uniform(0, 0.01)

    monkeypatch.setattr(ti, "graph_time_us", fake_graph_time_us)
    try:
        run = ti.tune_chain(ab, [ab], counts, 2, log=lambda line: None)
    finally:
        ab.close()
    assert run["winner"] == target and run["failures"] == [], run["failures"]
    assert run["default_us"] == {1: 11.0, 3: 13.0} and paths[:2] == [False, False]
    assert len(run["trials"]) == sum(len(invariant_candidates(*s)) for s in shapes.values())
    assert len(run["timings"]) == len(run["trials"]) + 4  # descent, then 2 rounds x 2 ways
    assert run["alternating"]["tuned"] == [pytest.approx(1.1, abs=0.01)] * 2
    assert saved == INVARIANT_ORDERS


def test_tune_alone_in_the_interpreter(monkeypatch):
    """``tune_alone`` (wq_b's way): the order the fake timer favours wins, its
    output meets the FP64 bar and keeps its rows' bits at each M for real."""
    shape, counts = (96, 128, 1), [1, 5, 17]
    target = random.Random().choice(invariant_candidates(*shape)[1:])
    saved = dict(INVARIANT_ORDERS)

    def fake_graph_time_us(steps, device="cuda"):
        rows = steps[0].args[1].rows
        if not steps[0].keywords["batch_invariant"]:
            return 4.0
        return 4.0 + (selected_tactic(shape, rows, True) != with_tile(target, dot_tile(rows)))

    monkeypatch.setattr(ti, "graph_time_us", fake_graph_time_us)
    monkeypatch.setattr(ti, "rotated_copies", lambda layer: [layer])
    run = ti.tune_alone("wq_b", shape, counts, 3, torch.device("cpu"), log=lambda line: None)
    assert run["winner"] == {"wq_b": target} and run["failures"] == []
    assert run["alternating"] == {"tables": [1.25] * 3, "tuned": [1.0] * 3}
    assert saved == INVARIANT_ORDERS


def test_alone_failures_catch_an_order_that_follows_m(monkeypatch):
    """The lone projection's check fails where the mode's order changed with
    the row count (split-K 1 for one row, 4 above): it cannot pass vacuously."""
    layer, x = cancelling(96, 512, 4, generator=torch.Generator().manual_seed(4))
    assert ti.alone_failures(layer, x, [1, 2], "probe") == []

    def follows_m(n, k, rows, groups=1):
        return with_tile(ReductionOrder(32, 1 if rows == 1 else 4, 4, 64), dot_tile(rows))

    monkeypatch.setattr(tactics, "invariant_tactic", follows_m)
    failures = ti.alone_failures(layer, x, [1, 2], "probe")
    assert failures == ["probe: its first 1 row(s) differ from the same at M = 1"]


def test_tune_batch_invariant_flag(capsys, monkeypatch):
    """The flag is in the help; bad rows still refuse before a GPU is needed;
    without a GPU it points to verify."""
    assert cli.main(["tune", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--batch-invariant" in out and "INVARIANT_ORDERS" in out
    assert "tune-<model>-tp<N>-batch-invariant.json" in out
    assert cli.main(["tune", "--batch-invariant", "--rows", "65"]) == 2
    assert "in [1, 64]" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["tune", "--batch-invariant", "--rows", "1"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_tune_batch_invariant_on_gpu(tmp_path, capsys):
    """The command end to end at two row counts of two tiles: the chain's run
    and wq_b's, every candidate order costed once per slot, the winners
    checked and among them, the JSON and the printed lines consistent."""
    assert cli.main(["tune", "--batch-invariant", "--model", "v4.1-flash", "--rows", "1", "32",
                     "--rounds", "2", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "tune-v4.1-flash-tp4-batch-invariant.json").read_text())
    assert result["kind"] == "tune-batch-invariant" and result["failures"] == []
    chain, alone = result["runs"]
    assert list(alone["shapes"]) == ["wq_b"] and chain["rows"] == [1, 32]
    for run in (chain, alone):
        assert run["failures"] == [] and all(0.5 < t["cost"] < 5 for t in run["trials"])
        assert all(0 < us < 1e4 for us in run["default_us"].values())
        for slot, shape in run["shapes"].items():
            timed = [ReductionOrder(**t["tactic"]) for t in run["trials"] if t["slot"] == slot]
            assert timed == invariant_candidates(*shape)
            assert ReductionOrder(**run["winner"][slot]) in timed
    lines = result["table_lines"]
    assert len(lines) >= len(INVARIANT_ORDERS) and "\n".join(lines) in capsys.readouterr().out
