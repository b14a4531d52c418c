# ruff: noqa: B023  (closures are called inside the loop iteration that defines them)
"""Kernel-structure experiment for the low-row MXFP8 GEMM (one H200, < 3 min).

Per shape (wo_b, fused_wqa_wkv, wq_b, wo_a, V4-Pro wo_b):

* **read**: read-only floors of two structures over the weight's e4m3 bytes
  (16-byte vector loads; a max of the XORs goes to a sink so nothing is elided):
  ``chunks`` = one program per contiguous 16-64 KB chunk, every load issued
  up front; ``rows`` = "row-owner" CTAs of BN rows x (K / split) bytes
  (contiguous when split = 1), a ``tl.range(num_stages=S)`` loop over K.
* **gemm** (M = 1, 8, 16): the shipped kernel with its table tactic against
  candidates of the new structures (``Tactic.num_stages`` >= 2: Triton's
  pipeline; block_n 16 / 32: row-owner tiles; split-K 1..8 for 128..450
  CTAs), plus one "group-dot" variant (a BF16 dot per 32-group on the
  unscaled weight, scales applied to the FP32 group result). Every variant
  meets the bar (the FP64 bound of reference.check_mxfp8_mm, computed once
  per problem) before it is timed.
* **chain** (M = 1, 8): fused_wqa_wkv -> wq_b -> wo_b back to back in one
  graph, table tactics vs the per-shape winners, with PDL (prefetch on / off)
  and without.

Kernels are compiled up front in worker processes (Triton's disk cache), so
the timing loop only loads them. Prints one table per part sorted by time,
then the winners as Tactic literals to paste into tactics.py.

    PYTHONPATH=. python benchmarks/gemm_variants.py [--parts read,gemm,chain]
        [--shapes wo_b,wq_b] [--budget 165]
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import multiprocessing
import os
import time
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from decode_boundary.gemm.api import selected_tactic
from decode_boundary.gemm.mxfp8_gemm_kernel import launch_low_latency, warmup_low_latency
from decode_boundary.gemm.reference import REL_SUM_TOLERANCE, bf16_ulp, mxfp8_mm_exact
from decode_boundary.gemm.tactics import Tactic, fits
from decode_boundary.gemm.timing import graph_time_us, rotated_copies
from decode_boundary.mxfp8.format import mxfp8_scale_bytes, quantize_mxfp8_ref, unswizzle_scales
from decode_boundary.mxfp8.quantize_kernel import swizzled_offset

SHAPES = {
    "wo_b": (5120, 2048),
    "fused_wqa_wkv": (1792, 5120),
    "wq_b": (8192, 1280),
    "wo_a": (1024, 4096),
    "v4pro_wo_b": (7168, 4096),
    "wo_b_tp2": (5120, 4096),  # DSV4.1-Flash wo_b at TP 2 (what a 2-GPU bench runs)
}
CHAIN = ("fused_wqa_wkv", "wq_b", "wo_b")
ROWS = (1, 8, 16)
HBM_TBS = 4.15  # the floor column: MXFP8 bytes (elements + scales) / this rate


# ---------------------------------------------------------------------------- read floors

@triton.jit
def read_chunks_kernel(w_ptr, sink_ptr, CHUNK_WORDS: tl.constexpr, SUB: tl.constexpr):
    """Program p reads the int32 words [p * CHUNK_WORDS, (p + 1) * CHUNK_WORDS):
    SUB words (4 per thread: one 16-byte load) per step, all steps unrolled."""
    pid = tl.program_id(0)
    base = w_ptr + pid.to(tl.int64) * CHUNK_WORDS + tl.arange(0, SUB)
    acc = tl.zeros((SUB,), dtype=tl.int32)
    for i in tl.static_range(CHUNK_WORDS // SUB):
        acc ^= tl.load(base + i * SUB)
    tl.store(sink_ptr + pid, tl.max(acc, 0))


@triton.jit
def read_rows_kernel(w_ptr, sink_ptr, K_WORDS, PER, BN: tl.constexpr, BKW: tl.constexpr,
                     STAGES: tl.constexpr):
    """CTA (n, s) reads rows [n * BN, (n + 1) * BN) x words [s * PER * BKW,
    (s + 1) * PER * BKW) of an int32 [N, K_WORDS] view, BKW words per step."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)
    base = w_ptr + rows[:, None].to(tl.int64) * K_WORDS + tl.arange(0, BKW)[None, :]
    acc = tl.zeros((BN, BKW), dtype=tl.int32)
    for it in tl.range(0, PER, num_stages=STAGES):
        acc ^= tl.load(base + (pid_k * PER + it) * BKW)
    tl.store(sink_ptr + pid_n * tl.num_programs(1) + pid_k, tl.max(tl.max(acc, 1), 0))


