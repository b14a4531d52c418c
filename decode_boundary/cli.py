"""The ``decode-boundary`` command.

* ``bench``: verify, then time every path of ``bench.paths.PATHS`` (fused,
  unfused and the baselines; the headline compares fused with the fastest
  baseline at each M, by name) on every
  local GPU (one process per GPU, started here; ``torchrun`` works too), or
  with ``--tp-shapes N`` one rank's share of a TP-N deployment on one GPU; a
  table, JSON and a PNG (latency vs M, and a per-kernel breakdown) in an output
  folder named at the end.
* ``verify``: correctness only. Without a GPU it runs the kernels in the Triton
  interpreter on CPU at the ``tiny`` size with tp = 2 simulated in one process, and says so.
* ``gemm``: our MXFP8 GEMM vs cuBLAS BF16 / FP8 row-wise vs the HBM floor.
* ``tune``: a model's GEMM and consumer tactics chosen inside the chain on one
  GPU (``bench.tune``); prints the tables' lines, writes ``tune-<model>-tp<N>.json``.
  With ``--batch-invariant``, batch-invariant mode's one order per GEMM shape
  (``bench.tune_invariant``).

Exit codes: 0 success, 1 a check failed or a rank failed, 2 bad arguments
(one line on stderr naming the argument) or no GPU for a command that needs one.
The tables and plots need the ``[bench]`` extra (rich, matplotlib); without it
a command says so in one line (exit 2).

Triton is imported inside the commands, never at the top (here or in what this
module imports): ``triton.jit`` reads ``TRITON_INTERPRET`` when a function is
decorated, and ``import triton`` already decorates Triton's own standard library
(``tl.max``, ...), so ``verify`` without a GPU must set it before that import
(the package's import sets it already where no CUDA device is visible;
``verify`` sets it too for a run told there is none).

Bare ``decode-boundary`` prints the usage and the commands (exit 2);
``--version`` the package's, torch's and Triton's versions. ``bench`` runs the
baselines of ``report.DEFAULT_BASELINES`` unless ``--baselines`` names others,
prints one line per stage where stderr is no terminal (``report.progress``) and
keeps Inductor's autotune tables out of its output (``baselines.quiet_autotune``);
its JSON records the seconds each part took (``harness.run_rank``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from decode_boundary.bench import report
from decode_boundary.bench.launch import RankError, in_torchrun, launch
from decode_boundary.bench.report import BASELINES, DEFAULT_BASELINES
from decode_boundary.model.config import MODELS, BoundaryConfig

if TYPE_CHECKING:
    from rich.console import Console

DEFAULT_MODEL = "v4.1-flash"
DEFAULT_ROWS = (1, 2, 4, 8, 16, 32, 48, 64)
INTERPRETER_MODEL = "tiny"
INTERPRETER_ROWS = (1, 5)  # 5: a row count that is not a power of two
INTERPRETER_TP = 2  # simulated ranks: the mailbox exchange is exercised without GPUs
GEMM_TP = 4  # the GEMM table shows per-rank shapes at the TP V4.1-Flash is served with
NO_GPU = (
    "decode-boundary {cmd}: no CUDA GPU is visible. Run `decode-boundary verify` to check "
    "correctness without one (Triton interpreter on CPU)."
)


# The decode step's capacity: the most tokens per step the boundary is built and
# tuned for (the fused chain's four launches, the mailbox slots a bench allocates).
# boundary.consumer_tactics.PUBLISH_EPILOGUE_MAX_ROWS (tests/cli/test_cli.py holds them equal;
# importing it here would import Triton before TRITON_INTERPRET is decided).
MAX_ROWS = 64
MAX_HC = 16  # hc streams: a power of two (the mixes' Sinkhorn layout), a few at most


class _Parser(argparse.ArgumentParser):
    """argparse, but a refusal is one line on stderr (``prog: error: message``,
    exit 2), not the usage block too: the line names the argument."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _integer(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None


