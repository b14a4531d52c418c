"""``decode-boundary tune`` (decode_boundary/bench/tune.py): its candidates, the
descent and the alternating rounds with a fake timer, the tables it writes
(rendered, merged and read back), the tables' one line per entry without
history, the pins it times under; the whole command on a GPU."""

import inspect
import json
import random
import re
import statistics
import sys
from types import SimpleNamespace

import pytest
import torch

from decode_boundary import cli
from decode_boundary.bench import tune
from decode_boundary.boundary.consumer_tactics import ConsumerTactic, runs_as
from decode_boundary.gemm import selected_tactic, tactics
from decode_boundary.gemm.tactics import TABLE, Tactic, is_valid, k_pieces
from decode_boundary.model.config import MODELS

CONSUMER_MODULE = sys.modules[ConsumerTactic.__module__]
SOURCES = {"gemm": inspect.getsource(tactics), "consumer": inspect.getsource(CONSUMER_MODULE)}


def model_shapes():
    """(N, K, groups) of every projection of every model at TP 1, 2, 4, 8."""
    return sorted({shape for c in MODELS.values() for tp in (1, 2, 4, 8)
                   if c.o_groups % tp == 0 and c.n_heads % tp == 0
                   for shape in c.projection_shapes(tp).values()})


def test_tune_rows_are_table_buckets():
    assert tune.tune_rows([1, 3, 5, 8, 9, 33, 64, 2, 2]) == [1, 2, 4, 8, 16, 48, 64]
    assert tune.tune_rows(range(1, 65)) == list(tune.TABLE_BUCKETS)
    for bad in ([0], [65], []):
        with pytest.raises(ValueError, match="rows must be in 1..64"):
            tune.tune_rows(bad)


@pytest.mark.parametrize("shape", model_shapes())
def test_gemm_candidates_are_valid_with_the_table_first(shape):
    n, k, groups = shape
    for rows in tune.TABLE_BUCKETS:
        got = tune.gemm_candidates(n, k, groups, rows)
        assert got[0] == selected_tactic(shape, rows)  # the tables' tactic leads, wins ties
        assert len(set(got)) == len(got) > 1
        assert all(is_valid(t, n, k, rows, groups) for t in got)
        base = got[0]
        footprints = [t for t in got if (t.block_n, t.rows_tile, t.split_k) ==
                      (base.block_n, base.rows_tile, base.split_k) and t != base]
        assert footprints, (shape, rows)  # other warps / K-pieces of the same blocks
        assert tactics.invariant_tactic(n, k, rows, groups) in got  # the mode's, offered


def test_consumer_candidates():
    table = ConsumerTactic(128, 4, mix_weights_early=True, release_late=True)
    fused = tune.consumer_candidates(table, True, 5120)
    assert fused[:2] == [table, table._replace(release_late=False)]
    assert len(set(fused)) == len(fused)
    assert {(t.block_h, t.warps) for t in fused} >= set(tune.CONSUMER_SHAPES)
    assert all(t.block_h <= 32 * t.warps for t in fused if t.mix_weights_early)
    plain = tune.consumer_candidates(ConsumerTactic(512, 4), False, 5120)
    assert plain[0] == ConsumerTactic(512, 4)
    assert not any(t.mix_weights_early or t.release_late for t in plain)
    narrow = tune.consumer_candidates(ConsumerTactic(256, 4), True, 200)  # a 256-wide row
    assert max(t.block_h for t in narrow) == 256


def test_consumer_table_name_follows_the_chain():
    assert tune.consumer_table_name(1, 4, "same", False) == "SAME_PRE_MIXES_TACTICS"
    assert tune.consumer_table_name(64, 4, "same", False) == "SAME_PRE_MIXES_TACTICS"
    assert tune.consumer_table_name(16, 4, "previous", False) == "MIXES_TACTICS"
    assert tune.consumer_table_name(32, 4, "previous", True) == "CONSUMER_TACTICS"
    assert tune.consumer_table_name(64, 4, "previous", False) == "CONSUMER_TACTICS"