def read_configs(n: int, k: int):
    """(label, launch(words, sink)) of every read structure that fits (N, K)."""
    total = n * k
    out = []
    for chunk_kb in (16, 32, 64):
        for warps in (4, 8):
            chunk = chunk_kb << 10
            if total % chunk == 0:
                out.append((f"chunks {chunk_kb}KB {warps}w ({total // chunk} CTAs)",
                            lambda w, s, c=chunk, nw=warps: read_chunks_kernel[(total // c,)](
                                w, s, CHUNK_WORDS=c // 4, SUB=nw * 128, num_warps=nw)))
    for bn in (8, 16, 32, 64):
        for bk in (256, 512):
            for stages in (2, 4):
                for split in (1, 2, 4, 8):
                    ctas = n // bn * split
                    if n % bn or (k // bk) % split or not 100 <= ctas <= 640:
                        continue
                    per = k // bk // split
                    out.append((f"rows BN={bn} BK={bk} S={stages} split={split} ({ctas} CTAs)",
                                lambda w, s, bn=bn, bk=bk, st=stages, sp=split, per=per:
                                read_rows_kernel[(n // bn, sp)](w, s, k // 4, per, BN=bn,
                                                                BKW=bk // 4, STAGES=st,
                                                                num_warps=4)))
    return out


# ------------------------------------------------------------------------- group-dot GEMM

@triton.jit
def group_dot_kernel(w_ptr, ws_ptr, a_ptr, as_ptr, out_ptr, part_ptr, cnt_ptr, M,
                     N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, ROWS: tl.constexpr,
                     SPLIT: tl.constexpr, GPI: tl.constexpr, STAGES: tl.constexpr):
    """One BF16 dot per 32-group on the unscaled e4m3 weight (exact), the two
    power-of-two scales applied to the FP32 group result; ``ws_ptr`` row-major
    [N, K/32] scales. Split-K partials of real rows only, reduced in order."""
    G: tl.constexpr = K // 32
    K_TILES: tl.constexpr = (G + 3) // 4
    PER: tl.constexpr = G // SPLIT
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * BN + tl.arange(0, BN)
    rows = tl.arange(0, ROWS)
    rmask = rows < M
    e = tl.arange(0, 32)
    acc = tl.zeros((BN, ROWS), dtype=tl.float32)
    g0 = pid_k * PER
    for it in tl.range(0, PER // GPI, num_stages=STAGES):
        for j in tl.static_range(GPI):
            g = g0 + it * GPI + j
            w = tl.load(w_ptr + cols[:, None].to(tl.int64) * K + g * 32 + e[None, :])
            ws = tl.load(ws_ptr + cols * G + g)
            a = tl.load(a_ptr + rows[None, :] * K + g * 32 + e[:, None], mask=rmask[None, :],
                        other=0.0)
            sa = tl.load(as_ptr + swizzled_offset(rows, g, K_TILES), mask=rmask, other=0)
            d = tl.dot(w.to(tl.bfloat16), a.to(tl.bfloat16))
            fw = (ws.to(tl.int32) << 23).to(tl.float32, bitcast=True)
            fa = (sa.to(tl.int32) << 23).to(tl.float32, bitcast=True)
            acc += (d * fw[:, None]) * fa[None, :]
    out_off = rows[None, :] * N + cols[:, None]
    if SPLIT == 1:
        tl.store(out_ptr + out_off, acc.to(tl.bfloat16), mask=rmask[None, :])
    else:
        tile = rows[None, :] * BN + tl.arange(0, BN)[:, None]
        parts = part_ptr + (pid_n * SPLIT).to(tl.int64) * (ROWS * BN)
        tl.store(parts + pid_k * (ROWS * BN) + tile, acc, mask=rmask[None, :])
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            tl.debug_barrier()
            total = tl.load(parts + tile, mask=rmask[None, :], other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT):
                total += tl.load(parts + s * (ROWS * BN) + tile, mask=rmask[None, :], other=0.0,
                                 cache_modifier=".cg")
            tl.store(cnt_ptr + pid_n, 0)
            tl.store(out_ptr + out_off, total.to(tl.bfloat16), mask=rmask[None, :])


# ----------------------------------------------------------------------------- candidates

def _split_for(n: int, k: int, block_n: int, block_k: int, lo=128, hi=450) -> list[int]:
    """Split-K values giving lo..hi CTAs (else the one closest above lo)."""
    k_blocks = -(-k // block_k)
    ok = [s for s in (1, 2, 4, 8, 16) if s <= k_blocks and lo <= n // block_n * s <= hi]
    if not ok:
        ok = [s for s in (1, 2, 4, 8, 16) if s <= k_blocks][-1:]
    return ok[:2]


def gemm_candidates(n: int, k: int) -> list[Tactic]:
    """The table's tactic, the previous sweep's best family, and the new structures."""
    out = [selected_tactic((n, k), 1), Tactic(64, 128, 16, 4, 4, True),
           Tactic(64, 128, 16, 16, 4, True)]
    for block_n, block_k, stages in ((16, 256, 3), (16, 512, 3), (32, 256, 3), (32, 128, 4),
                                     (64, 128, 4), (64, 256, 3), (16, 256, 0), (32, 256, 0)):
        for split in _split_for(n, k, block_n, block_k):
            warps = 4 if block_n * block_k <= 64 * 128 else 8
            out.append(Tactic(block_n, block_k, 16, split, warps, True, stages))
    out += oneshot_candidates(n, k)
    seen = []
    for t in out:
        if t not in seen and fits(t, n, k):
            seen.append(t)
    return seen


def oneshot_candidates(n: int, k: int) -> list[Tactic]:
    """Each CTA issues its whole K slice at once (one or two K-blocks, the first
    before the PDL wait): one DRAM latency per CTA instead of one per block,
    which the register double-buffer of the S=0 loop serialises."""
    out = []
    for block_n in (32, 64):
        for block_k in (256, 512, 1024):
            k_blocks = -(-k // block_k)
            for per_cta in (1, 2):
                split = -(-k_blocks // per_cta)
                ctas = n // block_n * split
                if per_cta <= k_blocks and 100 <= ctas <= 1400:
                    out.append(Tactic(block_n, block_k, 16, split, 8, True, 0))
    return out


def _layer_like(n: int, k: int, device="cuda"):
    return SimpleNamespace(weight=torch.zeros(n, k, dtype=torch.float8_e4m3fn, device=device).t(),
                           weight_scale=torch.zeros(mxfp8_scale_bytes(n, k), dtype=torch.uint8,
                                                    device=device),
                           bias=None)


def _compile_jobs(jobs):
    """Worker: compile (N, K, tactic, pdl) kernels into Triton's disk cache."""
    done = 0
    for n, k, tactic, pdl in jobs:
        os.environ["DECODE_BOUNDARY_DISABLE_PDL"] = "0" if pdl else "1"
        try:
            warmup_low_latency(_layer_like(n, k), 16, tactic)
            done += 1
        except Exception as exc:  # noqa: BLE001
            print(f"compile {n}x{k} {tuple(tactic)} pdl={pdl} failed: {exc!r}"[:300], flush=True)
    return done


def precompile_all(jobs, workers: int = 12) -> None:
    t0 = time.time()
    chunks = [jobs[i::workers] for i in range(workers) if jobs[i::workers]]
    ctx = multiprocessing.get_context("spawn")
    with futures.ProcessPoolExecutor(len(chunks), mp_context=ctx) as pool:
        done = sum(pool.map(_compile_jobs, chunks))
    print(f"[precompiled {done}/{len(jobs)} kernels in {time.time() - t0:.0f} s]", flush=True)


# ---------------------------------------------------------------------------------- parts

class Problem:
    """A shape's weight (+ rotated copies) and its inputs with FP64 bounds per M."""

    def __init__(self, name: str, n: int, k: int):
        self.name, self.n, self.k = name, n, k
        qw = quantize_mxfp8_ref(torch.randn(n, k, device="cuda") * 0.02)
        self.layer = SimpleNamespace(weight=qw.data.t(), weight_scale=qw.scale, bias=None)
        self.copies = rotated_copies(self.layer)
        self.floor_us = (n * k + qw.scale.numel()) / (HBM_TBS * 1e6)
        self.inputs = {}
        for rows in ROWS:
            qa = quantize_mxfp8_ref(torch.randn(rows, k, device="cuda").bfloat16())
            exact, abs_sum = mxfp8_mm_exact(qa, self.layer.weight, self.layer.weight_scale)
            bound = bf16_ulp(exact) + REL_SUM_TOLERANCE * abs_sum
            out = torch.empty(rows, n, dtype=torch.bfloat16, device="cuda")
            self.inputs[rows] = (qa, exact, bound, out)

    def check(self, rows: int, out: torch.Tensor) -> None:
        """reference.check_mxfp8_mm's bar, with the FP64 product computed once."""
        _, exact, bound, _ = self.inputs[rows]
        excess = (out.double() - exact).abs() - bound
        if not bool((excess <= 0).all()):
            raise AssertionError(f"{int((excess > 0).sum())} elements out of bound")


def run_read(problems, deadline) -> list[tuple]:
    table = []
    for p in problems:
        words = [c.weight.t().view(torch.int32) for c in p.copies]
        sink = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
        for label, launch in read_configs(p.n, p.k):
            if time.time() > deadline:
                print("[read: budget spent]")
                return table
            t = graph_time_us(lambda i: launch(words[i], sink), len(words))
            table.append((p.name, t, p.n * p.k / t / 1e6, label))
    table.sort(key=lambda r: (r[0], r[1]))
    print(f"\n{'shape':14s} {'us':>6s} {'TB/s':>5s}  read structure (best 6 per shape)")
    for name in dict.fromkeys(r[0] for r in table):
        for r in [r for r in table if r[0] == name][:6]:
            print(f"{r[0]:14s} {r[1]:6.2f} {r[2]:5.2f}  {r[3]}")
    return table


def time_tactic(p: Problem, rows: int, tactic: Tactic) -> float:
    qa, _, _, out = p.inputs[rows]
    out.fill_(float("nan"))
    launch_low_latency(p.layer, qa, out, tactic)
    p.check(rows, out)
    return graph_time_us(lambda i: launch_low_latency(p.copies[i], qa, out, tactic),
                         len(p.copies))


def time_group_dot(p: Problem, rows: int, block_n: int, split: int) -> float:
    qa, _, _, out = p.inputs[rows]
    ws = [unswizzle_scales(c.weight_scale, p.n, p.k).contiguous() for c in p.copies]
    part = torch.empty(1 << 22, dtype=torch.float32, device="cuda")
    cnt = torch.zeros(4096, dtype=torch.int32, device="cuda")

    def call(i):
        group_dot_kernel[(p.n // block_n, split)](
            p.copies[i].weight.t(), ws[i], qa.data, qa.scale, out, part, cnt, rows,
            N=p.n, K=p.k, BN=block_n, ROWS=16, SPLIT=split, GPI=4, STAGES=3, num_warps=4)
    out.fill_(float("nan"))
    call(0)
    p.check(rows, out)
    return graph_time_us(call, len(p.copies))


def run_gemm(problems, deadline) -> dict:
    """{shape: {rows: [(us, tactic or label)]}}, printed sorted by time."""
    results = {}
    for p in problems:
        res = results[p.name] = {rows: [] for rows in ROWS}
        for tactic in gemm_candidates(p.n, p.k):
            for rows in ROWS:
                if time.time() > deadline:
                    break
                try:
                    res[rows].append((time_tactic(p, rows, tactic), tactic))
                except Exception as exc:  # noqa: BLE001
                    print(f"  {p.name} M={rows} {tuple(tactic)} failed: {exc!r}"[:300])
        block_n = 32
        split = _split_for(p.n, p.k, block_n, 128)[0]
        for rows in ROWS:
            if time.time() > deadline or (p.k // 32) % (split * 4):
                break
            try:
                res[rows].append((time_group_dot(p, rows, block_n, split),
                                  f"group-dot BN={block_n} split={split} S=3"))
            except Exception as exc:  # noqa: BLE001
                print(f"  {p.name} M={rows} group-dot failed: {exc!r}"[:300])
    table = {shape: selected_tactic(shape, 1) for shape in SHAPES.values()}
    print(f"\n{'shape':14s} {'M':>3s} {'us':>6s} {'/floor':>6s}  variant (table tactic marked *)")
    for name, res in results.items():
        floor = next(p.floor_us for p in problems if p.name == name)
        for rows, timed in res.items():
            for t, v in sorted(timed, key=lambda r: r[0])[:5]:
                mark = "*" if v == table[SHAPES[name]] else " "
                desc = v if isinstance(v, str) else _short(v)
                print(f"{name:14s} {rows:3d} {t:6.2f} {t / floor:6.2f} {mark}{desc}")
            table_t = [t for t, v in timed if v == table[SHAPES[name]]]
            if table_t:
                print(f"{name:14s} {rows:3d} {table_t[0]:6.2f} {table_t[0] / floor:6.2f} *table")
    return results


def _short(t: Tactic) -> str:
    return (f"BN={t.block_n} BK={t.block_k} split={t.split_k} {t.num_warps}w "
            f"S={t.num_stages} pf={int(t.prefetch)}")


def winners(results) -> dict:
    """Per shape: (low-batch tactic = least M=1 + M=8 time, 16-row tactic)."""
    picks = {}
    print("\n# Paste into decode_boundary/gemm/tactics.py (measured winners):")
    print("LOW_BATCH_TACTICS = {")
    for name, res in results.items():
        by = {rows: {v: t for t, v in res[rows] if isinstance(v, Tactic)} for rows in ROWS}
        both = [v for v in by[1] if v in by[8]]
        if not both:
            continue
        low = min(both, key=lambda v: by[1][v] + by[8][v])
        wide = min(by[16], key=by[16].get) if by[16] else low
        picks[name] = (low, wide)
        print(f"    {SHAPES[name]}: {low!r},  # {name}: M=1 {by[1][low]:.2f} us, "
              f"M=8 {by[8][low]:.2f} us")
    print("}\nWIDE_16_TACTICS = {")
    for name, (_, wide) in picks.items():
        t16 = dict((v, t) for t, v in results[name][16])
        print(f"    {SHAPES[name]}: {wide!r},  # {name}: M=16 {t16.get(wide, 0):.2f} us")
    print("}")
    return picks


def run_chain(problems, picks, deadline) -> None:
    by_name = {p.name: p for p in problems}
    if not all(name in by_name for name in CHAIN):
        print("[chain: needs fused_wqa_wkv, wq_b and wo_b]")
        return
    ps = [by_name[name] for name in CHAIN]
    count = min(len(p.copies) for p in ps)
    variants = {"table": [selected_tactic(SHAPES[n], 1) for n in CHAIN]}
    if all(n in picks for n in CHAIN):
        variants["winners"] = [picks[n][0] for n in CHAIN]
        variants["winners, no prefetch"] = [picks[n][0]._replace(prefetch=False) for n in CHAIN]
    rows_list = (1, 8)
    print(f"\n{'chain ' + '+'.join(CHAIN):44s} {'M':>3s} {'PDL':>7s} {'no PDL':>7s}  "
          f"(sum of singles)")
    for label, tactics in variants.items():
        for rows in rows_list:
            times = {}
            for pdl in (True, False):
                if time.time() > deadline:
                    print("[chain: budget spent]")
                    return
                os.environ["DECODE_BOUNDARY_DISABLE_PDL"] = "0" if pdl else "1"

                def chain(i):
                    for p, t in zip(ps, tactics, strict=True):
                        qa, _, _, out = p.inputs[rows]
                        launch_low_latency(p.copies[i], qa, out, t)
                times[pdl] = graph_time_us(chain, count)
            os.environ["DECODE_BOUNDARY_DISABLE_PDL"] = "0"
            print(f"{label:44s} {rows:3d} {times[True]:7.2f} {times[False]:7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="read,gemm,chain")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--budget", type=float, default=165.0, help="seconds; parts stop after")
    parser.add_argument("--workers", type=int, default=14, help="compile processes")
    args = parser.parse_args()
    start = time.time()
    deadline = start + args.budget
    parts = args.parts.split(",")
    names = args.shapes.split(",")
    torch.manual_seed(0)
    jobs = []
    if "gemm" in parts or "chain" in parts:
        for name in names:
            n, k = SHAPES[name]
            cands = gemm_candidates(n, k) if "gemm" in parts else [selected_tactic((n, k), 1)]
            jobs += [(n, k, t, True) for t in cands]
            if "chain" in parts and name in CHAIN:
                jobs += [(n, k, t, False) for t in cands]
                jobs += [(n, k, t._replace(prefetch=False), True) for t in cands]
        precompile_all(jobs, args.workers)
    problems = [Problem(name, *SHAPES[name]) for name in names]
    print(f"[{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; setup {time.time() - start:.0f} s]", flush=True)
    for p in problems:
        print(f"{p.name:14s} N={p.n} K={p.k} floor {p.floor_us:.2f} us at {HBM_TBS} TB/s")
    if "read" in parts:
        run_read(problems, deadline)
    picks = {}
    if "gemm" in parts:
        picks = winners(run_gemm(problems, deadline))
    if "chain" in parts:
        run_chain(problems, picks, deadline + 20)
    print(f"[total {time.time() - start:.0f} s]")


if __name__ == "__main__":
    main()
