"""Launcher of the low-row MXFP8 GEMM kernel (``mxfp8_gemm_kernel.py``): operand
checks, the split-K workspace, compile-ahead warm-up and the launch.

**What it checks** (a malformed call raises ``ValueError`` here, never reaches
the kernel): the weight is a 2-D float8_e4m3fn column-major [K, N] view of a
contiguous [N, K] tensor with a 128x4-swizzled scale buffer
(``check_scale_buffer``) and ``groups`` a positive int dividing N
(:func:`weight_operands`); the activation is a contiguous BF16 [rows, G*K]
tensor or a ``QuantizedActivation`` with contiguous e4m3 [rows, G*K] data and a
scale buffer for it; ``out`` is contiguous BF16 [rows, N], or a
``QuantizedActivation`` [rows, N] (e4m3 data and a scale buffer for it) with a
tactic whose ``block_n`` is a multiple of 32 and no ``publish``; the tactic fits
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
time (launches on one stream are ordered).

**Split-K scratch belongs to the stream that launches.** The workspace and
arrival counters of a split-K tactic (a tactic of ``split_k`` 1 needs none) are
cached per (device, stream, size): the stream is
``torch.cuda.current_stream(device)`` at the launch (its ``stream_id``; a CPU
or interpreter launch has one stream), the size the request rounded up to a
power of two. Two GEMMs of one size on two streams (prefill and decode
overlapping, two models in one process, two threads) therefore never share
partials or counters; launches on one stream share them in stream order,
which, with the kernel's re-arming, keeps every counter zero at every launch.
Scratch is kept for the process's lifetime, since a captured graph may hold it.

**CUDA graphs.** Scratch is never allocated during capture: a capture finds
the scratch of the stream it captures on, or raises ``RuntimeError`` naming
that stream and :func:`precompile <decode_boundary.gemm.api.precompile>`. So
*precompile (or run once eagerly) on the stream you capture on*, or name it:
``precompile(layer, rows, stream=s)`` before ``torch.cuda.graph(g,
stream=s)``. Every allocation outside capture also allocates for the stream
``torch.cuda.graph`` captures on when given none (its process-wide
``default_capture_stream``, created here as ``torch.cuda.graph`` would create
it, on the current device), so the usual pattern needs nothing more: warm up
on the current or a side stream, then ``with torch.cuda.graph(g):`` (as
``decode_boundary.bench.timing.graph_time_us`` and the autotuner do). A graph
holds the scratch of the stream it was captured on: graphs captured on one
stream share it, so they must not replay concurrently with each other or with
eager launches on that stream; graphs that are to replay concurrently are
captured on distinct streams (``torch.cuda.graph(g, stream=s_i)`` after
``precompile(..., stream=s_i)``).
"""

from __future__ import annotations

import functools

import torch
import triton

from decode_boundary.common.contract import (
    NO_PUBLISH,
    check_publish_target,
    max_mix_chunks,
    mix_columns,
    mix_slots,
    mix_totals_offset,
)
from decode_boundary.common.timeline import launch_args
from decode_boundary.env import interpret_mode, use_pdl
from decode_boundary.mixes.handoff import MixesFinish
from decode_boundary.mxfp8.format import QuantizedActivation, check_scale_buffer, mxfp8_scale_bytes

from .mxfp8_gemm_kernel import mxfp8_gemm_kernel
from .tactics import Tactic, activation_upfront, fits, k_pieces

# ``publish`` arguments below: a ``decode_boundary.common.contract.PublishTarget``
# (or any object with its attributes); ``NO_PUBLISH`` when the GEMM does not publish.
# Split-K scratch, keyed (device, stream id, size in bytes): module docstring.
_WORKSPACES: dict[tuple[torch.device, int, int], torch.Tensor] = {}
_COUNTERS: dict[tuple[torch.device, int, int], torch.Tensor] = {}
_DUMMIES: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
HOST_STREAM = 0  # the one stream of a CPU (interpreter) launch


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


