"""``scripts/results_readme.py`` on synthetic result files: the figures each file
records land in the generated README's rows (fresh random figures every run, so a
table that drops, reorders or mislabels a column fails), provenance is read from both
result schemas, and files that lack fields or are not JSON still get a line."""

import importlib.util
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "results_readme.py"


def _load():
    spec = importlib.util.spec_from_file_location("results_readme", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


results_readme = _load()


def _table(text: str, heading: str) -> list[list[str]]:
    """The rows (cells stripped) of the first table under ``## heading``."""
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in section.splitlines() if line.startswith("|")]
    return rows[2:]


def _rows(text: str, heading: str) -> dict[str, list[str]]:
    """That table's rows by their first cell."""
    return {row[0]: row for row in _table(text, heading)}


def _header(text: str, heading: str) -> list[str]:
    section = text.split(f"\n## {heading}\n", 1)[1]
    line = next(line for line in section.splitlines() if line.startswith("|"))
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _bench(rng: random.Random) -> tuple[dict, dict[int, dict[str, float]]]:
    us = {}
    for m in (1, 16, 64):
        fused = rng.uniform(10, 60)
        us[m] = {"compiled_step": rng.uniform(30, 150), "strong_baseline": rng.uniform(30, 150),
                 "user_step_aside": rng.uniform(30, 150), "baseline": rng.uniform(300, 700),
                 "unfused": fused * rng.uniform(1.0, 1.3), "fused": fused}
    data = {"schema": 1, "kind": "bench", "command": "decode-boundary bench --rows 1 16 64",
            "created": "2026-12-04T15:21:00+00:00",
            "environment": {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "triton": "3.6.0",
                            "python": "3.12.3", "git_commit": "0123456789abcdef",
                            "git_dirty": False},
            "config": {"model": "v4.1-flash", "tp": 1, "tp_shapes": 4},
            "floor_us": rng.uniform(5, 8),
            "timings": [{"rows": m, "us": v} for m, v in us.items()]}
    return data, us


def test_bench_figures_land_in_their_columns(tmp_path):
    rng = random.Random()
    data, us = _bench(rng)
    (tmp_path / "bench-v4.1-flash-tp4-shapes-1gpu.json").write_text(json.dumps(data))
    (tmp_path / "bench-v4.1-flash-tp4-shapes-1gpu.png").write_bytes(b"\x89PNG")
    assert results_readme.main([str(tmp_path)]) == 0
    text = (tmp_path / "README.md").read_text()

    heading = "bench-v4.1-flash-tp4-shapes-1gpu.json"
    header = _header(text, heading)
    rows = _rows(text, heading)
    assert sorted(rows) == ["1", "16", "64"]
    for m, figures in us.items():
        row = dict(zip(header, rows[str(m)], strict=True))
        assert row["fused µs"] == f"{figures['fused']:.1f}"
        assert row["unfused µs"] == f"{figures['unfused']:.1f}"
        for name in ("compiled_step", "strong_baseline", "user_step_aside", "baseline"):
            assert row[f"{name} µs"] == f"{figures[name]:.1f}"
        baselines = {k: v for k, v in figures.items() if k not in ("fused", "unfused")}
        fastest = min(baselines, key=baselines.get)
        assert row["fastest baseline"] == fastest
        assert row[results_readme.GAIN] == f"{baselines[fastest] / figures['fused']:.2f}×"
        assert row["fused / floor"] == f"{figures['fused'] / data['floor_us']:.2f}"
    assert "run at commit 0123456 on 2026-12-04 15:21; GPU NVIDIA H200" in text
    assert "torch 2.11.0+cu130, triton 3.6.0, python 3.12.3" in text
    assert "`decode-boundary bench --rows 1 16 64`" in text
    assert "(bench-v4.1-flash-tp4-shapes-1gpu.png)" in text


def test_the_bench_s_own_choice_of_fastest_baseline_is_kept(tmp_path):
    data, us = _bench(random.Random())
    # The bench names the fastest baseline; where it names one that is present, the
    # README reports that one even if another column is lower (e.g. a secondary row).
    chosen = "strong_baseline"
    for timing in data["timings"]:
        timing["fastest_baseline"] = chosen
    (tmp_path / "bench-x.json").write_text(json.dumps(data))
    text = results_readme.render(tmp_path)
    header, rows = _header(text, "bench-x.json"), _rows(text, "bench-x.json")
    for m, figures in us.items():
        row = dict(zip(header, rows[str(m)], strict=True))
        assert row["fastest baseline"] == chosen
        assert row[results_readme.GAIN] == f"{figures[chosen] / figures['fused']:.2f}×"


