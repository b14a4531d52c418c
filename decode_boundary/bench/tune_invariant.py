"""``decode-boundary tune --batch-invariant``: the one reduction order per GEMM
shape that batch-invariant mode runs (``gemm.tactics.INVARIANT_ORDERS``;
docs/DESIGN.md §7.1), chosen inside the decode chain, and the lines that pin it.

The mode runs a shape's order at every row count, so an order is judged by its
cost over all the row counts at once: the chain in the mode (the bench's
``fused_invariant`` path) against the default chain (``fused``) at each M, and
the **geometric mean** of those ratios over the Ms. Each M weighs alike, and
an M no order can help (one row: the mode's tensor-core tile against the
default's CUDA-core one) does not decide the choice alone, as the worst ratio
would. Only orders are offered (``tactics.invariant_candidates``): the tile
follows M by ``tactics.dot_tile`` and the consumer keeps
``consumer_tactics.INVARIANT_CONSUMER``, both fixed by the mode.

The steps are :mod:`.tune`'s (``choose``: coordinate descent over the chain's
GEMM slots, each candidate order costed once with the others at their best so
far, the current orders first and winning ties; then, where the descent chose
otherwise, the current orders against the choice in alternating rounds, the
choice kept only with a lower median cost), then the check: at each M the
bench's verification with the winner pinned (the reference, and the
mode's tokens against the same tokens alone and as half the batch, every bit).
A projection the chain does not run (``wq_b``) is tuned the same way on its
own: ``mxfp8_mm`` in the mode over ``mxfp8_mm`` by the tables, on MXFP8 input;
its winner checked against the FP64 bar and every row against the same row at
each M.

Writes ``tune-<model>-tp<N>-batch-invariant.json`` and returns the
``INVARIANT_ORDERS`` lines to paste. The decisions (:func:`invariant_cost`,
:func:`order_lines`) are tested on CPU.
"""

from __future__ import annotations

import functools
import inspect
import re
import statistics
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch

from decode_boundary.bench.timing import graph_time_us, rotated_copies
from decode_boundary.gemm import mxfp8_mm, tactics
from decode_boundary.gemm.reference import check_mxfp8_mm
from decode_boundary.gemm.tactics import ReductionOrder, invariant_candidates, with_tile
from decode_boundary.mxfp8.quantize_kernel import quantize_mxfp8

from .gemm import cancelling, random_layer
from .harness import one_gpu_boundary, verify_rows
from .paths import build, join_all
from .report import environment, new_result, write_json
from .tune import (
    ROUNDS,
    TABLE_BUCKETS,
    choose,
    gemm_reason,
    gemm_slots,
    projections_outside_chain,
    runs_json,
    swapped,
)

_ORDER_LINE = re.compile(r"^    \((\d+), (\d+), (\d+)\): _o\([\d, ]+\),  # (.+)$")


def invariant_rows(rows: Sequence[int]) -> list[int]:
    """The row counts to cost an order at, sorted, each once (1..64: above 64
    the mode runs the 64-row tile over row blocks, as at 64)."""
    if not rows or any(r < 1 or r > TABLE_BUCKETS[-1] for r in rows):
        raise ValueError(f"rows must be in 1..{TABLE_BUCKETS[-1]}, got {list(rows)}")
    return sorted(set(rows))


def invariant_cost(us: dict[int, float], default_us: dict[int, float]) -> float:
    """An order's cost: the geometric mean over the row counts of ``us`` (the
    mode's µs) over ``default_us`` (the default mode's, same M); 1.0 is level."""
    if not us or set(us) != set(default_us):
        raise ValueError(f"need µs at the same row counts, got {sorted(us)} and "
                         f"{sorted(default_us)}")
    return statistics.geometric_mean([us[m] / default_us[m] for m in us])


@contextmanager
def pinned_orders(shapes: dict[str, tuple], choice: dict[str, ReductionOrder]
                  ) -> Iterator[None]:
    """Within the block the mode runs ``choice``: each slot's order in
    ``tactics.INVARIANT_ORDERS`` (what ``mxfp8_mm`` reads per call); the orders
    as they were after it."""
    with swapped(tactics.INVARIANT_ORDERS,
                 {shape: choice[slot] for slot, shape in shapes.items()}):
        yield