def empty_mxfp8(rows: int, n: int, device: torch.device) -> QuantizedActivation:
    """An MXFP8 [rows, N] output buffer of BF16 origin (every byte the kernel
    writes, padding included)."""
    return QuantizedActivation(
        torch.empty(rows, n, dtype=torch.float8_e4m3fn, device=device),
        torch.empty(mxfp8_scale_bytes(rows, n), dtype=torch.uint8, device=device),
        torch.bfloat16, torch.Size((rows, n)))


def _aligned(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.data_ptr() % 16:
            raise ValueError(f"GEMM operands must be 16-byte aligned; got {t.dtype} "
                             f"{tuple(t.shape)} at {t.data_ptr():#x}")


def _launch_stream(device: torch.device):
    """(key, stream) of the stream a launch on ``device`` runs on now: the current
    CUDA stream and its ``stream_id``; (``HOST_STREAM``, None) off CUDA."""
    if device.type != "cuda":
        return HOST_STREAM, None
    stream = torch.cuda.current_stream(device)
    return stream.stream_id, stream


def _default_capture_stream(device: torch.device):
    """The stream ``torch.cuda.graph`` captures on when given none, if it is on
    ``device``; created here as ``torch.cuda.graph`` creates it on first use (a
    pool stream of the current device), so an allocation before the first
    capture can serve it. None where this torch has no such stream or it is on
    another device."""
    graph = torch.cuda.graph
    if not hasattr(graph, "default_capture_stream"):
        return None
    stream = graph.default_capture_stream
    if stream is None and device.index == torch.cuda.current_device():
        stream = graph.default_capture_stream = torch.cuda.Stream(device)
    return stream if stream is not None and stream.device == device else None


def _cached(cache: dict, device: torch.device, nbytes: int, make) -> torch.Tensor:
    """The launching stream's buffer of >= nbytes on ``device`` (module
    docstring), sized to a power of two and kept forever (a captured graph may
    hold it); never allocated during capture. An allocation (outside capture)
    also allocates for ``torch.cuda.graph``'s default capture stream."""
    size = max(4096, 1 << (nbytes - 1).bit_length())
    key, stream = _launch_stream(device)
    buf = cache.get((device, key, size))
    if buf is not None:
        return buf
    if stream is not None and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"MXFP8 GEMM split-K workspace missing during CUDA graph capture on stream "
            f"{stream} (stream_id {key}, {device}): scratch belongs to the stream that launches; "
            "call decode_boundary.gemm.precompile(layer, rows, stream=<capture stream>) (or "
            "precompile / one eager call with that stream current) before capturing")
    buf = cache.setdefault((device, key, size), make(size, device))
    if stream is not None:
        capture = _default_capture_stream(device)
        if capture is not None and (device, capture.stream_id, size) not in cache:
            cache[(device, capture.stream_id, size)] = make(size, device)
            capture.wait_stream(stream)  # its zero fill (on this stream) precedes its uses
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


def quantized_out_fits(tactic: Tactic) -> bool:
    """Whether ``tactic``'s programs own whole 32-column groups, so the kernel
    can write its output as MXFP8 (``QUANT_OUT``: module docstring)."""
    return tactic.block_n % 32 == 0


