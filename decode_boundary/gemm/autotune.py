"""Autotuner of the MXFP8 GEMM: the best tactic per (N, K, row bucket).

Buckets: 1, 2, 4, 8, 16, 32, 48, then powers of two (tactics.row_bucket).
Candidates are timed with CUDA graphs on rotated weight copies (timing.py);
the cache saves to / loads from JSON so a server start reuses a measured
choice instead of re-timing close candidates (whose pick varies between
starts). Under :func:`pinned_tactics` a pinned problem (a table tactic exists
and rows >= PINNED_MIN_ROWS: the 5..8-row bucket and everything above 8 rows
of the tabled shapes) is offered only its pinned tactic.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from .tactics import PINNED_MIN_ROWS, Tactic, row_bucket, sweep_tactics, table_tactic

_pinned_only = False


@contextmanager
def pinned_tactics() -> Iterator[None]:
    """Within the block, the autotuner offers pinned problems only their pinned tactic."""
    global _pinned_only
    previous, _pinned_only = _pinned_only, True
    try:
        yield
    finally:
        _pinned_only = previous


def default_timer(layer, rows: int, tactic: Tactic) -> float:
    """µs per call of ``tactic`` on ``rows`` zero rows, L2 cold (GPU only)."""
    from .api import zeros_input
    from .mxfp8_gemm_kernel import launch_low_latency
    from .timing import graph_time_us, rotated_copies

    if layer.weight.device.type != "cuda":
        raise RuntimeError("the autotuner times on a CUDA device; pass timer= elsewhere")
    copies = rotated_copies(layer)
    qa = zeros_input(layer, rows)
    out = torch.empty(rows, layer.weight.shape[1], dtype=torch.bfloat16, device=qa.data.device)
    return graph_time_us(lambda i: launch_low_latency(copies[i], qa, out, tactic), len(copies))


class Autotuner:
    """Cache (N, K, row bucket) -> Tactic, filled by :meth:`tune`."""

    def __init__(self) -> None:
        self.cache: dict[tuple[int, int, int], Tactic] = {}

    def lookup(self, n: int, k: int, rows: int) -> Tactic | None:
        return self.cache.get((n, k, row_bucket(rows)))

    def candidates(self, n: int, k: int, rows: int) -> list[Tactic]:
        """Tactics offered for (N, K, rows): only the pinned one under
        pinned_tactics() for a pinned problem, else a small sweep."""
        pinned = table_tactic(n, k, rows)
        if _pinned_only and pinned is not None and rows >= PINNED_MIN_ROWS:
            return [pinned]
        return sweep_tactics(n, k, rows)

    def tune(self, layer, rows: int,
             timer: Callable[[object, int, Tactic], float] = default_timer) -> Tactic:
        """Time the candidates for ``layer`` at ``rows`` rows (the bucket's
        largest count, so the chosen tiles cover every row of the bucket) and
        cache the fastest; ties keep the earlier (default-first) candidate."""
        k, n = layer.weight.shape
        bucket = row_bucket(rows)
        offered = self.candidates(n, k, bucket)
        timed = [(timer(layer, bucket, t), i, t) for i, t in enumerate(offered)]
        best = min(timed)[2]
        self.cache[(n, k, bucket)] = best
        return best

    def save(self, path: str) -> None:
        entries = [{"n": n, "k": k, "bucket": b, "tactic": t._asdict()}
                   for (n, k, b), t in sorted(self.cache.items())]
        with open(path, "w") as f:
            json.dump({"version": 1, "entries": entries}, f, indent=1)

    def load(self, path: str) -> None:
        """Merge a saved cache (entries for the same key are replaced)."""
        with open(path) as f:
            data = json.load(f)
        if data.get("version") != 1:
            raise ValueError(f"{path}: unknown autotuner cache version {data.get('version')}")
        for entry in data["entries"]:
            self.cache[(entry["n"], entry["k"], entry["bucket"])] = Tactic(**entry["tactic"])


AUTOTUNER = Autotuner()
