"""Two bounds on what any re-staging of today's boundary could still gain
(a probe: NOTES attempt 22; GPU only).

1. **Hot against cold.** The fused chain timed as the bench does (rotated
   weight copies, cold L2) and with one copy only, so every step finds all
   its weights in L2. The hot figure bounds every scheme that only changes
   *when* weight bytes arrive (L2 prefetch, a persistent kernel holding the
   next phase's weights): with today's kernel bodies and launches, none can
   beat it.
2. **What a dependent edge costs.** A chain of P launches of a trivial
   kernel (PDL: every program releases its dependents, then waits for the
   grid before it reads the word its neighbour wrote) against one launch of
   P phases separated by a software grid barrier (arrival counter with
   release, spin with acquire, the way a persistent kernel would hand a
   phase on). ``(T(P=6) - T(P=2)) / 4`` is the cost of one edge of each kind;
   their difference is what a persistent boundary saves per dependent
   launch it removes, before any work.

Every figure uses the one timer (CUDA graphs of back-to-back steps). Each
probe kernel's result is checked: after S steps from zeroed buffers every
word of the last slot holds S x P (a reader that missed its neighbour's
store would hold less).

    PYTHONPATH=. python benchmarks/latency_bounds.py --rows 1 4 8 64 [--programs 132 264 640]
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from decode_boundary.bench.harness import (
    one_gpu_boundary,
    one_gpu_parser,
    one_gpu_result,
    one_gpu_write,
)
from decode_boundary.common.timing import copy_rate, graph_time_us
from decode_boundary.model.chain import check_outputs

PHASES = (2, 6)  # even: the ping-pong slots start each step where the last ended
WARPS = 4


@triton.jit
def _dependent_phase(buf_ptr, src, n):
    """One launch of the PDL chain: read the neighbour's word of slot ``src``
    (written by the previous launch), write this program's word of the other."""
    tl.extra.cuda.gdc_launch_dependents()
    tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    v = tl.load(buf_ptr + src * n + (pid + 1) % n)
    tl.store(buf_ptr + (1 - src) * n + pid, v + 1)


@triton.jit
def _grid_barrier(counter_ptr, n):
    """Every program of the grid (all resident) arrives, then waits for all.
    The counter only grows: each barrier adds exactly ``n``, so the arrival's
    old value names its barrier's target without a reset."""
    tl.debug_barrier()  # every thread's stores are issued before the arrival
    old = tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    target = (old // n + 1) * n
    seen = old + 1
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _persistent_phases(buf_ptr, counter_ptr, n, PHASES: tl.constexpr):
    """``PHASES`` phases of ``_dependent_phase``'s work in one launch, a grid
    barrier between each two; PDL towards the launches before and after."""
    tl.extra.cuda.gdc_launch_dependents()
    tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    for p in tl.static_range(PHASES):
        # volatile: another SM wrote the word since this SM may have cached it
        v = tl.load(buf_ptr + (p % 2) * n + (pid + 1) % n, volatile=True)
        tl.store(buf_ptr + (1 - p % 2) * n + pid, v + 1)
        if p < PHASES - 1:
            _grid_barrier(counter_ptr, n)


def chain_step(buf: torch.Tensor, n: int, phases: int) -> None:
    for p in range(phases):
        _dependent_phase[(n,)](buf, p % 2, n, num_warps=WARPS, launch_pdl=True)


def persistent_step(buf: torch.Tensor, counter: torch.Tensor, n: int, phases: int) -> None:
    _persistent_phases[(n,)](buf, counter, n, PHASES=phases, num_warps=WARPS, launch_pdl=True)


def _buffers(n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.zeros(2 * n, dtype=torch.int32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device))


def edge_costs(programs: int, device) -> dict:
    """µs per step of both structures at each of ``PHASES``, the per-edge costs,
    and the checks' failures."""
    out, failures = {}, []
    for phases in PHASES:
        for kind in ("chain", "persistent"):
            buf, counter = _buffers(programs, device)
            step = (functools.partial(chain_step, buf, programs, phases) if kind == "chain"
                    else functools.partial(persistent_step, buf, counter, programs, phases))
            for _ in range(3):
                step()
            torch.cuda.synchronize(device)
            if not bool((buf[:programs] == 3 * phases).all()):
                failures.append(f"{kind} P={phases}: words {buf[:programs].unique().tolist()}"
                                f" after 3 steps, expected {3 * phases}")
            out[f"{kind}_p{phases}"] = graph_time_us([step], device)
    lo, hi = PHASES
    for kind in ("chain", "persistent"):
        out[f"{kind}_edge"] = (out[f"{kind}_p{hi}"] - out[f"{kind}_p{lo}"]) / (hi - lo)
    return {"programs": programs, "us": out, "failures": failures}


def hot_and_cold(args) -> list[dict]:
    """µs per step of the fused chain on the rotated copies and on one copy."""
    ab, views = one_gpu_boundary(args, seed=5)
    rows_out = []
    for rows in args.rows:
        inputs = ab.make_inputs(rows, seed=rows)
        us = {"cold": [], "hot": []}
        for _ in range(2):
            for name, layers in (("cold", views), ("hot", views[:1])):
                us[name].append(graph_time_us(
                    [functools.partial(v, inputs, fused=True, mixes_aside="auto")
                     for v in layers], ab.device, join=ab.join_mixes))
        out = ab(inputs, fused=True, mixes_aside="auto")
        ab.join_mixes()
        failures = check_outputs(out, ab.reference(inputs))
        rows_out.append({"rows": rows, "us": us, "failures": failures})
        print(f"M={rows}: cold {us['cold']} hot {us['hot']} µs; "
              f"{'; '.join(failures) or 'checks ok'}", flush=True)
    ab.close()
    return rows_out


def main() -> None:
    parser = one_gpu_parser(__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, nargs="+", default=[132, 264, 640])
    args = parser.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    result = one_gpu_result("latency_bounds", args)
    result["copy_rate_gbps"] = copy_rate(device) / 1e9
    result["edges"] = []
    for programs in args.programs:
        edges = edge_costs(programs, device)
        result["edges"].append(edges)
        print(f"{programs} programs: " + " ".join(f"{k} {v:.2f}" for k, v in edges["us"].items())
              + f" µs; {'; '.join(edges['failures']) or 'checks ok'}", flush=True)
    result["rows"] = hot_and_cold(args)
    print("wrote", one_gpu_write(result, args))


if __name__ == "__main__":
    main()
