"""The whole boundary chain on 2 GPUs: fused vs unfused vs reference outside
graphs, then 10,000+ CUDA-graph replays (several layers per step, M varying
across graphs, fresh random data every replay), each checked bit for bit.

``DECODE_BOUNDARY_REPLAYS`` sets the replay count (default 10,000).
"""

import os

import chain_gpu_checks as gpu_checks
import pytest

from decode_boundary.bench.launch import launch

pytestmark = pytest.mark.multigpu


def test_fused_chain_bit_identical_over_graph_replays():
    replays = int(os.environ.get("DECODE_BOUNDARY_REPLAYS", "10000"))
    results = launch(gpu_checks.check_chain, 2, ("v4.1-flash", replays), timeout_s=540)
    for rank, out in results.items():
        for check in out["verify"]:
            assert check["ok"], f"rank {rank}: {check}"
        assert out["replays"] == replays
        assert out["mismatches"] == 0, f"rank {rank}: {out['mismatches']} differing values"
        assert out["ranks_identical"], out
