"""Turning a run's result dict into a table, a JSON file and a latency plot.

The result dict (schema ``SCHEMA``) is what ``decode-boundary`` writes:

* ``schema`` int, ``kind`` ("bench" / "verify" / "gemm"), ``command`` str,
  ``created`` ISO-8601 UTC str;
* ``environment``: ``gpu`` (name or None), ``gpu_count``, ``torch``, ``triton``,
  ``python``, ``git_commit`` (None outside a checkout), ``git_dirty``,
  ``interpreter`` (kernels ran in the Triton interpreter), ``unreachable_pairs``
  (GPU pairs without peer access: the all-reduce used its NCCL fallback);
* ``config``: the model's sizes, ``tp``, ``rows``, ``transport`` of the
  all-reduce ("mailbox" peer stores, or "nccl" where peers are unreachable),
  ``baselines`` (on a GPU: the baselines verified and timed), ...;
* bench / verify: ``verify`` [{``rows``, ``ok``, ``failures``, ``ranks_identical``}]
  and, on a GPU, ``seconds`` (wall clock of rank 0's parts: ``precompile``,
  ``first_call`` {baseline: {M: s}}, a compiled baseline's compile and autotuning,
  ``verify``; bench adds ``timing`` {path: s}, ``breakdown``, ``mixes``; ``total``:
  the whole command);
  bench adds ``copy_rate_gbps``, ``floor_us`` (every MXFP8 weight byte of the
  boundary — wo_a, wo_b, fused_wqa_wkv — at the copy rate, plus ``hop_us``, one
  measured hop where there are peers), ``weight_copies``, ``timings``
  [{``rows``, ``us`` {path: µs}, ``speedup`` {"<path>/fused": ratio,
  "fastest_baseline/fused": the headline}, ``fastest_baseline`` (the quickest
  of ``BASELINES`` at this M, by name: user_step, user_step_aside,
  compiled_step, strong_baseline or baseline)}] and
  ``breakdown`` {``rows``, path: {stage: µs}} (each stage timed alone);
  ``mixes`` {``collapse``, ``rows``: [{``rows``, ``us``: {fused, consumer,
  separate, consumer_then_separate[, mixes_kernel], fused_with_gemm,
  consumer_with_gemm}}]} (the next mixes both ways, bench.mixes);
* gemm: ``copy_rate_gbps`` and ``gemms`` [{``name``, ``n``, ``k``, ``rows``,
  ``floor_us``, ``us`` {"ours", "cublas_bf16", "cublas_fp8_rowwise"}}].
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import importlib.metadata
import io
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import torch

from decode_boundary.env import env_flag

if TYPE_CHECKING:
    from rich.table import Table

SCHEMA = 1
# The baseline paths of bench.paths.PATHS (what fused is compared with); report needs
# no kernels, so the list lives here.
# The user-built steps first: the strongest, the headline (bench.user_step); V4 runs no
# user_step_aside (its layer input needs the mixes).
BASELINES = ("user_step", "user_step_aside", "compiled_step", "strong_baseline", "baseline")
# What a bench runs unless --baselines says otherwise: the user steps (the headline),
# the strong baseline (Inductor's default mode on mHC alone: a short compile; the
# per-kernel breakdown's other column) and the eager one (no compile). compiled_step
# (the whole step, mixes included, by max-autotune) costs one more autotuned compile
# per M: --baselines adds it (``all``: every baseline).
DEFAULT_BASELINES = ("user_step", "user_step_aside", "strong_baseline", "baseline")
SPEEDUPS = (*((b, "fused") for b in BASELINES), ("unfused", "fused"),
            ("fused_invariant", "fused"))
# table headers (JSON keeps the names)
SHORT = {"user_step": "user", "user_step_aside": "user aside", "compiled_step": "compiled",
         "strong_baseline": "strong", "baseline": "eager"}
PACKAGE_ROOT = Path(__file__).resolve().parent.parent


BENCH_EXTRA = "pip install 'decode-boundary[bench]'"


class MissingBenchExtra(ModuleNotFoundError):
    """A module of the ``[bench]`` extra is not installed (the message says how)."""


def bench_extra(module: str):
    """``module`` of the ``[bench]`` extra (rich, matplotlib), imported on first
    use so that the package, its GEMMs and its all-reduce need neither;
    :class:`MissingBenchExtra` naming the extra when it is not installed."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise MissingBenchExtra(
            f"{exc.name} is not installed: the tables and plots need the [bench] extra "
            f"({BENCH_EXTRA})", name=exc.name) from None