def _check_out(out, rows: int, n: int, tactic: Tactic, publish):
    """(data, scale) kernel arguments of ``out``: a contiguous BF16 [rows, N]
    tensor (its own scale argument, unused), or a ``QuantizedActivation`` of
    [rows, N] the kernel writes as MXFP8 (``QUANT_OUT``)."""
    if isinstance(out, torch.Tensor):
        if out.dtype != torch.bfloat16 or tuple(out.shape) != (rows, n) or \
                not out.is_contiguous():
            raise ValueError(f"out must be contiguous bfloat16 [{rows}, {n}] (or an MXFP8 "
                             f"QuantizedActivation), got {out.dtype} {tuple(out.shape)}")
        return out, out
    if not isinstance(out, QuantizedActivation):
        raise ValueError(f"out must be a BF16 tensor or a QuantizedActivation, got "
                         f"{type(out).__name__}")
    data = out.data
    if data.dtype != torch.float8_e4m3fn or tuple(data.shape) != (rows, n) or \
            not data.is_contiguous():
        raise ValueError(f"out.data must be contiguous float8_e4m3fn [{rows}, {n}], got "
                         f"{data.dtype} {tuple(data.shape)}")
    check_scale_buffer(out.scale, rows, n, "out.scale")
    if not quantized_out_fits(tactic):
        raise ValueError(f"an MXFP8 out needs a tactic whose block_n is a multiple of 32 "
                         f"(whole scale groups per program), got {tactic}")
    if publish is not None:
        raise ValueError("an MXFP8 out cannot be published (the mailbox holds BF16)")
    return data, out.scale


def _finish_args(finish: MixesFinish | None, rows: int, device: torch.device, dummy):
    """(positional, constexpr) arguments of ``FINISH_MIXES`` (dummies without)."""
    if finish is None:
        return (dummy,) * 8 + (0.0, 0.0, 0, 0), {}
    _check_finish(finish, rows, device)
    f = finish
    return (f.mix_words, f.generation, f.status, f.hc_scale, f.hc_base, f.pre, f.post, f.comb,
            float(f.eps), float(f.hc_eps), int(f.rounds), int(f.wait_bound)), dict(
        FINISH_MIXES=True, HC=f.hc, MIX_HIDDEN=f.hidden, MIX_CHUNKS=f.chunks,
        MIX_CHUNKS_P2=triton.next_power_of_2(f.chunks), SLOTS=f.slots, MIX_ROW=f.mix_row,
        TOTALS_OFF=f.totals_off, USE_PTX=f.use_ptx)


def _check_finish(f: MixesFinish, rows: int, device: torch.device) -> None:
    """A ``MixesFinish`` as ``consume`` makes it, for these rows (whether it is
    current is the hand-off's check: ``NextMixes.launch_args``)."""
    if not isinstance(f, MixesFinish):
        raise ValueError(f"finish_mixes must be a MixesFinish, got {type(f).__name__}")
    hc = f.hc
    n_mix = (2 + hc) * hc
    want = dict(pre=(torch.float32, (rows, hc)), post=(torch.float32, (rows, hc)),
                comb=(torch.float32, (rows, hc, hc)), hc_scale=(torch.float32, (3,)),
                hc_base=(torch.float32, (n_mix,)), status=(torch.int32, (1,)),
                generation=(torch.int32, None), mix_words=(torch.int64, None))
    for name, (dtype, shape) in want.items():
        t = getattr(f, name)
        # 16-byte aligned, as the precompiled variant assumes (Triton specializes pointers
        # on it: a misaligned one would compile anew, perhaps inside a graph capture).
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.device != device or \
                not t.is_contiguous() or (shape is not None and tuple(t.shape) != shape) or \
                t.data_ptr() % 16:
            got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) \
                else type(t).__name__
            raise ValueError(f"finish_mixes.{name} must be a contiguous, 16-byte aligned "
                             f"{dtype} {shape or 'tensor'} on {device}, got {got}")
    if f.mix_words.ndim != 2 or f.mix_words.shape[0] < rows or f.generation.shape[0] < rows:
        raise ValueError(f"finish_mixes' scratch rows ({tuple(f.mix_words.shape)}, "
                         f"{tuple(f.generation.shape)}) are fewer than the GEMM's {rows}")
    row, chunks = mix_columns(f.hidden, hc), max_mix_chunks(f.hidden)
    if (f.slots, f.totals_off, f.mix_row) != (mix_slots(hc), mix_totals_offset(f.hidden, hc),
                                              row) or \
            not 1 <= f.chunks <= chunks or f.mix_words.shape[1] != row:
        raise ValueError(f"finish_mixes' geometry (chunks {f.chunks}, slots {f.slots}, totals "
                         f"at {f.totals_off}, row {f.mix_row}, mix_words "
                         f"{tuple(f.mix_words.shape)}) is not the mix row of hidden {f.hidden}, "
                         f"hc {hc} (common.contract: slots {mix_slots(hc)}, totals at "
                         f"{mix_totals_offset(f.hidden, hc)}, row {row}, <= {chunks} chunks)")