def test_gemm_tables_of_both_writers(tmp_path):
    rng = random.Random()
    script_rows = [{"shape": "wo_b", "n": 5120, "k": 2048, "groups": 1, "rows": m,
                    "ours_us": rng.uniform(3, 12), "cublas_bf16_us": rng.uniform(6, 10),
                    "floor_us": 2.69} for m in (1, 64)]
    (tmp_path / "gemm-NVIDIA_H200.json").write_text(json.dumps(
        {"gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "commit": "7ffb21a",
         "command": "python benchmarks/gemm.py --quick", "gemm": script_rows}))
    cli_rows = [{"name": "wo_a", "n": 1024, "k": 4096, "rows": m, "floor_us": 2.15,
                 "us": {"ours": rng.uniform(3, 12), "cublas_bf16": rng.uniform(6, 10)}}
                for m in (8, 32)]
    (tmp_path / "gemm-cli.json").write_text(json.dumps(
        {"kind": "gemm", "environment": {"git_commit": "abcdef0"}, "gemms": cli_rows}))
    text = results_readme.render(tmp_path)

    table = {row[1]: row for row in _table(text, "gemm-NVIDIA_H200.json")}  # by M
    for r in script_rows:
        row = table[str(r["rows"])]
        assert row[0] == "wo_b 5120×2048"
        assert row[2:5] == [f"{r['ours_us']:.2f}", f"{r['cublas_bf16_us']:.2f}",
                            f"{r['cublas_bf16_us'] / r['ours_us']:.2f}×"]
        assert row[5] == "—"  # no Inductor column recorded
    section = text.split("\n## gemm-cli.json\n", 1)[1]
    for r in cli_rows:
        assert (f"| wo_a 1024×4096 | {r['rows']} | {r['us']['ours']:.2f} | "
                f"{r['us']['cublas_bf16']:.2f} |") in section
    assert "run at commit 7ffb21a" in text and "run at commit abcdef0" in text
    assert "`benchmarks/gemm.py` no longer exists: `decode-boundary gemm` replaces it." in text


def test_grouped_shapes_are_labelled_per_group(tmp_path):
    """Both writers record a grouped layer's N over all its groups: wo_a at TP 4
    (two groups of 1024 rows, N = 2048) reads 2×1024×4096, as in PERFORMANCE.md."""
    script = {"shape": "wo_a", "n": 2048, "k": 4096, "groups": 2, "rows": 1, "ours_us": 3.9,
              "cublas_bf16_us": 8.9, "floor_us": 2.15}
    cli = {"name": "wo_a", "n": 2048, "k": 4096, "groups": 2, "rows": 1, "floor_us": 2.15,
           "us": {"ours": 3.9, "cublas_bf16": 8.9}}
    (tmp_path / "gemm-a.json").write_text(json.dumps({"gemm": [script]}))
    (tmp_path / "gemm-b.json").write_text(json.dumps({"kind": "gemm", "gemms": [cli]}))
    text = results_readme.render(tmp_path)
    for heading in ("gemm-a.json", "gemm-b.json"):
        assert [row[0] for row in _table(text, heading)] == ["wo_a 2×1024×4096"]


def _known(commit: str) -> bool:
    done = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"],
                          cwd=SCRIPT.parent, capture_output=True, timeout=30)
    return done.returncode == 0


# Commits of this repository's history: before the GEMM rebuild (and the user steps),
# after the rebuild but before the user steps, after both.
BEFORE_BOTH, AFTER_REBUILD, AFTER_BOTH = "09e70a4", "f916586", "9146f12"


def _notes(tmp_path, name: str, data: dict) -> str:
    (tmp_path / name).write_text(json.dumps(data))
    text = results_readme.render(tmp_path)
    return " ".join(text.split(f"\n## {name}\n", 1)[1].split("\n## ", 1)[0].split())


@pytest.mark.skipif(not all(_known(c) for c in (BEFORE_BOTH, AFTER_REBUILD, AFTER_BOTH)),
                    reason="needs the repository's history (a shallow clone lacks it)")
def test_each_bench_file_says_its_baselines_and_its_age(tmp_path):
    data, _ = _bench(random.Random())
    old = {**data, "environment": {**data["environment"], "git_commit": BEFORE_BOTH},
           "config": {"model": "v4.1-flash", "tp": 2}}
    text = _notes(tmp_path, "bench-old.json", old)
    assert "Predates the GEMM rebuild (424aed1" in text
    assert "Needs 2 GPUs to regenerate" in text
    assert ("Baselines: compiled_step, strong_baseline, user_step_aside, baseline; the "
            "user-built steps, the bench's headline baselines, are among them.") in text

    for timing in data["timings"]:
        del timing["us"]["user_step_aside"]
    between = {**data, "environment": {**data["environment"], "git_commit": AFTER_REBUILD}}
    text = _notes(tmp_path, "bench-between.json", between)
    assert "Predates the GEMM rebuild" not in text and "GPUs to regenerate" not in text
    assert ("Baselines: compiled_step, strong_baseline, baseline. None is a user-built step"
            in text)
    assert "not over what the bench compares with today. This run predates them." in text

    new = {**between, "environment": {**data["environment"], "git_commit": AFTER_BOTH}}
    text = _notes(tmp_path, "bench-new.json", new)
    assert "None is a user-built step" in text and "predates" not in text.lower()


