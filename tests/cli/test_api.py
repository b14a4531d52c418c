"""The package face and its layering: the user's names import from the top
level (lazily: no Triton on `import decode_boundary`), and every module imports
only layers below its own (docs/CONTRACTS.md)."""

import ast
import subprocess
import sys
from pathlib import Path

import decode_boundary

PACKAGE = Path(decode_boundary.__file__).parent
# Layer of each module path prefix (lower imports nothing higher).
LAYERS = [("mxfp8/format.py", 0), ("env.py", 0), ("common/", 1), ("mxfp8/", 2), ("mixes/", 2),
          ("gemm/", 3), ("boundary/", 3), ("publishing_linear.py", 4),
          ("model/", 5), ("bench/", 6), ("cli.py", 7)]


def layer_of(rel: str) -> int:
    for prefix, layer in LAYERS:
        if rel.startswith(prefix) or rel == prefix:
            return layer
    raise AssertionError(f"{rel} has no layer in this test's table")


def imported_modules(path: Path) -> set[str]:
    """decode_boundary modules ``path`` imports (absolute or relative, at any depth)."""
    tree = ast.parse(path.read_text())
    package = ".".join(["decode_boundary", *path.relative_to(PACKAGE).parent.parts])
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            if not node.level:
                out.add(node.module or "")
            elif node.module:
                out.add(f"{base}.{node.module}")
            else:  # "from . import x": each x may be a module
                out.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("decode_boundary.")}


def module_file(module: str) -> str | None:
    rel = Path(*module.split(".")[1:])
    for candidate in (rel.with_suffix(".py"), rel / "__init__.py"):
        if (PACKAGE / candidate).exists():
            return candidate.as_posix()
    return None


def test_every_module_imports_only_lower_layers():
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "__init__.py":
            continue
        own = layer_of(rel)
        for module in imported_modules(path):
            target = module_file(module)
            if target is None or target.endswith("__init__.py") and target != "gemm/__init__.py":
                continue
            same_package = rel.split("/")[0] == target.split("/")[0] and "/" in rel
            assert same_package or layer_of(target) < own, f"{rel} imports {target}"
        if rel.startswith("boundary/"):
            assert not any(m.startswith("decode_boundary.gemm")
                           for m in imported_modules(path)), rel
        if rel.startswith("gemm/"):
            assert not any(m.startswith("decode_boundary.boundary")
                           for m in imported_modules(path)), rel


def test_no_test_code_in_the_package():
    assert not list(PACKAGE.rglob("*gpu_checks*")) and not list(PACKAGE.rglob("test_*.py"))


def test_top_level_names_load_lazily_and_resolve():
    code = ("import sys, decode_boundary as db; assert 'triton' not in sys.modules; "
            "names = [getattr(db, n) for n in db.__all__]; "
            "assert db.mxfp8_mm.__module__ == 'decode_boundary.gemm.api'; "
            "assert db.BoundaryAllReduce.__name__ == 'BoundaryAllReduce'; print(len(names))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin",
                                          "PYTHONPATH": str(PACKAGE.parent)})
    assert int(out.stdout) == len(decode_boundary.__all__)
    for name in ("BoundaryAllReduce", "PublishingMxfp8Linear", "Mxfp8Linear",
                 "QuantizedActivation", "quantize_mxfp8", "dequantize_mxfp8", "mxfp8_mm",
                 "AttentionBoundary"):
        assert name in decode_boundary.__all__


def test_dir_shows_the_user_names_once():
    """``dir(decode_boundary)`` lists the dozen user names and ``__version__``,
    each once, before and after they load; no helper of the package file
    (``annotations``, ``importlib``, ``env``) is listed."""
    code = ("import decode_boundary as db; before = dir(db); "
            "[getattr(db, n) for n in db.__all__]; after = dir(db); "
            "assert before == after == sorted({*db.__all__, '__version__'}), (before, after); "
            "assert len(after) == len(set(after)) == len(db.__all__) + 1; "
            "assert not {'annotations', 'importlib', 'env'} & set(after)")
    subprocess.run([sys.executable, "-c", code], check=True)
