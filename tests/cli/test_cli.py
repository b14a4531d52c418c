"""The ``decode-boundary`` command: argument handling, the launcher, the report
files, and ``verify`` end to end in the Triton interpreter (tiny model, tp = 2 simulated).
On a multi-GPU machine: ``bench`` end to end within 5 minutes."""

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import matplotlib.image
import pytest
import torch
import torch.distributed as dist
from small_models import MICRO

from decode_boundary import cli
from decode_boundary.bench import report
from decode_boundary.bench.launch import RankError, launch
from decode_boundary.env import NO_MULTICAST_ENV

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("argv", "argument", "message"),
    [
        (["frobnicate"], "COMMAND", "invalid choice"),
        (["--json"], "COMMAND", "required"),
        (["verify", "--model", "v5"], "--model", "invalid choice"),
        (["bench", "--rows", "0"], "--rows", "got 0"),
        (["verify", "--rows", "two"], "--rows", "must be an integer in [1, 64]"),
        (["verify", "--rows", "abc"], "--rows", "got 'abc'"),
        (["verify", "--rows", "65"], "--rows", "capacity"),
        (["bench", "--rows", "100000"], "--rows", "got 100000"),
        (["gemm", "--rows", "1", "65"], "--rows", "got 65"),
        (["bench", "--rows", "1", "4", "1"], "--rows", "M = 1 given more than once"),
        (["tune", "--rows", "8", "8", "2", "2"], "--rows", "M = 8, 2 given more than once"),
        (["bench", "--baselines", "user"], "--baselines", "must be one of user_step"),
        (["bench", "--baselines", "baseline", "baseline"], "--baselines",
         "baseline given more than once"),
        (["verify", "--hc", "3"], "--hc", "power of two"),
        (["verify", "--hc", "0"], "--hc", "got 0"),
        (["verify", "--hidden", "x"], "--hidden", "positive integer"),
        (["verify", "--tp", "-2"], "--tp", "must be >= 1"),
        (["verify", "--weights", "/nonexistent"], "--weights", "does not exist"),
        (["verify", "--weights", __file__], "--weights", "neither a folder nor"),
        (["verify", "--timeout", "0"], "--timeout", "seconds > 0"),
        (["verify", "--timeout", "nan"], "--timeout", "seconds > 0"),
        (["gemm", "--shapes", "5120x100"], "--shapes", "K % 32"),
        (["gemm", "--shapes", "5120by2048"], "--shapes", "not NxK"),
        (["verify", "--out", __file__], "--out", "not a folder"),
        (["verify", "--out", "/proc/no/such/folder"], "--out", "cannot be created"),
    ],
)
def test_argument_errors_exit_2_with_one_line(capsys, argv, argument, message):
    """Bad input is refused before any work: exit 2 and ONE line on stderr
    naming the argument (no usage block, no traceback, no internal names)."""
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("decode-boundary") and "error:" in lines[0]
    assert argument in lines[0] and message in lines[0]
    assert "_" + "rows" not in lines[0] and "Traceback" not in captured.err
    assert captured.out == ""


