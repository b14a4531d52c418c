"""A dead peer on 2 GPUs (one process each, NCCL group, peer mailboxes): rank 1
exits with ``os._exit`` after a good step; the survivor's next step raises
RuntimeError naming rank 1 within ``wait_timeout_s`` (the consumer's bounded
wait, its outputs NaN), and its ``reset(collective=True)`` raises naming rank 1
within ``host_timeout_s`` (docs/FAILURES.md). The CPU version of this test
(gloo, the gather transport) is tests/boundary/test_boundary_failure_processes.py.
"""

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from survivors import report_and_exit, run_ranks, timed_error

from decode_boundary.bench.launch import free_port

pytestmark = pytest.mark.multigpu
HIDDEN, HC, CAP, M, EPS = 5120, 4, 8, 2, 1e-6
WAIT_TIMEOUT_S, HOST_TIMEOUT_S = 1.0, 3.0


def _step(ar, gen, rank, device):
    xs = torch.randn(2, M, HIDDEN, generator=gen, device=device).bfloat16()
    residual = torch.randn(M, HC, HIDDEN, generator=gen, device=device).bfloat16()
    post = torch.rand(M, HC, generator=gen, device=device)
    comb = torch.rand(M, HC, HC, generator=gen, device=device)
    pre = torch.rand(M, HC, generator=gen, device=device)
    gamma = torch.ones(HIDDEN, dtype=torch.bfloat16, device=device)
    return ar(xs[rank].clone(), residual=residual, post=post, comb=comb, pre=pre,
              norm_weight=gamma, norm_eps=EPS)


def _rank(rank: int, port: int, results) -> None:
    def body() -> dict:
        from decode_boundary.boundary.all_reduce import BoundaryAllReduce  # sets NVLS off

        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2, timeout=timedelta(seconds=60), device_id=device)
        ar = BoundaryAllReduce(HIDDEN, HC, CAP, 2, group=dist.group.WORLD, residual_only=False,
                               device=device, wait_timeout_s=WAIT_TIMEOUT_S, transport="mailbox")
        ar.host_timeout_s = HOST_TIMEOUT_S
        ar.precompile([M])
        gen = torch.Generator(device=device).manual_seed(5)
        _step(ar, gen, rank, device)  # one good step on both
        torch.cuda.synchronize(device)
        if rank == 1:
            os._exit(3)  # dies mid-run, without a word
        out = {}
        ar.launches.guard.check = lambda: None  # keep the step's outputs, check after
        start = time.monotonic()
        res, layer, *_ = _step(ar, gen, rank, device)
        del ar.launches.guard.check
        out["step"], _ = timed_error(ar.check)
        out["step_s"] = time.monotonic() - start
        out["nan"] = bool(res.isnan().any()) and bool(layer.isnan().any())
        out["reset"], out["reset_s"] = timed_error(lambda: ar.reset(collective=True))
        return out

    report_and_exit(rank, results, body)


def test_dead_peer_on_gpus_is_named_by_the_step_and_by_reset_within_the_bounds():
    got, procs = run_ranks(_rank, 2, (free_port(),), reports=1, timeout_s=180)
    assert procs[1].exitcode == 3
    out = got.get(0)
    assert isinstance(out, dict), got
    assert "rank(s) [1] did not publish" in out["step"], out
    assert out["step_s"] < WAIT_TIMEOUT_S + 2.0 and out["nan"], out
    assert "rank(s) [1] did not reach the reset-a barrier" in out["reset"], out
    assert out["reset_s"] < HOST_TIMEOUT_S + 3.0, out