def test_allreduce_keeps_each_path_s_fastest_tactic(tmp_path):
    rng = random.Random()
    rows = [{"m": m, "path": path, "tactic": [t, 4], "us": rng.uniform(2, 20)}
            for m in (1, 8) for path in ("ours", "nccl") for t in (256, 512, 1024)]
    (tmp_path / "allreduce-sweep-NVIDIA_H200.json").write_text(json.dumps(
        {"gpu": "NVIDIA H200", "commit": "HEAD", "date": "2026-11-29T20:22:00", "rows": rows}))
    text = results_readme.render(tmp_path)
    table = {row[1]: row for row in _table(text, "allreduce-sweep-NVIDIA_H200.json")}
    for m in (1, 8):
        for column, path in ((2, "nccl"), (3, "ours")):
            best = min((r for r in rows if r["m"] == m and r["path"] == path),
                       key=lambda r: r["us"])
            assert table[str(m)][column] == f"{best['us']:.2f} ({best['tactic']})"
    assert "run at commit — on 2026-11-29 20:22" in text  # "HEAD" is no commit


def test_tune_batch_invariant_shows_each_winner_and_its_cost(tmp_path):
    """Each run's winner, the cost that chose it (the lowest median of the rounds;
    without rounds the median of the winner's timings) and per M the median of
    its µs: several timings of the winner, so first, last and median differ."""
    rng = random.Random()
    rows = (1, 16, 64)
    runs = []
    for slots, rounds in ((("wo_a", "wo_b"), True), (("wq_b",), False)):
        winner = {s: {"block_n": 64, "split_k": rng.randint(1, 16), "num_warps": 4,
                      "chunk_k": 128} for s in slots}
        other = {s: {**o, "split_k": o["split_k"] + 1} for s, o in winner.items()}
        timings = [{"orders": orders, "us": {str(m): rng.uniform(5, 60) for m in rows},
                    "cost": rng.uniform(0.9, 1.5)}
                   for orders in (other, winner, winner, other, winner)]
        alternating = {"tables": [rng.uniform(1.2, 1.5) for _ in range(3)],
                       "tuned": [rng.uniform(0.9, 1.1) for _ in range(3)]} if rounds else None
        runs.append({"winner": winner, "timings": timings, "alternating": alternating,
                     "default_us": {str(m): rng.uniform(5, 60) for m in rows}})
    (tmp_path / "tune-v4.1-flash-tp4-batch-invariant.json").write_text(json.dumps(
        {"schema": 1, "kind": "tune-batch-invariant", "runs": runs}))
    text = results_readme.render(tmp_path)
    table = _table(text, "tune-v4.1-flash-tp4-batch-invariant.json")
    assert [row[0] for row in table] == ["wo_a, wo_b", "wq_b"]
    for row, run in zip(table, runs, strict=True):
        chosen = [t for t in run["timings"] if t["orders"] == run["winner"]]
        assert row[1] == "; ".join(f"{s} (64, {o['split_k']}, 4, 128)"
                                   for s, o in run["winner"].items())
        cost = statistics.median(run["alternating"]["tuned"]) if run["alternating"] else \
            statistics.median(t["cost"] for t in chosen)
        assert row[2] == f"{cost:.3f}"
        assert row[3:] == [f"{statistics.median(t['us'][str(m)] for t in chosen):.1f} / "
                           f"{run['default_us'][str(m)]:.1f}" for m in rows]


def test_files_without_fields_are_listed_not_fatal(tmp_path):
    (tmp_path / "gpu-tests.log").write_text("....s.\n\n5 passed, 1 skipped in 12.34s\n")
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "other.json").write_text(json.dumps({"kind": "mystery"}))
    (tmp_path / "bench-empty.json").write_text(json.dumps({"kind": "bench", "timings": []}))
    text = results_readme.render(tmp_path)
    assert "`5 passed, 1 skipped in 12.34s`" in text
    assert "## broken.json" in text and "Not readable as JSON" in text
    assert "## other.json" in text and "| mystery |" in text
    assert "No timings recorded." in text
    assert "Command: —" in text


def test_command_line(tmp_path):
    data, us = _bench(random.Random())
    (tmp_path / "bench-a.json").write_text(json.dumps(data))
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"| 16 | {us[16]['fused']:.1f} |" in (tmp_path / "README.md").read_text()
    bad = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "absent")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "is not a folder" in bad.stderr
