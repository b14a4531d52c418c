"""``decode-boundary tune``: a model's GEMM and consumer tactics, chosen inside
the decode chain, and the table lines that pin them.

Always the whole step, never a kernel alone: one rank's share of a TP-N
boundary on this GPU (``harness.one_gpu_boundary``: the all-reduce over a group
of one) runs the bench's fused path (``paths.PATHS["fused"]``) with the one
timer (``bench.timing.graph_time_us``: CUDA graphs of back-to-back steps over
cold-L2 weight copies). Inside the chain a GEMM's programs start (PDL) while
the kernel before it still runs and share its SMs and registers, so the
fastest tactic alone is often not the fastest there.

Per row count M (each a bucket of ``gemm.tactics.TABLE``; at most 64):

1. coordinate descent: each GEMM shape of the chain (``wo_a``, ``wo_b``,
   ``fused_wqa_wkv``; layers of one shape share their table entry), then the
   consumer, each candidate timed once with the other slots at their best so
   far; the tables' tactics come first and win ties;
2. where the descent chose something else, the tables and the choice are
   timed in alternating rounds (one sample each cannot separate choices
   within a run's spread); the choice wins only with a lower median;
3. the winner is checked: fused = unfused bit for bit, both within the
   reference, the next mixes too.

A projection of the model the boundary chain does not run (``wq_b``) is tuned
the same way on its own, on MXFP8 input, its winner checked against the FP64
bar (``gemm.reference.check_mxfp8_mm``).

Writes ``tune-<model>-tp<N>.json`` (every timing, the winners) and returns the
tables' source lines to paste into ``gemm/tactics.py`` and the consumer's
module: a kept entry keeps its reason, a new one gets its geometry as a first
one. The decisions are pure functions (up to :func:`table_lines`), tested on
CPU; the GPU part starts at :func:`gemm_slots`.
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
from decode_boundary.boundary import consumer_tactics
from decode_boundary.boundary.consumer_tactics import (
    ConsumerTactic,
    auto_placement,
    consumer_table,
    fused_collapse,
    runs_as,
    table_entry,
)
from decode_boundary.gemm import mxfp8_mm, tactics
from decode_boundary.gemm.reference import check_mxfp8_mm
from decode_boundary.gemm.tactics import Tactic, default_tactic, is_valid, k_pieces, row_bucket
from decode_boundary.model.config import MODELS, BoundaryConfig
from decode_boundary.mxfp8.quantize_kernel import quantize_mxfp8

from .gemm import random_layer
from .harness import one_gpu_boundary, verify_rows
from .paths import build
from .report import environment, new_result, write_json

LAYERS = ("wo_a", "wo_b", "fused_wqa_wkv")  # the chain's GEMMs, in chain order
TABLE_BUCKETS = (*tactics.SMALL_BUCKETS, 64)  # TABLE's rows; above 64 the 64 entry serves
ROUNDS = 3  # alternating rounds of the tables against the descent's choice
UNBOUNDED = 1 << 30  # the consumer tables' last "largest M"
CONSUMER_TABLES = ("CONSUMER_TACTICS", "MIXES_TACTICS", "SAME_PRE_MIXES_TACTICS")
# (warps, K-piece width) variants of the table's GEMM tactic, block and split-K kept: the
# same weight bytes held in fewer or more registers per thread.
FMA_FOOTPRINTS = ((2, 256), (2, 512), (2, 1024), (4, 256), (4, 512), (4, 1024), (8, 512),
                  (8, 1024))
DOT_FOOTPRINTS = ((4, 64), (4, 128), (4, 256), (8, 64), (8, 128), (8, 256))
# (columns, warps) of the consumer's candidates; with fused mixes a program takes >= 64
# columns (contract.MIX_MIN_BLOCK), and holds hc_fn early only at <= one column per thread.
CONSUMER_SHAPES = ((64, 2), (64, 4), (128, 4), (128, 8), (256, 4), (256, 8), (512, 4))



def tune_rows(rows: Sequence[int]) -> list[int]:
    """The row counts to time: each count's TABLE bucket, at its largest count
    (the chosen tiles must cover every count of the bucket)."""
    if not rows or any(r < 1 or r > TABLE_BUCKETS[-1] for r in rows):
        raise ValueError(f"rows must be in 1..{TABLE_BUCKETS[-1]} (above it the tables' "
                         f"{TABLE_BUCKETS[-1]}-row entries serve), got {list(rows)}")
    return sorted({row_bucket(r) for r in rows})


def gemm_candidates(n: int, k: int, groups: int, rows: int) -> list[Tactic]:
    """The table's tactic (else the heuristic's) first, then its neighbours
    (``tactics.sweep_tactics``), its register-footprint variants
    (``FMA_FOOTPRINTS`` / ``DOT_FOOTPRINTS``): in the chain a GEMM's programs
    start only where the kernel before them has left registers free; and
    batch-invariant mode's tactic at this M (``tactics.invariant_tactic``), so a
    tune takes it where the mode's GEMM is the faster one."""
    base = default_tactic(n, k, rows, groups)
    footprints = FMA_FOOTPRINTS if base.rows_tile < 16 else DOT_FOOTPRINTS
    out = [*tactics.sweep_tactics(n, k, rows, groups),
           *(base._replace(num_warps=w, chunk_k=c) for w, c in footprints),
           tactics.invariant_tactic(n, k, rows, groups)]
    return [t for t in dict.fromkeys(out) if is_valid(t, n, k, rows, groups)]