def _fake_costs(rng, slots):
    """Per slot and option a random cost (with ties), summed: a step's fake µs."""
    return {slot: [rng.choice([1.0, 2.0, 2.5, 3.0]) for _ in range(count)]
            for slot, count in slots.items()}


def test_descend_keeps_each_slots_fastest_and_the_earlier_on_ties():
    rng = random.Random()
    for _ in range(50):
        slots = {f"s{i}": rng.randint(1, 6) for i in range(rng.randint(1, 4))}
        costs = _fake_costs(rng, slots)
        candidates = {s: [Tactic(8 * (i + 1), 1, 1, 4) for i in range(c)]
                      for s, c in slots.items()}
        seen = []

        def cost(choice, costs=costs, candidates=candidates):
            return sum(costs[s][candidates[s].index(t)] for s, t in choice.items())

        def timer(choice, seen=seen):
            seen.append(dict(choice))
            return cost(choice)

        trials = []
        best = tune.descend(candidates, timer, trials)
        for s, options in candidates.items():  # additive: the per-slot argmin, first on ties
            want = min(range(len(options)), key=lambda i, s=s: (costs[s][i], i))
            assert best[s] == options[want]
        assert len(trials) == len(seen) == sum(slots.values())
        assert [t["cost"] for t in trials] == [cost(c) for c in seen]
        # slot by slot: the earlier slots already at their best, the later at their first
        order = list(candidates)
        for choice, trial in zip(seen, trials, strict=True):
            i = order.index(trial["slot"])
            assert all(choice[s] == best[s] for s in order[:i])
            assert all(choice[s] == candidates[s][0] for s in order[i + 1:])


def test_alternate_times_in_rounds_and_fastest_keeps_the_tables_on_ties():
    calls = []
    values = iter([5.0, 4.0, 5.2, 4.1, 4.9, 4.2])

    def timer(choice):
        calls.append(choice["name"])
        return next(values)

    samples = tune.alternate({"tables": {"name": "a"}, "tuned": {"name": "b"}}, timer, 3)
    assert calls == ["a", "b"] * 3
    assert samples == {"tables": [5.0, 5.2, 4.9], "tuned": [4.0, 4.1, 4.2]}
    assert tune.fastest(samples) == "tuned"
    assert tune.fastest({"tables": [3.0, 1.0, 2.0], "tuned": [2.0, 2.0, 9.0]}) == "tables"
    rng = random.Random()
    for _ in range(100):
        samples = {name: [rng.choice([1.0, 2.0, 3.0]) for _ in range(3)]
                   for name in ("tables", "tuned", "other")}
        medians = {n: statistics.median(v) for n, v in samples.items()}
        low = min(medians.values())
        assert tune.fastest(samples) == next(n for n in samples if medians[n] == low)


def test_choose_keeps_the_tables_unless_the_rounds_say_otherwise():
    """No rounds where the descent kept the tables; after rounds, the tuned
    choice only with the lower median."""
    candidates = {"a": [Tactic(8, 1, 1, 4), Tactic(16, 1, 1, 4)]}
    costs = {8: 2.0, 16: 1.0}
    rounds_seen = []

    def once(choice):
        return costs[choice["a"].block_n]

    def in_rounds(choice, table_us=3.0):
        rounds_seen.append(choice["a"].block_n)
        return table_us if choice["a"].block_n == 8 else 3.5  # the rounds disagree

    winner, trials, samples = tune.choose(candidates, once, in_rounds, 2)
    assert winner == {"a": Tactic(8, 1, 1, 4)} and len(trials) == 2
    assert rounds_seen == [8, 16, 8, 16] and samples == {"tables": [3.0] * 2, "tuned": [3.5] * 2}
    winner, _, samples = tune.choose(candidates, once, once, 2)
    assert winner == {"a": Tactic(16, 1, 1, 4)} and samples["tuned"] == [1.0, 1.0]
    costs[16] = 2.0  # a tie: the descent keeps the tables, no rounds
    winner, _, samples = tune.choose(candidates, once, in_rounds, 2)
    assert winner == {"a": Tactic(8, 1, 1, 4)} and samples is None and len(rounds_seen) == 4


