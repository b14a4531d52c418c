"""Every CuTe DSL kernel variant compiles for sm_90a on a machine without a GPU
(``CUTE_DSL_ARCH=sm_90a``), and its PTX holds what the schedule needs: the TMA
ring (``cp.async.bulk.tensor``), BF16 wgmma with a register A operand (one
``{...}`` register list for A, no shared-memory descriptor) that accumulates
(its scale-d predicate the constant 1), PDL's grid wait,
the split-K exchange over distributed shared memory where it splits, and no
local memory (a spill or a stack array would show as ``.local``). One
subprocess: the DSL reads the target architecture when it is imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cutlass", reason="the CuTe DSL is an optional extra (decode-boundary[hopper])")

PACKAGE = Path(__file__).resolve().parents[2]
# (N, K, groups, (warpgroups, tokens, split_k, stages)): each TP-4 shape, every tokens
# tile, every split the shapes use, one and two warpgroups.
VARIANTS = [
    (5120, 2048, 1, (2, 64, 2, 4)),
    (5120, 2048, 1, (1, 8, 1, 8)),
    (8192, 1280, 1, (1, 16, 1, 6)),
    (1792, 5120, 1, (1, 32, 4, 4)),
    (1792, 5120, 1, (2, 16, 8, 6)),
    (2048, 4096, 2, (2, 32, 2, 4)),
]

SCRIPT = r"""
import json, pathlib, re, sys
from decode_boundary.gemm.hopper import launcher
from decode_boundary.gemm.hopper.tactics import HopperTactic
launcher.COMPILE_OPTIONS += " --keep-ptx"
dump = pathlib.Path(sys.argv[1])
report = []
for n, k, g, t in json.loads(sys.argv[2]):
    launcher.compiled(n, k, g, HopperTactic(*t), True)
    (ptx,) = dump.glob("*.ptx")  # named by the shape: removed once read
    text = ptx.read_text()
    ptx.unlink()
    wgmma = [line for line in text.splitlines() if "wgmma.mma_async" in line]
    # Each wgmma's scale-d predicate (accumulate, not overwrite) is set from a register:
    # it must be the constant 1 (the atom's default, 0, kept only the last k16 step).
    flags = set(re.findall(r"setp.ne.b32 p, (%r[0-9]+), 0;\s*wgmma", text))
    accumulates = bool(flags) and all(
        re.search(r"mov.b32\s+" + re.escape(f) + r", 1;", text) for f in flags)
    report.append(dict(
        tma=text.count("cp.async.bulk.tensor"), wgmma=len(wgmma),
        bf16=all(".f32.bf16.bf16" in line for line in wgmma), accumulates=accumulates,
        a_in_registers=all(line.count("{") == 2 for line in wgmma),
        grid_wait="griddepcontrol.wait" in text, dsmem=text.count("ld.shared::cluster"),
        cluster_barrier="barrier.cluster" in text, local=text.count(".local")))
print(json.dumps(report))
"""


def test_every_variant_compiles_for_sm90a(tmp_path):
    # A cache of its own: a compile found in the DSL's file cache writes no PTX.
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_DUMP_DIR=str(tmp_path),
               CUTE_DSL_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=str(PACKAGE))
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), json.dumps(VARIANTS)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    for (n, k, g, t), r in zip(VARIANTS, report, strict=True):
        what = (n, k, g, t, r)
        assert r["tma"] > 0 and r["wgmma"] > 0 and r["bf16"] and r["a_in_registers"], what
        assert r["accumulates"], what
        assert r["grid_wait"] and r["local"] == 0, what
        split = t[2]
        assert (r["dsmem"] > 0 and r["cluster_barrier"]) == (split > 1), what
