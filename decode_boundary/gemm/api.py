"""Public MXFP8 GEMM entry points (the seed 004 functions, on our Triton kernel).

A *layer* is any object with ``weight`` (column-major [K, N] view of e4m3
[N, K] storage), ``weight_scale`` (1-D uint8, 128x4-swizzled over (N, K/32))
and ``bias`` (None, or BF16 [N] added after the product), e.g.
``decode_boundary.mxfp8.linear.Mxfp8Linear``. ``x`` is a float tensor
[..., K] (quantized here with the Triton MXFP8 quantizer) or a
``QuantizedActivation``. Outputs are [..., N] in the input's original dtype
(computed as BF16).

Row ranges and who chooses the tactic (tactics.py): ``low_latency_mm`` (<= 8
rows, the autotuner's choice else the table), ``wide_mm`` (9..48 rows, the
fixed wide table), ``pinned_mm`` (above 48, only pinned shapes). ``mxfp8_mm``
runs any row count with :func:`selected_tactic`; layers no kernel takes
(N % 64 != 0, misaligned buffers) get the reference computation, which is
correct but slow. Malformed operands raise ValueError.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from decode_boundary.mxfp8.format import QuantizedActivation, check_quantized, mxfp8_scale_bytes
from decode_boundary.mxfp8.quantize_kernel import quantize_mxfp8

from .autotune import AUTOTUNER
from .mxfp8_gemm_kernel import (
    launch_low_latency,
    warmup_low_latency,
    weight_operands,
)
from .reference import mxfp8_mm_ref
from .tactics import (
    LOW_BATCH_MAX_ROWS,
    PINNED_TACTICS,
    WIDE_LOW_LATENCY_MAX_ROWS,
    WIDE_TACTICS,
    Tactic,
    default_tactic,
    heuristic_tactic,
    rows_tiles_for,
    table_tactic,
)


def mxfp8_eligible(layer) -> bool:
    """Whether ``layer``'s weights are ones the kernel takes (else: reference path)."""
    try:
        storage, scale, n, k = weight_operands(layer)
    except ValueError:
        return False
    return n % 64 == 0 and k % 32 == 0 and storage.data_ptr() % 16 == 0 and \
        scale.data_ptr() % 16 == 0


def selected_tactic(layer_or_shape, rows: int) -> Tactic:
    """The tactic ``mxfp8_mm`` runs for ``rows`` rows: the autotuner's cached
    choice, else the pinned table, else the heuristic. ``layer_or_shape`` is a
    layer or an (N, K) pair."""
    if isinstance(layer_or_shape, tuple):
        n, k = layer_or_shape
    else:
        k, n = layer_or_shape.weight.shape
    cached = AUTOTUNER.lookup(n, k, rows)
    return cached if cached is not None else default_tactic(n, k, rows)


def _quantized(layer, x) -> QuantizedActivation:
    k = layer.weight.shape[0]
    if isinstance(x, QuantizedActivation):
        check_quantized(x)
        qa = x
    elif isinstance(x, torch.Tensor):
        if not x.is_floating_point():
            raise ValueError(f"x must be a float tensor [..., {k}], got {x.dtype}")
        qa = quantize_mxfp8(x)
    else:
        raise ValueError(f"x must be a tensor or QuantizedActivation, got {type(x).__name__}")
    if qa.data.shape[1] != k or qa.orig_shape[-1] != k:
        raise ValueError(f"x has K = {qa.data.shape[1]}, the layer's weight is [K={k}, N]")
    if qa.data.data_ptr() % 16 or qa.scale.data_ptr() % 16:
        qa = QuantizedActivation(qa.data.clone(), qa.scale.clone(), qa.orig_dtype, qa.orig_shape)
    return qa


def _finish(layer, qa: QuantizedActivation, out: torch.Tensor) -> torch.Tensor:
    if layer.bias is not None:
        out = out + layer.bias
    return out.view(*qa.orig_shape[:-1], out.shape[-1]).to(qa.orig_dtype)


def _run(layer, qa: QuantizedActivation, tactic: Tactic) -> torch.Tensor:
    n = layer.weight.shape[1]
    out = torch.empty(qa.rows, n, dtype=torch.bfloat16, device=qa.data.device)
    launch_low_latency(layer, qa, out, tactic)
    return _finish(layer, qa, out)


def mxfp8_mm(layer, x) -> torch.Tensor:
    """``layer``'s GEMM of ``x`` with the selected tactic (any row count)."""
    weight_operands(layer)  # malformed weights raise here
    qa = _quantized(layer, x)
    if not mxfp8_eligible(layer):
        return _finish(layer, qa, mxfp8_mm_ref(qa, layer.weight, layer.weight_scale)
                       .reshape(qa.rows, -1))
    if qa.rows == 0:
        return _finish(layer, qa, torch.empty(0, layer.weight.shape[1], dtype=torch.bfloat16,
                                              device=qa.data.device))
    return _run(layer, qa, selected_tactic(layer, qa.rows))


