"""The GEMM's backend dispatch (gemm/dispatch.py) on the CPU: the switch and its
errors, the fallback and its one line, the CuTe tactics' fit and batch-invariant
orders. The device is faked where the rule needs an sm_90 GPU: these tests hold
the decision, the GPU tests (tests/gemm/test_cute_gemm_gpu.py) what runs."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from decode_boundary.gemm import dispatch, selected_tactic
from decode_boundary.gemm.hopper import tactics as ht
from decode_boundary.gemm.tactics import Tactic, row_bucket

PACKAGE = Path(__file__).resolve().parents[2]
CUDA0 = torch.device("cuda", 0)
SHAPES = [(5120, 2048, 1), (8192, 1280, 1), (1792, 5120, 1), (2048, 4096, 2)]


@pytest.fixture
def sm90(monkeypatch):
    """A fake H100 as ``cuda:0`` (the dispatch's view of the device), kernels
    compiled, not interpreted; the DSL as installed here."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
    monkeypatch.setattr(dispatch, "interpret_mode", lambda: False)
    dispatch.cute_refusal.cache_clear()
    dispatch._SAID.clear()
    yield
    dispatch.cute_refusal.cache_clear()
    dispatch._SAID.clear()


def test_backend_switch_parses_and_names_the_bad_value(monkeypatch):
    monkeypatch.delenv(dispatch.BACKEND_ENV, raising=False)
    assert dispatch.resolve_backend() == "auto"
    for value, want in [(" CuTe ", "cute"), ("triton", "triton"), ("", "auto")]:
        monkeypatch.setenv(dispatch.BACKEND_ENV, value)
        assert dispatch.resolve_backend() == want
    monkeypatch.setenv(dispatch.BACKEND_ENV, "cutlass")
    with pytest.raises(ValueError, match=dispatch.BACKEND_ENV):
        dispatch.resolve_backend()
    with pytest.raises(ValueError, match="backend must be one of"):
        dispatch.resolve_backend("gluon")
    assert dispatch.resolve_backend("triton") == "triton"  # the argument wins


def test_cpu_runs_the_twin_and_a_forced_cute_names_why():
    tactic = selected_tactic((5120, 2048, 1), 8, device="cpu")
    assert isinstance(tactic, Tactic) and tactic.backend == "triton"
    with pytest.raises(RuntimeError, match="not a CUDA GPU"):
        selected_tactic((5120, 2048, 1), 8, backend="cute", device="cpu")


def test_fallback_without_the_dsl_says_so_once(sm90, monkeypatch, caplog):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "cutlass" else real(name, *a))
    monkeypatch.setitem(ht.TABLE, (5120, 2048, 1), {8: ht._h(1, 8, 2)})
    with caplog.at_level(logging.WARNING, logger="decode_boundary"):
        for _ in range(3):
            assert selected_tactic((5120, 2048, 1), 8, device=CUDA0).backend == "triton"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "nvidia-cutlass-dsl is not installed" in lines[0], lines
    with pytest.raises(RuntimeError, match="nvidia-cutlass-dsl is not installed"):
        selected_tactic((5120, 2048, 1), 8, backend="cute", device=CUDA0)