def _positive(text: str) -> int:
    """An int >= 1 (``--tp``, ``--tp-shapes``, ``--hidden``)."""
    value = _integer(text, "a positive integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _rows(text: str) -> int:
    """A token count per step in [1, MAX_ROWS]."""
    what = f"an integer in [1, {MAX_ROWS}] (the decode step's capacity)"
    value = _integer(text, what)
    if not 1 <= value <= MAX_ROWS:
        raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
    return value


class _Distinct(argparse.Action):
    """A list option whose values must differ (``--rows``, ``--baselines``): a
    repeated M would be verified and timed twice and fill the table with
    duplicate rows, so a repeat is refused (exit 2), not run."""

    def __call__(self, parser, namespace, values, option_string=None):
        repeated = [str(v) for v in dict.fromkeys(v for v in values if values.count(v) > 1)]
        if repeated:
            what = "M = " if self.dest == "rows" else ""
            raise argparse.ArgumentError(
                self, f"{what}{', '.join(repeated)} given more than once (give each once)")
        setattr(namespace, self.dest, values)


def _hc(text: str) -> int:
    """The number of hc streams: a power of two up to MAX_HC (the next mixes'
    Sinkhorn layout needs a power of two)."""
    what = f"a power of two in [1, {MAX_HC}] (the mixes' Sinkhorn layout)"
    value = _integer(text, what)
    if not 1 <= value <= MAX_HC or value & (value - 1):
        raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text}")
    return value


def _weights_dir(text: str) -> Path:
    """A DSV4.1-format checkpoint: a ``.safetensors`` file, or a folder holding
    some (or their ``*.safetensors.index.json``), as ``gemm.load_linear`` reads it."""
    path = Path(text)
    if path.is_file() and path.name.endswith(".safetensors"):
        return path
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text!r} does not exist")
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is neither a folder nor a .safetensors file")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.safetensors.index.json")):
        raise argparse.ArgumentTypeError(f"{text!r} holds no *.safetensors file")
    return path


def _shapes(text: str) -> list[tuple[str, int, int]]:
    shapes = []
    for item in text.split(","):
        try:
            n, k = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"shape {item!r} is not NxK") from None
        if n < 1 or k < 1 or k % 32:
            raise argparse.ArgumentTypeError(f"shape {item!r}: need N, K >= 1 and K % 32 == 0")
        shapes.append((f"{n}x{k}", n, k))
    return shapes


