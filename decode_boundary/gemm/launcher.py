"""Launcher of the low-row MXFP8 GEMM kernel (``mxfp8_gemm_kernel.py``): operand
checks, the split-K workspace, compile-ahead warm-up and the launch.

**What it checks** (a malformed call raises ``ValueError`` here, never reaches
the kernel): the weight is a 2-D float8_e4m3fn column-major [K, N] view of a
contiguous [N, K] tensor with a 128x4-swizzled scale buffer
(``check_scale_buffer``) and ``groups`` a positive int dividing N
(:func:`weight_operands`); the activation is a contiguous BF16 [rows, G*K]
tensor or a ``QuantizedActivation`` with contiguous e4m3 [rows, G*K] data and a
scale buffer for it; ``out`` is contiguous BF16 [rows, N]; the tactic fits
(N, K, groups) (``tactics.fits``: K % 32 == 0, (N/G) % BLOCK_N == 0, at most
``MAX_PIECES`` pieces, no empty split or piece); every operand is on the
weight's device and 16-byte aligned; a ``publish`` target passes
``check_publish_target`` (peer table, stage words, rank, N == hidden with
N % 8 == 0, rows <= capacity). The peer mailbox addresses' alignment is checked
only by :func:`warmup_low_latency` (reading the table synchronizes the host, so
a launch, possibly under capture, does not); ``precompile(..., publish=...)``,
which ``PublishingMxfp8Linear.precompile`` runs, goes through it.

**What the kernel then assumes** (its module docstring): that layout and
alignment, without checking anything; M >= 1 (a launch of 0 rows launches
nothing); split-K counters that are zero at launch (allocated zeroed, re-armed
by the kernel) in a workspace that no launch on another stream uses at the same
time (one cache per device and size, shared by every layer; launches on one
stream are ordered).

Workspaces are allocated outside CUDA-graph capture only (:func:`precompile
<decode_boundary.gemm.api.precompile>` or an eager call first) and kept for
the process's lifetime, since a captured graph may hold them.
"""

from __future__ import annotations

import torch

from decode_boundary.common.contract import NO_PUBLISH, check_publish_target
from decode_boundary.common.timeline import launch_args
from decode_boundary.env import interpret_mode, use_pdl
from decode_boundary.mxfp8.format import QuantizedActivation, check_scale_buffer, mxfp8_scale_bytes

from .mxfp8_gemm_kernel import mxfp8_gemm_kernel
from .tactics import Tactic, fits, k_pieces

