"""``scripts/results_readme.py`` on synthetic result files: the figures each file
records land in the generated README's rows (fresh random figures every run, so a
table that drops, reorders or mislabels a column fails), provenance is read from both
result schemas, and files that lack fields or are not JSON still get a line."""

import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path

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
        assert row["gain"] == f"{baselines[fastest] / figures['fused']:.2f}×"
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
        assert row["gain"] == f"{figures[chosen] / figures['fused']:.2f}×"


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
