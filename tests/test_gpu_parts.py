"""scripts/gpu_tests.sh runs the GPU suite in named parts, each within one
device session: together the parts must run every gpu / multigpu test
exactly once (a new GPU test file in no part would never run)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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
    """What ``pytest FILES -k EXPR`` keeps of ``nodes`` for the two forms the
    parts use: a name, or ``not`` a name (checked below)."""
    negate, _, name = expr.rpartition(" ")
    assert expr == "" or (negate in ("", "not") and re.fullmatch(r"\w+", name)), expr
    kept = {n for n in nodes if n.split("::")[0] in files}
    if expr:
        kept = {n for n in kept if (name in n.split("::", 1)[1]) != (negate == "not")}
    return kept


@pytest.fixture(scope="module")
def every() -> set[str]:
    """Every gpu / multigpu test of the suite (one collection, in a subprocess)."""
    return _collect(sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                    "no:cacheprovider", "-m", MARKS, "tests")


def test_every_gpu_test_runs_in_exactly_one_part(every):
    parts = _parts()
    assert {"gemm", "exhaustive", "boundary", "mixes", "chain", "compile"} <= set(parts)
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


def test_the_script_runs_what_its_list_says(tmp_path, every):
    """The script's own pytest call for a part (collect-only) selects the tests
    its ``--list`` line names: the arguments reach pytest as listed, and its
    output lands in the part's log."""
    files, expr = _parts()["exhaustive"]
    env = {**os.environ, "PYTHON": sys.executable, "GPU_TESTS_LOG_DIR": str(tmp_path)}
    got = _collect("bash", str(SCRIPT), "exhaustive", "--collect-only", "-p",
                   "no:cacheprovider", env=env)
    assert got and got == _selected(every, files, expr)
    assert _node_ids((tmp_path / "gpu-tests-exhaustive.log").read_text()) == got


def test_unknown_part_is_refused():
    done = subprocess.run(["bash", str(SCRIPT), "gmm"], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 2 and "unknown part 'gmm'" in done.stderr
