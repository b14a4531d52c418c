"""Which backend runs a GEMM: the CuTe DSL kernel on Hopper (``gemm/hopper/``)
or its Triton twin (``mxfp8_gemm_kernel.py``). The one place that decides.

**The switch.** ``backend=`` on ``mxfp8_mm``, ``precompile`` and
``selected_tactic`` (None reads ``DECODE_BOUNDARY_GEMM_BACKEND``; unset means
``"auto"``):

* ``"triton"``: the twin, everywhere (its tables: ``tactics.py``);
* ``"cute"``: the CuTe kernel, at every row count (``hopper.tactics``: the table's
  tactic, else its heuristic); a device or an install where it cannot run, or a
  shape no CuTe tactic fits, is an error naming why;
* ``"auto"``: the CuTe kernel where it can run and ``hopper.tactics.TABLE``
  holds a tactic for the shape and row bucket (it measured faster there), else
  the twin. Where it cannot run on a CUDA device, it says so once per process,
  in one line (logger ``decode_boundary``). In batch-invariant mode one backend
  serves every row count of a shape (a row's bits must not depend on M): the
  CuTe kernel where ``hopper.tactics.INVARIANT_SPLITS`` holds the shape.

**Where the CuTe kernel can run**: a CUDA device of compute capability 9.0
(H100, H200), kernels not in Triton's interpreter, and ``nvidia-cutlass-dsl``
importable (``pip install decode-boundary[hopper]``). Checked once per device.

The epilogues only the twin has (publishing into the mailbox, finishing the
consumer's mixes, MXFP8 written by the epilogue) are chosen by their callers
with ``backend="triton"``: the chain and ``PublishingMxfp8Linear`` run the twin
at every GEMM, so their fused and unfused paths keep one summation order.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from decode_boundary.env import interpret_mode, logger

from . import tactics
from .hopper import tactics as hopper_tactics

BACKEND_ENV = "DECODE_BOUNDARY_GEMM_BACKEND"
BACKENDS = ("auto", "triton", "cute")


def resolve_backend(given: str | None = None) -> str:
    """``given``, or the environment's (module docstring); anything else than
    ``BACKENDS`` is a ``ValueError`` naming the argument or the variable."""
    if given is None:
        raw = os.environ.get(BACKEND_ENV, "")
        value = raw.strip().lower() or "auto"
        if value not in BACKENDS:
            raise ValueError(f"environment variable {BACKEND_ENV}={raw!r}: expected one of "
                             f"{', '.join(BACKENDS)}")
        return value
    if given not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)} (or None: "
                         f"{BACKEND_ENV}), got {given!r}")
    return given


@functools.cache
def cute_refusal(device: torch.device) -> str | None:
    """Why the CuTe kernel cannot run on ``device`` (None: it can)."""
    if device.type != "cuda":
        return f"the device is {device.type}, not a CUDA GPU"
    if interpret_mode():
        return "Triton's interpreter is selected (TRITON_INTERPRET=1)"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}, not sm_90"
    if importlib.util.find_spec("cutlass") is None:
        return ("nvidia-cutlass-dsl is not installed (pip install 'decode-boundary[hopper]')")
    try:
        from .hopper import launcher  # noqa: F401  (imports the DSL)
    except Exception as error:  # noqa: BLE001  (any import failure is the reason)
        return f"the CuTe DSL did not import: {type(error).__name__}: {error}"
    return None


_SAID: set[str] = set()


def _say_fallback(device: torch.device, reason: str) -> None:
    """Auto mode's one line per reason and process (on CUDA devices only: on a
    CPU the twin is the only path)."""
    if device.type == "cuda" and reason not in _SAID:
        _SAID.add(reason)
        logger.warning("decode_boundary: MXFP8 GEMMs run the Triton twin, not the CuTe DSL "
                       "kernel: %s", reason)


def select(n: int, k: int, rows: int, groups: int, invariant: bool, backend: str | None,
           device: torch.device) -> tactics.Tactic | hopper_tactics.HopperTactic:
    """The tactic a GEMM of (N, K, groups) at ``rows`` rows runs on ``device``:
    a ``HopperTactic`` (CuTe) or a ``Tactic`` (the twin); module docstring."""
    backend = resolve_backend(backend)
    if backend == "triton":
        return tactics.tactic_for(n, k, rows, groups, invariant)
    refusal = cute_refusal(device)
    if backend == "cute":
        if refusal is not None:
            raise RuntimeError(f"backend='cute' ({BACKEND_ENV} or the argument) cannot run: "
                               f"{refusal}")
        found = (hopper_tactics.invariant_tactic(n, k, rows, groups) if invariant else
                 hopper_tactics.table_tactic(n, k, rows, groups) or
                 hopper_tactics.heuristic_tactic(n, k, rows, groups))
        if found is None:
            raise ValueError(f"backend='cute': no CuTe tactic fits N={n}, K={k}, "
                             f"groups={groups} (hopper.tactics.fits: K % 128 == 0, N % 128 "
                             "== 0, whole 64-row blocks per group)")
        return found
    if refusal is not None:
        _say_fallback(device, refusal)
        return tactics.tactic_for(n, k, rows, groups, invariant)
    if invariant:
        if (n, k, groups) in hopper_tactics.INVARIANT_SPLITS:
            found = hopper_tactics.invariant_tactic(n, k, rows, groups)
            if found is not None:
                return found
        return tactics.tactic_for(n, k, rows, groups, invariant)
    found = hopper_tactics.table_tactic(n, k, rows, groups)
    return found if found is not None else tactics.tactic_for(n, k, rows, groups, invariant)


def is_cute(tactic) -> bool:
    """Whether ``tactic`` runs the CuTe kernel."""
    return isinstance(tactic, hopper_tactics.HopperTactic)
