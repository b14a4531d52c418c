"""The documentation stands alone and matches the checkout.

* Every repository path that README.md or docs/*.md names (inside backticks or as a
  markdown link target) exists: written repo-relative, relative to the naming
  document, relative to the package (``gemm/tactics.py``), or, for a bare file name,
  somewhere in the checkout. URLs, globs and placeholders (``*``, ``<gpu>``, ``{a,b}``)
  are not paths and are skipped.
* No file of the docs, the package, the benchmarks, the scripts or the tests points
  at documents a reader cannot open: the design document is cited only as
  ``docs/DESIGN.md``, and there are no references to internal tracker numbers, to the
  original system's source documents, or to machine-specific absolute paths.
* The README's API tables match the package: the user-facing table lists exactly
  ``decode_boundary.__all__``, and every name of the expert table imports from the
  module it is listed under.
"""

import importlib
import os
import re
from pathlib import Path

import decode_boundary

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "decode_boundary"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", ".pytest_cache", ".ruff_cache",
             "node_modules", "build", "dist"}
PATH_SUFFIXES = (".py", ".md", ".sh", ".json")
# A path-like token: name segments separated by "/", optionally a trailing "/". Segments
# start with a letter, "_" or "." (so formulas such as K/32 are not paths), and no
# glob or placeholder character is allowed (those are examples, not files).
PATH_TOKEN = re.compile(r"^\.?[A-Za-z_][\w.-]*(?:/\.?[A-Za-z_][\w.-]*)*/?$")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")

# What a stand-alone file must not mention (case-insensitive). Written so that this
# file does not match itself.
FORBIDDEN = {
    "the design notes other than as docs/DESIGN.md": re.compile(r"(?<!docs/)\bdesign\.md", re.I),
    "the original system's source folder": re.compile(r"\bseeds[/]", re.I),
    "a numbered source document": re.compile(r"\bseeds?\s+0\d\d\b", re.I),
    "a tracker number": re.compile(r"\bissues?\s*#?\d+", re.I),
    "a machine-specific path": re.compile(r"(?<![\w.~-])/(?:work|home|Users)/"),
}


def _repo_files() -> dict[str, list[Path]]:
    """Every file and directory of the checkout by name (outside caches and venvs)."""
    by_name: dict[str, list[Path]] = {}
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for name in [*filenames, *dirnames]:
            by_name.setdefault(name, []).append(Path(dirpath) / name)
    return by_name


def named_paths(text: str) -> list[str]:
    """Path-like tokens of code spans and link targets outside fenced blocks."""
    text = FENCE.sub("", text)
    tokens = []
    for span in CODE_SPAN.findall(text):
        tokens.extend(span.split())
    for target in LINK.findall(text):
        if "://" in target or target.startswith(("#", "mailto:")):
            continue
        tokens.append(target.split("#")[0])
    out = []
    for token in tokens:
        token = token.strip(",;:")
        if PATH_TOKEN.match(token) and ("/" in token or token.endswith(PATH_SUFFIXES)):
            out.append(token)
    return out


def resolves(token: str, doc: Path, by_name: dict[str, list[Path]]) -> bool:
    rel = token.rstrip("/")
    if any((base / rel).exists() for base in (ROOT, doc.parent, PACKAGE)):
        return True
    return "/" not in rel and rel in by_name


def test_every_path_the_docs_name_exists():
    by_name = _repo_files()
    missing = []
    for doc in DOCS:
        for token in named_paths(doc.read_text()):
            if not resolves(token, doc, by_name):
                missing.append(f"{doc.relative_to(ROOT)}: {token}")
    assert not missing, "paths named in the docs that the checkout lacks:\n" + "\n".join(missing)


def test_path_extraction():
    text = ("See `decode_boundary/gemm/tactics.py`, `env.py`, [notes](benchmarks/NOTES.md#x), "
            "[site](https://example.com/a.md), `results/gemm-<gpu>.json`, `results/*.json`, "
            "`K/32`, `amax / 448`, `python benchmarks/gemm.py --quick`, `torch.compile`.\n"
            "```bash\npython fenced/only.py\n```\n")
    assert named_paths(text) == ["decode_boundary/gemm/tactics.py", "env.py", "benchmarks/gemm.py",
                                 "benchmarks/NOTES.md"]