def test_merged_consumer_table_serves_each_m_as_tuned():
    rng = random.Random()
    shapes = [ConsumerTactic(c, w) for c, w in tune.CONSUMER_SHAPES]
    for current in (CONSUMER_MODULE.MIXES_TACTICS, CONSUMER_MODULE.CONSUMER_TACTICS,
                    CONSUMER_MODULE.SAME_PRE_MIXES_TACTICS):
        for _ in range(30):
            tuned = {m: rng.choice([*shapes, current[0][1]])
                     for m in rng.sample(tune.TABLE_BUCKETS, rng.randint(1, 4))}
            merged = tune.merged_consumer_table(current, tuned)
            limits = sorted({limit for limit, _ in current} | set(tuned))
            for m in range(1, 300):
                cover = min(limit for limit in limits if limit >= m)
                want = tuned[cover] if cover in tuned else tune.table_entry(current, cover)
                assert tune.table_entry(merged, m) == want, (tuned, m)
            assert all(a[1] != b[1] for a, b in zip(merged, merged[1:], strict=False))
            assert merged[-1][0] == tune.UNBOUNDED
    assert tune.merged_consumer_table(CONSUMER_MODULE.MIXES_TACTICS, {}) == \
        CONSUMER_MODULE.MIXES_TACTICS


def _block(source: str, first: str, end: str) -> list[str]:
    lines = source.splitlines()
    start = lines.index(first)
    return lines[start:start + lines[start:].index(end) + 1]


def test_rendered_tables_are_the_source():
    """Rendering the current tables with their parsed reasons gives their source
    line for line: every entry is one line with its reason, and what tune
    prints for a table it kept pastes in unchanged."""
    comments = {**tune.table_comments(SOURCES["gemm"]),
                **tune.table_comments(SOURCES["consumer"])}
    body = _block(SOURCES["gemm"], "TABLE: dict[tuple[int, int, int], dict[int, Tactic]] = {",
                  "}")[1:-1]
    assert tune.gemm_table_lines(TABLE, TABLE, comments, {}) == body
    assert len(body) == len(TABLE) * 10
    for name in tune.CONSUMER_TABLES:
        table = getattr(CONSUMER_MODULE, name)
        assert tune.consumer_table_lines(name, table, table, comments) == \
            _block(SOURCES["consumer"], f"{name} = (", ")")


def test_table_lines_of_a_tune_put_the_winners_in():
    """Fake runs (as ``tune_one`` returns them) that change one GEMM bucket and
    one consumer M: the lines, evaluated, are the current tables with those
    winners; a changed entry's reason is its geometry, the others keep theirs."""
    shape, bucket = (2048, 4096, 2), 16
    new_gemm = next(t for t in tune.gemm_candidates(*shape, bucket) if t != TABLE[shape][16])
    new_consumer = ConsumerTactic(64, 2, mix_weights_early=True)
    runs = [{"rows": bucket, "shapes": {"wo_a": shape, "wo_b": (5120, 2048, 1)},
             "consumer_table": "MIXES_TACTICS",
             "winner": {"wo_a": new_gemm, "wo_b": TABLE[(5120, 2048, 1)][16],
                        "consumer": new_consumer}}]
    lines = tune.table_lines(runs)
    split = lines.index("MIXES_TACTICS = (")
    got = eval("{" + "\n".join(lines[:split]) + "}", {"_t": tactics._t})
    assert got == {shape: {**TABLE[shape], bucket: new_gemm},
                   (5120, 2048, 1): TABLE[(5120, 2048, 1)]}
    got = eval("\n".join(lines[split:]).split(" = ", 1)[1], {"ConsumerTactic": ConsumerTactic})
    assert got == tune.merged_consumer_table(CONSUMER_MODULE.MIXES_TACTICS,
                                             {bucket: new_consumer})
    changed = [line for line in lines if str(tuple(new_gemm)) in line]
    k_slice, pieces = k_pieces(shape[1], new_gemm)
    programs = shape[0] // new_gemm.block_n * new_gemm.split_k
    assert len(changed) == 1 and f"{programs} programs, {k_slice}-element" in changed[0]
    source = set(SOURCES["gemm"].splitlines()) | set(SOURCES["consumer"].splitlines())
    assert [line for line in lines if line not in source] == [
        changed[0], "    (16, ConsumerTactic(64, 2, mix_weights_early=True)),  "
        "# 64 columns x 2 warps, hc_fn held"]


