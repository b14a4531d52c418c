"""BoundaryAllReduce on 2 GPUs (one process each): every variant against the
reference, ranks bit-identical, many CUDA-graph replays with random M and
data, a rank that skips a step, and the NCCL fallback.

``DECODE_BOUNDARY_REPLAYS`` sets the replay count (default 10,000).
"""

import os

import boundary_gpu_checks as gpu_checks
import pytest

from decode_boundary.bench.launch import launch

pytestmark = pytest.mark.multigpu
HIDDEN = int(os.environ.get("DECODE_BOUNDARY_TEST_HIDDEN", "5120"))


@pytest.mark.parametrize("transport", ["mailbox", "nccl"])
def test_variants_match_reference_on_every_rank(transport):
    results = launch(gpu_checks.check_variants, 2, (transport, HIDDEN), timeout_s=300)
    for rank, per_variant in results.items():
        for variant, (bad, same) in per_variant.items():
            assert bad == 0, f"rank {rank} {variant}: {bad} mismatches"
            assert same, f"{variant}: ranks differ"


def test_graph_replays_random_m_all_checked():
    replays = int(os.environ.get("DECODE_BOUNDARY_REPLAYS", "10000"))
    results = launch(gpu_checks.check_graph_replays, 2, (replays, HIDDEN), timeout_s=600)
    for rank, out in results.items():
        assert out["replays"] == replays
        assert out["mismatches"] == 0, f"rank {rank}: {out}"


def test_skipped_step_raises_naming_the_rank_then_reset_recovers():
    timeout_s = 1.0  # also the host skew the post-reset step must tolerate
    results = launch(gpu_checks.check_skipped_step, 2, (timeout_s, HIDDEN), timeout_s=120)
    for step in ("plain", "full"):
        raised = results[0][f"raised_{step}"]
        assert "rank(s) [1] did not publish" in raised, (step, results[0])
        assert results[0][f"seconds_{step}"] < timeout_s + 2.0, (step, results[0])
        assert all(out[f"exact_after_reset_{step}"] for out in results.values()), results