def _costed(shapes: dict[str, tuple], counts: list[int], default_us: dict[int, float],
            time_at: Callable[[int], float], timings: list[dict],
            log: Callable[[str], None]) -> Callable[[dict], float]:
    """The cost of a choice (one order per slot): the mode timed at every M
    with it pinned; each timing appended to ``timings`` and logged."""
    def cost(choice: dict) -> float:
        with pinned_orders(shapes, choice):
            us = {m: time_at(m) for m in counts}
        value = invariant_cost(us, default_us)
        timings.append({"orders": {s: o._asdict() for s, o in choice.items()},
                        "us": us, "cost": value})
        log(" | ".join(f"{s} {tuple(o)}" for s, o in choice.items()) + ": "
            + " ".join(f"M={m} {us[m]:.2f}" for m in counts) + f" µs, cost {value:.3f}")
        return value
    return cost


def tune_chain(ab, views: list, counts: list[int], rounds: int,
               log: Callable[[str], None]) -> dict:
    """The chain's orders (module docstring) over the row counts ``counts``."""
    shapes = gemm_slots(ab.config, ab.tp)
    inputs = {m: ab.make_inputs(m, seed=m) for m in counts}

    def time_path(name: str, m: int) -> float:
        steps = [functools.partial(build(name, v), inputs[m]) for v in views]
        return graph_time_us(steps, ab.device, join=join_all(ab, steps))

    default_us = {m: time_path("fused", m) for m in counts}
    log("default chain: " + " ".join(f"M={m} {default_us[m]:.2f}" for m in counts) + " µs")
    timings: list[dict] = []
    cost = _costed(shapes, counts, default_us, functools.partial(time_path, "fused_invariant"),
                   timings, log)
    candidates = {slot: invariant_candidates(*shape) for slot, shape in shapes.items()}
    winner, trials, samples = choose(candidates, cost, cost, rounds)
    with pinned_orders(shapes, winner):
        failures = [f"M={m}: {f}" for m in counts
                    for f in verify_rows(ab, m, None, baselines={})["failures"]]
    log("chain: " + ("; ".join(failures) or "checks ok"))
    return {"rows": counts, "shapes": shapes, "default_us": default_us, "trials": trials,
            "timings": timings, "alternating": samples, "winner": winner,
            "failures": failures}


def alone_failures(layer, x: torch.Tensor, counts: list[int], name: str) -> list[str]:
    """``mxfp8_mm`` in the mode on MXFP8 ``x`` (BF16 [R, K]) against the FP64
    bar, and the first m rows at each m of ``counts`` against the same rows of
    the whole ``x``, every bit. Give it ``bench.gemm.cancelling`` data: on
    ordinary data the FP32 sums are often exact and any order passes."""
    quantized = quantize_mxfp8(x)
    whole = mxfp8_mm(layer, quantized, batch_invariant=True)
    failures = []
    try:
        check_mxfp8_mm(whole, quantized, layer.weight, layer.weight_scale,
                       getattr(layer, "groups", 1))
    except AssertionError as exc:
        failures.append(f"{name}: {exc}")
    for m in counts:
        head = mxfp8_mm(layer, quantize_mxfp8(x[:m].contiguous()), batch_invariant=True)
        if not torch.equal(head.view(torch.int16), whole[:m].view(torch.int16)):
            failures.append(f"{name}: its first {m} row(s) differ from the same at M = {m}")
    return failures


def tune_alone(name: str, shape: tuple[int, int, int], counts: list[int], rounds: int,
               device: torch.device, log: Callable[[str], None]) -> dict:
    """A projection outside the chain (module docstring), as :func:`tune_chain`
    returns it."""
    n, k, groups = shape
    layer = random_layer(n, k, groups, device)
    copies = rotated_copies(layer)
    x = torch.randn(max(counts), groups * k, device=device).bfloat16()
    quantized = {m: quantize_mxfp8(x[:m].contiguous()) for m in counts}

    def time_at(m: int, invariant: bool) -> float:
        calls = [functools.partial(mxfp8_mm, c, quantized[m], batch_invariant=invariant)
                 for c in copies]
        return graph_time_us(calls, device)

    slots = {name: shape}
    default_us = {m: time_at(m, False) for m in counts}
    log(f"{name} by the tables: " + " ".join(f"M={m} {default_us[m]:.2f}" for m in counts)
        + " µs")
    timings: list[dict] = []
    cost = _costed(slots, counts, default_us, functools.partial(time_at, invariant=True),
                   timings, log)
    winner, trials, samples = choose({name: invariant_candidates(*shape)}, cost, cost, rounds)
    with pinned_orders(slots, winner):
        failures = alone_failures(*cancelling(n, k, max(counts), groups, device), counts, name)
    return {"rows": counts, "shapes": slots, "default_us": default_us, "trials": trials,
            "timings": timings, "alternating": samples, "winner": winner,
            "failures": failures}


