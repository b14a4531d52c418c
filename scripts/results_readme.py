"""Write ``benchmarks/results/README.md`` from the result files present.

``benchmarks/results/`` holds one file per kind of run under a stable name, each
overwritten by the next run of that kind (git keeps the history). This script reads
what every file records and lists, per file, its kind, its headline figures and its
provenance (commit, command, GPU, versions, date), so the README cannot drift from
the files. Fields a file does not record show as "—"; a file of an unknown kind is
still listed, with whatever provenance it carries.

    python scripts/results_readme.py [RESULTS_DIR]   # default: benchmarks/results

Kinds read: the bench (``decode-boundary bench``: per M the fused µs, every
baseline, the fastest baseline and the gain, fused / floor), the GEMM table (per
shape and M: ours, cuBLAS BF16, the floor), the timeline (per M the step and each
kernel's span), the all-reduce comparison (per M each path, its fastest tactic),
``tune --batch-invariant`` (each slot's chosen order, the cost that chose it, per M
the mode's µs against the default's) and pytest logs (the summary line). Each bench file's
baselines are named, with whether the user-built steps (today's headline baselines)
are among them; a file run before the GEMM rebuild, one that one GPU cannot
regenerate, and a command naming a script since replaced each get a line saying so.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

MISSING = "—"
ROOT = Path(__file__).resolve().parent.parent
# The bench's own paths: every other entry of a timing's "us" is a baseline.
OURS = ("fused", "unfused")
# The user-built steps (decode_boundary/bench/user_step.py): the bench's headline
# baselines since the commit that added them. A file without them measured its gain
# over weaker ones.
USER_STEPS = ("user_step", "user_step_aside")
USER_STEPS_ADDED = "921b958"
# The GEMM rebuild (new kernel family, tactic tables, grouped wo_a): figures of a run
# at a commit before it are not those of the current kernels.
REBUILD = ("424aed1", "2026-12-01")
# Scripts a recorded command names that the tree no longer has, and what replaced them.
REPLACED = {"benchmarks/gemm.py": "decode-boundary gemm"}
GAIN = "gain (fastest baseline / fused)"


def fmt(value, digits: int = 1) -> str:
    """A number with ``digits`` decimals, or the missing mark."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return MISSING
    return f"{value:.{digits}f}"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table (the header, the separator, one line per row)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def git_added(path: Path) -> str:
    """"<commit> <date>" of the last commit that wrote ``path``'s content (renames to
    the stable name not counted), or the missing mark where git does not track it:
    the only provenance of files that record none themselves (test logs)."""
    try:
        out = subprocess.run(["git", "log", "-1", "--follow", "--diff-filter=ACM",
                              "--format=%h %cs", "--", path.name],
                             cwd=path.parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return MISSING
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else MISSING


def provenance(data: dict) -> dict[str, str]:
    """Commit, command, GPU, versions and date from either result schema:
    ``report.new_result``'s (an ``environment`` dict, ``created``) or the flat one
    of the scripts (``gpu``, ``torch``, ``triton``, ``commit``, ``date``)."""
    env = data.get("environment") if isinstance(data.get("environment"), dict) else {}

    def field(*names):
        for name in names:
            for source in (env, data):
                if source.get(name) not in (None, ""):
                    return source[name]
        return None

    commit = field("git_commit", "commit")
    if isinstance(commit, str) and commit not in ("HEAD", "unknown"):
        commit = commit[:7] + ("+dirty" if env.get("git_dirty") else "")
    else:
        commit = None
    versions = ", ".join(f"{name} {field(name)}" for name in ("torch", "triton", "python")
                         if field(name))
    date = field("created", "date")
    return {"commit": commit or MISSING, "command": field("command") or MISSING,
            "gpu": field("gpu") or MISSING, "versions": versions or MISSING,
            "date": str(date)[:16].replace("T", " ") if date else MISSING, "notes": []}


def bench_section(data: dict, commit: str = MISSING) -> list[str]:
    """Per M: fused, every baseline, the fastest baseline and the gain over it,
    fused / floor; then which baselines the file holds."""
    timings = [t for t in data.get("timings", []) if isinstance(t.get("us"), dict)]
    if not timings:
        return ["No timings recorded."]
    baselines = list(dict.fromkeys(k for t in timings for k in t["us"] if k not in OURS))
    floor = data.get("floor_us")
    header = ["M", "fused µs", "unfused µs", *(f"{b} µs" for b in baselines),
              "fastest baseline", GAIN, "fused / floor"]
    rows = []
    for t in timings:
        us = t["us"]
        present = {b: us[b] for b in baselines if isinstance(us.get(b), int | float)}
        fastest = t.get("fastest_baseline")
        if fastest not in present:
            fastest = min(present, key=present.get) if present else None
        fused = us.get("fused")
        gain = (f"{present[fastest] / fused:.2f}×" if fastest and isinstance(fused, int | float)
                and fused > 0 else MISSING)
        ratio = (f"{fused / floor:.2f}" if isinstance(fused, int | float)
                 and isinstance(floor, int | float) and floor > 0 else MISSING)
        rows.append([str(t.get("rows", MISSING)), fmt(fused), fmt(us.get("unfused")),
                     *(fmt(us.get(b)) for b in baselines), fastest or MISSING, gain, ratio])
    lines = table(header, rows)
    if isinstance(floor, int | float):
        lines.append(f"\nFloor: {floor:.1f} µs (every weight byte at the measured copy rate).")
    lines.append("\n" + baseline_set(baselines, commit))
    return lines


def baseline_set(baselines: list[str], commit: str) -> str:
    """The file's baselines in words: the current set (a user-built step heads
    it) or a weaker one, which its gain is measured over (and, where git knows
    the run's commit, whether it predates the user-built steps)."""
    names = ", ".join(baselines) or "none"
    if any(b in USER_STEPS for b in baselines):
        return (f"Baselines: {names}; the user-built steps, the bench's headline baselines, "
                "are among them.")
    when = " This run predates them." if precedes(commit, USER_STEPS_ADDED) else ""
    return (f"Baselines: {names}. None is a user-built step ({', '.join(USER_STEPS)}, the "
            "bench's headline baselines): the gain is over these weaker baselines, not over "
            f"what the bench compares with today.{when}")


def history_notes(kind: str, data: dict, commit: str) -> list[str]:
    """What a reader must know about a file's age: a run before the GEMM rebuild,
    a file one GPU cannot regenerate, a command naming a script since replaced."""
    notes = []
    if precedes(commit, REBUILD[0]):
        notes.append(f"Predates the GEMM rebuild ({REBUILD[0]}, {REBUILD[1]}): these are "
                     "not the current kernels' figures.")
    gpus = gpus_needed(kind, data)
    if gpus > 1:
        notes.append(f"Needs {gpus} GPUs to regenerate; a one-GPU run cannot replace it.")
    command = str(data.get("command") or "")
    for script, now in REPLACED.items():
        if script in command and not (ROOT / script).exists():
            notes.append(f"`{script}` no longer exists: `{now}` replaces it.")
    return notes


def precedes(commit: str, marker: str) -> bool:
    """Whether ``commit`` (the README's short form, ``+dirty`` allowed) is known
    to git here and does not descend from ``marker``: a run before that change."""
    sha = commit.split("+")[0]
    if sha == MISSING:
        return False
    try:
        done = subprocess.run(["git", "merge-base", "--is-ancestor", marker, sha],
                              cwd=ROOT, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 1  # 0: it descends from marker; other codes: unknown commit


def gpus_needed(kind: str, data: dict) -> int:
    """GPUs a run of this file took: benchmarks/allreduce.py runs on two; a bench
    with tp ranks of its own shapes (not ``--tp-shapes`` on one GPU) on tp."""
    if kind == "allreduce":
        return 2
    config = data.get("config") if isinstance(data.get("config"), dict) else {}
    tp = config.get("tp")
    if kind == "bench" and isinstance(tp, int) and config.get("tp_shapes", tp) == tp:
        return tp
    return 1


def _gemm_rows(data: dict) -> list[tuple[str, object, dict, object]]:
    """(shape, M, {path: µs}, floor) from the CLI's ``gemms`` or the script's ``gemm``."""
    out = []
    for r in data.get("gemms", []):
        shape = f"{r.get('name', MISSING)} {_size(r)}"
        out.append((shape, r.get("rows"), r.get("us") or {}, r.get("floor_us")))
    for r in data.get("gemm", []):
        us = {"ours": r.get("ours_us"), "cublas_bf16": r.get("cublas_bf16_us"),
              "inductor_bf16": r.get("inductor_bf16_us")}
        out.append((f"{r.get('shape', MISSING)} {_size(r)}", r.get("rows"), us, r.get("floor_us")))
    return out


def _size(r: dict) -> str:
    """N×K, or groups×(N / groups)×K for a grouped layer: both writers record N
    over all groups (wo_a at TP 4: 2 groups of 1024 rows, N = 2048)."""
    n, k, groups = r.get("n", "?"), r.get("k", "?"), r.get("groups", 1)
    if isinstance(groups, int) and groups > 1 and isinstance(n, int):
        return f"{groups}×{n // groups}×{k}"
    return f"{n}×{k}"


def gemm_section(data: dict) -> list[str]:
    """Per shape and M: ours, cuBLAS BF16 and their ratio, Inductor, the floor."""
    rows = []
    for shape, m, us, floor in _gemm_rows(data):
        ours, cublas = us.get("ours"), us.get("cublas_bf16")
        ratio = (f"{cublas / ours:.2f}×" if isinstance(ours, int | float) and ours > 0
                 and isinstance(cublas, int | float) else MISSING)
        rows.append([shape, str(m), fmt(ours, 2), fmt(cublas, 2), ratio,
                     fmt(us.get("inductor_bf16"), 2), fmt(floor, 2)])
    if not rows:
        return ["No GEMM timings recorded."]
    return table(["shape (N×K; grouped: G×N×K)", "M", "ours µs", "cuBLAS BF16 µs", "cuBLAS / ours",
                  "Inductor BF16 µs", "floor µs"], rows)


def timeline_section(data: dict) -> list[str]:
    """Per M: the step in a CUDA graph, and when each kernel's programs ended."""
    rows = []
    for p in data.get("profiles", []):
        spans = ", ".join(f"{k.get('kernel', '?')} ends {fmt(k.get('last_end'))}"
                          for k in p.get("kernels", []))
        rows.append([str(p.get("rows", MISSING)), fmt(p.get("graph_us_per_step")),
                     fmt(p.get("stamped_step_us")), spans or MISSING])
    if not rows:
        return ["No profiles recorded."]
    return table(["M", "step µs (graph)", "step µs (stamped)", "kernels (µs from the first start)"],
                 rows)


def allreduce_section(data: dict) -> list[str]:
    """Per (hidden, M): each path's fastest time (and, in a sweep, its tactic)."""
    best: dict[tuple, dict[str, dict]] = {}
    for r in data.get("rows", []):
        if not isinstance(r.get("us"), int | float):
            continue
        cell = best.setdefault((r.get("hidden"), r.get("m")), {})
        path = str(r.get("path", MISSING))
        if path not in cell or r["us"] < cell[path]["us"]:
            cell[path] = r
    paths = sorted({p for cell in best.values() for p in cell})
    if not paths:
        return ["No all-reduce timings recorded."]
    rows = []
    order = sorted(best, key=lambda key: (str(key[0]), _number(key[1])))
    for hidden, m in order:
        cell = best[hidden, m]
        cells = []
        for p in paths:
            r = cell.get(p)
            tactic = f" ({r['tactic']})" if r and r.get("tactic") else ""
            cells.append(fmt(r["us"], 2) + tactic if r else MISSING)
        rows.append([str(hidden) if hidden is not None else MISSING, str(m), *cells])
    return table(["hidden", "M", *(f"{p} µs" for p in paths)], rows)


def tune_invariant_section(data: dict) -> list[str]:
    """Per tuned run (the chain, each projection outside it): the chosen order of
    each GEMM slot, the cost that chose it (the lowest median of the alternating
    rounds, else the median of the winner's timings; a cost is the geometric mean
    over M of the mode's µs over the default's) and, per M, the median of the
    mode's µs with it against the default's."""
    header, rows = None, []
    for run in data.get("runs", []):
        winner = run.get("winner") or {}
        timed = [t for t in run.get("timings", []) if t.get("orders") == winner]
        default = run.get("default_us") or {}
        if header is None:
            header = ["GEMM slots", "orders (block, split-K, warps, K-piece)", "cost",
                      *(f"M = {m}: mode / default µs" for m in default)]
        rounds = [v for v in (run.get("alternating") or {}).values() if v]
        costs = [t["cost"] for t in timed if isinstance(t.get("cost"), int | float)]
        cost = min(map(statistics.median, rounds)) if rounds else \
            (statistics.median(costs) if costs else None)
        orders = "; ".join(f"{slot} ({', '.join(str(v) for v in o.values())})"
                           for slot, o in winner.items())
        cells = []
        for m, us in default.items():
            mode = [t["us"][m] for t in timed if isinstance(t.get("us", {}).get(m), int | float)]
            cells.append(f"{fmt(statistics.median(mode) if mode else None)} / {fmt(us)}")
        rows.append([", ".join(winner) or MISSING, orders or MISSING, fmt(cost, 3), *cells])
    if not rows:
        return ["No tuned runs recorded."]
    return table(header, rows)


def _number(value) -> float:
    return value if isinstance(value, int | float) else float("inf")


def kind_of(name: str, data: dict) -> str:
    """The kind of run a JSON holds, from what it records (its name as a hint)."""
    if data.get("kind") in ("bench", "gemm", "timeline", "verify"):
        return data["kind"]
    if "gemm" in data or "gemms" in data:
        return "gemm"
    if "profiles" in data:
        return "timeline"
    if name.startswith("allreduce") or (data.get("rows") and "path" in data["rows"][0]):
        return "allreduce"
    return str(data.get("kind") or "unknown")


SECTIONS: dict[str, Callable[[dict], list[str]]] = {
    "bench": bench_section, "gemm": gemm_section, "timeline": timeline_section,
    "allreduce": allreduce_section, "tune-batch-invariant": tune_invariant_section,
}


def json_entry(path: Path) -> tuple[str, dict[str, str], list[str]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return "unreadable", provenance({}), [f"Not readable as JSON: {exc}."]
    if not isinstance(data, dict):
        return "unknown", provenance({}), ["Not a result object."]
    kind = kind_of(path.name, data)
    p = provenance(data)
    section = SECTIONS.get(kind)
    if section is None:
        body = ["No summary for this kind."]
    else:
        body = section(data, p["commit"]) if kind == "bench" else section(data)
    figure = path.with_suffix(".png")
    if figure.exists():
        body = [*body, f"\nPlot: [{figure.name}]({figure.name})."]
    p["notes"] = history_notes(kind, data, p["commit"])
    return kind, p, body


def log_entry(path: Path) -> tuple[str, dict[str, str], list[str]]:
    """A pytest log: its last line (the summary); provenance from git when tracked."""
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines()
             if line.strip()]
    return "test log", provenance({}), [f"`{lines[-1]}`" if lines else "Empty log."]


def render(folder: Path) -> str:
    entries = []
    for path in sorted(folder.iterdir()):
        if path.suffix == ".json":
            entries.append((path.name, *json_entry(path), git_added(path)))
        elif path.suffix == ".log":
            entries.append((path.name, *log_entry(path), git_added(path)))
    out = ["# Current results",
           "",
           "Generated by `scripts/results_readme.py` from the files in this folder; do not",
           "edit by hand. Each file is the latest run of its kind and is overwritten by the",
           "next one; `git log -- benchmarks/results/<file>` is its history.",
           ""]
    out += table(["file", "kind", "run's commit", "run's date", "GPU", "in git since"],
                 [[f"[{name}](#{anchor(name)})", kind, p["commit"], p["date"], p["gpu"], added]
                  for name, kind, p, _, added in entries])
    for name, kind, p, body, added in entries:
        out += ["", f"## {name}", "",
                f"{kind}; run at commit {p['commit']} on {p['date']}; GPU {p['gpu']}; "
                f"{p['versions']}; in git since {added}.",
                f"Command: `{p['command']}`" if p["command"] != MISSING else "Command: —",
                *(["", *p["notes"]] if p["notes"] else []),
                "", *body]
    return "\n".join(out) + "\n"


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation other than - and _ dropped."""
    return "".join(c for c in heading.lower().replace(" ", "-") if c.isalnum() or c in "-_")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or (args and args[0].startswith("-")):
        print("usage: python scripts/results_readme.py [RESULTS_DIR]", file=sys.stderr)
        return 2
    folder = Path(args[0]) if args else ROOT / "benchmarks" / "results"
    if not folder.is_dir():
        print(f"results_readme: {folder} is not a folder", file=sys.stderr)
        return 2
    target = folder / "README.md"
    target.write_text(render(folder))
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
