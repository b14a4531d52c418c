"""Process environment the library relies on.

NVLink multicast (NVLS, ``multimem.*``, ``cuMulticastCreate``) can take a shared
host's GPUs out of service, so every multi-GPU process this library starts or
joins runs with it switched off in NCCL, PyTorch symmetric memory and NVSHMEM.
Peers are reached with unicast loads and stores only.

The switches are process environment variables that NCCL, symmetric memory and
NVSHMEM read when a communicator (or heap) is created, and NCCL keeps the first
value it read for the life of the process. So they must be in the environment
before the first collective, if possible before ``init_process_group``:
:func:`disable_multicast` sets them, and importing this module (which every
module of the package that touches a process group does) calls it once.
Every entry point that may touch a process group or symmetric memory calls it
again first thing (``BoundaryAllReduce``, ``launch``, the baselines); with a
group it also refuses an NCCL group that may have been created with multicast
possible (:func:`disable_multicast`).

Without a CUDA device the kernels can only run in Triton's CPU interpreter, which
``triton.jit`` chooses when a function is decorated (``TRITON_INTERPRET``, read
then): :func:`select_interpreter` sets ``TRITON_INTERPRET=1`` at this module's
import where no CUDA device is visible and the variable is unset, and says so once
(a ``UserWarning``). A process that imported Triton before this package is told
what to set instead: Triton's own jit functions are already compiled-mode then.

The library's own switches (``DECODE_BOUNDARY_*``) are read with
:func:`env_flag`: ``1/0``, ``true/false``, ``yes/no``, ``on/off`` (any case,
surrounding spaces ignored), unset or empty meaning the default; anything else
raises ``ValueError``.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

import torch

logger = logging.getLogger("decode_boundary")

NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

# The variables of NO_MULTICAST_ENV this process set while torch.distributed was
# already initialized, with the value each had before (None: unset). A
# communicator created before that moment may have read the old value.
_SET_LATE: dict[str, str | None] = {}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _distributed_initialized() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


def disable_multicast(group=None) -> None:
    """Force the no-multicast settings into this process's environment; with
    ``group``, also check that its communicator cannot predate them.

    Called first thing by every entry point that may touch a process group or
    symmetric memory; overriding a user's ``NCCL_NVLS_ENABLE=1`` is deliberate
    (see the module docstring). Local (no collective), cheap, idempotent.

    ``group`` (a ``ProcessGroup`` with an NCCL backend): raises
    ``RuntimeError`` when this process had to set ``NCCL_NVLS_ENABLE=0``
    itself while ``torch.distributed`` was already initialized, i.e. the
    group's communicator may have been created (eagerly, or at an earlier
    collective) with NVLS possible, and NCCL keeps the value it read first.
    Nothing is changed by the refusal beyond the environment.

    Residual risk: we cannot see how an existing communicator was configured.
    Not detected: a variable set by someone else after the communicator was
    created but before this call; NCCL communicators created outside
    ``torch.distributed`` (another library's NCCL, before any process group);
    symmetric memory or NVSHMEM heaps created before these variables were set.
    Conservative: an NCCL group initialized before the variables were set but
    that has run no collective yet (so no communicator yet) is refused too.
    """
    if _distributed_initialized():
        for key, value in NO_MULTICAST_ENV.items():
            if os.environ.get(key) != value:
                _SET_LATE.setdefault(key, os.environ.get(key))
    for key, value in NO_MULTICAST_ENV.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
    if group is not None:
        _check_group(group)


def _check_group(group) -> None:
    backend = str(torch.distributed.get_backend(group)).lower()
    if "nccl" not in backend or "NCCL_NVLS_ENABLE" not in _SET_LATE:
        return
    before = _SET_LATE["NCCL_NVLS_ENABLE"]
    raise RuntimeError(
        f"decode_boundary: this NCCL process group (backend {backend!r}) was initialized "
        f"before NCCL_NVLS_ENABLE=0 was in the environment (it was "
        f"{'unset' if before is None else repr(before)}), so its communicator may use NVLink "
        "multicast (NVLS), which must never run on these machines. Set "
        + ", ".join(f"{k}={v}" for k, v in NO_MULTICAST_ENV.items())
        + " in the environment of every rank, or import decode_boundary.env / call "
        "decode_boundary.env.disable_multicast(), before torch.distributed.init_process_group "
        "(decode_boundary.bench.launch does this)")


def env_flag(name: str, default: bool = False) -> bool:
    """The boolean switch ``name`` of the environment (module docstring):
    ``default`` when unset or empty; raises ``ValueError`` naming the variable
    and its value for anything but 1/0, true/false, yes/no, on/off."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"environment variable {name}={raw!r}: expected one of "
                     f"{'/'.join(_TRUE)} or {'/'.join(_FALSE)} (any case)")