# 64-row tensor-core tiles of 4 warps and 128-wide K-pieces compile to ~175
# registers per thread: two programs per SM, where 168 allows three. The cap pays
# only where the third program shortens the grid's waves (same bits); where it does
# not (one wave either way) it costs time. The 64-wide-piece tiles compile at 168 as
# they are, and the cap makes ptxas spill them: not capped. The publishing and
# mixes-finishing variants hold more live values and compile as they are.
CAPPED_REGISTERS = 168
_UNCAPPED_PROGRAMS_PER_SM, _CAPPED_PROGRAMS_PER_SM = 2, 3


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def register_cap(tactic: Tactic, programs: int, device: torch.device) -> int | None:
    """The ``maxnreg`` a launch of ``programs`` programs of ``tactic`` compiles
    with, or None (as compiled)."""
    # The tile test first: most launches fail it, and it reads no environment.
    if (tactic.rows_tile, tactic.num_warps, tactic.chunk_k) != (64, 4, 128) or \
            device.type != "cuda" or interpret_mode():
        return None
    sms = _sm_count(device)
    waves = -(-programs // (_UNCAPPED_PROGRAMS_PER_SM * sms))
    capped_waves = -(-programs // (_CAPPED_PROGRAMS_PER_SM * sms))
    return CAPPED_REGISTERS if capped_waves < waves else None


def _launch_config(layer, a, out, tactic: Tactic, publish, finish: MixesFinish | None = None):
    """(grid, positional args, keyword args) shared by launch and warmup, so a
    warmed-up kernel is exactly the one a launch looks up. ``a`` is a BF16
    [rows, G*K] tensor or a QuantizedActivation (2-D data); with ``finish``,
    M more programs in front combine the tokens' next mixes."""
    storage, w_scale, n, k, groups = weight_operands(layer)
    bf16 = isinstance(a, torch.Tensor)
    rows = (a if bf16 else a.data).shape[0]
    device = storage.device
    a_bf16 = _check_activation(a, rows, groups * k)
    a_data, a_scale = (a, a) if a_bf16 else (a.data, a.scale)
    if not fits(tactic, n, k, groups):
        raise ValueError(f"tactic {tactic} is not valid for N={n}, K={k}, groups={groups}")
    quant_out = isinstance(out, QuantizedActivation)
    out_data, out_scale = _check_out(out, rows, n, tactic, publish)
    if any(t.device != device for t in (a_data, a_scale, out_data, out_scale)):
        raise ValueError(f"weight, activations and out must share one device ({device})")
    _aligned(storage, w_scale, a_data, a_scale, out_data, out_scale)
    if publish is not None:
        check_publish_target(publish, n, rows, device)
    buffers = _buffers(device, n, rows, tactic, publish)
    mix_args, mix_kwargs = _finish_args(finish, rows, device, buffers[0])
    grid = (n // tactic.block_n + (rows if finish is not None else 0), tactic.split_k,
            -(-rows // tactic.rows_tile))
    programs = grid[0] * grid[1] * grid[2]
    stamps, first_slot, timeline = launch_args("mxfp8_gemm_kernel", programs, device, buffers[0])
    pub = publish or NO_PUBLISH
    k_slice, pieces = k_pieces(k, tactic)
    pdl = use_pdl(device)
    kwargs = dict(
        N=n, K=k, GROUPS=groups, BLOCK_N=tactic.block_n, ROWS=tactic.rows_tile,
        SPLIT_K=tactic.split_k, K_SLICE=k_slice, CHUNK=tactic.chunk_k, PIECES=pieces,
        A_UPFRONT=activation_upfront(tactic, k, a_bf16),
        A_BF16=a_bf16, USE_PDL=pdl, INTERPRETER=interpret_mode(), PUBLISH=publish is not None,
        TP=pub.tp, RANK=pub.rank, CAPACITY=pub.capacity, HIDDEN=pub.hidden,
        TIMELINE=timeline, QUANT_OUT=quant_out, num_warps=tactic.num_warps, num_stages=1,
        launch_pdl=pdl, **mix_kwargs,
    )
    cap = register_cap(tactic, programs, device) if publish is None and finish is None else None
    if cap is not None:
        kwargs["maxnreg"] = cap
    return grid, (storage, w_scale, a_data, a_scale, out_data, out_scale, *buffers, stamps,
                  first_slot, rows, *mix_args), kwargs


def launch_low_latency(layer, a, out, tactic: Tactic, publish=None,
                       finish: MixesFinish | None = None):
    """``out`` [rows, N] (BF16) = ``a`` @ ``layer.weight`` with ``tactic`` on the
    current stream; ``a`` is MXFP8 (``QuantizedActivation``, 2-D data) or a BF16
    [rows, G*K] tensor quantized in the prologue; ``out`` a BF16 tensor, or a
    ``QuantizedActivation`` [rows, N] that receives the MXFP8 of that BF16
    output (``quantized_out_fits(tactic)``); with ``publish``, also into
    the mailbox (module docstring); with ``finish``, also the next mixes the
    consumer before it left (``MixesFinish``)."""
    grid, args, kwargs = _launch_config(layer, a, out, tactic, publish, finish)
    if grid[2]:
        mxfp8_gemm_kernel[grid](*args, **kwargs)
    return out


def warmup_low_latency(layer, rows: int, tactic: Tactic, publish=None, bf16_input: bool = False,
                       stream: torch.cuda.Stream | None = None,
                       finish: MixesFinish | None = None, mxfp8_out: bool = False):
    """Compile (launch nothing) the kernel ``launch_low_latency`` runs for
    ``rows`` rows, ``tactic`` and the input kind, and allocate its split-K
    scratch for the current stream, or for ``stream`` (the one later launches or
    a capture run on: module docstring), and for ``torch.cuda.graph``'s default
    capture stream; returns the compiled kernel (None in the interpreter);
    ``mxfp8_out``: the variant writing an MXFP8 output (``QUANT_OUT``). Peer
    addresses are checked here, outside any capture: a host read of the table
    would synchronize."""
    storage, _, n, k, groups = weight_operands(layer)
    device = storage.device
    if stream is not None and device.type == "cuda":
        with torch.cuda.stream(stream):
            return warmup_low_latency(layer, rows, tactic, publish, bf16_input, finish=finish,
                                      mxfp8_out=mxfp8_out)
    a_k = groups * k
    if bf16_input:
        a = torch.empty(rows, a_k, dtype=torch.bfloat16, device=device)
    else:
        a = empty_mxfp8(rows, a_k, device)
    out = empty_mxfp8(rows, n, device) if mxfp8_out else \
        torch.empty(rows, n, dtype=torch.bfloat16, device=device)
    if publish is not None and any(ptr % 16 for ptr in publish.peer_ptrs.tolist()):
        raise ValueError("publish.peer_ptrs must hold 16-byte aligned mailbox addresses")
    grid, args, kwargs = _launch_config(layer, a, out, tactic, publish, finish)
    return mxfp8_gemm_kernel.warmup(*args, grid=grid, **kwargs)