def build_parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    common.add_argument("--hidden", type=_positive,
                        help="override the model's hidden size (a multiple of 32)")
    common.add_argument("--hc", type=_hc,
                        help=f"override the model's hc_mult (a power of two <= {MAX_HC})")
    common.add_argument("--tp", type=_positive,
                        help="tensor-parallel size (bench/verify: default one rank per visible "
                             f"GPU; gemm: per-rank shapes at this TP, default {GEMM_TP})")
    common.add_argument("--rows", type=_rows, nargs="+", action=_Distinct,
                        help=f"token counts M per step, each in [1, {MAX_ROWS}] and given once "
                             f"(default {' '.join(map(str, DEFAULT_ROWS))}; verify without a "
                             f"GPU: {' '.join(map(str, INTERPRETER_ROWS))})")
    common.add_argument("--out", type=_out_dir,
                        help="folder for the JSON (and PNG), created if missing (default: "
                             "benchmarks/results of a checkout, else "
                             "./decode-boundary-results/<time>; verify writes only with --out)")
    common.add_argument("--json", action="store_true",
                        help="also print the result JSON to stdout (the tables go to stderr)")
    boundary = _Parser(add_help=False)
    boundary.add_argument("--weights", type=_weights_dir,
                          help="DSV4.1-format safetensors folder (default: synthetic weights)")
    boundary.add_argument("--seed", type=int, default=0,
                          help="seed of the synthetic weights (default 0)")
    boundary.add_argument("--tp-shapes", type=_positive, dest="tp_shapes",
                          help="run one rank's share of a TP-N deployment on one GPU (the "
                               "per-rank shapes of TP N, the all-reduce over a group of one)")
    boundary.add_argument("--timeout", type=_seconds, default=600.0,
                          help="seconds before a run with a silent rank is ended (default 600)")

    parser = _Parser(
        prog="decode-boundary",
        description="Run, verify and benchmark a DeepSeek V4.1 attention boundary.",
    )
    parser.add_argument("--version", action="version", version=version(),
                        help="print the package's, torch's and Triton's versions and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench = sub.add_parser("bench", parents=[common, boundary],
                   help="verify, then time the fused boundary against the baselines",
                   description="Verify the boundary, then time every path (fused, unfused "
                               "and the baselines a user could build: the strongest is named "
                               "at each M) on all local GPUs, one process per GPU, or one "
                               "rank's share of a TP-N deployment on one GPU (--tp-shapes N). "
                               "Writes a table, JSON and a latency plot. Needs a CUDA GPU.")
    _add_model(bench, f"the model whose shapes are run (default {DEFAULT_MODEL})")
    bench.add_argument("--baselines", nargs="+", type=_baseline, action=_Distinct,
                       help="the baselines to verify and time besides ours: names among "
                            f"{', '.join(BASELINES)}, or 'all' (default: "
                            f"{' '.join(DEFAULT_BASELINES)}: compiled_step, left out, "
                            "compiles and autotunes the whole step once more per M)")
    verify = sub.add_parser("verify", parents=[common, boundary],
                   help="correctness only (without a GPU: tiny model, Triton interpreter)",
                   description="Check the boundary's outputs: fused and unfused bit-identical, "
                               "both within tolerance of the reference, every rank holding "
                               "the same bits. Without a GPU it runs the tiny model's kernels "
                               f"in the Triton interpreter on CPU (tp = {INTERPRETER_TP} "
                               "simulated), whatever the default below.")
    _add_model(verify, f"the model whose shapes are checked (default {DEFAULT_MODEL}; without "
                       f"a GPU {INTERPRETER_MODEL}, the only one it accepts then)")
    gemm = sub.add_parser("gemm", parents=[common],
                          help="our MXFP8 GEMM vs cuBLAS BF16 / FP8 row-wise vs the floor",
                          description="Time our MXFP8 GEMM on the model's per-rank projections "
                                      "(or --shapes) against cuBLAS BF16 and FP8 row-wise and "
                                      "the HBM floor, cold L2. Needs a CUDA GPU.")
    _add_model(gemm, f"the model whose projections are timed (default {DEFAULT_MODEL})")
    gemm.add_argument("--shapes", type=_shapes,
                      help="time these NxK weights (comma-separated) instead of the model's "
                           "projections")
    parser.subcommands = {"bench": bench, "verify": verify, "gemm": gemm,
                          "tune": _add_tune_parser(sub)}
    return parser


def _add_model(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument("--model", choices=list(MODELS), help=help)


def _baseline(text: str) -> str:
    if text not in (*BASELINES, "all"):
        raise argparse.ArgumentTypeError(
            f"must be one of {', '.join(BASELINES)} or all, got {text!r}")
    return text


def version() -> str:
    """``decode-boundary X (torch Y, triton Z)``: Triton's version read from its
    metadata, not by importing it (module docstring)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    from decode_boundary import __version__

    try:
        triton = installed("triton")
    except PackageNotFoundError:
        triton = "not installed"
    return f"decode-boundary {__version__} (torch {torch.__version__}, triton {triton})"


def _add_tune_parser(sub) -> argparse.ArgumentParser:
    tune = sub.add_parser(
        "tune", help="choose the GEMM and consumer tactics inside the chain (one GPU) and "
                     "print the tables' lines",
        description="Time one rank's fused boundary step with each candidate tactic of its "
                    "GEMMs and consumer (coordinate descent, then the tables against the "
                    "choice in alternating rounds), check the winner, print the lines of "
                    "gemm/tactics.py's TABLE and boundary/consumer_tactics.py's tables to "
                    "paste, and write tune-<model>-tp<N>.json.")
    tune.add_argument("--model", choices=list(MODELS), default=DEFAULT_MODEL,
                      help=f"the model whose tactics are chosen (default {DEFAULT_MODEL})")
    tune.add_argument("--tp-shapes", type=_positive, default=GEMM_TP, dest="tp_shapes",
                      help=f"the per-rank shapes of TP N (default {GEMM_TP})")
    tune.add_argument("--rows", type=_rows, nargs="+", action=_Distinct,
                      help=f"token counts, 1..{MAX_ROWS}, each timed at its table bucket's largest "
                           "(default: every bucket, 1 2 4 8 16 32 48 64)")
    tune.add_argument("--rounds", type=_positive, default=3,
                      help="alternating rounds of the tables against the choice (default 3)")
    tune.add_argument("--batch-invariant", action="store_true", dest="batch_invariant",
                      help="choose batch-invariant mode's one reduction order per GEMM shape "
                           "instead (gemm/tactics.py's INVARIANT_ORDERS): each order costed "
                           "at every --rows count as it is, by the geometric mean of the "
                           "mode's chain over the default's; writes "
                           "tune-<model>-tp<N>-batch-invariant.json")
    tune.add_argument("--out", type=_out_dir,
                      help="folder for the JSON (default: benchmarks/results of a checkout)")
    return tune


def _out_dir(text: str) -> Path:
    """A folder for the results: an existing writable folder, or one that can be
    created (it is, before any work, so a long run never ends on a bad path)."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} cannot be created ({exc.strerror})") from None
    if not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not writable")
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    if not argv:  # a first try: the usage and the commands, not only "command is required"
        parser.print_help(sys.stderr)
        return 2
    try:
        args = parser.parse_args(argv)
        args.command_line = shlex.join(["decode-boundary", *argv])
        # Before any work: the tables (and bench's plot) need the [bench] extra; tune
        # prints plain lines.
        for module in {"bench": ("rich.console", "matplotlib"), "tune": ()}.get(
                args.command, ("rich.console",)):
            report.bench_extra(module)
        # Argument errors found after parsing name the subcommand, as argparse's own do.
        command = parser.subcommands[args.command]
        if args.command == "tune":
            return _tune(command, args)
        return _gemm(command, args) if args.command == "gemm" else _boundary(command, args)
    except SystemExit as exc:  # --help and parser.error(): return argparse's code
        return int(exc.code or 0)
    except report.MissingBenchExtra as exc:
        print(f"decode-boundary: {exc}", file=sys.stderr)
        return 2


