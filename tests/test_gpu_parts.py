"""scripts/gpu_tests.sh runs the GPU suite in named parts, each within one
device session: together the parts must run every gpu / multigpu test
exactly once (a new GPU test file in no part would never run)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_tests.sh"
MARKS = "gpu or multigpu"


def _parts() -> dict[str, tuple[list[str], str]]:
    done = subprocess.run(["bash", str(SCRIPT), "--list"], capture_output=True, text=True,
                          check=True, timeout=30)
    parts = {}
    for line in done.stdout.splitlines():
        name, files, expr, what = line.split("|")
        assert name not in parts and what, line
        parts[name] = (files.split(), expr)
    return parts


def _node_ids(output: str) -> set[str]:
    return {line for line in output.splitlines() if "::" in line}


def _collect(*args: str, env: dict | None = None) -> set[str]:
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return _node_ids(done.stdout)


def _selected(nodes: set[str], files: list[str], expr: str) -> set[str]:
    """What ``pytest FILES -k EXPR`` keeps of ``nodes``: pytest's own -k grammar
    (names joined by and / or / not), each name matched case-insensitively
    within the test's file name or its name with parameters, as -k matches them."""
    kept = {n for n in nodes if n.split("::")[0] in files}
    if not expr:
        return kept
    rule = Expression.compile(expr)

    def keeps(node: str) -> bool:
        path, test = node.split("::", 1)
        text = f"{Path(path).name} {test}".lower()
        return rule.evaluate(lambda name, **_: name.lower() in text)

    return {n for n in kept if keeps(n)}


@pytest.fixture(scope="module")
def every() -> set[str]:
    """Every gpu / multigpu test of the suite (one collection, in a subprocess)."""
    return _collect(sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                    "no:cacheprovider", "-m", MARKS, "tests")


def test_every_gpu_test_runs_in_exactly_one_part(every):
    parts = _parts()
    assert {"gemm", "gemm-epilogues", "exhaustive", "boundary", "mixes", "chain",
            "compile"} <= set(parts)
    assert len(every) > 20  # the suite, not an empty collection
    for name, (files, _) in parts.items():
        for f in files:
            assert (REPO / f).is_file(), f"part {name}: {f} does not exist"
    owner: dict[str, str] = {}
    for name, (files, expr) in parts.items():
        chosen = _selected(every, files, expr)
        assert chosen, f"part {name} runs no GPU test"
        for node in chosen:
            assert node not in owner, f"{node} in parts {owner[node]} and {name}"
            owner[node] = name
    missing = sorted(every - set(owner))
    assert not missing, f"GPU tests in no part of scripts/gpu_tests.sh: {missing}"
    # The exhaustive tactic test is a part of its own.
    assert {n for n, p in owner.items() if p == "exhaustive"} == \
        {n for n in every if "every_pickable" in n}


@pytest.mark.parametrize("part", ["exhaustive", "gemm-epilogues"])
def test_the_script_runs_what_its_list_says(tmp_path, every, part):
    """The script's own pytest call for a part (collect-only) selects the tests
    its ``--list`` line names: the arguments reach pytest as listed (a -k of one
    name, and one of several joined by or), and its output lands in the part's log."""
    files, expr = _parts()[part]
    env = {**os.environ, "PYTHON": sys.executable, "GPU_TESTS_LOG_DIR": str(tmp_path)}
    got = _collect("bash", str(SCRIPT), part, "--collect-only", "-p",
                   "no:cacheprovider", env=env)
    assert got and got == _selected(every, files, expr)
    assert _node_ids((tmp_path / f"gpu-tests-{part}.log").read_text()) == got


def test_no_cuda_device_is_refused_in_one_line(tmp_path):
    """Without a CUDA device the suite would skip every test and read as a pass:
    the script refuses (exit 2, one line naming the cause) and writes no log."""
    env = {**os.environ, "PYTHON": sys.executable, "GPU_TESTS_LOG_DIR": str(tmp_path),
           "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(["bash", str(SCRIPT), "gemm"], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert "no CUDA device is visible" in line and done.stdout == ""
    assert not any(tmp_path.iterdir())


def test_logs_go_to_an_ignored_folder():
    """A part's log by default lands where git ignores it, not among the
    committed results."""
    text = SCRIPT.read_text()
    folder = re.search(r"GPU_TESTS_LOG_DIR:-([^}]+)}", text).group(1)
    done = subprocess.run(["git", "check-ignore", "-q", f"{folder}/gpu-tests-gemm.log"],
                          cwd=REPO, timeout=30)
    assert done.returncode == 0, f"{folder} is not ignored by git"
    assert not folder.startswith("benchmarks")


def test_unknown_part_is_refused():
    done = subprocess.run(["bash", str(SCRIPT), "gmm"], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 2 and "unknown part 'gmm'" in done.stderr
