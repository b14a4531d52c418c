"""Probe (temporary): a K-loop tensor-core MXFP8 GEMM for 32-64 rows against
today's tensor-core tiles and cuBLAS BF16, one H200, cold L2.

    PYTHONPATH=. python benchmarks/tc_probe.py [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import torch
import triton
import triton.language as tl

from decode_boundary.bench.gemm import random_layer, time_cublas_bf16, time_inductor_bf16, time_ours
from decode_boundary.common.rounding import swizzled_offset
from decode_boundary.common.timing import graph_time_us, rotated_copies
from decode_boundary.gemm.reference import check_mxfp8_mm
from decode_boundary.gemm.tactics import default_tactic
from decode_boundary.mxfp8.format import dequantize_mxfp8
from decode_boundary.mxfp8.quantize_kernel import quantize_mxfp8


@triton.jit
def _exp2(byte):
    return (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _tile(ptr, sptr, rows, row_live, kk, k_end, ld, BK: tl.constexpr, K_TILES: tl.constexpr,
          col0):
    k = kk + tl.arange(0, BK)
    g = kk // 32 + tl.arange(0, BK // 32)
    x = tl.load(ptr + rows[:, None].to(tl.int64) * ld + col0 + k[None, :],
                mask=row_live[:, None] & (k < k_end)[None, :], other=0.0)
    s = tl.load(sptr + swizzled_offset(rows[:, None], col0 // 32 + g[None, :], K_TILES),
                mask=row_live[:, None] & (g * 32 < k_end)[None, :], other=0)
    return x, s


@triton.jit
def _bf16(x, s, R: tl.constexpr, BK: tl.constexpr, HW: tl.constexpr):
    v = tl.reshape(x.to(tl.float32), (R, BK // 32, 32)) * _exp2(s)[:, :, None]
    v = tl.reshape(v, (R, BK))
    if HW:
        v = v.to(tl.bfloat16)
    return v


@triton.jit
def loop_kernel(w_ptr, ws_ptr, a_ptr, as_ptr, out_ptr, partial_ptr, counter_ptr, M,
                N: tl.constexpr, K: tl.constexpr, GROUPS: tl.constexpr, BLOCK_N: tl.constexpr,
                ROWS: tl.constexpr, SPLIT_K: tl.constexpr, K_SLICE: tl.constexpr,
                BK: tl.constexpr, STAGES: tl.constexpr, MODE: tl.constexpr,
                USE_PDL: tl.constexpr = True):
    W_K_TILES: tl.constexpr = (K // 32 + 3) // 4
    A_K: tl.constexpr = GROUPS * K
    A_K_TILES: tl.constexpr = (A_K // 32 + 3) // 4
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_live = cols < N
    rows = pid_m * ROWS + tl.arange(0, ROWS)
    row_live = rows < M
    k0 = pid_k * K_SLICE
    k_end = tl.minimum(k0 + K_SLICE, K)
    a_k0 = (pid_n * BLOCK_N) // (N // GROUPS) * K
    acc = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
    if MODE == 0:  # Triton's pipeliner, grid wait first
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        for i in tl.range(0, K_SLICE // BK, num_stages=STAGES):
            kk = k0 + i * BK
            w, ws = _tile(w_ptr, ws_ptr, cols, col_live, kk, k_end, K, BK, W_K_TILES, 0)
            a, sa = _tile(a_ptr, as_ptr, rows, row_live, kk, k_end, A_K, BK, A_K_TILES, a_k0)
            acc = tl.dot(_bf16(w, ws, BLOCK_N, BK, USE_PDL),
                         tl.trans(_bf16(a, sa, ROWS, BK, USE_PDL)), acc)
    elif MODE == 2:  # activation already dequantized to BF16 (exact): a_ptr is BF16 [M, A_K]
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        for i in tl.range(0, K_SLICE // BK, num_stages=STAGES):
            kk = k0 + i * BK
            w, ws = _tile(w_ptr, ws_ptr, cols, col_live, kk, k_end, K, BK, W_K_TILES, 0)
            k = kk + tl.arange(0, BK)
            a = tl.load(a_ptr + rows[:, None].to(tl.int64) * A_K + a_k0 + k[None, :],
                        mask=row_live[:, None] & (k < k_end)[None, :], other=0.0)
            acc = tl.dot(_bf16(w, ws, BLOCK_N, BK, USE_PDL), tl.trans(a), acc)
    else:  # registers: STAGES weight tiles ahead, the first ones before the grid wait
        w, ws = _tile(w_ptr, ws_ptr, cols, col_live, k0, k_end, K, BK, W_K_TILES, 0)
        if STAGES >= 2:
            w1, ws1 = _tile(w_ptr, ws_ptr, cols, col_live, k0 + BK, k_end, K, BK, W_K_TILES, 0)
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        a, sa = _tile(a_ptr, as_ptr, rows, row_live, k0, k_end, A_K, BK, A_K_TILES, a_k0)
        for i in tl.range(0, K_SLICE // BK, num_stages=1):
            kk = k0 + i * BK
            if STAGES >= 2:
                wn, wsn = _tile(w_ptr, ws_ptr, cols, col_live, kk + 2 * BK, k_end, K, BK,
                                W_K_TILES, 0)
            else:
                wn, wsn = _tile(w_ptr, ws_ptr, cols, col_live, kk + BK, k_end, K, BK,
                                W_K_TILES, 0)
            an, san = _tile(a_ptr, as_ptr, rows, row_live, kk + BK, k_end, A_K, BK, A_K_TILES,
                            a_k0)
            acc = tl.dot(_bf16(w, ws, BLOCK_N, BK, USE_PDL),
                         tl.trans(_bf16(a, sa, ROWS, BK, USE_PDL)), acc)
            if STAGES >= 2:
                w, ws = w1, ws1
                w1, ws1 = wn, wsn
            else:
                w, ws = wn, wsn
            a, sa = an, san
    if SPLIT_K == 1:
        out = acc.to(tl.bfloat16)  # probe: hardware cast
        tl.store(out_ptr + rows[None, :].to(tl.int64) * N + cols[:, None], out,
                 mask=row_live[None, :])
    else:
        block = pid_m * (N // BLOCK_N) + pid_n
        tile = tl.arange(0, ROWS)[None, :] * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
        partials = partial_ptr + (block * SPLIT_K).to(tl.int64) * (ROWS * BLOCK_N)
        real = rows[None, :] < M
        tl.store(partials + pid_k * (ROWS * BLOCK_N) + tile, acc, mask=real)
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + block, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            tl.debug_barrier()
            total = tl.load(partials + tile, mask=real, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                total += tl.load(partials + s * (ROWS * BLOCK_N) + tile, mask=real, other=0.0,
                                 cache_modifier=".cg")
            tl.store(counter_ptr + block, 0)
            tl.store(out_ptr + rows[None, :].to(tl.int64) * N + cols[:, None],
                     total.to(tl.bfloat16), mask=real)


_WS = {}
_DQ = {}


def launch(layer, a, out, cfg):
    mode, block_n, bk, warps, stages, split = cfg
    storage = layer.weight.t()
    n = storage.shape[0]
    k = storage.shape[1]
    groups = getattr(layer, "groups", 1)
    rows = a.data.shape[0]
    tile = 16 if rows <= 16 else 32 if rows <= 32 else 64
    k_slice = -(-(k // bk) // split) * bk
    grid = (n // block_n, split, -(-rows // tile))
    key = (n, rows, block_n, split)
    if key not in _WS:
        dev = storage.device
        _WS[key] = (torch.empty(grid[2] * n * tile * split, dtype=torch.float32, device=dev),
                    torch.zeros(grid[2] * (n // block_n), dtype=torch.int32, device=dev))
    part, cnt = _WS[key]
    pdl = storage.is_cuda
    a_data = _DQ[a.data.data_ptr()] if mode == 2 else a.data
    loop_kernel[grid](storage, layer.weight_scale, a_data, a.scale, out, part, cnt, rows,
                      N=n, K=k, GROUPS=groups, BLOCK_N=block_n, ROWS=tile, SPLIT_K=split,
                      K_SLICE=k_slice, BK=bk, STAGES=stages, MODE=mode, num_warps=warps,
                      num_stages=1, launch_pdl=pdl, USE_PDL=pdl)
    return out


SHAPES = {"wo_b": (5120, 2048, 1), "wq_b": (8192, 1280, 1), "fused_wqa_wkv": (1792, 5120, 1),
          "wo_a": (2048, 4096, 2), "v4pro_wo_b": (7168, 4096, 1)}


def configs(n, k, groups, rows):
    out = []
    for block_n, bk, warps in ((64, 128, 4), (128, 128, 8), (128, 128, 4), (64, 256, 4)):
        blocks = n // block_n
        for target in (132, 264):
            split = max(1, min(k // bk // 2, round(target / blocks)))
            while (k // bk) % split:
                split -= 1
            for mode, stages in ((2, 3), (2, 4), (0, 3)):
                cfg = (mode, block_n, bk, warps, stages, split)
                if cfg not in out:
                    out.append(cfg)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--rows", type=int, nargs="*", default=[32, 64])
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    parser.add_argument("--inductor", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    results = []
    for name in args.shapes:
        n, k, groups = SHAPES[name]
        layer = random_layer(n, k, groups, torch.device("cuda"))
        copies = rotated_copies(layer)
        bf16 = layer.dequantized_weight().bfloat16().view(groups, n // groups, k)
        for rows in args.rows:
            x = torch.randn(rows, groups * k, device="cuda").bfloat16()
            qa = quantize_mxfp8(x)
            _DQ[qa.data.data_ptr()] = dequantize_mxfp8(qa, torch.bfloat16).reshape(rows, groups * k)
            xg = x.view(rows, groups, k).transpose(0, 1)
            row = {"shape": name, "rows": rows,
                   "ours_now": time_ours(layer, qa, default_tactic(n, k, rows, groups), copies),
                   "cublas_bf16": time_cublas_bf16(xg, bf16)}
            if args.inductor:
                row["inductor_bf16"] = time_inductor_bf16(xg, bf16)
            best = None
            for cfg in configs(n, k, groups, rows):
                out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                try:
                    launch(layer, qa, out, cfg)
                    check_mxfp8_mm(out, qa, layer.weight, layer.weight_scale, groups)
                except Exception as err:  # noqa: BLE001
                    print(name, rows, cfg, "FAILED", str(err).splitlines()[0][:200], flush=True)
                    continue
                o = torch.empty(rows, n, dtype=torch.bfloat16, device="cuda")
                us = graph_time_us([functools.partial(launch, c, qa, o, cfg) for c in copies])
                row.setdefault("loop", []).append({"cfg": cfg, "us": us})
                if best is None or us < best[1]:
                    best = (cfg, us)
            row["best"] = best
            print(json.dumps({k2: v for k2, v in row.items() if k2 != "loop"}), flush=True)
            results.append(row)
    with open(os.path.join(args.out, "tc_probe.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
