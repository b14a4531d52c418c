"""The README's performance table is read from the committed bench file: every
cell, the row counts and the tree it names."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks/results/bench-v4.1-flash-tp4-shapes-1gpu.json"


def _table() -> dict[str, list[str]]:
    """{first cell: the other cells} of the README's performance table."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Performance", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    cells = [[c.strip().strip("*") for c in line.strip("|").split("|")] for line in rows]
    return {row[0]: row[1:] for row in cells}


def _row(table: dict[str, list[str]], starts: str) -> list[str]:
    (key,) = [k for k in table if k.startswith(starts)]
    return table[key]


def test_readme_table_is_the_committed_bench_file():
    result = json.loads(BENCH.read_text())
    us = {t["rows"]: t["us"] for t in result["timings"]}
    rows = sorted(us)
    table = _table()
    header = _row(table, "µs per step")
    assert [int(re.sub(r"\D", "", h)) for h in header] == rows
    assert _row(table, "ours, fused") == [f"{us[m]['fused']:.1f}" for m in rows]
    assert _row(table, "strongest user-built step") == \
        [f"{us[m]['user_step_aside']:.1f}" for m in rows]
    assert _row(table, "the same with the mixes inline") == \
        [f"{us[m]['user_step']:.1f}" for m in rows]
    fastest = [min(us[m]["user_step"], us[m]["user_step_aside"]) for m in rows]
    assert _row(table, "gain") == [f"{f / us[m]['fused']:.2f}×" for f, m in zip(fastest, rows,
                                                                                 strict=True)]
    floor = result["floor_us"]
    floor_key = next(k for k in table if k.startswith("fused / floor"))
    assert f"{floor:.1f} µs" in floor_key
    assert table[floor_key] == [f"{us[m]['fused'] / floor:.2f}" for m in rows]
    assert _row(table, "batch-invariant mode") == \
        [f"{us[m]['fused_invariant']:.1f}" for m in rows]
    assert _row(table, "its cost") == [f"{us[m]['fused_invariant'] / us[m]['fused']:.2f}"
                                       for m in rows]
    env = result["environment"]
    readme = (ROOT / "README.md").read_text()
    assert f"tree {env['git_commit']}" in readme and not env["git_dirty"]
    assert env["gpu"].split()[1] in readme.split("## Performance", 1)[1][:300]
