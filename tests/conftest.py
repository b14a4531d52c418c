"""Two suites share these files.

* CPU suite (the default, CI): every kernel runs in the Triton interpreter on
  CPU tensors. ``TRITON_INTERPRET=1`` is set here, before any kernel module is
  imported, because ``triton.jit`` reads it when a kernel is decorated.
  Tests marked ``gpu`` / ``multigpu`` are skipped.
* GPU suite (``DECODE_BOUNDARY_GPU_TESTS=1``, see scripts/gpu_tests.sh): only
  the ``gpu`` / ``multigpu`` tests run, compiled for the real device.
"""

import os
import sys
from pathlib import Path

import pytest

# tests/ has a folder per role; what they share (inputs, checks, references, the GPU
# checks ranks run) is tests/helpers/, imported by module name.
sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))

GPU_SUITE = os.environ.get("DECODE_BOUNDARY_GPU_TESTS", "0") not in ("", "0")
if not GPU_SUITE:
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    import torch

    gpus = torch.cuda.device_count() if GPU_SUITE else 0
    for item in items:
        needs_gpu = "gpu" in item.keywords
        needs_multigpu = "multigpu" in item.keywords
        if not GPU_SUITE:
            if needs_gpu or needs_multigpu:
                item.add_marker(pytest.mark.skip(reason="GPU test (run scripts/gpu_tests.sh)"))
        elif not (needs_gpu or needs_multigpu):
            item.add_marker(pytest.mark.skip(reason="CPU/interpreter test; GPU suite runs"))
        elif needs_multigpu and gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2 GPUs, found {gpus}"))
        elif needs_gpu and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture
def cooperative_in_the_interpreter(monkeypatch):
    """Let consume launch cooperative full-mode tactics in the interpreter (it
    refuses them there: the programs would run one by one) and run every launch's
    programs concurrently (tests/helpers/concurrent_programs.py), so the programs of a
    token do meet."""
    from concurrent_programs import concurrent_programs

    from decode_boundary.boundary import consumer
    from decode_boundary.boundary.consumer_kernel import RESIDUAL_ONLY

    check = consumer.check_tactic
    monkeypatch.setattr(consumer, "check_tactic",
                        lambda tactic, hidden, mode, mixes=False, mixes_kernel=False: check(
                            tactic, hidden, RESIDUAL_ONLY, mixes, mixes_kernel))
    with concurrent_programs():
        yield