def _config(parser: argparse.ArgumentParser, args, default_model: str, tp: int) -> BoundaryConfig:
    """The model (with ``--hidden`` / ``--hc`` applied), checked against ``tp``;
    a bad combination is an argument error (exit 2)."""
    config = MODELS[args.model or default_model]
    overrides = {k: v for k, v in (("hidden", args.hidden), ("hc_mult", args.hc)) if v}
    if overrides:
        config = dataclasses.replace(config, name=f"{config.name}-custom", **overrides)
    if config.hidden % 32:
        parser.error(f"--hidden must be a multiple of 32 (MXFP8 groups), got {config.hidden}")
    try:
        config.check_tp(tp)
    except ValueError as exc:
        flag = "--tp-shapes" if getattr(args, "tp_shapes", None) else "--tp"
        parser.error(f"{flag} {tp}: {exc}")
    return config


def _boundary(parser: argparse.ArgumentParser, args) -> int:
    started = time.perf_counter()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    interpreter = gpus == 0
    if interpreter:
        if args.command == "bench":
            print(NO_GPU.format(cmd="bench"), file=sys.stderr)
            return 2
        if args.tp_shapes:
            parser.error(f"--tp-shapes needs a GPU: it runs one rank's share of a TP-N "
                         f"deployment on one GPU (without a GPU, {args.command} runs the "
                         f"{INTERPRETER_MODEL} model with tp = {INTERPRETER_TP} simulated)")
        if args.weights:
            parser.error("--weights needs a GPU (without one, verify runs the tiny model "
                         "on synthetic weights)")
        if args.model not in (None, INTERPRETER_MODEL):
            parser.error(f"--model {args.model} needs a GPU: the Triton interpreter takes "
                         f"hours at its size (without a GPU, verify runs {INTERPRETER_MODEL!r})")
        os.environ["TRITON_INTERPRET"] = "1"
        tp = args.tp or INTERPRETER_TP
    elif args.tp_shapes:
        if args.tp not in (None, 1) or in_torchrun():
            parser.error("--tp-shapes runs one process on one GPU: drop --tp / torchrun")
        tp = 1
    else:
        tp = int(os.environ["WORLD_SIZE"]) if in_torchrun() else args.tp or max(1, gpus)
    config = _config(parser, args, INTERPRETER_MODEL if interpreter else DEFAULT_MODEL,
                     args.tp_shapes or tp)
    rows = tuple(args.rows or (INTERPRETER_ROWS if interpreter else DEFAULT_ROWS))
    # After TRITON_INTERPRET is set: importing Triton reads it.
    from decode_boundary.bench.harness import BenchSpec, run_rank, verify_simulated

    out = _console(args.json)
    if interpreter:
        out.print(f"No CUDA GPU: verify runs the {config.name} model (not {DEFAULT_MODEL}), "
                  f"its kernels in the Triton interpreter on CPU, tp={tp} simulated in one "
                  f"process, M={list(rows)} (reduced size; no timings).")
    unreachable = _unreachable_pairs(min(tp, gpus))
    for i, j in unreachable:
        out.print(f"GPU {i} cannot access GPU {j} (no peer access): "
                  "the all-reduce falls back to NCCL for the sum.")
    chosen = getattr(args, "baselines", None) or DEFAULT_BASELINES
    baselines = BASELINES if "all" in chosen else tuple(b for b in BASELINES if b in chosen)
    spec = BenchSpec(config, rows, time=args.command == "bench", seed=args.seed,
                     weights_dir=str(args.weights) if args.weights else None,
                     tp_shapes=args.tp_shapes if not interpreter else None,
                     baselines=baselines)
    try:
        if interpreter:
            per_rank = {0: verify_simulated(spec, tp)}
        else:
            per_rank = launch(run_rank, tp, (spec,), timeout_s=args.timeout)
    except RankError as exc:
        print(f"decode-boundary {args.command}: {exc}", file=sys.stderr)
        return 1
    ok = all(c["ok"] for res in per_rank.values() for c in res["verify"])
    if 0 not in per_rank:  # a non-zero torchrun rank: rank 0 reports
        return 0 if ok else 1

    result = report.new_result(
        args.command, args.command_line, report.environment(interpreter, unreachable),
        {"model": config.name, **dataclasses.asdict(config), "tp": tp,
         "tp_shapes": args.tp_shapes or tp, "rows": list(rows),
         "weights": spec.weights_dir, "seed": args.seed, "transport": per_rank[0]["transport"],
         **({} if interpreter else {"baselines": list(baselines)})},
    )
    result["verify"] = merge_verify(per_rank)
    if "seconds" in per_rank[0]:  # rank 0's wall clock, and the whole command's
        result["seconds"] = {**per_rank[0]["seconds"], "total": time.perf_counter() - started}
    out.print(report.verify_table(result))
    first = per_rank[0]
    if "timings" in first:
        result.update({k: first[k] for k in ("copy_rate_gbps", "floor_us", "hop_us",
                                             "weight_copies", "breakdown", "mixes")})
        result["timings"] = report.add_speedups(first["timings"])
        out.print(report.bench_table(result))
        out.print(report.mixes_table(result))
    elif args.command == "bench":
        out.print("[red]Correctness failed: nothing was timed.[/]")
    _save(args, result, out, plot="timings" in result)
    return 0 if ok else 1