def consumer_candidates(table: ConsumerTactic, mixes_fused: bool,
                        hidden: int) -> list[ConsumerTactic]:
    """The table's tactic first; with the mixes fused in the consumer, the same
    with the other release point, then ``CONSUMER_SHAPES`` (no wider than the
    row) with hc_fn loaded after the grid wait and, where a thread holds at
    most one column, before it. Each once."""
    out = [table]
    if mixes_fused:
        out.append(table._replace(release_late=not table.release_late))
    for cols, warps in CONSUMER_SHAPES:
        if runs_as(ConsumerTactic(cols, warps), hidden).block_h < cols:  # wider than the row
            continue
        out.append(ConsumerTactic(cols, warps))
        if mixes_fused and cols <= 32 * warps:
            out.append(ConsumerTactic(cols, warps, mix_weights_early=True))
    return list(dict.fromkeys(out))


def consumer_table_name(m: int, hc: int, collapse, aside: bool) -> str:
    """The name of the consumer table that serves a chain step of M tokens
    (``aside``: its mixes on the side stream), by the consumer's own rule
    (``consumer_tactics.fused_collapse``)."""
    placement = "side_stream" if aside else "consumer"
    table = consumer_table(fused_collapse(m, hc, collapse, placement))
    return next(name for name in CONSUMER_TABLES if getattr(consumer_tactics, name) is table)


def descend(candidates: dict[str, list], time_with: Callable[[dict], float],
            trials: list[dict]) -> dict:
    """Coordinate descent over the slots, in ``candidates``' order: each
    candidate timed once (``time_with(choice)``) with the other slots at their
    best so far (the first candidates to start), the cheapest kept; a tie keeps
    the earlier candidate. Appends ``{"slot", "tactic", "cost"}`` to ``trials``
    (the cost: what ``time_with`` returns, µs here, a ratio in
    ``tune_invariant``)."""
    best = {slot: options[0] for slot, options in candidates.items()}
    for slot, options in candidates.items():
        timed = []
        for i, option in enumerate(options):
            cost = time_with({**best, slot: option})
            trials.append({"slot": slot, "tactic": option._asdict(), "cost": cost})
            timed.append((cost, i))
        best[slot] = options[min(timed)[1]]
    return best


def alternate(ways: dict[str, dict], time_with: Callable[[dict], float],
              rounds: int) -> dict[str, list[float]]:
    """The cost (what ``time_with`` returns) of each way (a choice for every
    slot) in ``rounds`` rounds A, B, A, B, ..."""
    samples: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, choice in ways.items():
            samples[name].append(time_with(choice))
    return samples


def fastest(samples: dict[str, list[float]]) -> str:
    """The way of the lowest median; a tie keeps the earlier way (the tables first)."""
    order = list(samples)
    return min(order, key=lambda name: (statistics.median(samples[name]), order.index(name)))


def choose(candidates: dict[str, list], time_once: Callable[[dict], float],
           time_round: Callable[[dict], float], rounds: int) -> tuple[dict, list, dict | None]:
    """Steps 1-2 of the module docstring: (the winner, the descent's trials,
    the alternating rounds' samples or None where the descent kept the tables)."""
    trials: list[dict] = []
    tables = {slot: options[0] for slot, options in candidates.items()}
    chosen = descend(candidates, time_once, trials)
    if chosen == tables:
        return tables, trials, None
    samples = alternate({"tables": tables, "tuned": chosen}, time_round, rounds)
    return (chosen if fastest(samples) == "tuned" else tables), trials, samples


