# ruff: noqa: B023  (closures are called inside the loop iteration that defines them)
"""Tactic sweep of the MXFP8 GEMM on one GPU: what ``tactics.TABLE`` is pinned from.

Per shape (the DSV4.1-Flash TP-4 projections, grouped wo_a, V4-Pro wo_b, wo_b
at TP 2, V4-Flash wo_b) and row bucket: every candidate tactic that compiles
without spills is checked against the FP64 bar (reference.check_mxfp8_mm's
bound, computed once per problem), then timed like benchmarks/gemm.py (CUDA
graph of back-to-back calls on rotated weight copies, cold L2, medians).
CUDA-core tiles (rows 1..8) and tensor-core tiles (16/32/64, also timed at 8
rows) compete; the winner of each bucket is re-timed with BF16 input
(quantized in the prologue). Also a pure read of the same bytes (1-D chunks,
16-byte loads) per shape, the floor any GEMM structure is measured against.

Kernels compile up front in worker processes (Triton's disk cache), so the
timing loop only loads them. Writes JSON (every timing) and prints the
winners as ``TABLE`` entries to paste into decode_boundary/gemm/tactics.py.

    PYTHONPATH=. python benchmarks/gemm_sweep.py [--shapes wo_b,wq_b] [--budget 420]
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import datetime
import functools
import multiprocessing
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from decode_boundary.bench.gemm import time_cublas_bf16
from decode_boundary.bench.report import git_commit, write_json
from decode_boundary.common.timing import copy_rate, graph_time_us, rotated_copies
from decode_boundary.gemm.launcher import launch_low_latency, warmup_low_latency
from decode_boundary.gemm.reference import REL_SUM_TOLERANCE, bf16_ulp, mxfp8_mm_exact
from decode_boundary.gemm.tactics import DOT_TILES, Tactic, fits
from decode_boundary.mxfp8.format import mxfp8_scale_bytes, quantize_mxfp8_ref

SHAPES = {  # name: (N, K, groups)
    "wo_b": (5120, 2048, 1),
    "wq_b": (8192, 1280, 1),
    "fused_wqa_wkv": (1792, 5120, 1),
    "wo_a": (2048, 4096, 2),
    "v4pro_wo_b": (7168, 4096, 1),
    "wo_b_tp2": (5120, 4096, 1),
    "v4flash_wo_b": (4096, 2048, 1),
}
# rows tile -> the row counts it is timed at (its bucket's largest; 16 also at 8)
TIMED_ROWS = {1: (1,), 2: (2,), 4: (4,), 16: (4, 8, 16), 32: (32,), 64: (48, 64)}
BF16_TOP = 4  # per bucket <= 16, the fastest MXFP8-in tactics re-timed with BF16 in
DEFAULT_SHAPES = "wo_b,wq_b,fused_wqa_wkv,wo_a,v4pro_wo_b"


def _splits(k: int, lo: int, hi: int) -> list[int]:
    """Split-K counts whose K-slice is lo..hi elements."""
    return [sp for sp in range(1, 17) if lo <= -(-(k // 32) // sp) * 32 <= hi]


def candidates(n: int, k: int, groups: int) -> list[Tactic]:
    """CUDA-core tiles (1..4 rows), and tensor-core tiles with the warps their
    MMA wants (BLOCK_N >= 64: wgmma) over K-slices of 128..1024."""
    out = []
    for rows in (1, 2, 4):
        for block_n in (4, 8, 16) if rows <= 2 else (4, 8):
            for split in (1, 2):
                for warps in (2, 4) if rows <= 2 else (4, 8):
                    for chunk in (256, 512, 1024):
                        out.append(Tactic(block_n, rows, split, warps, chunk))
    for rows in DOT_TILES:
        pairs = ((32, 4), (64, 4), (128, 8)) if rows == 16 else ((64, 4), (128, 8), (256, 8))
        for block_n, warps in pairs:
            for split in _splits(k, 128, 1024):
                for chunk in (64, 128):
                    out.append(Tactic(block_n, rows, split, warps, chunk))
    return [t for t in dict.fromkeys(out) if fits(t, n, k, groups)]


def layer_like(n: int, k: int, groups: int, device="cuda"):
    return SimpleNamespace(weight=torch.zeros(n, k, dtype=torch.float8_e4m3fn, device=device).t(),
                           weight_scale=torch.zeros(mxfp8_scale_bytes(n, k), dtype=torch.uint8,
                                                    device=device),
                           bias=None, groups=groups)


def _compile_jobs(jobs):
    """Worker: compile kernels into Triton's disk cache; return the spill-free ones."""
    ok = []
    for n, k, groups, tactic, bf16 in jobs:
        try:
            kernel = warmup_low_latency(layer_like(n, k, groups), tactic.rows_tile, tactic,
                                        bf16_input=bf16)
            kernel._init_handles()
            if kernel.n_spills == 0:
                ok.append((n, k, groups, tuple(tactic), bf16))
        except Exception as exc:  # noqa: BLE001
            print(f"compile {n}x{k}x{groups} {tuple(tactic)} failed: {exc!r}"[:300], flush=True)
    return ok


