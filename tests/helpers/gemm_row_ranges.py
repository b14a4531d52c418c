"""Row-range GEMM entry points, for the tests only: each runs one row range of
``decode_boundary.gemm.api`` through the package's own launch path (``api._run``,
the path ``mxfp8_mm`` takes) and returns None outside its range, so the tests can
pin which tactic family serves which row count. The package itself calls
``mxfp8_mm``, which runs any row count with ``selected_tactic``.

``low_latency_mm`` (<= LOW_BATCH_MAX_ROWS rows, the table or heuristic),
``wide_mm`` (9..48 rows, the table or heuristic),
``pinned_mm`` (above 48, only tabled shapes), ``wide_or_pinned_mm`` and
``projection_mm`` (a decode step's choice between them).
"""

from __future__ import annotations

import torch

from decode_boundary.gemm.api import _run, _shape, mxfp8_eligible, selected_tactic
from decode_boundary.gemm.tactics import (
    LOW_BATCH_MAX_ROWS,
    TABLE,
    WIDE_LOW_LATENCY_MAX_ROWS,
    Tactic,
    default_tactic,
    table_tactic,
)


def low_latency_mm(layer, x) -> torch.Tensor | None:
    """The low-latency GEMM (<= LOW_BATCH_MAX_ROWS rows) of an eligible layer; None otherwise."""
    if not mxfp8_eligible(layer):
        return None
    return _run(layer, x, lambda rows: selected_tactic(layer, rows)
                if rows <= LOW_BATCH_MAX_ROWS else None)


def wide_tactic(n: int, k: int, rows: int, groups: int = 1) -> Tactic | None:
    """The wide-tile tactic (rows tile 16/32/64) of (N, K, groups) at ``rows``
    rows: the table's, else the heuristic; None outside 9..48 rows."""
    if not LOW_BATCH_MAX_ROWS < rows <= WIDE_LOW_LATENCY_MAX_ROWS:
        return None
    return default_tactic(n, k, rows, groups)


def wide_mm(layer, x) -> torch.Tensor | None:
    """The wide-tile GEMM (9..48 rows) of an eligible layer; None otherwise."""
    if not mxfp8_eligible(layer):
        return None
    n, k, groups = _shape(layer)
    return _run(layer, x, lambda rows: wide_tactic(n, k, rows, groups))


def pinned_mm(layer, x) -> torch.Tensor | None:
    """The GEMM above 48 rows with the tactic pinned for the layer's shape and
    row range; None where no tactic is pinned."""
    n, k, groups = _shape(layer)
    if not mxfp8_eligible(layer) or (n, k, groups) not in TABLE:
        return None
    return _run(layer, x, lambda rows: table_tactic(n, k, rows, groups)
                if rows > WIDE_LOW_LATENCY_MAX_ROWS else None)


def wide_or_pinned_mm(layer, x) -> torch.Tensor | None:
    """Above LOW_BATCH_MAX_ROWS rows: the wide GEMM, else the pinned one, else None."""
    out = wide_mm(layer, x)
    return out if out is not None else pinned_mm(layer, x)


def projection_mm(layer, x, low_batch: bool) -> torch.Tensor | None:
    """A decode step's projection: ``low_latency_mm`` in a step of <= 8 rows
    (``low_batch``), else ``wide_or_pinned_mm``; None where none applies."""
    return low_latency_mm(layer, x) if low_batch else wide_or_pinned_mm(layer, x)