def merged_consumer_table(current: Sequence[tuple[int, ConsumerTactic]],
                          tuned: dict[int, ConsumerTactic]) -> tuple:
    """``current`` with each tuned M's winner serving from the previous entry's
    M (exclusive) to that M; neighbours of one tactic merge into the larger M."""
    limits = sorted({limit for limit, _ in current} | set(tuned))
    merged: list[tuple[int, ConsumerTactic]] = []
    for limit in limits:
        tactic = tuned.get(limit) or table_entry(current, limit)
        if merged and merged[-1][1] == tactic:
            merged[-1] = (limit, tactic)
        else:
            merged.append((limit, tactic))
    return tuple(merged)


# The tables' source, one line per entry (gemm/tactics.py, boundary/consumer_tactics.py).
_SHAPE_LINE = re.compile(r"^    \((\d+), (\d+), (\d+)\): \{  # (.+)$")
_GEMM_LINE = re.compile(r"^        (\d+): _t\([\d, ]+\),  # (.+)$")
_CONSUMER_START = re.compile(r"^([A-Z_]+) = \($")
_CONSUMER_LINE = re.compile(r"^    \((\d+|1 << 30), ConsumerTactic\(.*\)\),  # (.+)$")


def table_comments(source: str) -> dict[tuple, str]:
    """The one-line reasons in a tables module's source: ``(N, K, groups)`` ->
    the shape's line, ``(N, K, groups, bucket)`` -> a TABLE entry's,
    ``(table name, largest M)`` -> a consumer table entry's."""
    out: dict[tuple, str] = {}
    shape, table = None, None
    for line in source.splitlines():
        if m := _SHAPE_LINE.match(line):
            shape = tuple(int(v) for v in m.groups()[:3])
            out[shape] = m.group(4)
        elif (m := _GEMM_LINE.match(line)) and shape is not None:
            out[(*shape, int(m.group(1)))] = m.group(2)
        elif m := _CONSUMER_START.match(line):
            table = m.group(1)
        elif (m := _CONSUMER_LINE.match(line)) and table is not None:
            limit = UNBOUNDED if m.group(1) == "1 << 30" else int(m.group(1))
            out[(table, limit)] = m.group(2)
    return out


def gemm_reason(n: int, k: int, groups: int, bucket: int, t: Tactic) -> str:
    """A new entry's first reason: where its programs run and what each reads."""
    k_slice, pieces = k_pieces(k, t)
    programs = n // t.block_n * t.split_k * -(-bucket // t.rows_tile)
    cores = "CUDA cores" if t.rows_tile < 16 else "tensor cores"
    return f"{cores}, {programs} programs, {k_slice}-element K-slices in {pieces} pieces"


def consumer_source(t: ConsumerTactic) -> str:
    """``t`` as the tables write it (flags only where not the default)."""
    flags = [f"{name}={value}" for name, value in t._asdict().items()
             if name in ConsumerTactic._field_defaults
             and value != ConsumerTactic._field_defaults[name]]
    return f"ConsumerTactic({', '.join([str(t.block_h), str(t.warps), *flags])})"


def consumer_reason(t: ConsumerTactic) -> str:
    """A new entry's first reason: its geometry and flags."""
    notes = [f"{t.block_h} columns x {t.warps} warps"]
    notes += ["one program per token"] * (not t.cooperative)
    notes += ["hc_fn held"] * t.mix_weights_early + ["late release"] * t.release_late
    return ", ".join(notes)


def gemm_table_lines(table: dict[tuple, dict[int, Tactic]], current: dict[tuple, dict],
                     comments: dict[tuple, str], names: dict[tuple, str]) -> list[str]:
    """TABLE's source lines for ``table``: an entry equal to ``current``'s keeps
    its reason from ``comments``; others get :func:`gemm_reason`. ``names``:
    the shape's line for a shape ``comments`` lacks."""
    lines = []
    for shape, entries in table.items():
        lines.append(f"    {shape}: {{  # {comments.get(shape) or names.get(shape, '')}")
        for bucket, t in sorted(entries.items()):
            kept = current.get(shape, {}).get(bucket) == t and (*shape, bucket) in comments
            why = comments[(*shape, bucket)] if kept else gemm_reason(*shape, bucket, t)
            lines.append(f"        {bucket}: _t{tuple(t)},  # {why}")
        lines.append("    },")
    return lines