def test_run_writes_the_json_and_returns_the_lines(monkeypatch, tmp_path):
    """``run`` (the command's body) with fake runs: one JSON under a stable name
    (a second run replaces it) holding the runs, the lines and the provenance;
    no lines where a winner failed its check."""
    shape = (5120, 2048, 1)
    winner = {"wo_b": TABLE[shape][1], "consumer": CONSUMER_MODULE.MIXES_TACTICS[0][1]}
    runs = [{"rows": 1, "shapes": {"wo_b": shape}, "consumer_table": "MIXES_TACTICS",
             "trials": [], "alternating": None, "winner": winner, "failures": []}]
    monkeypatch.setattr(tune, "tune", lambda *args, **kwargs: runs)
    path, lines, failures = tune.run("v4.1-flash", 4, [1], 3, tmp_path, "decode-boundary tune")
    assert path == tmp_path / "tune-v4.1-flash-tp4.json" and failures == []
    assert lines == tune.table_lines(runs, " of v4.1-flash at TP 4")
    result = json.loads(path.read_text())
    assert result["kind"] == "tune" and result["command"] == "decode-boundary tune"
    assert {"git_commit", "gpu", "torch", "triton"} <= set(result["environment"])
    assert result["table_lines"] == lines and result["config"]["rows"] == [1]
    assert result["runs"][0]["winner"]["wo_b"] == TABLE[shape][1]._asdict()
    runs[0]["failures"] = ["fused != unfused"]
    path, lines, failures = tune.run("v4.1-flash", 4, [1], 3, tmp_path, "decode-boundary tune")
    assert lines == [] and failures == ["M=1: fused != unfused"]
    assert json.loads(path.read_text())["failures"] == failures
    assert [p.name for p in tmp_path.iterdir()] == ["tune-v4.1-flash-tp4.json"]


HISTORY = {
    "a time": re.compile(r"\d\s*(µs|us|ms)\b"),
    "a commit": re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"),
    "an item or attempt": re.compile(r"\b(item|attempt)s? \d", re.IGNORECASE),
    "a date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    "a notes or results file": re.compile(r"NOTES|results/|\.json|benchmarks/"),
    "a measurement": re.compile(r"\bmeasured\b|\bvs\.? \d", re.IGNORECASE),
}


def test_the_tables_carry_one_reason_per_entry_and_no_history():
    blocks = {"gemm/tactics.py": SOURCES["gemm"].splitlines(),
              "consumer_tactics.py": SOURCES["consumer"].splitlines()}
    found = [f"{where}: {what}: {line.strip()}"
             for where, lines in blocks.items() for line in lines
             for what, pattern in HISTORY.items() if pattern.search(line)]
    assert not found, "\n".join(found)
    entries = [line for line in SOURCES["gemm"].splitlines()
               if re.match(r"^        \d+: _t\(", line)]
    assert len(entries) == sum(len(e) for e in TABLE.values())
    assert all(re.search(r"\),  # \S", line) for line in entries)
    for name in tune.CONSUMER_TABLES:
        lines = _block(SOURCES["consumer"], f"{name} = (", ")")[1:-1]
        assert len(lines) == len(getattr(CONSUMER_MODULE, name))
        assert all(re.search(r"\)\),  # \S", line) for line in lines), name
    for bad in ("41.2 µs", "tree 13e3c42", "NOTES item 21", "attempt 8", "2026-12-04",
                "results/x.json", "16.3 vs 17.1"):
        assert any(p.search(bad) for p in HISTORY.values()), bad