def test_other_gpus_fall_back(sm90, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert dispatch.cute_refusal(CUDA0) == "NVIDIA H100 is sm_100, not sm_90"
    assert selected_tactic((5120, 2048, 1), 64, device=CUDA0).backend == "triton"


cutlass = pytest.importorskip("cutlass", reason="the CuTe DSL is an optional extra")


def test_auto_takes_the_table_and_cute_takes_any_fitting_shape(sm90, monkeypatch):
    shape = (5120, 2048, 1)
    monkeypatch.setitem(ht.TABLE, shape, {16: ht._h(1, 16, 2)})
    assert selected_tactic(shape, 16, device=CUDA0) == ht._h(1, 16, 2)
    assert selected_tactic(shape, 12, device=CUDA0) == ht._h(1, 16, 2)  # its bucket
    assert selected_tactic(shape, 32, device=CUDA0).backend == "triton"  # not tabled
    for n, k, g in SHAPES:
        for rows in (1, 3, 8, 17, 64, 100):
            t = selected_tactic((n, k, g), rows, backend="cute", device=CUDA0)
            assert t.backend == "cute" and ht.fits(t, n, k, g), (n, k, g, rows, t)
            assert t.tokens == ht.tokens_for(rows)
    with pytest.raises(ValueError, match="no CuTe tactic fits N=96"):
        selected_tactic((96, 2048, 1), 8, backend="cute", device=CUDA0)


def test_batch_invariant_keeps_one_split_per_shape(sm90, monkeypatch):
    for n, k, g in SHAPES:
        picks = {rows: selected_tactic((n, k, g), rows, batch_invariant=True, backend="cute",
                                       device=CUDA0) for rows in range(1, 65)}
        assert len({t.split_k for t in picks.values()}) == 1, (n, k, g)
        assert all(t.tokens == ht.tokens_for(rows) for rows, t in picks.items())
    # Auto in the mode: one backend for every M of a shape.
    shape = (8192, 1280, 1)
    monkeypatch.setitem(ht.TABLE, shape, {1: ht._h(1, 8, 1)})  # the default's table only
    assert {selected_tactic(shape, r, batch_invariant=True, device=CUDA0).backend
            for r in range(1, 65)} == {"triton"}
    monkeypatch.setitem(ht.INVARIANT_SPLITS, shape, 2)
    assert {selected_tactic(shape, r, batch_invariant=True, device=CUDA0).split_k
            for r in range(1, 65)} == {2}


def test_fits_refuses_what_the_kernel_cannot_run():
    ok = ht.HopperTactic(2, 64, 2, 4)
    assert ht.fits(ok, 5120, 2048)
    assert not ht.fits(ok, 5120, 2048 + 32)  # K % 128
    assert not ht.fits(ok, 5120 - 64, 2048)  # N % 128
    assert not ht.fits(ok._replace(split_k=3), 5120, 2048)  # not a cluster size offered
    assert not ht.fits(ht.HopperTactic(1, 8, 8, 4), 5120, 2048)  # 4 accumulators, 8 ranks
    assert not ht.fits(ok._replace(stages=30), 5120, 2048)  # shared memory
    assert not ht.fits(ht.HopperTactic(2, 64, 1, 4), 2048 + 128, 4096, 2)  # 1088-row groups
    assert ht.max_stages(ok) >= 4 and ht.smem_bytes(ok._replace(
        stages=ht.max_stages(ok))) <= ht.SMEM_BYTES
    assert row_bucket(48) == 48 and ht.tokens_for(48) == 64 and ht.tokens_for(200) == 64


def test_import_loads_neither_triton_nor_the_dsl():
    """``import decode_boundary`` loads neither; the GEMM package loads Triton (the
    twin) but not the DSL, which only a CuTe launch or compile imports."""
    code = ("import sys, decode_boundary as db; "
            "bad = [m for m in ('triton', 'cutlass') if m in sys.modules]; assert not bad, bad; "
            "from decode_boundary.gemm import mxfp8_mm, precompile, selected_tactic; "
            "selected_tactic((5120, 2048, 1), 8, device='cpu'); "
            "assert 'cutlass' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                   env={"TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin",
                        "PYTHONPATH": str(PACKAGE)})


def test_cute_launcher_names_each_malformed_operand():
    """The CuTe launcher's contract checks (before any compile or launch): each
    error names the argument. The kernel reads the weights in FlashInfer's own
    layout (no repacked copy), so there is none to round-trip."""
    from decode_boundary.gemm.hopper.launcher import check_operands
    from decode_boundary.mxfp8.format import mxfp8_scale_bytes

    n, k, rows = 256, 512, 5
    t = ht.HopperTactic(1, 8, 1, 4)
    w = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
    ws = torch.zeros(mxfp8_scale_bytes(n, k), dtype=torch.uint8)
    a = torch.zeros(rows, k, dtype=torch.float8_e4m3fn)
    a_s = torch.zeros(mxfp8_scale_bytes(rows, k), dtype=torch.uint8)
    out = torch.zeros(rows, n, dtype=torch.bfloat16)
    check_operands(w, ws, 1, a, a_s, out, t)
    bad = {
        "weight must be contiguous": (w.t().contiguous().t(), ws, a, a_s, out, t),
        "weight_scale must be": (w, ws[:-16], a, a_s, out, t),
        "does not fit": (w, ws, a, a_s, out, t._replace(split_k=8)),
        "activation data must be": (w, ws, a[:, :256], a_s, out, t),
        "activation scale must hold": (w, ws, a, a_s[:100], out, t),
        "out must be contiguous bfloat16": (w, ws, a, a_s, out.float(), t),
        "16-byte aligned": (w, ws, a, a_s, torch.zeros(rows * n + 1, dtype=torch.bfloat16)[1:]
                            .view(rows, n), t),
    }
    for message, (w_, ws_, a_, as_, out_, t_) in bad.items():
        with pytest.raises(ValueError, match=message):
            check_operands(w_, ws_, 1, a_, as_, out_, t_)