def consumer_table_lines(name: str, entries: Sequence[tuple[int, ConsumerTactic]],
                         current: Sequence[tuple], comments: dict[tuple, str]) -> list[str]:
    """A consumer table's source lines, reasons as in :func:`gemm_table_lines`."""
    lines = [f"{name} = ("]
    for limit, t in entries:
        kept = (limit, t) in tuple(current) and (name, limit) in comments
        why = comments[(name, limit)] if kept else consumer_reason(t)
        bound = "1 << 30" if limit >= UNBOUNDED else str(limit)
        lines.append(f"    ({bound}, {consumer_source(t)}),  # {why}")
    return [*lines, ")"]


def table_lines(runs: list[dict], label: str = "") -> list[str]:
    """The source lines of every table the runs tuned, merged into the current
    tables (``label``: after the layer name on a new shape's line)."""
    comments = {**table_comments(inspect.getsource(tactics)),
                **table_comments(inspect.getsource(consumer_tactics))}
    gemm: dict[tuple, dict[int, Tactic]] = {}
    names: dict[tuple, str] = {}
    tuned_consumer: dict[str, dict[int, ConsumerTactic]] = {}
    for run in runs:
        for slot, shape in run["shapes"].items():
            gemm.setdefault(shape, dict(tactics.TABLE.get(shape, {})))[run["rows"]] = \
                run["winner"][slot]
            names[shape] = f"{slot}{label}"
        if "consumer" in run["winner"]:
            tuned_consumer.setdefault(run["consumer_table"], {})[run["rows"]] = \
                run["winner"]["consumer"]
    lines = gemm_table_lines(gemm, tactics.TABLE, comments, names)
    for name, tuned in tuned_consumer.items():
        current = getattr(consumer_tactics, name)
        lines += consumer_table_lines(name, merged_consumer_table(current, tuned), current,
                                      comments)
    return lines


def gemm_slots(config: BoundaryConfig, tp: int) -> dict[str, tuple[int, int, int]]:
    """The chain's GEMM shapes by layer name (``+``-joined where layers share
    one), from ``config.projection_shapes``."""
    by_shape: dict[tuple, list[str]] = {}
    shapes = config.projection_shapes(tp)
    for name in LAYERS:
        by_shape.setdefault(shapes[name], []).append(name)
    return {"+".join(names): shape for shape, names in by_shape.items()}


def projections_outside_chain(model: str, tp_shapes: int, chain: dict[str, tuple]
                              ) -> dict[str, tuple[int, int, int]]:
    """The model's projections whose shape no GEMM slot of ``chain``
    (:func:`gemm_slots`) has, by name: tuned alone."""
    return {name: shape for name, shape in MODELS[model].projection_shapes(tp_shapes).items()
            if shape not in chain.values()}


@contextmanager
def swapped(table: dict, entries: dict) -> Iterator[None]:
    """Within the block ``table`` holds ``entries``; after it, what it held
    before (a key it lacked gone again), also after an error."""
    saved = {key: table.get(key) for key in entries}
    table.update(entries)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                table.pop(key, None)
            else:
                table[key] = value


@contextmanager
def pinned(ab, shapes: dict[str, tuple], rows: int, choice: dict) -> Iterator[None]:
    """Within the block the chain runs ``choice``: each GEMM slot's tactic in
    ``tactics.TABLE`` at ``rows``' bucket (what ``mxfp8_mm`` reads), the
    consumer's (if it has one) pinned on ``ab``'s all-reduce; the tables as
    they were after it."""
    entries = {shape: {**tactics.TABLE.get(shape, {}), row_bucket(rows): choice[slot]}
               for slot, shape in shapes.items()}
    if "consumer" in choice:
        ab.all_reduce.tactic = runs_as(choice["consumer"], ab.config.hidden)
    try:
        with swapped(tactics.TABLE, entries):
            yield
    finally:
        if "consumer" in choice:
            ab.all_reduce.tactic = None