def test_pins_put_the_choice_in_the_tables_and_take_it_out():
    fake = SimpleNamespace(config=SimpleNamespace(hidden=256),
                           all_reduce=SimpleNamespace(tactic=None))
    shapes = {"wo_b": (5120, 2048, 1), "x": (96, 64, 1)}  # a tabled and an untabled shape
    saved = {s: dict(e) for s, e in TABLE.items()}
    choice = {"wo_b": Tactic(64, 16, 4, 4, 128), "x": Tactic(16, 2, 1, 4, 64),
              "consumer": ConsumerTactic(512, 4)}
    with pytest.raises(RuntimeError, match="inside"), tune.pinned(fake, shapes, 3, choice):
        assert selected_tactic((5120, 2048, 1), 4) == choice["wo_b"]
        assert selected_tactic((5120, 2048, 1), 8) == saved[(5120, 2048, 1)][8]
        assert selected_tactic((96, 64, 1), 3) == choice["x"]
        # what the consumer runs: clamped to the row, serial in the interpreter
        assert fake.all_reduce.tactic == ConsumerTactic(256, 4, cooperative=False)
        raise RuntimeError("inside")
    assert saved == TABLE and fake.all_reduce.tactic is None


def test_tune_one_on_the_chain_in_the_interpreter(monkeypatch):
    """``tune_one`` on the tiny model's chain (wo_b and fused_wqa_wkv share a
    shape there: one slot), its timer replaced by one that reads what the chain
    would run (the tables, the all-reduce's tactic): it finds each slot's
    fastest candidate, re-times it against the tables, runs the winner's
    check for real (fused = unfused, the reference, the mixes) and leaves the
    tables as they were."""
    from decode_boundary.model.chain import AttentionBoundary

    rows, config = 2, MODELS["tiny"]
    ab = AttentionBoundary(config, 2, 0, None, torch.device("cpu"), rows, seed=5)
    shapes = tune.gemm_slots(config, 2)
    assert set(shapes) == {"wo_a", "wo_b+fused_wqa_wkv"}
    rng = random.Random()
    target = {slot: rng.choice(tune.gemm_candidates(*shape, rows)[1:])
              for slot, shape in shapes.items()}
    table = tune.table_entry(CONSUMER_MODULE.MIXES_TACTICS, rows)
    target["consumer"] = tune.consumer_candidates(table, True, config.hidden)[-1]
    saved = {s: dict(e) for s, e in TABLE.items()}
    timed = []

    def fake_graph_time_us(steps, device, join=None):
        assert len(steps) == 1 and join == ab.join_mixes
        misses = sum(selected_tactic(shape, rows) != target[slot]
                     for slot, shape in shapes.items())
        misses += ab.all_reduce.tactic != runs_as(target["consumer"], config.hidden)
        timed.append(misses)
        return 10.0 + misses + rng.uniform(0, 0.1)

    monkeypatch.setattr(tune, "graph_time_us", fake_graph_time_us)
    run = tune.tune_one(ab, [ab], rows, 2, log=lambda line: None)
    ab.close()
    assert run["winner"] == target and run["failures"] == []
    assert run["consumer_table"] == "MIXES_TACTICS" and run["shapes"] == shapes
    assert len(run["alternating"]["tables"]) == len(run["alternating"]["tuned"]) == 2
    assert len(run["trials"]) == sum(len(tune.gemm_candidates(*shape, rows))
                                     for shape in shapes.values()) + \
        len(tune.consumer_candidates(table, True, config.hidden))
    assert timed[-4:] == [3, 0, 3, 0]  # tables, tuned, tables, tuned
    assert saved == TABLE and ab.all_reduce.tactic is None