def _table(title: str):
    return bench_extra("rich.table").Table(title=title)


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(PACKAGE_ROOT), *args], capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_commit() -> str | None:
    """``DECODE_BOUNDARY_COMMIT`` when set (a copied working tree, as on a lent
    GPU machine, may carry no .git or a stale one), else the checkout's commit,
    else None."""
    commit = os.environ.get("DECODE_BOUNDARY_COMMIT") or _git("rev-parse", "HEAD")
    return commit if commit and re.fullmatch(r"[0-9a-f]{7,40}", commit) else None


def git_dirty() -> bool:
    """Whether the tree differs from its commit: ``DECODE_BOUNDARY_DIRTY`` (default
    no) where ``DECODE_BOUNDARY_COMMIT`` names the commit (a copied tree's .git, if
    any, is stale: its status would report every file), else ``git status``."""
    if os.environ.get("DECODE_BOUNDARY_COMMIT"):
        return env_flag("DECODE_BOUNDARY_DIRTY", False)
    return bool(_git("status", "--porcelain", "--untracked-files=no"))


def environment(interpreter: bool, unreachable_pairs: list[tuple[int, int]]) -> dict:
    """Where the numbers come from (docs/DESIGN.md §9: GPU, versions, commit)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {
        "gpu": torch.cuda.get_device_name(0) if gpus else None,
        "gpu_count": gpus,
        "torch": torch.__version__,
        # Not `import triton`: that would decorate Triton's own jit functions before the
        # CLI has decided on TRITON_INTERPRET (see cli.py).
        "triton": importlib.metadata.version("triton"),
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "git_dirty": git_dirty(),
        "interpreter": interpreter,
        "unreachable_pairs": [list(p) for p in unreachable_pairs],
    }


def new_result(kind: str, command: str, env: dict, config: dict) -> dict:
    return {
        "schema": SCHEMA,
        "kind": kind,
        "command": command,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "environment": env,
        "config": config,
    }


def add_speedups(timings: list[dict]) -> list[dict]:
    """Each timing row gets ``speedup`` (a path's µs / fused µs) and, where a
    baseline ran, ``fastest_baseline`` (the name of the quickest at this M)
    with ``speedup["fastest_baseline/fused"]``: the headline ratio."""
    for row in timings:
        us = row["us"]
        row["speedup"] = {f"{a}/{b}": us[a] / us[b] for a, b in SPEEDUPS if a in us and b in us}
        ran = [b for b in BASELINES if b in us]
        if ran and "fused" in us:
            row["fastest_baseline"] = min(ran, key=us.__getitem__)
            row["speedup"]["fastest_baseline/fused"] = us[row["fastest_baseline"]] / us["fused"]
    return timings


class Stages:
    """A long run's stages, as they begin: ``stage(label)`` says that ``label``
    begins (and the stage before it is done); ``done()`` ends the last one.

    On a terminal a rich bar (transient: the tables replace it); anywhere else
    (a log file, CI, ``nohup``, a remote runner, where a transient bar writes
    nothing) one line per stage, ``[elapsed s] (i/total) label``, so a log
    shows what a run of several minutes is doing and how long each stage took."""

    def __init__(self, total: int, stream: TextIO, bar=None, task=None) -> None:
        self.total, self.stream, self.bar, self.task = total, stream, bar, task
        self.begun = 0
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def __call__(self, label: str) -> None:
        self.begun += 1
        if self.bar is not None:
            self.bar.update(self.task, completed=self.begun - 1, description=label)
        else:
            self._line(f"({self.begun}/{self.total}) {label}")

    def done(self) -> None:
        if self.bar is None:
            self._line(f"done ({self.begun} stages)")

    def _line(self, text: str) -> None:
        self.stream.write(f"[{self.elapsed():7.1f} s] {text}\n")
        self.stream.flush()


@contextlib.contextmanager
def progress(show: bool, total: int, stream: TextIO | None = None) -> Iterator[Stages]:
    """The :class:`Stages` of a run of ``total`` stages on ``stream`` (default
    stderr: stdout may carry JSON); ``show`` False: silent (the ranks but 0)."""
    stream = stream or sys.stderr
    if not show:
        yield Stages(total, io.StringIO())
        return
    if not stream.isatty():
        stages = Stages(total, stream)
        yield stages
        stages.done()
        return
    console = bench_extra("rich.console").Console(file=stream)
    with bench_extra("rich.progress").Progress(console=console, transient=True) as bar:
        yield Stages(total, stream, bar, bar.add_task("starting", total=total))


def verify_table(result: dict) -> Table:
    table = _table(_title(result, "correctness"))
    for col in ("M", "fused = unfused, vs reference", "ranks identical", "result"):
        table.add_column(col)
    for check in result["verify"]:
        table.add_row(
            str(check["rows"]),
            "; ".join(check["failures"]) or "bit-identical, within tolerance",
            "yes" if check["ranks_identical"] else "NO",
            "[green]ok[/]" if check["ok"] else "[red]FAIL[/]",
        )
    return table


def bench_table(result: dict) -> Table:
    """The headline first — per M, fused against the fastest baseline at that M,
    named, with the gain and fused / floor —, then every other path's µs as
    secondary columns (their ratios to fused are in the JSON's ``speedup``)."""
    table = _table(_title(result, "µs per boundary (median, cold L2)"))
    paths = list(result["timings"][0]["us"]) if result["timings"] else []
    others = [p for p in paths if p != "fused"]
    for name in ("M", "fused µs", "fastest baseline", "its µs", "gain", "fused/floor",
                 "floor µs", *(f"{SHORT.get(p, p)} µs" for p in others)):
        table.add_column(name, justify="left" if name == "fastest baseline" else "right")
    for row in result["timings"]:
        us, fastest = row["us"], row.get("fastest_baseline")
        fused = us.get("fused")
        table.add_row(
            str(row["rows"]),
            f"{fused:.1f}" if fused is not None else "",
            SHORT.get(fastest, fastest) if fastest else "",
            f"{us[fastest]:.1f}" if fastest else "",
            f"{row['speedup']['fastest_baseline/fused']:.2f}x" if fastest else "",
            f"{fused / result['floor_us']:.2f}x" if fused is not None else "",
            f"{result['floor_us']:.1f}",
            *(f"{us[p]:.1f}" for p in others),
        )
    table.caption = (f"gain = the fastest baseline at this M / fused; floor = every MXFP8 "
                     f"weight byte of the boundary (wo_a, wo_b, fused_wqa_wkv) / copy rate "
                     f"({result['copy_rate_gbps']:.0f} GB/s, read + write). Baselines: user = "
                     f"the step without the next mixes by torch.compile max-autotune, then "
                     f"the mixes by cuBLAS FP32 + one Triton kernel; user aside = the same "
                     f"with the mixes on a side stream (V4.1); compiled = the whole step, "
                     f"mixes included, by torch.compile max-autotune; strong = cuBLAS BF16 + "
                     f"compiled mHC; eager = cuBLAS FP8 + torch ops")
    return table


def mixes_table(result: dict) -> Table:
    """The next sublayer's mixes both ways (``result["mixes"]``, bench.mixes)."""
    mixes = result["mixes"]
    table = _table(_title(result, f"next mixes, collapse with the {mixes['collapse']} "
                                       "pre: µs (median, cold L2)"))
    kernel = all("mixes_kernel" in row["us"] for row in mixes["rows"])
    gemm = all("fused_with_gemm" in row["us"] for row in mixes["rows"])
    for name in ("M", "fused consumer", "consumer", "fused - consumer", "separate tail",
                 "consumer + separate", "(consumer + separate) / fused",
                 *(("consumer + mixes kernel",) if kernel else ()),
                 *(("fused + GEMM", "consumer + GEMM", "difference") if gemm else ())):
        table.add_column(name, justify="right")
    for row in mixes["rows"]:
        us = row["us"]
        with_gemm = (us["fused_with_gemm"], us["consumer_with_gemm"]) if gemm else ()
        table.add_row(str(row["rows"]), f"{us['fused']:.2f}", f"{us['consumer']:.2f}",
                      f"{us['fused'] - us['consumer']:+.2f}", f"{us['separate']:.2f}",
                      f"{us['consumer_then_separate']:.2f}",
                      f"{us['consumer_then_separate'] / us['fused']:.2f}x",
                      *((f"{us['mixes_kernel']:.2f}",) if kernel else ()),
                      *((f"{with_gemm[0]:.2f}", f"{with_gemm[1]:.2f}",
                         f"{with_gemm[0] - with_gemm[1]:+.2f}") if gemm else ()))
    table.caption = ("publish + consumer each; consumer = without the mixes (given pre); "
                     "separate = torch.compile of the user's tail (V4.1: the mixes; V4: the "
                     "mixes, collapse, RMSNorm, then MXFP8); consumer + separate runs the "
                     "consumer residual-only for V4; consumer + mixes kernel (V4.1): ours "
                     "after the consumer, as beyond MIXES_FUSED_MAX_ROWS; fused + GEMM: the "
                     "chain's consumer and fused_wqa_wkv, which combines the mixes; consumer "
                     "+ GEMM: the same GEMM after the consumer without them")
    failures = [f"M = {row['rows']}: {f}" for row in mixes["rows"]
                for f in row.get("failures", [])]
    if failures:
        table.caption += "; CHECK FAILED: " + "; ".join(failures)
    return table


def gemm_table(result: dict) -> Table:
    table = _table(_title(result, "GEMM µs (median, cold L2)"))
    for col in ("GEMM", "N x K", "M", "ours", "CuTe DSL", "cuBLAS BF16", "Inductor BF16",
                "cuBLAS FP8 row-wise", "floor", "ours / floor", "FP8 / ours"):
        table.add_column(col, justify="right")
    for g in result["gemms"]:
        us = g["us"]
        groups = g.get("groups", 1)
        shape = f"{g['n']} x {g['k']}" if groups == 1 else \
            f"{groups} x {g['n'] // groups} x {g['k']}"
        table.add_row(
            g["name"], shape, str(g["rows"]),
            f"{us['ours']:.1f}", _us(us.get("cute")), f"{us['cublas_bf16']:.1f}",
            _us(us.get("inductor_bf16")),
            f"{us['cublas_fp8_rowwise']:.1f}",
            f"{g['floor_us']:.1f}", f"{us['ours'] / g['floor_us']:.2f}",
            f"{us['cublas_fp8_rowwise'] / us['ours']:.2f}x",
        )
    return table


def _us(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def _title(result: dict, what: str) -> str:
    cfg, env = result["config"], result["environment"]
    where = env["gpu"] or "CPU (Triton interpreter)"
    transport = f" over {cfg['transport']}" if cfg.get("transport") else ""
    shapes = cfg.get("tp_shapes", cfg.get("tp"))
    tp = f"tp={cfg.get('tp')}" if shapes == cfg.get("tp") else f"one rank of TP {shapes}"
    return f"{cfg.get('model', 'custom')} {tp}{transport} on {where}: {what}"


def render(table: Table, width: int = 140) -> str:
    """The table as plain text (what the terminal shows, without colour codes)."""
    console = bench_extra("rich.console").Console(file=io.StringIO(), width=width,
                                                  color_system=None)
    console.print(table)
    return console.file.getvalue()


def write_json(result: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def _plot_breakdown(bx, breakdown: dict) -> None:
    """One horizontal bar per path, its stages stacked left to right, each in a
    colour of its own and named in the legend below the axes with its µs (no text
    on the bars, so no two labels can overlap at any M); each bar's total at its end."""
    paths = [p for p in breakdown if p != "rows"]
    colours = iter(bench_extra("matplotlib.pyplot").get_cmap("tab20").colors * 2)
    for y, p in enumerate(paths):
        left = 0.0
        for name, us in breakdown[p].items():
            bx.barh(y, us, left=left, height=0.6, color=next(colours),
                    label=f"{p}: {name}, {us:.1f} µs")
            left += us
        bx.text(left, y, f" {left:.1f} µs", va="center", fontsize=7)
    bx.set_yticks(range(len(paths)), paths, fontsize=8)
    bx.invert_yaxis()  # the first path on top, as in the legend
    bx.set_xlabel("µs, each stage timed alone")
    bx.set_xlim(0, 1.25 * max(sum(breakdown[p].values()) for p in paths))
    bx.set_title(f"where the time goes, M = {breakdown['rows']}", fontsize=9)
    bx.grid(alpha=0.3, axis="x")
    bx.legend(fontsize=6.5, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1,
              frameon=False)


def plot_latency(result: dict, path: Path) -> Path:
    """PNG: µs per boundary vs M, one line per path, the floor dashed; beside
    it, where the run timed one, the per-kernel breakdown of fused vs the
    strong baseline at one M (stacked bars of each stage timed alone)."""
    matplotlib = bench_extra("matplotlib")
    matplotlib.use("Agg")  # files only: no display on GPU hosts or CI
    plt = bench_extra("matplotlib.pyplot")
    timings = result["timings"]
    rows = [t["rows"] for t in timings]
    breakdown = result.get("breakdown")
    fig, axes = plt.subplots(1, 2 if breakdown else 1, figsize=(13 if breakdown else 7, 4.8),
                             squeeze=False)
    ax = axes[0][0]
    for p in timings[0]["us"]:  # the headline pair bold, the secondary baselines faint
        main = p == "fused" or p.startswith("user_step")
        ax.plot(rows, [t["us"][p] for t in timings], marker="o", label=p,
                linewidth=2.0 if main else 1.0, alpha=1.0 if main else 0.45)
    ax.axhline(result["floor_us"], linestyle="--", color="grey", label="floor (all weights)")
    for t in timings:  # the headline: fused against the fastest baseline at this M
        if "fastest_baseline" in t:
            ax.annotate(f"{t['speedup']['fastest_baseline/fused']:.2f}x vs\n"
                        f"{SHORT.get(t['fastest_baseline'], t['fastest_baseline'])}",
                        (t["rows"], t["us"]["fused"]), textcoords="offset points",
                        xytext=(0, -22), ha="center", fontsize=6.5)
    ax.set_xlabel("M (tokens per decode step)")
    ax.set_ylabel("µs per boundary")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(rows, [str(r) for r in rows])
    ax.set_title(_title(result, "boundary latency"), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if breakdown:
        _plot_breakdown(axes[0][1], breakdown)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