def tune_one(ab, views: list, rows: int, rounds: int, log: Callable[[str], None]) -> dict:
    """Steps 1-3 of the module docstring at ``rows`` tokens."""
    c = ab.config
    inputs = ab.make_inputs(rows, seed=rows)
    steps = [functools.partial(build("fused", v), inputs) for v in views]
    shapes = gemm_slots(c, ab.tp)
    candidates = {slot: gemm_candidates(*shape, rows) for slot, shape in shapes.items()}
    # The fused path's "auto" placement.
    aside = auto_placement(rows, ab.mixes_aside_possible) == "side_stream"
    name = consumer_table_name(rows, c.hc_mult, c.collapse_pre, aside)
    candidates["consumer"] = consumer_candidates(
        table_entry(getattr(consumer_tactics, name), rows), name != "CONSUMER_TACTICS", c.hidden)

    def time_with(choice: dict) -> float:
        with pinned(ab, shapes, rows, choice):
            return graph_time_us(steps, ab.device, join=ab.join_mixes)

    def logged(choice: dict) -> float:
        us = time_with(choice)
        log(f"M={rows} " + " | ".join(f"{s} {tuple(t)}" for s, t in choice.items())
            + f": {us:.2f} µs")
        return us

    winner, trials, samples = choose(candidates, logged, time_with, rounds)
    with pinned(ab, shapes, rows, winner):
        failures = verify_rows(ab, rows, None, baselines={})["failures"]
    if samples:
        log(f"M={rows} alternating rounds: " + ", ".join(
            f"{k} {' '.join(f'{u:.2f}' for u in v)} µs" for k, v in samples.items()))
    log(f"M={rows}: {'; '.join(failures) or 'checks ok'}")
    return {"rows": rows, "shapes": shapes, "consumer_table": name, "trials": trials,
            "alternating": samples, "winner": winner, "failures": failures}


def tune_alone(name: str, shape: tuple[int, int, int], rows: int, rounds: int,
               device: torch.device, log: Callable[[str], None]) -> dict:
    """A projection outside the boundary chain (module docstring), as
    :func:`tune_one` returns it, without a consumer."""
    n, k, groups = shape
    layer = random_layer(n, k, groups, device)
    copies = rotated_copies(layer)
    x = quantize_mxfp8(torch.randn(rows, groups * k, device=device).bfloat16())
    slots = {name: shape}

    def time_with(choice: dict) -> float:
        with pinned(None, slots, rows, choice):
            us = graph_time_us([functools.partial(mxfp8_mm, c, x) for c in copies], device)
        log(f"M={rows} {name} {tuple(choice[name])}: {us:.2f} µs")
        return us

    candidates = {name: gemm_candidates(n, k, groups, rows)}
    winner, trials, samples = choose(candidates, time_with, time_with, rounds)
    with pinned(None, slots, rows, winner):
        out = mxfp8_mm(layer, x)
    try:
        check_mxfp8_mm(out, x, layer.weight, layer.weight_scale, groups)
        failures = []
    except AssertionError as exc:
        failures = [f"{name}: {exc}"]
    return {"rows": rows, "shapes": slots, "trials": trials, "alternating": samples,
            "winner": winner, "failures": failures}


def tune(model: str, tp_shapes: int, rows: Sequence[int], rounds: int = ROUNDS,
         log: Callable[[str], None] = print) -> list[dict]:
    """Per row count of :func:`tune_rows` on this GPU: the chain
    (:func:`tune_one`), then each projection outside it (:func:`tune_alone`)."""
    counts = tune_rows(rows)
    ab, views = one_gpu_boundary(SimpleNamespace(model=model, tp_shapes=tp_shapes,
                                                 rows=counts), seed=5)
    alone = projections_outside_chain(model, tp_shapes, gemm_slots(ab.config, ab.tp))
    try:
        runs = []
        for m in counts:
            runs.append(tune_one(ab, views, m, rounds, log))
            runs += [tune_alone(name, shape, m, rounds, ab.device, log)
                     for name, shape in alone.items()]
        return runs
    finally:
        ab.close()


def runs_json(runs: list[dict]) -> list[dict]:
    """The runs as the JSON holds them: shapes as lists, winners as dicts."""
    return [{**r, "shapes": {s: list(v) for s, v in r["shapes"].items()},
             "winner": {s: t._asdict() for s, t in r["winner"].items()}} for r in runs]


def run(model: str, tp_shapes: int, rows: Sequence[int] | None, rounds: int, out: Path,
        command: str, log: Callable[[str], None] = print) -> tuple[Path, list[str], list[str]]:
    """``decode-boundary tune``: :func:`tune`, then the JSON written to
    ``out/tune-<model>-tp<N>.json`` (replacing the last run's). Returns (its
    path, the table lines, the failures; no lines where a check failed)."""
    runs = tune(model, tp_shapes, rows or TABLE_BUCKETS, rounds, log)
    failures = [f"M={r['rows']}: {f}" for r in runs for f in r["failures"]]
    lines = [] if failures else table_lines(runs, f" of {model} at TP {tp_shapes}")
    result = new_result("tune", command, environment(False, []),
                        {"model": model, "tp_shapes": tp_shapes, "rounds": rounds,
                         "rows": [r["rows"] for r in runs]})
    result["runs"] = runs_json(runs)
    result["table_lines"], result["failures"] = lines, failures
    return write_json(result, out / f"tune-{model}-tp{tp_shapes}.json"), lines, failures
