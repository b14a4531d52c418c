"""MXFP8 GEMMs for Hopper: the low-row Triton kernel (mxfp8_gemm_kernel.py:
CUDA-core tiles for 1..8 rows, tensor-core tiles above, optionally grouped,
BF16 input quantized in its prologue, an epilogue that publishes into the
boundary mailbox), its launcher (launcher.py: operand checks, split-K
workspace, warm-up), its tactic tables (tactics.py), ``Mxfp8Linear``, the
public entry points (``mxfp8_mm`` and ``precompile``; api.py) and their custom
ops (ops.py)."""

from . import ops  # noqa: F401  (registers torch.ops.decode_boundary.mxfp8_mm)
from .api import (
    mxfp8_eligible,
    mxfp8_mm,
    mxfp8_out_in_epilogue,
    precompile,
    selected_tactic,
    shape_representatives,
)
from .launcher import launch_low_latency, warmup_low_latency
from .linear import Mxfp8Linear, load_linear
from .reference import check_mxfp8_mm, mxfp8_mm_ref
from .tactics import (
    LOW_BATCH_MAX_ROWS,
    WIDE_LOW_LATENCY_MAX_ROWS,
    Tactic,
    default_tactic,
    invariant_tactic,
    row_bucket,
    valid_tactics,
)

__all__ = [
    "LOW_BATCH_MAX_ROWS", "Mxfp8Linear", "Tactic", "WIDE_LOW_LATENCY_MAX_ROWS",
    "check_mxfp8_mm", "default_tactic", "invariant_tactic", "launch_low_latency", "load_linear",
    "mxfp8_eligible",
    "mxfp8_mm", "mxfp8_mm_ref", "mxfp8_out_in_epilogue", "precompile", "row_bucket",
    "selected_tactic", "shape_representatives", "valid_tactics", "warmup_low_latency",
]