def _stand_alone_files() -> list[Path]:
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"),
             *(ROOT / "benchmarks").glob("*.py"), *(ROOT / "benchmarks").glob("*.md"),
             ROOT / "benchmarks" / "results" / "README.md",
             *(p for p in (ROOT / "scripts").glob("*") if p.is_file())]
    for folder in (PACKAGE, ROOT / "tests"):
        files.extend(p for p in folder.rglob("*") if p.suffix in (".py", ".md")
                     and "__pycache__" not in p.parts)
    return sorted(set(files))


def test_no_references_a_reader_cannot_follow():
    found = []
    for path in _stand_alone_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for what, pattern in FORBIDDEN.items():
                if pattern.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {what}: {line.strip()}")
    assert not found, "references outside the repository:\n" + "\n".join(found)


def test_forbidden_patterns():
    def hits(line):
        return [what for what, pattern in FORBIDDEN.items() if pattern.search(line)]

    for ok in ("see docs/DESIGN.md §4", "torch.manual_seed(0)", "seed=3", "issue-bound",
               "PATH=/usr/bin:/bin"):
        assert not hits(ok), ok
    for bad in ("design" ".md §4", "Design" ".md", "the " "seeds" "/ folder", "seed " "004",
                "Issue " "11", "issue #" "3", "/" "work/venv/bin/python"):
        assert hits(bad), bad


def _readme_tables() -> tuple[list[list[str]], list[list[str]]]:
    """Rows (cells) of the first two tables of the README's API section."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## API\n", 1)[1].split("\n## ", 1)[0]
    tables, current = [], None
    for line in section.splitlines():
        if line.startswith("|"):
            if current is None:
                current = []
                tables.append(current)
            current.append([c.strip() for c in line.strip("|").split("|")])
        else:
            current = None
    assert len(tables) >= 2, "the API section needs a user table and an expert table"
    return tables[0][2:], tables[1][2:]  # without header and separator rows


def _leading_name(cell: str) -> str:
    return re.match(r"`([A-Za-z_]\w*)", cell).group(1)


def test_readme_api_tables_match_the_package():
    users, experts = _readme_tables()
    assert sorted(_leading_name(row[0]) for row in users) == sorted(decode_boundary.__all__)
    for row in experts:
        module = importlib.import_module(row[0].strip("`"))
        for name in re.findall(r"`([A-Za-z_]\w*)(?:\(\))?`", row[1]):
            assert hasattr(module, name), f"{name} is not in {module.__name__}"


# History a package file must not carry: its code and docstrings hold contracts and
# reasons; what was tried and measured lives in git and docs/EXPERIMENTS.md. Written
# so that this file does not match itself.
HISTORY = {
    "an experiment number": re.compile(r"\b(?:item|attempt)s? \d+", re.I),
    "a commit hash": re.compile(r"(?<![\w.])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?!\w)"),
    "a time in microseconds": re.compile(r"\d(?:\.\d+)?\s*(?:µs|us)\b"),
}


def history_in(text: str) -> list[str]:
    """(what, line) of every line of ``text`` that carries history."""
    return [f"{what}: {line.strip()}" for line in text.splitlines()
            for what, pattern in HISTORY.items() if pattern.search(line)]


def test_history_patterns():
    assert history_in("measured in NOTES " + "item" + " 21, 15.9 vs 16.3 us per step")
    assert history_in("# attempt" + " 18: 40.4 -> 33.4 " + "µs")
    assert history_in("bench at " + "b4bea" + "60")
    assert not history_in("SENTINEL_BITS = -32768  # 0x8000; hc_eps = 1e-6; e4m3fn; mul.rn")
    assert not history_in('ax.set_ylabel("µs per boundary")  # a unit, not a measurement')


def test_no_history_in_the_package():
    """No experiment numbers, commit hashes or times in microseconds anywhere in
    the package (code, comments, docstrings)."""
    found = [f"{path.relative_to(ROOT)}: {hit}" for path in sorted(PACKAGE.rglob("*.py"))
             for hit in history_in(path.read_text())]
    assert not found, "\n".join(found)
