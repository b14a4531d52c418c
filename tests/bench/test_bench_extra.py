"""The ``[bench]`` extra (rich, matplotlib) is only for the CLI's tables and
plots: in a process where neither can be imported, the package, its MXFP8 GEMM
and its all-reduce still import and compute, and the CLI says in one line
which extra to install."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Runs in a fresh interpreter: a meta-path finder refuses rich and matplotlib
# (as if not installed), then the API is used as a user without the extra would.
SCRIPT = r'''
import sys

BLOCKED = ("rich", "matplotlib")


class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Blocker())
for name in list(sys.modules):
    if name.split(".")[0] in BLOCKED:
        del sys.modules[name]

import torch

import decode_boundary
from decode_boundary import Mxfp8Linear, dequantize_mxfp8, mxfp8_mm, quantize_mxfp8
from decode_boundary.boundary.all_reduce import BoundaryAllReduce  # noqa: F401
from decode_boundary.bench import report

gen = torch.Generator().manual_seed(int(sys.argv[1]))
layer = Mxfp8Linear.from_float(torch.randn(64, 256, generator=gen))
x = torch.randn(3, 256, generator=gen).bfloat16()
q = quantize_mxfp8(x)
got = mxfp8_mm(layer, q)
# FP64 product of the dequantized operands: ours differs by the BF16 rounding of the output.
want = dequantize_mxfp8(q).double() @ layer.dequantized_weight().double().t()
err = ((got.double() - want).abs() / (want.abs() + 1e-3)).max().item()
assert got.shape == (3, 64) and err <= 2 ** -7, err
assert report.new_result("gemm", "x", {}, {})["kind"] == "gemm"  # the schema needs no extra
assert not any(n.split(".")[0] in BLOCKED for n in sys.modules), "an extra was imported"

from decode_boundary import cli

code = cli.main(["verify", "--rows", "1"])
print("exit", code)
sys.stderr.flush()
print("---", file=sys.stderr, flush=True)
code = cli.main(["tune"])  # prints plain lines: no extra asked for (no GPU here: exit 2)
print("tune exit", code)
'''


def test_api_works_without_the_bench_extra():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(int.from_bytes(os.urandom(2)))],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-2:] == ["exit 2", "tune exit 2"]
    verify_err, tune_err = (part.strip().splitlines() for part in done.stderr.split("---\n"))
    err = verify_err
    assert len(err) == 1 and "decode-boundary[bench]" in err[0] and "rich" in err[0], err
    assert len(tune_err) == 1 and "no CUDA GPU" in tune_err[0], tune_err