def tune(model: str, tp_shapes: int, rows: Sequence[int], rounds: int = ROUNDS,
         log: Callable[[str], None] = print) -> list[dict]:
    """The chain (:func:`tune_chain`), then each projection outside it
    (:func:`tune_alone`), over :func:`invariant_rows` of ``rows`` on this GPU."""
    counts = invariant_rows(rows)
    ab, views = one_gpu_boundary(SimpleNamespace(model=model, tp_shapes=tp_shapes,
                                                 rows=counts), seed=5)
    ab.batch_invariant_twin().precompile(counts)
    alone = projections_outside_chain(model, tp_shapes, gemm_slots(ab.config, ab.tp))
    try:
        runs = [tune_chain(ab, views, counts, rounds, log)]
        runs += [tune_alone(name, shape, counts, rounds, ab.device, log)
                 for name, shape in alone.items()]
        return runs
    finally:
        ab.close()


def order_source(order: ReductionOrder) -> str:
    """``order`` as ``INVARIANT_ORDERS`` writes it: ``_o(...)`` without the
    trailing arguments at their defaults."""
    defaults = inspect.signature(tactics._o).parameters
    values = list(order)
    names = list(ReductionOrder._fields)
    while names and defaults[names[-1]].default is not inspect.Parameter.empty \
            and values[-1] == defaults[names[-1]].default:
        names.pop()
        values.pop()
    return f"_o({', '.join(str(v) for v in values)})"


def order_comments(source: str) -> dict[tuple[int, int, int], str]:
    """The one-line reason of each ``INVARIANT_ORDERS`` entry in ``source``."""
    return {tuple(int(v) for v in m.groups()[:3]): m.group(4)
            for line in source.splitlines() if (m := _ORDER_LINE.match(line))}


def order_lines(runs: list[dict], current: dict[tuple, ReductionOrder],
                comments: dict[tuple, str], label: str = "") -> list[str]:
    """``INVARIANT_ORDERS``' source lines: ``current`` with the runs' winners;
    an unchanged entry keeps its reason from ``comments``, a new one gets its
    geometry at the 64-row tile and the slot it serves (``label`` after it)."""
    orders = dict(current)
    names: dict[tuple, str] = {}
    for run in runs:
        for slot, shape in run["shapes"].items():
            orders[tuple(shape)] = run["winner"][slot]
            names[tuple(shape)] = f"{slot}{label}"
    lines = []
    for shape, order in orders.items():
        kept = current.get(shape) == order and shape in comments
        geometry = gemm_reason(*shape, 64, with_tile(order, 64))
        why = comments[shape] if kept else \
            (f"{names[shape]}: {geometry}" if shape in names else geometry)
        lines.append(f"    {shape}: {order_source(order)},  # {why}")
    return lines


def run(model: str, tp_shapes: int, rows: Sequence[int] | None, rounds: int, out: Path,
        command: str, log: Callable[[str], None] = print) -> tuple[Path, list[str], list[str]]:
    """``decode-boundary tune --batch-invariant``: :func:`tune`, the JSON written
    to ``out/tune-<model>-tp<N>-batch-invariant.json`` (replacing the last
    run's). Returns (its path, the lines, the failures; no lines where a check
    failed)."""
    runs = tune(model, tp_shapes, rows or TABLE_BUCKETS, rounds, log)
    failures = [f for r in runs for f in r["failures"]]
    result = new_result("tune-batch-invariant", command, environment(False, []),
                        {"model": model, "tp_shapes": tp_shapes, "rounds": rounds,
                         "rows": runs[0]["rows"]})
    result["runs"] = runs_json(runs)
    result["table_lines"], result["failures"] = [], failures
    path = out / f"tune-{model}-tp{tp_shapes}-batch-invariant.json"
    write_json(result, path)  # the timings are kept whatever the lines do
    if not failures:
        result["table_lines"] = order_lines(
            runs, tactics.INVARIANT_ORDERS, order_comments(inspect.getsource(tactics)),
            f" of {model} at TP {tp_shapes}")
        write_json(result, path)
    return path, result["table_lines"], failures
