"""Launcher of the CuTe DSL Hopper MXFP8 GEMM (``mxfp8_wgmma_kernel.py``): which
tactics it takes, one compile per static key behind a cache, and the call.

**Compiles.** A variant is a function of (N, K, groups, tactic, PDL) only:
compiled once per process against fake tensors whose row count M is symbolic,
so one compile serves every M (the row count never selects a variant here;
the tactic tables do). Compiled with TVM FFI: a call takes the torch tensors
as they are and runs on torch's current stream, with no per-call conversion.

**What it checks** (``check_operands``; a malformed call raises ``ValueError``
naming the argument): the tactic fits the shape (:func:`fits`), the weight is
e4m3 [N, K] K-contiguous with its exact swizzled scale buffer, the activation
e4m3 [M, G*K] contiguous with a scale buffer for it, ``out`` BF16 [M, N]
contiguous, one device, 16-byte aligned. The kernel assumes them.

Importing this module imports the DSL: ``dispatch.py`` imports it only once it
has decided the CuTe path can run.
"""

from __future__ import annotations

import functools
import time

import torch

from decode_boundary.mxfp8.format import mxfp8_scale_bytes

from .tactics import K_TILE, HopperTactic, fits


@functools.cache
def _dsl():
    """The DSL's modules (imported on first use)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from .mxfp8_wgmma_kernel import Mxfp8WgmmaGemm
    return cutlass, cute, make_fake_tensor, make_fake_stream, Mxfp8WgmmaGemm


COMPILE_SECONDS: dict[tuple, float] = {}  # each variant's compile time (the bench reports it)
# TVM FFI: torch tensors in, torch's current stream (module docstring). Tests add
# --keep-ptx to inspect the code.
COMPILE_OPTIONS = "--enable-tvm-ffi"


@functools.cache
def compiled(n: int, k: int, groups: int, tactic: HopperTactic, pdl: bool):
    """The compiled variant (module docstring); raises ValueError where the
    tactic does not fit."""
    if not fits(tactic, n, k, groups):
        raise ValueError(f"CuTe tactic {tactic} does not fit N={n}, K={k}, groups={groups}")
    cutlass, cute, fake, fake_stream, gemm = _dsl()
    m, scale_rows = cute.sym_int32(), cute.sym_int32()
    w = fake(cutlass.Float8E4M3FN, (n, k), (k, 1), assumed_align=16)
    ws = fake(cutlass.Uint8, (n // 128 * (k // K_TILE) * 2, 256), (256, 1), assumed_align=16)
    a = fake(cutlass.Float8E4M3FN, (m, groups * k), (groups * k, 1), assumed_align=16)
    a_s = fake(cutlass.Uint8, (scale_rows, 256), (256, 1), assumed_align=16)
    out = fake(cutlass.BFloat16, (m, n), (n, 1), assumed_align=16)
    kernel = gemm(n, k, groups, *tactic, use_pdl=pdl)
    start = time.perf_counter()
    fn = cute.compile(kernel, w, ws, a, a_s, out, fake_stream(use_tvm_ffi_env_stream=True),
                      options=COMPILE_OPTIONS)
    COMPILE_SECONDS[(n, k, groups, tactic, pdl)] = time.perf_counter() - start
    return fn


def scale_rows(scale: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """The first ``mxfp8_scale_bytes(rows, k)`` bytes of a swizzled scale buffer
    as [bytes / 256, 256]: the view the kernel's scale boxes read."""
    return scale[:mxfp8_scale_bytes(rows, k)].view(-1, 256)


def check_operands(w: torch.Tensor, w_scale: torch.Tensor, groups: int, a_data: torch.Tensor,
                   a_scale: torch.Tensor, out: torch.Tensor, tactic: HopperTactic) -> None:
    """Module docstring: the layout contract, with errors naming the argument."""
    n, k = w.shape
    if w.dtype != torch.float8_e4m3fn or not w.is_contiguous():
        raise ValueError(f"weight must be contiguous float8_e4m3fn [N, K], got {w.dtype}")
    if w_scale.dtype != torch.uint8 or w_scale.numel() != mxfp8_scale_bytes(n, k):
        raise ValueError(f"weight_scale must be the {mxfp8_scale_bytes(n, k)}-byte swizzled "
                         f"buffer of [{n}, {k}], got {w_scale.dtype} {tuple(w_scale.shape)}")
    if not fits(tactic, n, k, groups):
        raise ValueError(f"tactic {tactic} does not fit N={n}, K={k}, groups={groups}")
    rows = a_data.shape[0]
    if a_data.dtype != torch.float8_e4m3fn or tuple(a_data.shape) != (rows, groups * k) or \
            not a_data.is_contiguous() or rows < 1:
        raise ValueError(f"activation data must be contiguous float8_e4m3fn [M >= 1, "
                         f"{groups * k}], got {a_data.dtype} {tuple(a_data.shape)}")
    if a_scale.dtype != torch.uint8 or a_scale.numel() < mxfp8_scale_bytes(rows, groups * k):
        raise ValueError(f"activation scale must hold {mxfp8_scale_bytes(rows, groups * k)} "
                         f"swizzled bytes, got {a_scale.dtype} {tuple(a_scale.shape)}")
    if out.dtype != torch.bfloat16 or tuple(out.shape) != (rows, n) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous bfloat16 [{rows}, {n}], got {out.dtype} "
                         f"{tuple(out.shape)}")
    tensors = (w, w_scale, a_data, a_scale, out)
    if any(t.device != w.device for t in tensors) or any(t.data_ptr() % 16 for t in tensors):
        raise ValueError("weight, activation and out must share one CUDA device and start at "
                         "16-byte aligned addresses")


def launch(w: torch.Tensor, w_scale: torch.Tensor, groups: int, a_data: torch.Tensor,
           a_scale: torch.Tensor, out: torch.Tensor, tactic: HopperTactic, pdl: bool,
           check: bool = True) -> torch.Tensor:
    """``out`` [M, N] BF16 = MXFP8 ``a`` @ ``w``^T on the current stream."""
    if check:
        check_operands(w, w_scale, groups, a_data, a_scale, out, tactic)
    n, k = w.shape
    fn = compiled(n, k, groups, tactic, pdl)
    fn(w, w_scale.view(-1, 256), a_data, scale_rows(a_scale, a_data.shape[0], groups * k), out)
    return out