def precompile_all(jobs, workers: int) -> set:
    t0 = time.time()
    chunks = [jobs[i::workers] for i in range(workers) if jobs[i::workers]]
    ctx = multiprocessing.get_context("spawn")
    with futures.ProcessPoolExecutor(len(chunks), mp_context=ctx) as pool:
        ok = {tuple(j) for part in pool.map(_compile_jobs, chunks) for j in part}
    print(f"[compiled {len(jobs)} kernels, {len(ok)} spill-free, in {time.time() - t0:.0f} s]",
          flush=True)
    return ok


@triton.jit
def read_chunks_kernel(w_ptr, sink_ptr, CHUNK_WORDS: tl.constexpr, SUB: tl.constexpr):
    """Program p reads int32 words [p * CHUNK_WORDS, (p + 1) * CHUNK_WORDS),
    one 16-byte load per thread per step, every step unrolled (all in flight)."""
    pid = tl.program_id(0)
    base = w_ptr + pid.to(tl.int64) * CHUNK_WORDS + tl.arange(0, SUB)
    acc = tl.zeros((SUB,), dtype=tl.int32)
    for i in tl.static_range(CHUNK_WORDS // SUB):
        acc ^= tl.load(base + i * SUB)
    tl.store(sink_ptr + pid, tl.max(acc, 0))


def read_floor_us(copies, n: int, k: int) -> tuple[float, str]:
    """Best pure read of the weight's e4m3 bytes over a few chunk sizes / warps."""
    words = [c.weight.t().view(torch.int32) for c in copies]
    sink = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    best = (float("inf"), "")
    for chunk_kb in (8, 16, 32):
        for warps in (4, 8):
            chunk = chunk_kb << 10
            if (n * k) % chunk:
                continue
            launch = lambda w: read_chunks_kernel[(n * k // chunk,)](
                w, sink, CHUNK_WORDS=chunk // 4, SUB=warps * 128, num_warps=warps)
            t = graph_time_us([functools.partial(launch, w) for w in words])
            best = min(best, (t, f"{chunk_kb} KB x {warps} warps"))
    return best


class Problem:
    """A shape's weight, rotated copies, and per-M inputs with their FP64 bounds."""

    def __init__(self, n: int, k: int, groups: int):
        self.n, self.k, self.groups = n, k, groups
        qw = quantize_mxfp8_ref(torch.randn(n, k, device="cuda") * 0.02)
        self.layer = SimpleNamespace(weight=qw.data.t(), weight_scale=qw.scale, bias=None,
                                     groups=groups)
        self.copies = rotated_copies(self.layer)
        self.bytes = n * k + qw.scale.numel()
        self.inputs = {}

    def input(self, rows: int):
        if rows not in self.inputs:
            x = torch.randn(rows, self.groups * self.k, device="cuda").bfloat16()
            qa = quantize_mxfp8_ref(x)
            exact, abs_sum = mxfp8_mm_exact(qa, self.layer.weight, self.layer.weight_scale,
                                            self.groups)
            bound = bf16_ulp(exact) + REL_SUM_TOLERANCE * abs_sum
            out = torch.empty(rows, self.n, dtype=torch.bfloat16, device="cuda")
            self.inputs[rows] = (x, qa, exact, bound, out)
        return self.inputs[rows]

    def time(self, rows: int, tactic: Tactic, bf16: bool) -> float:
        x, qa, exact, bound, out = self.input(rows)
        a = x if bf16 else qa
        out.fill_(float("nan"))
        launch_low_latency(self.layer, a, out, tactic)
        excess = (out.double() - exact).abs() - bound
        if not bool((excess <= 0).all()):
            raise AssertionError(f"{tuple(tactic)} M={rows}: {int((excess > 0).sum())} "
                                 "elements out of bound")
        return graph_time_us([functools.partial(launch_low_latency, c, a, out, tactic)
                              for c in self.copies])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"of {','.join(SHAPES)}")
    parser.add_argument("--budget", type=float, default=420, help="seconds for the timing loop")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    names = args.shapes.split(",")
    torch.manual_seed(0)
    jobs = [(*SHAPES[name], t, False) for name in names for t in candidates(*SHAPES[name])]
    ok = precompile_all(jobs, args.workers)
    rate = copy_rate() / 1e9
    deadline = time.time() + args.budget
    report = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=triton.__version__, commit=git_commit(),
                  command=" ".join([sys.executable, *sys.argv]), copy_rate_gbs=rate, shapes={})
    winners, bf16_winners = {}, {}
    for name in names:
        n, k, groups = SHAPES[name]
        p = Problem(n, k, groups)
        read_us, read_how = read_floor_us(p.copies, n, k)
        entry = dict(n=n, k=k, groups=groups, floor_us=p.bytes / (rate * 1e3), read_us=read_us,
                     read_structure=read_how, timings=[], cublas_bf16_us={}, best={})
        ranked = {}  # bucket -> [(us, tactic)]
        for job in jobs:
            if job[:3] != (n, k, groups) or (n, k, groups, tuple(job[3]), False) not in ok:
                continue
            tactic = job[3]
            for rows in TIMED_ROWS[tactic.rows_tile]:
                if time.time() > deadline:
                    break
                us = p.time(rows, tactic, False)
                entry["timings"].append(dict(rows=rows, tactic=tuple(tactic), us=us))
                ranked.setdefault(rows, []).append((us, tactic))
        for rows in sorted(ranked):
            entry["cublas_bf16_us"][rows] = time_cublas_bf16(
                torch.randn(groups, rows, k, device="cuda").bfloat16(),
                torch.randn(groups, n // groups, k, device="cuda").bfloat16())
            top = sorted(ranked[rows])
            us, tactic = top[0]
            bf16 = []
            if rows <= 16:
                for _, t in top[:BF16_TOP]:
                    bf16.append((p.time(rows, t, True), t))
                    entry["timings"].append(dict(rows=rows, tactic=tuple(t), us=bf16[-1][0],
                                                 bf16_input=True))
            bf16_us, bf16_tactic = min(bf16) if bf16 else (None, None)
            entry["best"][rows] = dict(tactic=tuple(tactic), us=us, bf16_input_us=bf16_us,
                                       bf16_tactic=bf16_tactic and tuple(bf16_tactic))
            print(f"{name:14s} M={rows:2d} best {us:6.2f} us {tuple(tactic)}; bf16 in "
                  f"{bf16_us or 0:6.2f} {bf16_tactic and tuple(bf16_tactic)}; floor "
                  f"{entry['floor_us']:5.2f} read {read_us:5.2f} "
                  f"cuBLAS {entry['cublas_bf16_us'][rows]:6.2f}", flush=True)
            winners.setdefault((n, k, groups), {})[rows] = tactic
            if bf16_tactic:
                bf16_winners.setdefault((n, k, groups), {})[rows] = bf16_tactic
        report["shapes"][name] = entry
    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M")
    path = os.path.join(args.out, f"gemm_sweep-{report['gpu'].replace(' ', '_')}-{stamp}.json")
    write_json(report, Path(path))
    print(f"\ncopy rate {rate:.0f} GB/s; {path}")
    # One TABLE serves both input kinds (tactics.py): buckets <= 16 of the shapes the
    # chain feeds BF16 take the BF16-in winners, everything else the MXFP8-in ones.
    for title, tables in (("TABLE (MXFP8-in winners)", winners),
                          ("BF16-in winners (TABLE buckets <= 16 of BF16-fed shapes)",
                           bf16_winners)):
        print(f"{title} entries:")
        for shape, table in tables.items():
            body = ", ".join(f"{rows}: _t{tuple(t)}" for rows, t in table.items())
            print(f"    {shape}: {{{body}}},")


if __name__ == "__main__":
    main()