def _gemm(parser: argparse.ArgumentParser, args) -> int:
    if not torch.cuda.is_available():
        print(NO_GPU.format(cmd="gemm"), file=sys.stderr)
        return 2
    tp = args.tp or GEMM_TP
    config = _config(parser, args, DEFAULT_MODEL, tp)
    from decode_boundary.bench.baselines import quiet_autotune  # kernels: only once needed
    from decode_boundary.bench.gemm import gemm_table

    shapes = args.shapes or [(name, *shape)
                             for name, shape in config.projection_shapes(tp).items()]
    rows = list(args.rows or DEFAULT_ROWS)
    result = report.new_result(
        "gemm", args.command_line, report.environment(False, []),
        {"model": config.name, "tp": tp, "rows": rows, "shapes": [list(s) for s in shapes]},
    )
    quiet_autotune()
    with report.progress(True, len(shapes) * len(rows)) as stage:
        result.update(gemm_table(shapes, rows, torch.device("cuda", torch.cuda.current_device()),
                                 stage))
    out = _console(args.json)
    out.print(report.gemm_table(result))
    _save(args, result, out, plot=False)
    return 0


def _tune(parser: argparse.ArgumentParser, args) -> int:
    """``tune``: refuses bad rows or TP (exit 2) before it needs a GPU."""
    try:
        MODELS[args.model].check_tp(args.tp_shapes)
    except ValueError as exc:
        parser.error(f"--tp-shapes {args.tp_shapes}: {exc}")
    if not torch.cuda.is_available():
        print(NO_GPU.format(cmd="tune"), file=sys.stderr)
        return 2
    # kernels: import only once needed
    if args.batch_invariant:
        from decode_boundary.bench.tune_invariant import run
        where = "gemm/tactics.py's INVARIANT_ORDERS"
    else:
        from decode_boundary.bench.tune import run
        where = "gemm/tactics.py, boundary/consumer_tactics.py"

    out = args.out or default_out_dir(Path.cwd(), time.strftime("%Y%m%d-%H%M%S"))
    path, lines, failures = run(args.model, args.tp_shapes, args.rows, args.rounds, out,
                                args.command_line)
    if failures:
        print("decode-boundary tune: the chosen tactics failed their checks: "
              + "; ".join(failures), file=sys.stderr)
    else:
        print("\n".join([f"# tables' lines ({where}):", *lines]))
    print(f"Results in {path}")
    return 1 if failures else 0