# ``publish`` arguments below: a ``decode_boundary.common.contract.PublishTarget``
# (or any object with its attributes); ``NO_PUBLISH`` when the GEMM does not publish.
_WORKSPACES: dict[tuple[torch.device, int], torch.Tensor] = {}
_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}
_DUMMIES: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def weight_operands(layer) -> tuple[torch.Tensor, torch.Tensor, int, int, int]:
    """(e4m3 [N, K] storage, swizzled scales, N, K, groups) of ``layer``, checked.
    ``layer.groups`` (default 1) > 1 marks a grouped layer (module docstring)."""
    weight, scale = layer.weight, layer.weight_scale
    groups = getattr(layer, "groups", 1)
    if weight.dtype != torch.float8_e4m3fn or weight.ndim != 2:
        raise ValueError(f"layer.weight must be a 2-D float8_e4m3fn [K, N] view, got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    k, n = weight.shape
    storage = weight.t()
    if not storage.is_contiguous():
        raise ValueError("layer.weight must be the column-major [K, N] view of a contiguous "
                         "[N, K] tensor (layer.weight.t().is_contiguous())")
    check_scale_buffer(scale, n, k, "layer.weight_scale")
    if not isinstance(groups, int) or groups < 1 or n % groups:
        raise ValueError(f"layer.groups must be a positive int dividing N={n}, got {groups!r}")
    return storage, scale, n, k, groups


def _aligned(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.data_ptr() % 16:
            raise ValueError(f"GEMM operands must be 16-byte aligned; got {t.dtype} "
                             f"{tuple(t.shape)} at {t.data_ptr():#x}")


def _cached(cache: dict, device: torch.device, nbytes: int, make) -> torch.Tensor:
    """A buffer of >= nbytes for ``device``, sized to a power of two and kept
    forever (a captured graph may hold it); never allocated during capture."""
    size = max(4096, 1 << (nbytes - 1).bit_length())
    key = (device, size)
    buf = cache.get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("MXFP8 GEMM workspace missing during CUDA graph capture: call "
                               "decode_boundary.gemm.precompile(layer, rows) before capturing")
        buf = cache[key] = make(size, device)
    return buf


def _buffers(device: torch.device, n: int, rows: int, tactic: Tactic, publish=None):
    """(partials, counters, peer_ptrs, stage_state) arguments of one launch."""
    if device not in _DUMMIES:
        _DUMMIES[device] = (torch.zeros(4, dtype=torch.float32, device=device),
                            torch.zeros(2, dtype=torch.int64, device=device),
                            torch.zeros(2, dtype=torch.int32, device=device))
    partials, peer_ptrs, stage_state = _DUMMIES[device]
    counters = _DUMMIES[device][2]
    if tactic.split_k > 1:
        m_tiles = -(-rows // tactic.rows_tile)
        nbytes = m_tiles * n * tactic.rows_tile * tactic.split_k * 4
        partials = _cached(_WORKSPACES, device, nbytes,
                           lambda size, d: torch.empty(size // 4, dtype=torch.float32, device=d))
        counters = _cached(_COUNTERS, device, m_tiles * (n // tactic.block_n) * 4,
                           lambda size, d: torch.zeros(size // 4, dtype=torch.int32, device=d))
    if publish is not None:
        peer_ptrs, stage_state = publish.peer_ptrs, publish.stage_state
    return partials, counters, peer_ptrs, stage_state


def _check_activation(a, rows: int, a_k: int) -> bool:
    """Validate the activation operand; True when it is BF16 (quantized in the kernel)."""
    if isinstance(a, torch.Tensor):
        if a.dtype != torch.bfloat16 or tuple(a.shape) != (rows, a_k) or not a.is_contiguous():
            raise ValueError(f"activation must be contiguous bfloat16 [rows, {a_k}] (or an MXFP8 "
                             f"QuantizedActivation), got {a.dtype} {tuple(a.shape)}")
        return True
    data, scale = a.data, a.scale
    if data.dtype != torch.float8_e4m3fn or tuple(data.shape) != (rows, a_k) or \
            not data.is_contiguous():
        raise ValueError(f"activation data must be contiguous float8_e4m3fn [rows, {a_k}], got "
                         f"{data.dtype} {tuple(data.shape)}")
    check_scale_buffer(scale, rows, a_k, "activation scale")
    return False


def _launch_config(layer, a, out, tactic: Tactic, publish):
    """(grid, positional args, keyword args) shared by launch and warmup, so a
    warmed-up kernel is exactly the one a launch looks up. ``a`` is a BF16
    [rows, G*K] tensor or a QuantizedActivation (2-D data)."""
    storage, w_scale, n, k, groups = weight_operands(layer)
    bf16 = isinstance(a, torch.Tensor)
    rows = (a if bf16 else a.data).shape[0]
    device = storage.device
    a_bf16 = _check_activation(a, rows, groups * k)
    a_data, a_scale = (a, a) if a_bf16 else (a.data, a.scale)
    if out.dtype != torch.bfloat16 or tuple(out.shape) != (rows, n) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous bfloat16 [{rows}, {n}], got {out.dtype} "
                         f"{tuple(out.shape)}")
    if not fits(tactic, n, k, groups):
        raise ValueError(f"tactic {tactic} is not valid for N={n}, K={k}, groups={groups}")
    if any(t.device != device for t in (a_data, a_scale, out)):
        raise ValueError(f"weight, activations and out must share one device ({device})")
    _aligned(storage, w_scale, a_data, a_scale, out)
    if publish is not None:
        check_publish_target(publish, n, rows, device)
    buffers = _buffers(device, n, rows, tactic, publish)
    grid = (n // tactic.block_n, tactic.split_k, -(-rows // tactic.rows_tile))
    stamps, first_slot, timeline = launch_args("mxfp8_gemm_kernel", grid[0] * grid[1] * grid[2],
                                               device, buffers[0])
    pub = publish or NO_PUBLISH
    k_slice, pieces = k_pieces(k, tactic)
    pdl = use_pdl(device)
    kwargs = dict(
        N=n, K=k, GROUPS=groups, BLOCK_N=tactic.block_n, ROWS=tactic.rows_tile,
        SPLIT_K=tactic.split_k, K_SLICE=k_slice, CHUNK=tactic.chunk_k, PIECES=pieces,
        A_BF16=a_bf16, USE_PDL=pdl, INTERPRETER=interpret_mode(), PUBLISH=publish is not None,
        TP=pub.tp, RANK=pub.rank, CAPACITY=pub.capacity, HIDDEN=pub.hidden,
        TIMELINE=timeline, num_warps=tactic.num_warps, num_stages=1, launch_pdl=pdl,
    )
    return grid, (storage, w_scale, a_data, a_scale, out, *buffers, stamps, first_slot, rows), \
        kwargs


def launch_low_latency(layer, a, out: torch.Tensor, tactic: Tactic, publish=None) -> torch.Tensor:
    """``out`` [rows, N] (BF16) = ``a`` @ ``layer.weight`` with ``tactic`` on the
    current stream; ``a`` is MXFP8 (``QuantizedActivation``, 2-D data) or a BF16
    [rows, G*K] tensor quantized in the prologue; with ``publish``, also into
    the mailbox (module docstring)."""
    grid, args, kwargs = _launch_config(layer, a, out, tactic, publish)
    if args[-1]:
        mxfp8_gemm_kernel[grid](*args, **kwargs)
    return out


def warmup_low_latency(layer, rows: int, tactic: Tactic, publish=None, bf16_input: bool = False):
    """Compile (launch nothing) the kernel ``launch_low_latency`` runs for
    ``rows`` rows, ``tactic`` and the input kind, and allocate its workspace;
    returns the compiled kernel (None in the interpreter). Peer addresses are
    checked here, outside any capture: a host read of the table would synchronize."""
    storage, _, n, k, groups = weight_operands(layer)
    device = storage.device
    a_k = groups * k
    if bf16_input:
        a = torch.empty(rows, a_k, dtype=torch.bfloat16, device=device)
    else:
        a = QuantizedActivation(
            torch.empty(rows, a_k, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(mxfp8_scale_bytes(rows, a_k), dtype=torch.uint8, device=device),
            torch.bfloat16, torch.Size((rows, a_k)))
    out = torch.empty(rows, n, dtype=torch.bfloat16, device=device)
    if publish is not None and any(ptr % 16 for ptr in publish.peer_ptrs.tolist()):
        raise ValueError("publish.peer_ptrs must hold 16-byte aligned mailbox addresses")
    grid, args, kwargs = _launch_config(layer, a, out, tactic, publish)
    return mxfp8_gemm_kernel.warmup(*args, grid=grid, **kwargs)