def test_weights_folder_without_a_checkpoint_is_refused(capsys, tmp_path):
    assert cli.main(["verify", "--weights", str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "--weights" in err[0] and "safetensors" in err[0]


def test_weights_without_gpu_is_refused_not_ignored(capsys, monkeypatch, tmp_path):
    """Without a GPU verify runs the tiny model on synthetic weights: a
    checkpoint given is refused, not silently dropped."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (tmp_path / "model-00001.safetensors").write_bytes(b"")
    assert cli.main(["verify", "--weights", str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "--weights needs a GPU" in err[0]


def test_row_capacity_is_the_fused_chains():
    """The CLI's bound on --rows is the capacity the fused chain is built for
    (the CLI cannot import it: that would import Triton too early)."""
    from decode_boundary.boundary.consumer_tactics import PUBLISH_EPILOGUE_MAX_ROWS

    assert cli.MAX_ROWS == PUBLISH_EPILOGUE_MAX_ROWS
    assert max(cli.DEFAULT_ROWS) <= cli.MAX_ROWS


@pytest.mark.parametrize("command", ["bench", "verify", "gemm"])
def test_every_command_has_a_description(capsys, command):
    assert cli.main([command, "--help"]) == 0
    out = capsys.readouterr().out
    description = out.split("\n\n")[1]  # argparse: usage, blank line, description
    assert not description.lstrip().startswith(("options:", "-")) and len(description) > 60


def test_help_exits_0(capsys):
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--model", "--tp", "--rows", "--weights", "--out", "--json", "--hidden",
                   "--baselines"):
        assert option in out


def test_bare_command_prints_usage_and_the_commands(capsys):
    """A first try with no arguments: the usage and every command with what it
    does, on stderr, exit 2 (not only 'the following arguments are required')."""
    assert cli.main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("usage: decode-boundary")
    lines = {line.split()[0]: line for line in captured.err.splitlines()
             if line.startswith("    ") and line.split()}
    for command in ("bench", "verify", "gemm", "tune"):
        assert len(lines[command].split()) > 4, captured.err  # the name, then what it does


def build_parser_commands() -> dict:
    return cli.build_parser().subcommands


def test_version_names_the_package_torch_and_triton(capsys):
    from importlib.metadata import version

    import decode_boundary

    assert cli.main(["--version"]) == 0
    out = capsys.readouterr().out.strip()
    assert out == (f"decode-boundary {decode_boundary.__version__} (torch {torch.__version__}, "
                   f"triton {version('triton')})")


def test_every_flag_says_what_it_does():
    """Each option of each command has a help text that describes it, not only
    its default (``--seed`` had none, ``--model`` only 'default v4.1-flash')."""
    for name, sub in build_parser_commands().items():
        for action in sub._actions:
            if action.dest == "help":
                continue
            text = action.help or ""
            assert len(text.split()) >= 4 and not text.startswith("default"), \
                (name, action.option_strings, text)


def test_verify_help_says_it_runs_tiny_without_a_gpu(capsys):
    assert cli.main(["verify", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    model = text.rsplit("--model {", 1)[1].split(" --", 1)[0]  # its line under options
    assert "without a GPU tiny" in model


@pytest.mark.parametrize("command", ["bench", "gemm"])
def test_timing_commands_without_gpu_point_to_verify(capsys, monkeypatch, command):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main([command]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "decode-boundary verify" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["verify", "--tp", "3"], "--tp 3: tp=3 must divide"),
        (["verify", "--hidden", "100"], "multiple of 32"),
        (["verify", "--model", "v4.1-flash"], "needs a GPU"),
        (["verify", "--tp-shapes", "3"], "it runs one rank's share of a TP-N deployment"),
    ],
)
def test_verify_without_gpu_rejects_what_it_cannot_run(capsys, monkeypatch, argv, message):
    """One line naming the subcommand, exit 2, before any kernel runs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("decode-boundary verify: error:") and message in line


def test_default_out_dir(tmp_path):
    assert cli.default_out_dir(tmp_path, "S") == tmp_path / "decode-boundary-results" / "S"
    (tmp_path / "decode_boundary").mkdir()
    (tmp_path / "benchmarks").mkdir()
    assert cli.default_out_dir(tmp_path, "S") == tmp_path / "decode-boundary-results" / "S"
    (tmp_path / "decode_boundary" / "cli.py").touch()
    assert cli.default_out_dir(tmp_path, "S") == tmp_path / "benchmarks" / "results"
    assert cli.default_out_dir(REPO, "S") == REPO / "benchmarks" / "results"


def test_merge_verify_names_the_failing_rank():
    ok = {"rows": 4, "ok": True, "failures": [], "ranks_identical": True}
    bad = {"rows": 4, "ok": False, "failures": ["q: relative error"], "ranks_identical": True}
    merged = cli.merge_verify({0: {"verify": [ok]}, 1: {"verify": [bad]}})
    assert merged == [{"rows": 4, "ok": False, "failures": ["rank 1: q: relative error"],
                       "ranks_identical": True}]


# ---------------------------------------------------------------- launcher (gloo on CPU)


def _all_reduce_rank(ctx, base):
    t = torch.tensor([ctx.rank + base])
    dist.all_reduce(t, group=ctx.group)
    return {"sum": t.item(), "env": {k: os.environ.get(k) for k in NO_MULTICAST_ENV}}


def _rank_1_raises(ctx):
    if ctx.rank == 1:
        raise ValueError("injected failure")
    dist.barrier(group=ctx.group)  # rank 0 would wait here forever for rank 1


def _rank_1_dies(ctx):
    if ctx.rank == 1:
        os._exit(3)
    dist.barrier(group=ctx.group)


def _sleeps(ctx):
    time.sleep(120)


def test_launch_runs_every_rank_without_multicast():
    results = launch(_all_reduce_rank, 2, (10,), timeout_s=60)
    assert sorted(results) == [0, 1]
    for res in results.values():
        assert res["sum"] == 10 + 11
        assert res["env"] == NO_MULTICAST_ENV


@pytest.mark.parametrize(
    ("fn", "timeout_s", "rank", "message"),
    [
        (_rank_1_raises, 60, 1, "injected failure"),
        (_rank_1_dies, 60, 1, "exited with code 3"),
        (_sleeps, 3, None, "timed out"),
    ],
)
def test_launch_never_hangs_and_names_the_rank(fn, timeout_s, rank, message):
    start = time.monotonic()
    with pytest.raises(RankError, match=message) as info:
        launch(fn, 2, timeout_s=timeout_s)
    assert info.value.rank == rank
    assert time.monotonic() - start < 45


# ---------------------------------------------------------------- report


def _synthetic_bench() -> dict:
    env = report.environment(interpreter=False, unreachable_pairs=[(0, 1)])
    result = report.new_result("bench", "decode-boundary bench --rows 1 8", env,
                               {"model": "v4.1-flash", "tp": 2, "rows": [1, 8]})
    result["verify"] = [{"rows": m, "ok": True, "failures": [], "ranks_identical": True}
                        for m in (1, 8)]
    result.update(copy_rate_gbps=4200.0, floor_us=2.5, weight_copies=3)
    result["timings"] = report.add_speedups([
        # The fastest baseline: the aside user step at M = 1, the strong one at 8.
        {"rows": 1, "us": {"user_step": 19.0, "user_step_aside": 17.6, "strong_baseline": 20.0,
                           "baseline": 30.0, "unfused": 12.0, "fused": 8.0}},
        {"rows": 8, "us": {"user_step": 25.0, "user_step_aside": 24.0, "strong_baseline": 22.0,
                           "baseline": 33.0, "unfused": 14.0, "fused": 11.0}},
    ])
    result["breakdown"] = {"rows": 1, "fused": {"wo_a": 3.0, "wo_b": 2.5, "consumer": 2.0},
                           "strong_baseline": {"wo_a (bmm)": 8.0, "mHC": 9.0}}
    return result


def test_bench_table_leads_with_fused_against_the_fastest_baseline():
    table = report.bench_table(_synthetic_bench())
    headers = [column.header for column in table.columns]
    assert headers[:7] == ["M", "fused µs", "fastest baseline", "its µs", "gain", "fused/floor",
                           "floor µs"]
    # Today's baselines and ours unfused stay, as secondary columns.
    assert headers[7:] == ["user µs", "user aside µs", "strong µs", "eager µs", "unfused µs"]
    text = report.render(table, width=200)
    rows = {line.strip("│ ").split()[0]: [c.strip() for c in line.strip("│").split("│")]
            for line in text.splitlines() if line.strip("│ ")[:2] in ("1 ", "8 ")}
    assert rows["1"][:7] == ["1", "8.0", "user aside", "17.6", "2.20x", "3.20x", "2.5"]
    assert rows["1"][7:] == ["19.0", "17.6", "20.0", "30.0", "12.0"]
    assert rows["8"][:7] == ["8", "11.0", "strong", "22.0", "2.00x", "4.40x", "2.5"]
    assert "4200 GB/s" in text and "every MXFP8 weight byte" in text
    assert "cuBLAS FP32 + one Triton kernel" in " ".join(text.split())  # the caption, wrapped


def test_verify_table_shows_failures():
    result = _synthetic_bench()
    result["verify"][1] = {"rows": 8, "ok": False, "failures": ["q: relative error 3e-02"],
                           "ranks_identical": False}
    text = report.render(report.verify_table(result))
    assert "q: relative error 3e-02" in text and "FAIL" in text and "NO" in text


def test_json_schema(tmp_path):
    path = report.write_json(_synthetic_bench(), tmp_path / "sub" / "r.json")
    data = json.loads(path.read_text())
    assert data["schema"] == report.SCHEMA and data["kind"] == "bench"
    env = data["environment"]
    for key, types in {"gpu": (str, type(None)), "gpu_count": int, "torch": str, "triton": str,
                       "python": str, "git_commit": (str, type(None)), "git_dirty": bool,
                       "interpreter": bool, "unreachable_pairs": list}.items():
        assert isinstance(env[key], types), key
    assert env["unreachable_pairs"] == [[0, 1]]
    assert env["git_commit"] is None or len(env["git_commit"]) == 40
    assert isinstance(data["created"], str) and isinstance(data["command"], str)
    # Speedups worked out by hand from the synthetic times (path µs / fused µs); the
    # fastest baseline named per M.
    want = {1: {"user_step/fused": 2.375, "user_step_aside/fused": 2.2,
                "strong_baseline/fused": 2.5, "baseline/fused": 3.75, "unfused/fused": 1.5,
                "fastest_baseline/fused": 2.2},
            8: {"user_step/fused": 2.2727, "user_step_aside/fused": 2.1818,
                "strong_baseline/fused": 2.0, "baseline/fused": 3.0, "unfused/fused": 1.2727,
                "fastest_baseline/fused": 2.0}}
    fastest = {1: "user_step_aside", 8: "strong_baseline"}
    for row in data["timings"]:
        assert set(row["us"]) == {"user_step", "user_step_aside", "strong_baseline",
                                  "baseline", "unfused", "fused"}
        assert row["speedup"] == pytest.approx(want[row["rows"]], abs=1e-4)
        assert row["fastest_baseline"] == fastest[row["rows"]]


def test_plot_is_a_valid_png(tmp_path):
    path = report.plot_latency(_synthetic_bench(), tmp_path / "plot.png")
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_gemm_table():
    result = report.new_result("gemm", "decode-boundary gemm", report.environment(False, []),
                               {"model": "v4.1-flash", "tp": 4})
    result["gemms"] = [{"name": "wo_b", "n": 5120, "k": 2048, "rows": 1, "floor_us": 2.5,
                        "us": {"ours": 3.0, "cute": 5.5, "cublas_bf16": 8.0,
                               "inductor_bf16": 7.5, "cublas_fp8_rowwise": 9.0}},
                       {"name": "wq_b", "n": 4096, "k": 1024, "rows": 2, "floor_us": 1.5,
                        "us": {"ours": 2.0, "cublas_bf16": 6.0, "inductor_bf16": None,
                               "cublas_fp8_rowwise": 4.0}}]
    text = report.render(report.gemm_table(result))
    for cell in ("wo_b", "5120 x 2048", "3.0", "5.5", "8.0", "7.5", "9.0", "2.5", "1.20",
                 "3.00x"):
        assert cell in text
    wq_b = next(line for line in text.splitlines() if "wq_b" in line)
    assert wq_b.count("—") == 2  # neither the CuTe kernel nor Inductor timed here


# ---------------------------------------------------------------- end to end


def test_verify_without_gpu_runs_in_the_interpreter(tmp_path):
    """The user's path: a fresh process with no GPU and no TRITON_INTERPRET set."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "decode_boundary.cli", "verify", "--rows", "3",
         "--out", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=120,
        env={**env, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Triton interpreter" in done.stderr and "verify runs the tiny model" in done.stderr
    assert "ok" in done.stderr and "FAIL" not in done.stderr
    printed = json.loads(done.stdout)
    assert printed["kind"] == "verify" and printed["environment"]["interpreter"] is True
    assert printed["config"]["tp"] == 2 and printed["config"]["hidden"] == 256
    assert printed["config"]["transport"] == "simulated"
    assert printed["verify"] == [{"rows": 3, "ok": True, "failures": [],
                                  "ranks_identical": True}]
    (written,) = tmp_path.glob("*.json")
    assert written.name == "verify-tiny-tp2.json"  # a stable name: the next run overwrites it
    assert json.loads(written.read_text()) == printed


def test_verify_fails_with_exit_1_on_a_wrong_answer(capsys, monkeypatch):
    """A wrong answer (check_outputs patched to fail) is named per path and
    exits 1; the interpreter's model is the micro config here
    (tests/helpers/small_models.py), the verdict does not depend on it."""
    import decode_boundary.bench.harness as harness

    monkeypatch.setitem(cli.MODELS, cli.INTERPRETER_MODEL, MICRO)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(harness, "check_outputs", lambda out, ref: ["q: injected"])
    assert cli.main(["verify", "--rows", "1"]) == 1
    table = capsys.readouterr().out  # without --json the table goes to stdout
    assert "fused q: injected" in table and "unfused q: injected" in table and "FAIL" in table


@pytest.mark.multigpu
def test_bench_end_to_end_within_5_minutes(tmp_path):
    start = time.monotonic()
    # Own session: on a timeout the whole group (the command and its rank processes) is killed.
    proc = subprocess.Popen(
        [sys.executable, "-m", "decode_boundary.cli", "bench", "--rows", "1", "8",
         "--out", str(tmp_path)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=330)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("decode-boundary bench ran past 330 s")
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, stderr[-4000:]
    assert elapsed < 300
    (path,) = tmp_path.glob("bench-v4.1-flash-tp*.json")
    data = json.loads(path.read_text())
    assert data["config"]["tp"] == torch.cuda.device_count()
    assert [t["rows"] for t in data["timings"]] == [1, 8]
    assert all(v > 0 for t in data["timings"] for v in t["us"].values())
    assert data["environment"]["gpu"] and data["floor_us"] > 0
    assert (tmp_path / path.name.replace(".json", ".png")).read_bytes()[:8] == PNG_SIGNATURE
    assert str(tmp_path) in stdout


def test_gemm_table_times_grouped_wo_a_as_one_launch(monkeypatch):
    """The GEMM table's plumbing on CPU (timer and device properties stubbed:
    each timed call runs once): a grouped shape is one grouped layer for ours,
    one bmm for cuBLAS BF16, one FP8 call per group; every call runs."""
    import types

    import decode_boundary.bench.gemm as bench

    ran = []

    def once(steps, *args, **kwargs):
        ran.append(steps[0]())
        return 1.0

    monkeypatch.setattr(bench, "graph_time_us", once)
    monkeypatch.setattr(bench, "copy_rate", lambda device: 4e12)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(L2_cache_size=1 << 20))
    result = bench.gemm_table([("wo_b", 64, 96), ("wo_a", 64, 64, 2)], [3], torch.device("cpu"))
    ours, bf16, _, ours_g, bf16_g, _ = ran
    assert ours.shape == (3, 64) and bf16.shape == (1, 3, 64)  # bmm with one group
    assert ours_g.shape == (3, 64) and bf16_g.shape == (2, 3, 32)  # one bmm over the groups
    assert [(g["name"], g["groups"]) for g in result["gemms"]] == [("wo_b", 1), ("wo_a", 2)]
    text = report.render(report.gemm_table(
        {**report.new_result("gemm", "x", report.environment(False, []), {"tp": 4}), **result}))
    assert "2 x 32 x 64" in text and "64 x 96" in text


def test_result_files_have_one_stable_name_per_kind():
    """Each kind of run writes under one name that its next run overwrites."""
    env = {"gpu": "NVIDIA H200"}
    one_gpu = {"environment": env, "config": {"model": "v4.1-flash", "tp": 1, "tp_shapes": 4}}
    local = {"environment": env, "config": {"model": "v4-flash", "tp": 2}}
    assert cli.result_stem("bench", one_gpu) == "bench-v4.1-flash-tp4-shapes-1gpu"
    assert cli.result_stem("bench", local) == "bench-v4-flash-tp2"
    assert cli.result_stem("gemm", one_gpu) == "gemm-NVIDIA_H200"


# ---------------------------------------------------------------- progress, bench plumbing


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_off_a_terminal_is_one_line_per_stage_with_elapsed_seconds(monkeypatch):
    """Where stderr is a log (not a terminal) each stage is one line as it
    begins, with the seconds since the start, then one closing line."""
    clock = iter([0.0, 1.5, 12.3, 80.0])
    monkeypatch.setattr(report.time, "perf_counter", lambda: next(clock))
    log = io.StringIO()
    with report.progress(True, 2, log) as stage:
        stage("verifying M = 1: ours, fused and unfused")
        stage("verifying M = 1: compiling baseline user_step")
    assert log.getvalue().splitlines() == [
        "[    1.5 s] (1/2) verifying M = 1: ours, fused and unfused",
        "[   12.3 s] (2/2) verifying M = 1: compiling baseline user_step",
        "[   80.0 s] done (2 stages)",
    ]


def test_progress_on_a_terminal_is_the_bar_and_silent_for_other_ranks():
    tty = _Tty()
    with report.progress(True, 2, tty) as stage:
        stage("timing fused at M = 1")
    assert "(1/2)" not in tty.getvalue()  # the rich bar (transient), not log lines
    quiet = io.StringIO()
    with report.progress(False, 2, quiet) as stage:
        stage("timing fused at M = 1")
    assert quiet.getvalue() == ""


def test_quiet_autotune_silences_inductors_tables(monkeypatch):
    """Inductor's two stderr reports of max-autotune go off, unless
    DECODE_BOUNDARY_AUTOTUNE_TABLES asks for them."""
    from torch._inductor import config, select_algorithm

    from decode_boundary.bench.baselines import quiet_autotune

    monkeypatch.setattr(select_algorithm, "PRINT_AUTOTUNE", True)
    monkeypatch.setattr(config, "max_autotune_report_choices_stats", True)
    monkeypatch.setenv("DECODE_BOUNDARY_AUTOTUNE_TABLES", "1")
    quiet_autotune()
    assert select_algorithm.PRINT_AUTOTUNE and config.max_autotune_report_choices_stats
    monkeypatch.delenv("DECODE_BOUNDARY_AUTOTUNE_TABLES")
    quiet_autotune()
    assert not select_algorithm.PRINT_AUTOTUNE
    assert not config.max_autotune_report_choices_stats


@pytest.mark.parametrize(("argv", "want"), [
    ([], report.DEFAULT_BASELINES),
    (["--baselines", "all"], report.BASELINES),
    (["--baselines", "baseline", "user_step"], ("user_step", "baseline")),
])
def test_bench_runs_the_chosen_baselines_and_records_the_seconds(monkeypatch, tmp_path, argv,
                                                                 want):
    """``bench``'s plumbing on CPU (a GPU pretended, the ranks' work stubbed): the
    baselines --baselines names reach every rank, in BASELINES' order, the JSON
    names them, and it records the ranks' seconds and the command's total."""
    synthetic = _synthetic_bench()
    seconds = {"precompile": 2.0, "first_call": {"user_step": {"1": 30.0}}, "verify": 40.0,
               "timing": {"fused": 3.0}, "breakdown": 1.0, "mixes": 5.0}
    specs = []

    def fake_launch(fn, tp, args, timeout_s):
        specs.append(args[0])
        keys = ("verify", "copy_rate_gbps", "floor_us", "weight_copies", "timings",
                "breakdown")
        rank = {k: synthetic[k] for k in keys}
        rank.update(hop_us=0.0, transport="mailbox", seconds=seconds,
                    mixes={"collapse": "previous", "rows": []})
        return {0: rank}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cli, "launch", fake_launch)
    monkeypatch.setattr(report, "environment", lambda interpreter, pairs: synthetic["environment"])
    assert cli.main(["bench", "--tp-shapes", "4", "--rows", "1", "8", "--out", str(tmp_path),
                     *argv]) == 0
    (spec,) = specs
    assert spec.baselines == want and spec.rows == (1, 8) and spec.tp_shapes == 4
    data = json.loads((tmp_path / "bench-v4.1-flash-tp4-shapes-1gpu.json").read_text())
    assert data["config"]["baselines"] == list(want)
    assert {k: v for k, v in data["seconds"].items() if k != "total"} == seconds
    assert 0 < data["seconds"]["total"] < 60


def test_a_named_commit_is_clean_unless_said(monkeypatch):
    """A copied tree names its commit; its (stale) .git must not mark results dirty."""
    from decode_boundary.bench import report
    monkeypatch.setenv("DECODE_BOUNDARY_COMMIT", "abc1234")
    monkeypatch.delenv("DECODE_BOUNDARY_DIRTY", raising=False)
    assert report.git_dirty() is False
    monkeypatch.setenv("DECODE_BOUNDARY_DIRTY", "1")
    assert report.git_dirty() is True
