"""Boundary all-reduce on 2 GPUs: ours (publish + fused consumer: mHC, RMSNorm,
MXFP8) against (a) NCCL all-reduce + the same mHC/norm/quant in torch ops,
(b) torch symmetric-memory ``one_shot_all_reduce`` alone, (c) NCCL alone,
(d) our two kernels as a plain sum (mHC/norm/quant off).

Per (hidden, M, path): a CUDA graph of CALLS back-to-back calls, replayed
REPS times between barriers, timed with CUDA events; the per-call time is the
median replay / CALLS (rank 0's numbers; ranks run in lock step). Writes
``benchmarks/results/allreduce[-sweep]-<gpu>.json``, a stable name each run
overwrites (``--out`` for another folder), and prints a table.

    PYTHONPATH=. python benchmarks/allreduce.py            # spawns 2 ranks
    PYTHONPATH=. torchrun --nproc-per-node 2 benchmarks/allreduce.py

``--sweep``: ours (full + MXFP8) and the plain sum for H = 5120, M in {1, 8, 16,
32, 64} over the consumer tactics of ``SWEEP_TACTICS`` (< 2 minutes), to re-pin
``CONSUMER_TACTICS`` in ``decode_boundary/boundary/consumer_tactics.py``;
``--tactics 512x4 8192x32 1024x4s`` and ``--m`` choose others.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import sys

import torch
import torch.distributed as dist
import triton

from decode_boundary.bench.launch import RankContext, launch
from decode_boundary.bench.report import git_commit
from decode_boundary.bench.timing import graph_time_us
from decode_boundary.boundary.all_reduce import BoundaryAllReduce
from decode_boundary.boundary.consumer_tactics import ConsumerTactic
from decode_boundary.boundary.reference import consumer_ref
from decode_boundary.env import disable_multicast
from decode_boundary.mxfp8.format import mxfp8_scale_bytes

HIDDENS = (5120, 4096, 7168)
MS = (1, 2, 4, 8, 16, 32, 48, 64)
HC, TOP_K, EPS, CAPACITY = 4, 6, 1e-6, 64
CALLS, REPS = 50, 15
PATHS = ("ours", "a_nccl_torch_mhc", "b_symm_one_shot", "c_nccl", "d_plain")
SWEEP_HIDDEN, SWEEP_MS = 5120, (1, 8, 16, 32, 64)
SWEEP_TACTICS = tuple(ConsumerTactic(*t) for t in (
    (256, 2, True), (256, 4, True), (256, 8, True), (512, 2, True), (512, 4, True),
    (512, 8, True), (1024, 4, True), (1024, 8, True), (1024, 4, False)))


def _time_graph(fn, device, group) -> float:
    """Median µs per call of ``fn`` over REPS replays of a graph of CALLS calls,
    ranks barriered before each replay."""
    return graph_time_us([fn], device, group, min_calls=CALLS, replays=REPS)


def _cases(ar, symm, gamma, m, hidden, device, group) -> dict:
    """The five paths for one (hidden, M), as zero-argument calls."""
    x = torch.randn(m, hidden, device=device).bfloat16()
    residual = torch.randn(m, HC, hidden, device=device).bfloat16()
    post = torch.rand(m, HC, device=device)
    comb = torch.rand(m, HC, HC, device=device)
    pre = torch.rand(m, HC, device=device)
    q = (torch.empty(m, hidden, dtype=torch.float8_e4m3fn, device=device),
         torch.zeros(mxfp8_scale_bytes(m, hidden), dtype=torch.uint8, device=device))
    nccl_buf = x.clone()
    sym = symm[: m * hidden].view(m, hidden)
    sym.copy_(x)

    def baseline():
        dist.all_reduce(nccl_buf, group=group)
        consumer_ref([nccl_buf], residual, post, comb, pre, gamma, EPS, quantize=True)

    return {
        "ours": lambda: ar(x, residual=residual, post=post, comb=comb, pre=pre, norm_weight=gamma,
                           norm_eps=EPS, mxfp8_out=q),
        "a_nccl_torch_mhc": baseline,
        "b_symm_one_shot": lambda: torch.ops.symm_mem.one_shot_all_reduce(
            sym, "sum", group.group_name),
        "c_nccl": lambda: dist.all_reduce(nccl_buf, group=group),
        "d_plain": lambda: ar.plain_sum(x),
    }


def _rank_main(ctx: RankContext, hiddens, ms) -> list[dict]:
    import torch.distributed._symmetric_memory as symm_mem

    device, group = ctx.device, ctx.group
    torch.cuda.set_device(device)
    rows = []
    for hidden in hiddens:
        ar = BoundaryAllReduce(hidden, HC, CAPACITY, TOP_K, group, quantize_layer_input=True,
                               residual_only=False, device=device)
        symm = symm_mem.empty(CAPACITY * hidden, dtype=torch.bfloat16, device=device)
        symm_mem.rendezvous(symm, group.group_name)
        gamma = torch.ones(hidden, dtype=torch.bfloat16, device=device)
        for m in ms:
            for path, fn in _cases(ar, symm, gamma, m, hidden, device, group).items():
                rows.append(dict(hidden=hidden, m=m, path=path,
                                 us=_time_graph(fn, device, group)))
        ar.check()
        ar.close()
    return rows


def _sweep_main(ctx: RankContext, tactics, ms) -> list[dict]:
    """Ours (full + MXFP8) and plain per consumer tactic; (b) once per M."""
    import torch.distributed._symmetric_memory as symm_mem

    device, group, hidden = ctx.device, ctx.group, SWEEP_HIDDEN
    torch.cuda.set_device(device)
    ar = BoundaryAllReduce(hidden, HC, CAPACITY, TOP_K, group, quantize_layer_input=True,
                           residual_only=False, device=device)
    symm = symm_mem.empty(CAPACITY * hidden, dtype=torch.bfloat16, device=device)
    symm_mem.rendezvous(symm, group.group_name)
    gamma = torch.ones(hidden, dtype=torch.bfloat16, device=device)
    rows = []
    for m in ms:
        cases = _cases(ar, symm, gamma, m, hidden, device, group)
        rows.append(dict(m=m, path="b_symm_one_shot", tactic=None,
                         us=_time_graph(cases["b_symm_one_shot"], device, group)))
        timed_plain = set()
        for tactic in tactics:
            ar.tactic = tactic
            rows.append(dict(m=m, path="ours", tactic=tuple(tactic),
                             us=_time_graph(cases["ours"], device, group)))
            if tactic[:2] not in timed_plain:  # the plain sum has no norm: no serial walk
                timed_plain.add(tactic[:2])
                rows.append(dict(m=m, path="d_plain", tactic=tuple(tactic),
                                 us=_time_graph(cases["d_plain"], device, group)))
    ar.check()
    ar.close()
    return rows


def _sweep_table(rows) -> str:
    b = {r["m"]: r["us"] for r in rows if r["path"] == "b_symm_one_shot"}
    plain = {(r["m"], r["tactic"][:2]): r["us"] for r in rows if r["path"] == "d_plain"}
    lines = [f"H = {SWEEP_HIDDEN}; (b) symm one-shot: "
             + ", ".join(f"M={m} {us:.2f}us" for m, us in b.items()),
             f"{'M':>3} {'cols':>5} {'warps':>5} {'coop':>5} {'ours':>8} {'plain':>8} "
             f"{'ours/b':>7} {'ours/plain':>10}"]
    for r in rows:
        if r["path"] != "ours":
            continue
        m, (block, warps, coop) = r["m"], r["tactic"]
        p = plain[m, (block, warps)]
        lines.append(f"{m:>3} {block:>5} {warps:>5} {coop!s:>5} {r['us']:>6.2f}us {p:>6.2f}us "
                     f"{r['us'] / b[m]:>7.2f} {r['us'] / p:>10.2f}")
    return "\n".join(lines)


def _table(rows) -> str:
    by = {(r["hidden"], r["m"], r["path"]): r["us"] for r in rows}
    lines = [f"{'H':>5} {'M':>3} " + " ".join(f"{p[:14]:>14}" for p in PATHS)
             + "  ours/a  ours/b  ours/d"]
    for hidden, m in sorted({(r["hidden"], r["m"]) for r in rows}):
        t = [by[hidden, m, p] for p in PATHS]
        lines.append(f"{hidden:>5} {m:>3} " + " ".join(f"{v:>12.2f}us" for v in t)
                     + f"  {t[0] / t[1]:>6.2f}  {t[0] / t[2]:>6.2f}  {t[0] / t[4]:>6.2f}")
    return "\n".join(lines)


def _tactic(text: str) -> ConsumerTactic:
    serial = text.endswith("s")
    cols, _, warps = text.rstrip("s").partition("x")
    try:
        return ConsumerTactic(int(cols), int(warps), not serial)
    except ValueError:
        raise argparse.ArgumentTypeError(f"tactic {text!r}: expected COLSxWARPS[s], "
                                         "e.g. 512x4 or 1024x4s") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=list(HIDDENS))
    parser.add_argument("--m", type=int, nargs="+", help=f"token counts (default {list(MS)}; "
                        f"with --sweep {list(SWEEP_MS)})")
    parser.add_argument("--sweep", action="store_true",
                        help="consumer tactics at H = 5120, M = 1, 8, 16, 32, 64 (ours and plain)")
    parser.add_argument("--tactics", type=_tactic, nargs="+",
                        help="with --sweep: COLSxWARPS[s] each (s = serial), instead of the "
                             "built-in list")
    parser.add_argument("--out", type=pathlib.Path,
                        default=pathlib.Path(__file__).parent / "results",
                        help="folder for the JSON (default benchmarks/results)")
    args = parser.parse_args()
    if args.tactics and not args.sweep:
        parser.error("--tactics needs --sweep")
    disable_multicast()
    if args.sweep:
        tactics = tuple(args.tactics) if args.tactics else SWEEP_TACTICS
        results = launch(_sweep_main, 2, (tactics, tuple(args.m or SWEEP_MS)), timeout_s=600)
    else:
        results = launch(_rank_main, 2, (tuple(args.hidden), tuple(args.m or MS)),
                         timeout_s=600)
    if 0 not in results:  # torchrun: only rank 0 reports
        return
    rows = results[0]
    gpu = torch.cuda.get_device_name(0)
    commit = git_commit()
    record = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, commit=commit,
                  python=platform.python_version(), command=" ".join(sys.argv),
                  calls_per_graph=CALLS, replays=REPS,
                  date=datetime.datetime.now().isoformat(timespec="seconds"), rows=rows)
    out_dir = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    kind = "allreduce-sweep" if args.sweep else "allreduce"
    name = f"{kind}-{gpu.replace(' ', '_')}.json"
    (out_dir / name).write_text(json.dumps(record, indent=1))
    print(_sweep_table(rows) if args.sweep else _table(rows))
    print(f"wrote {out_dir / name}")


if __name__ == "__main__":
    main()