def low_latency_mm(layer, x) -> torch.Tensor | None:
    """The low-latency GEMM (<= LOW_BATCH_MAX_ROWS rows) of an eligible layer; None otherwise."""
    qa = _quantized(layer, x)
    if not (mxfp8_eligible(layer) and 0 < qa.rows <= LOW_BATCH_MAX_ROWS):
        return None
    return _run(layer, qa, selected_tactic(layer, qa.rows))


def wide_tactic(n: int, k: int, rows: int) -> Tactic | None:
    """The wide low-latency tactic (rows tile 16/32/64) of (N, K) at ``rows``
    rows: the wide table's, else the heuristic; None outside 9..48 rows."""
    if not LOW_BATCH_MAX_ROWS < rows <= WIDE_LOW_LATENCY_MAX_ROWS:
        return None
    tactic = WIDE_TACTICS.get((n, k), {}).get(rows_tiles_for(rows)[0])
    return tactic if tactic is not None else heuristic_tactic(n, k, rows)


def wide_mm(layer, x) -> torch.Tensor | None:
    """The wide-tile GEMM (9..48 rows) of an eligible layer; None otherwise."""
    qa = _quantized(layer, x)
    k, n = layer.weight.shape
    tactic = wide_tactic(n, k, qa.rows)
    if tactic is None or not mxfp8_eligible(layer):
        return None
    return _run(layer, qa, tactic)


def pinned_mm(layer, x) -> torch.Tensor | None:
    """The GEMM above 48 rows with the tactic pinned for the layer's shape and
    row range; None where no tactic is pinned."""
    qa = _quantized(layer, x)
    k, n = layer.weight.shape
    if qa.rows <= WIDE_LOW_LATENCY_MAX_ROWS or (n, k) not in PINNED_TACTICS or \
            not mxfp8_eligible(layer):
        return None
    tactic = table_tactic(n, k, qa.rows)
    return None if tactic is None else _run(layer, qa, tactic)


def wide_or_pinned_mm(layer, x) -> torch.Tensor | None:
    """Above LOW_BATCH_MAX_ROWS rows: the wide GEMM, else the pinned one, else None."""
    out = wide_mm(layer, x)
    return out if out is not None else pinned_mm(layer, x)


def projection_mm(layer, x, low_batch: bool) -> torch.Tensor | None:
    """A decode step's projection: ``low_latency_mm`` in a step of <= 8 rows
    (``low_batch``), else ``wide_or_pinned_mm``; None where none applies."""
    return low_latency_mm(layer, x) if low_batch else wide_or_pinned_mm(layer, x)


def shape_representatives(layers: Iterable) -> list:
    """One eligible layer per distinct (N, K), sorted by (N, K) so every rank
    tunes and compiles the same problems in the same order."""
    by_shape = {}
    for layer in layers:
        if mxfp8_eligible(layer):
            k, n = layer.weight.shape
            by_shape.setdefault((n, k), layer)
    return [by_shape[shape] for shape in sorted(by_shape)]


def zeros_input(layer, rows: int) -> QuantizedActivation:
    """An all-zero MXFP8 input of ``layer`` laid out like the quantizer's output."""
    k = layer.weight.shape[0]
    device = layer.weight.device
    shape = torch.Size((rows, k))
    return QuantizedActivation(torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device),
                               torch.zeros(mxfp8_scale_bytes(rows, k), dtype=torch.uint8,
                                           device=device),
                               torch.bfloat16, shape)


def run_zeros(layer, rows: int) -> torch.Tensor:
    """``mxfp8_mm`` of ``layer`` on a zero input (warm-up / graph-capture dry run)."""
    return mxfp8_mm(layer, zeros_input(layer, rows))


def precompile(layer, rows_list: Iterable[int], publish=None) -> None:
    """Compile the kernels ``mxfp8_mm`` (or, with ``publish``, the publishing
    launch) uses for each row count and allocate their workspaces, launching
    nothing, so CUDA-graph capture never compiles or allocates. Call it
    again after the autotuner changes a choice."""
    if not mxfp8_eligible(layer):
        return
    for rows in rows_list:
        warmup_low_latency(layer, rows, selected_tactic(layer, rows), publish)


def compile_pinned(layer) -> None:
    """Compile ``layer``'s pinned tactics (each at its range's largest row
    count, capped at 4096) and its wide tiles."""
    if not mxfp8_eligible(layer):
        return
    k, n = layer.weight.shape
    for max_rows, tactic in PINNED_TACTICS.get((n, k), ()):
        warmup_low_latency(layer, min(max_rows, 4096), tactic)
    for rows in (16, 32, 48):
        warmup_low_latency(layer, rows, wide_tactic(n, k, rows))