def test_tune_alone_tunes_a_projection_outside_the_chain(monkeypatch):
    """``tune_alone`` (wq_b's way) in the interpreter, its timer reading the
    table as mxfp8_mm would: the fastest candidate wins over the table's in
    the rounds, the winner's output meets the FP64 bar for real, the tables
    stay as they were, and its lines carry no consumer table."""
    shape, rows = (96, 128, 1), 2  # a shape no table holds: the heuristic's first
    target = random.Random().choice(tune.gemm_candidates(*shape, rows)[1:])
    saved = {s: dict(e) for s, e in TABLE.items()}

    def fake_graph_time_us(steps, device="cuda", join=None):
        return 5.0 - (selected_tactic(shape, rows) == target)

    monkeypatch.setattr(tune, "graph_time_us", fake_graph_time_us)
    monkeypatch.setattr(tune, "rotated_copies", lambda layer: [layer])
    run = tune.tune_alone("wq_b", shape, rows, 3, torch.device("cpu"), log=lambda line: None)
    assert run["winner"] == {"wq_b": target} and run["failures"] == []
    assert run["alternating"] == {"tables": [5.0] * 3, "tuned": [4.0] * 3}
    assert len(run["trials"]) == len(tune.gemm_candidates(*shape, rows))
    assert saved == TABLE
    lines = tune.table_lines([run], " of a test")
    assert lines[0] == "    (96, 128, 1): {  # wq_b of a test" and lines[-1] == "    },"
    assert eval("{" + "\n".join(lines) + "}", {"_t": tactics._t}) == {shape: {rows: target}}


def test_gemm_slots_share_a_shape_and_are_the_chains_layers():
    from decode_boundary.model.chain import AttentionBoundary

    config = MODELS["tiny"]
    slots = tune.gemm_slots(config, 2)
    assert slots == {"wo_a": (256, 128, 2), "wo_b+fused_wqa_wkv": (256, 256, 1)}
    ab = AttentionBoundary(config, 2, 0, None, torch.device("cpu"), 1, seed=5)
    for slot, shape in slots.items():
        for name in slot.split("+"):
            layer = getattr(ab, name)
            k, n = layer.weight.shape
            assert (n, k, getattr(layer, "groups", 1)) == shape, name
    ab.close()


def test_tune_refuses_bad_arguments(capsys):
    """Bad rows, a TP the model cannot split, an unknown model: one line, exit 2,
    before anything needs a GPU."""
    for extra, message in ((["--rows", "65"], "in [1, 64]"), (["--tp-shapes", "3"], "tp=3"),
                           (["--rows", "0"], "got 0"), (["--model", "v5"], "invalid")):
        assert cli.main(["tune", *extra]) == 2, extra
        assert message in capsys.readouterr().err, extra


def test_tune_help_says_what_it_does(capsys):
    assert cli.main(["tune", "--help"]) == 0
    out = capsys.readouterr().out
    assert "alternating rounds" in out and "tune-<model>-tp<N>.json" in out
    for option in ("--model", "--tp-shapes", "--rows", "--rounds", "--out"):
        assert option in out


def test_tune_without_gpu_points_to_verify(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["tune", "--rows", "1"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "decode-boundary verify" in err


@pytest.mark.gpu
def test_tune_on_gpu(tmp_path, capsys):
    """The command end to end at one row count: the chain's run and wq_b's,
    every candidate timed once per slot, the winners checked and among them,
    the JSON and the printed lines consistent."""
    assert cli.main(["tune", "--model", "v4.1-flash", "--rows", "1", "--rounds", "2",
                     "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "tune-v4.1-flash-tp4.json").read_text())
    assert result["kind"] == "tune" and result["failures"] == []
    chain, alone = result["runs"]
    assert chain["consumer_table"] == "MIXES_TACTICS" and list(alone["shapes"]) == ["wq_b"]
    for run in (chain, alone):
        assert run["failures"] == [] and all(0 < t["cost"] < 1e5 for t in run["trials"])
        for slot, shape in run["shapes"].items():
            timed = [Tactic(**t["tactic"]) for t in run["trials"] if t["slot"] == slot]
            assert timed == tune.gemm_candidates(*shape, 1)
            assert Tactic(**run["winner"][slot]) in timed
    consumer = [ConsumerTactic(**t["tactic"]) for t in chain["trials"] if t["slot"] == "consumer"]
    assert ConsumerTactic(**chain["winner"]["consumer"]) in consumer
    assert result["table_lines"] and "\n".join(result["table_lines"]) in capsys.readouterr().out
