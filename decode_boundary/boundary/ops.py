"""The custom ops through which ``BoundaryAllReduce`` launches under
torch.compile, and the registry of live instances they name.

Under tracing, ``publish``, ``publish_finalize`` and the reduction go through
``decode_boundary::boundary_publish``, ``boundary_publish_finalize`` and
``boundary_reduce``; each runs the instance's own eager launch path. Each
declares mutated the device words it writes: this rank's stage words (every
op of the protocol, so functionalization keeps them all and in order), the
consumer's status word and norm scratch, and the caller's MXFP8 buffers. The
mailbox itself is not an argument: every rank's kernels store into it through
peer addresses, so a functional copy of it (what an eager backend makes of a
mutated argument) would be copied back stale over a peer's later stores. The
host rules (``mark_published``, one publish per reduce) stay Python in the
class and are traced with the step. Open the mailbox (construct,
``precompile``) before compiling. Each op's implementation checks every input
before its first launch, as the eager path does (a rejected input aborts the
step: docs/FAILURES.md), so a direct call cannot write a peer with bad input.

An op names an instance's launches (:class:`~.launches.Launches`) by an int
``handle`` (:func:`register`, at construction; :func:`instance`); the
registry holds weak references, so they live no longer than their all-reduce.
The ops run their eager paths (``publish_eager``, ``publish_finalize_eager``,
``reduce_eager``) and read their ``mailbox``; nothing here reaches the
all-reduce.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from .consumer_kernel import FULL, MODES, PLAIN
from .plan import StepInputs

_HANDLES = itertools.count()
_INSTANCES: dict[int, weakref.ref] = {}
_SCRATCH = ("stage_state", "status", "generation", "sumsq", "prenorm")


def register(launches) -> int:
    """A new handle naming ``launches`` for the custom ops (held weakly)."""
    handle = next(_HANDLES)
    _INSTANCES[handle] = weakref.ref(launches)
    return handle


def instance(handle: int):
    """The launches of the live (open) all-reduce a custom op's ``handle`` names."""
    ref = _INSTANCES.get(handle)
    launches = ref() if ref is not None else None
    if launches is None or launches.guard.box is None:
        raise RuntimeError(f"BoundaryAllReduce {handle} is closed or gone")
    return launches


def sync_words(handle: int, **passed: torch.Tensor) -> None:
    """After a launch on the instance's own device words: make the tensors an
    op was handed (the same words, or an eager backend's functional copies of
    them, which it copies back afterwards) hold what the kernels wrote."""
    box = instance(handle).mailbox
    for name, tensor in passed.items():
        own = getattr(box, name)
        if tensor.data_ptr() != own.data_ptr():
            tensor.copy_(own)


@torch.library.custom_op("decode_boundary::boundary_publish", mutates_args=("stage_state",))
def publish_op(handle: int, x: torch.Tensor, stage_state: torch.Tensor) -> None:
    """``x`` into every peer's mailbox; ACTIVE of this rank's stage words set."""
    instance(handle).publish_eager(x)
    sync_words(handle, stage_state=stage_state)


@torch.library.custom_op("decode_boundary::boundary_publish_finalize",
                         mutates_args=("stage_state",))
def publish_finalize_op(handle: int, gemm2_permuted: torch.Tensor,
                         expert_weights: torch.Tensor, idx: torch.Tensor,
                         shared_output: torch.Tensor, stage_state: torch.Tensor) -> torch.Tensor:
    partial = instance(handle).publish_finalize_eager(gemm2_permuted, expert_weights, idx,
                                                      shared_output)
    sync_words(handle, stage_state=stage_state)
    return partial


@publish_finalize_op.register_fake
def _(handle, gemm2_permuted, expert_weights, idx, shared_output, stage_state):
    return shared_output.new_empty(shared_output.shape, dtype=torch.bfloat16)


def _no_mixes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three distinct empty tensors (a custom op's outputs may not alias)."""
    return tuple(x.new_empty(0, dtype=torch.float32) for _ in range(3))


@torch.library.custom_op("decode_boundary::boundary_reduce",
                         mutates_args=(*_SCRATCH, "mxfp8_data", "mxfp8_scale", "mix_words"))
def reduce_op(handle: int, x: torch.Tensor, publish: bool, reduce_mode: int,
               residual: torch.Tensor | None, post: torch.Tensor | None,
               comb: torch.Tensor | None, pre: torch.Tensor | None,
               norm_weight: torch.Tensor | None, eps: float, stage_state: torch.Tensor,
               status: torch.Tensor, generation: torch.Tensor, sumsq: torch.Tensor,
               prenorm: torch.Tensor, mxfp8_data: torch.Tensor | None,
               mxfp8_scale: torch.Tensor | None, hc_fn: torch.Tensor | None,
               hc_scale: torch.Tensor | None, hc_base: torch.Tensor | None,
               mix_words: torch.Tensor | None,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(plain sum or residual_out, layer_input or an empty tensor, and the next
    mixes pre, post, comb or three empty tensors). (Not ``mode``: the
    dispatcher passes an argument of that name itself.) No argument has a
    default: the dispatcher drops an argument passed at its default, and
    torch 2.11's in-place bookkeeping then indexes past the arguments of a
    mutated optional one (``mix_words``; pytorch#176078)."""
    launches = instance(handle)
    inputs = {} if reduce_mode == PLAIN else dict(
        residual=residual, post=post, comb=comb, pre=pre, norm_weight=norm_weight, eps=eps,
        mxfp8_out=None if mxfp8_data is None else (mxfp8_data, mxfp8_scale),
        mix_weights=None if hc_fn is None else (hc_fn, hc_scale, hc_base))
    result = launches.reduce_eager(x, MODES[reduce_mode], publish,
                                   StepInputs(**inputs))
    sync_words(handle, stage_state=stage_state, status=status, generation=generation,
               sumsq=sumsq, prenorm=prenorm,
               **({} if mix_words is None else dict(mix_words=mix_words)))
    mixes = tuple(result.mixes) if result.mixes is not None else _no_mixes(x)
    second = result.layer_input
    return (result.residual_out, second if second is not None else x.new_empty(0), *mixes)


@reduce_op.register_fake
def _(handle, x, publish, reduce_mode, residual, post, comb, pre, norm_weight, eps,
      stage_state, status, generation, sumsq, prenorm, mxfp8_data, mxfp8_scale, hc_fn,
      hc_scale, hc_base, mix_words):
    none = _no_mixes(x)
    if reduce_mode == PLAIN:
        return torch.empty_like(x), x.new_empty(0), *none
    m, hc = x.shape[0], residual.shape[1]
    first = x.new_empty(m, hc, x.shape[1])
    second = torch.empty_like(x) if reduce_mode == FULL else x.new_empty(0)
    if hc_fn is None:
        return first, second, *none
    return (first, second, x.new_empty(m, hc, dtype=torch.float32),
            x.new_empty(m, hc, dtype=torch.float32), x.new_empty(m, hc, hc, dtype=torch.float32))