BATCH_INVARIANT_ENV = "DECODE_BOUNDARY_BATCH_INVARIANT"


def batch_invariant(given: bool | None = None) -> bool:
    """Whether batch-invariant mode is on: ``given`` where it is a bool, else
    ``DECODE_BOUNDARY_BATCH_INVARIANT`` (:func:`env_flag`, default off), read
    now. ``mxfp8_mm`` and ``precompile`` read it at each call that passes
    None; ``BoundaryAllReduce`` and ``AttentionBoundary`` once, at
    construction."""
    if given is None:
        return env_flag(BATCH_INVARIANT_ENV)
    if not isinstance(given, bool):
        raise ValueError(f"batch_invariant must be True, False or None (the environment's "
                         f"{BATCH_INVARIANT_ENV}), got {given!r}")
    return given


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``device`` with a bare ``"cuda"`` (or None) meaning the current CUDA device."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def interpret_mode() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET``,
    read as Triton itself reads it: 1, true, on, yes or y in any case)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes", "y")


def use_ptx(device: torch.device) -> bool:
    """Whether kernels may take their inline-PTX / PDL paths on ``device``.

    Off in the interpreter and on CPU tensors; ``DECODE_BOUNDARY_DISABLE_PTX=1``
    switches it off on a GPU too (useful to bisect a suspected PTX problem).
    Read at each launch: a caller that derives something from it (the
    consumer's wait bound) must take both from the same call.
    """
    if interpret_mode() or device.type != "cuda":
        return False
    return not env_flag("DECODE_BOUNDARY_DISABLE_PTX")


def use_pdl(device: torch.device) -> bool:
    """Whether launches use programmatic dependent launch on ``device``.

    Needs Hopper or newer; ``DECODE_BOUNDARY_DISABLE_PDL=1`` switches it off.
    """
    if not use_ptx(device):
        return False
    if env_flag("DECODE_BOUNDARY_DISABLE_PDL"):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def select_interpreter() -> bool:
    """Set ``TRITON_INTERPRET=1`` where no CUDA device is visible and the
    variable is unset, before Triton is imported (module docstring); True when
    it did. ``torch.cuda.device_count`` asks NVML, not the CUDA driver, so a
    process that forks workers later can still use CUDA in them. Warns once
    either way: that the kernels run in the interpreter, or, Triton being
    imported already, what to set for them to run on CPU."""
    if "TRITON_INTERPRET" in os.environ or torch.cuda.device_count() > 0:
        return False
    if "triton" in sys.modules:
        warnings.warn("decode_boundary: no CUDA device is visible and Triton was imported "
                      "before this package, so its kernels cannot run on CPU in this "
                      "process: set TRITON_INTERPRET=1 before importing Triton", stacklevel=3)
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    warnings.warn("decode_boundary: no CUDA device is visible: the kernels run in Triton's CPU "
                  "interpreter (TRITON_INTERPRET=1 set; slow, for correctness only)",
                  stacklevel=3)
    return True


disable_multicast()  # at import: before any process group this process may create later
select_interpreter()  # at import: before anything of this package imports Triton
