"""Autotuner of the MXFP8 GEMM: the best tactic per (N, K, row bucket).

Keys: (N, K, groups, row bucket); buckets 1, 2, 4, 8, 16, 32, 48, then powers
of two (tactics.row_bucket). No input kind: one choice serves MXFP8 and BF16
inputs alike, so ``mxfp8_mm(layer, x)`` and ``mxfp8_mm(layer,
quantize_mxfp8(x))`` give the same bits (the summation order follows the
tactic); a tune may time either kind.
Candidates are timed with CUDA graphs on rotated weight copies (``decode_boundary.common.timing``);
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
from functools import partial

import torch

from decode_boundary.common.timing import graph_time_us, rotated_copies
from decode_boundary.mxfp8.format import QuantizedActivation, mxfp8_scale_bytes

from .launcher import launch_low_latency
from .tactics import PINNED_MIN_ROWS, Tactic, row_bucket, sweep_tactics, table_tactic

CACHE_VERSION = 3  # 2: Tactic(block_n, rows_tile, split_k, num_warps, chunk_k); keys with
# groups and the input kind. 3: keys without the input kind (one tactic for both)

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


def default_timer(layer, rows: int, tactic: Tactic, bf16_input: bool = False) -> float:
    """µs per call of ``tactic`` on ``rows`` random rows (MXFP8, or BF16 quantized
    in the prologue), L2 cold (GPU only)."""
    if layer.weight.device.type != "cuda":
        raise RuntimeError("the autotuner times on a CUDA device; pass timer= elsewhere")
    copies = rotated_copies(layer)
    width = getattr(layer, "groups", 1) * layer.weight.shape[0]
    device = layer.weight.device
    out = torch.empty(rows, layer.weight.shape[1], dtype=torch.bfloat16, device=device)
    if bf16_input:
        x = torch.randn(rows, width, device=device).bfloat16()
        return graph_time_us([partial(launch_low_latency, c, x, out, tactic) for c in copies],
                             device)
    # Random bytes, not zeros (zeros can run faster than real data); NaN-free
    # e4m3 codes and scale bytes near 127 keep the sums finite.
    data = torch.randint(0, 0x7E, (rows, width), dtype=torch.uint8, device=device)
    scale = torch.randint(120, 128, (mxfp8_scale_bytes(rows, width),), dtype=torch.uint8,
                          device=device)
    qa = QuantizedActivation(data.view(torch.float8_e4m3fn), scale, torch.bfloat16,
                             data.shape)
    return graph_time_us([partial(launch_low_latency, c, qa, out, tactic) for c in copies], device)


def cache_key(layer, rows: int) -> tuple[int, int, int, int]:
    """The autotuner's key of ``layer`` at ``rows`` rows: (N, K, groups, row bucket)."""
    k, n = layer.weight.shape
    return n, k, getattr(layer, "groups", 1), row_bucket(rows)


class Autotuner:
    """Cache (N, K, groups, row bucket) -> Tactic, for both input kinds, filled
    by :meth:`tune`."""

    def __init__(self) -> None:
        self.cache: dict[tuple[int, int, int, int], Tactic] = {}

    def lookup(self, n: int, k: int, rows: int, groups: int = 1) -> Tactic | None:
        return self.cache.get((n, k, groups, row_bucket(rows)))

    def candidates(self, n: int, k: int, rows: int, groups: int = 1) -> list[Tactic]:
        """Tactics offered for (N, K, groups, rows): only the pinned one under
        pinned_tactics() for a pinned problem, else a small sweep."""
        pinned = table_tactic(n, k, rows, groups)
        if _pinned_only and pinned is not None and rows >= PINNED_MIN_ROWS:
            return [pinned]
        return sweep_tactics(n, k, rows, groups)

    def tune(self, layer, rows: int, timer: Callable[..., float] = default_timer,
             bf16_input: bool = False) -> Tactic:
        """Time the candidates for ``layer`` at ``rows`` rows (the bucket's
        largest count, so the chosen tiles cover every row of the bucket) and
        cache the fastest; ties keep the earlier (default-first) candidate.
        ``timer(layer, rows, tactic, bf16_input)`` returns µs; ``bf16_input``
        only says which input kind is timed: the winner serves both kinds."""
        key = n, k, groups, bucket = cache_key(layer, rows)
        offered = self.candidates(n, k, bucket, groups)
        timed = [(timer(layer, bucket, t, bf16_input), i, t) for i, t in enumerate(offered)]
        best = min(timed)[2]
        self.cache[key] = best
        return best

    def save(self, path: str) -> None:
        entries = [{"n": n, "k": k, "groups": g, "bucket": b, "tactic": t._asdict()}
                   for (n, k, g, b), t in sorted(self.cache.items())]
        with open(path, "w") as f:
            json.dump({"version": CACHE_VERSION, "entries": entries}, f, indent=1)

    def load(self, path: str) -> None:
        """Merge a saved cache (entries for the same key are replaced)."""
        with open(path) as f:
            data = json.load(f)
        if data.get("version") != CACHE_VERSION:
            raise ValueError(f"{path}: autotuner cache version {data.get('version')}, this "
                             f"library reads version {CACHE_VERSION} (re-tune)")
        for entry in data["entries"]:
            key = (entry["n"], entry["k"], entry["groups"], entry["bucket"])
            self.cache[key] = Tactic(**entry["tactic"])


AUTOTUNER = Autotuner()
