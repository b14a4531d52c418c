"""Process environment the library relies on.

NVLink multicast (NVLS, ``multimem.*``, ``cuMulticastCreate``) can take a shared
host's GPUs out of service, so every multi-GPU process this library starts or
joins runs with it switched off in NCCL, PyTorch symmetric memory and NVSHMEM.
Peers are reached with unicast loads and stores only.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger("decode_boundary")

NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def disable_multicast() -> None:
    """Force the no-multicast settings into this process's environment.

    Called before anything touches NCCL or symmetric memory; overriding a
    user's ``NCCL_NVLS_ENABLE=1`` is deliberate (see the module docstring).
    """
    for key, value in NO_MULTICAST_ENV.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``device`` with a bare ``"cuda"`` (or None) meaning the current CUDA device."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def interpret_mode() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_ptx(device: torch.device) -> bool:
    """Whether kernels may take their inline-PTX / PDL paths on ``device``.

    Off in the interpreter and on CPU tensors; ``DECODE_BOUNDARY_DISABLE_PTX=1``
    switches it off on a GPU too (useful to bisect a suspected PTX problem).
    """
    if interpret_mode() or device.type != "cuda":
        return False
    return os.environ.get("DECODE_BOUNDARY_DISABLE_PTX", "0") in ("", "0")


def use_pdl(device: torch.device) -> bool:
    """Whether launches use programmatic dependent launch on ``device``.

    Needs Hopper or newer; ``DECODE_BOUNDARY_DISABLE_PDL=1`` switches it off.
    """
    if not use_ptx(device):
        return False
    if os.environ.get("DECODE_BOUNDARY_DISABLE_PDL", "0") not in ("", "0"):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9