def _console(to_stderr: bool) -> Console:
    """Tables go to stderr when stdout carries JSON; off a terminal (logs, CI)
    rich would assume 80 columns and fold the wide tables, so give it more."""
    console = report.bench_extra("rich.console").Console(stderr=to_stderr)
    if not console.is_terminal:
        console.width = 160
    return console


def _unreachable_pairs(gpus: int) -> list[tuple[int, int]]:
    return [(i, j) for i in range(gpus) for j in range(gpus)
            if i != j and not torch.cuda.can_device_access_peer(i, j)]


def merge_verify(per_rank: dict) -> list[dict]:
    """One check per row count over all ranks (failures prefixed by rank when tp > 1)."""
    merged = []
    for i, check in enumerate(per_rank[0]["verify"]):
        rank_checks = [(r, res["verify"][i]) for r, res in sorted(per_rank.items())]
        failures = [f if len(per_rank) == 1 else f"rank {r}: {f}"
                    for r, c in rank_checks for f in c["failures"]]
        merged.append({
            "rows": check["rows"],
            "ok": all(c["ok"] for _, c in rank_checks),
            "failures": failures,
            "ranks_identical": all(c["ranks_identical"] for _, c in rank_checks),
        })
    return merged


def default_out_dir(cwd: Path, stamp: str) -> Path:
    """``benchmarks/results`` of a checkout when run from its root (created if a
    fresh clone lacks it), else a new ``decode-boundary-results/<stamp>`` folder here."""
    if (cwd / "decode_boundary" / "cli.py").is_file() and (cwd / "benchmarks").is_dir():
        return cwd / "benchmarks" / "results"
    return cwd / "decode-boundary-results" / stamp


def result_stem(command: str, result: dict) -> str:
    """The stable name of a run's files, one per kind of run, which the next run of
    that kind overwrites (the JSON records commit, command, GPU and versions; git
    keeps the history): ``bench-<model>-tp<N>`` (all local GPUs) or
    ``bench-<model>-tp<N>-shapes-1gpu`` (one rank's share), ``gemm-<GPU name>``."""
    if command == "gemm":
        gpu = result["environment"].get("gpu") or "cpu"
        return "gemm-" + re.sub(r"[^A-Za-z0-9.]+", "_", gpu)
    cfg = result["config"]
    shapes = cfg.get("tp_shapes", cfg["tp"])
    tag = f"tp{cfg['tp']}" if shapes == cfg["tp"] else f"tp{shapes}-shapes-1gpu"
    return f"{command}-{cfg['model']}-{tag}"


def _save(args, result: dict, out: Console, plot: bool) -> None:
    """Write JSON (+ PNG) where they belong and name the folder; ``verify``
    writes only when given ``--out``. ``--json`` also prints the JSON to stdout."""
    if args.command != "verify" or args.out:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        folder = args.out or default_out_dir(Path.cwd(), stamp)
        stem = result_stem(args.command, result)
        written = [report.write_json(result, folder / f"{stem}.json")]
        if plot:
            written.append(report.plot_latency(result, folder / f"{stem}.png"))
        out.print(f"Results in {folder}: {', '.join(p.name for p in written)}")
    if args.json:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":  # python -m decode_boundary.cli (and torchrun -m) without installing
    sys.exit(main())
