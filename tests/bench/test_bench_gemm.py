"""``decode_boundary.bench.gemm``'s Inductor column on CPU: one process times
many (shape, M) pairs, each a compile of the same function, which Dynamo counts
as recompiles (the GEMM table's ninth failed on the GPU with
``FailOnRecompileLimitHit``). The timer and the compiler's backend are stood in
for (no GPU here); the recompile accounting is Dynamo's own."""

import pytest
import torch

from decode_boundary.bench import gemm as bench_gemm


@pytest.fixture
def cpu_timing(monkeypatch):
    calls = []

    def run_once(steps, *args, **kwargs):
        for step in steps:
            calls.append(step().shape)
        return 0.0

    compile_ = torch.compile

    def eager_compile(fn, *, mode, dynamic, fullgraph):
        assert mode == "max-autotune-no-cudagraphs"  # what a user's torch.compile gets
        return compile_(fn, backend="eager", dynamic=dynamic, fullgraph=fullgraph)

    monkeypatch.setattr(bench_gemm, "graph_time_us", run_once)
    monkeypatch.setattr(bench_gemm, "copies_for_cold_l2", lambda nbytes, device: 1)
    monkeypatch.setattr(bench_gemm.torch, "compile", eager_compile)
    torch.compiler.reset()
    yield calls
    torch.compiler.reset()


def _table(rows):
    w = torch.randn(1, 48, 64).bfloat16()
    for m in rows:
        bench_gemm.time_inductor_bf16(torch.randn(1, m, 64).bfloat16(), w)


def test_a_table_of_many_row_counts_compiles_each(cpu_timing):
    rows = range(1, 13)  # 12 compiles of one function: past Dynamo's default limit of 8
    _table(rows)
    assert cpu_timing == [torch.Size([1, m, 48]) for m in rows]


def test_without_the_raised_limit_the_ninth_fails(cpu_timing, monkeypatch):
    monkeypatch.setattr(bench_gemm, "RECOMPILE_LIMIT", 8)
    from torch._dynamo.exc import FailOnRecompileLimitHit

    with pytest.raises(FailOnRecompileLimitHit):  # the GPU run's error
        _table(range(1, 13))
