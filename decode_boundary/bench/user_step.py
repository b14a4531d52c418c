"""The strongest step a user can build without our kernels: the bench's
headline baseline (docs/DESIGN.md §8.2).

* The step without the next sublayer's mixes — the BF16 weights, ``wo_a``'s
  groups in one bmm, the all-reduce (a functional collective), mHC + RMSNorm,
  ``fused_wqa_wkv`` — compiled by ``torch.compile(mode="max-autotune-no-cudagraphs")``
  (:class:`~decode_boundary.bench.baselines.CompiledStep` minus the mixes);
* then the mixes as a careful user runs them (:func:`user_mixes`): the
  projection of the flattened streams onto ``hc_fn`` in FP32 and their RMS
  (:func:`mix_inputs`) as a compiled graph of their own (Inductor fuses the RMS
  into one reduction beside the FP32 GEMM; as eager torch ops they were five
  more launches; traced into the graph that makes
  ``residual_out``, Inductor would read that graph's FP32 values before their
  BF16 rounding and miss ``MIXES_ATOL``), then ONE
  Triton kernel for the sigmoids, the softmax and every Sinkhorn round
  (``bench.user_mixes_kernel``), within ``MIXES_ATOL`` of the reference: not
  Inductor's code for the rounds (dozens of dependent kernels).

Paths (``bench.paths``): ``user_step`` runs the mixes inline after the step;
``user_step_aside`` (V4.1, ``collapse_pre="previous"``) runs them on a side
stream, as V4.1 engines do, joined where the next step needs them: before the
next step's mHC, the point where our fused path joins its own aside mixes (the
all-reduce's next call). So the aside step is compiled as two graphs, the
GEMMs and the all-reduce, then mHC + RMSNorm + ``fused_wqa_wkv``, with the
join between. V4 (``"same"``) collapses with the pre of these very mixes: it
cannot hide them, its user step runs them between two compiled graphs
(residual_out; then the collapse, RMSNorm and ``fused_wqa_wkv``), and it has
no aside path.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from decode_boundary.env import disable_multicast
from decode_boundary.model.chain import AttentionBoundary, BoundaryInputs, BoundaryOutputs

from .baselines import (
    bf16_weights,
    collapse_rmsnorm,
    compiled,
    group_name_of,
    mhc_mix,
    mhc_rmsnorm,
    reduced_sum,
)
from .user_mixes_kernel import launch_user_mixes


def mix_inputs(streams: torch.Tensor, hc_fn: torch.Tensor, rms_eps: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(``s @ hc_fn^T``, ``rsqrt(mean(s^2) + rms_eps)``) of ``streams`` [M, hc, H]
    flattened to ``s`` (FP32): the user mixes kernel's inputs. Traced into a
    compiled graph or run eagerly; the caller keeps FP32 matmuls in full FP32
    (:func:`fp32_matmul`: TF32 would miss ``MIXES_ATOL``)."""
    m, hc, h = streams.shape
    s = streams.float().reshape(m, hc * h)
    return s @ hc_fn.t(), torch.rsqrt(s.square().mean(dim=-1) + rms_eps)


def user_mixes(streams: torch.Tensor, hc_fn: torch.Tensor, hc_scale: torch.Tensor,
               hc_base: torch.Tensor, rms_eps: float, hc_eps: float, sinkhorn_iters: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mhc_mixes_ref``'s (pre, post, comb) of ``streams`` [M, hc, H] as a user
    computes them, eagerly: :func:`mix_inputs` in full FP32, then one Triton
    kernel for the rest."""
    with fp32_matmul():
        projected, rstd = mix_inputs(streams, hc_fn, rms_eps)
    return launch_user_mixes(projected, rstd, hc_scale, hc_base, hc_eps, sinkhorn_iters)


@contextlib.contextmanager
def fp32_matmul():
    """CUDA FP32 matmuls in FP32 (not TF32) inside."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


class _AsideLane:
    """The side stream of one device's aside user steps, and the event of the
    mixes the last one left there: every step (of any weight copy) joins the
    previous one's, as one engine's consecutive layers would."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.device = device
        self.pending: torch.cuda.Event | None = None

    def join(self) -> None:
        """The current stream waits for the mixes left aside (none: no-op)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            torch.cuda.current_stream(self.device).wait_event(pending)

    def run(self, fn, residual_out: torch.Tensor):
        """``fn(residual_out)`` on the side stream, after what the current stream
        has queued (inline on CPU)."""
        if self.stream is None:
            return fn(residual_out)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        residual_out.record_stream(self.stream)  # read there until joined
        with torch.cuda.stream(self.stream):
            out = fn(residual_out)
            self.pending = torch.cuda.Event()
            self.pending.record(self.stream)
        return out


@functools.cache
def aside_lane(device: torch.device) -> _AsideLane:
    return _AsideLane(device)


def _step_without_mixes(attn_out, residual, post, comb, pre, wo_a, wo_b, fused_wqa_wkv,
                        norm_weight, eps: float, group_name: str | None):
    """V4.1's step (given pre) without the next mixes: (residual_out, layer_input, q)."""
    return _tail(reduced_sum(attn_out, wo_a, wo_b, group_name), residual, post, comb, pre,
                 norm_weight, eps, fused_wqa_wkv)


def _tail(reduced, residual, post, comb, pre, norm_weight, eps: float, fused_wqa_wkv):
    """mHC + RMSNorm + ``fused_wqa_wkv`` of the all-reduced sum."""
    residual_out, layer_input = mhc_rmsnorm(reduced, residual, post, comb, pre, norm_weight,
                                            eps)
    return residual_out, layer_input, layer_input @ fused_wqa_wkv.t()


def _residual_out(attn_out, residual, post, comb, wo_a, wo_b, group_name: str | None):
    """V4's first graph: the GEMMs, the all-reduce and the mHC mix: residual_out."""
    return mhc_mix(reduced_sum(attn_out, wo_a, wo_b, group_name), residual, post, comb)


def _collapse_project(residual_out, pre, norm_weight, eps: float, fused_wqa_wkv):
    """V4's second graph: the collapse with the new pre, RMSNorm, ``fused_wqa_wkv``."""
    layer_input = collapse_rmsnorm(residual_out, pre, norm_weight, eps)
    return layer_input, layer_input @ fused_wqa_wkv.t()


class UserStep:
    """``ab``'s step as the strongest user-built baseline (module docstring), on
    BF16 copies of its weights; ``aside``: the mixes on the side stream (V4.1
    only: ``ValueError`` for V4). The first call per M compiles and autotunes
    (tens of seconds): make it outside any CUDA-graph capture."""

    def __init__(self, ab: AttentionBoundary, aside: bool = False, backend: str = "inductor",
                 mode: str | None = "max-autotune-no-cudagraphs") -> None:
        c = ab.config
        self.same = c.collapse_pre == "same"
        if aside and self.same:
            raise ValueError(f"{c.name} collapses with the pre of the next mixes "
                             "(collapse_pre='same'): they cannot run aside")
        disable_multicast(ab.group)  # first: the functional collective runs over ab's group
        self.wo_a, self.wo_b, self.fused_wqa_wkv = bf16_weights(ab)
        self.norm_weight, self.eps = ab.norm_weight, c.eps
        self.group_name = group_name_of(ab.group)
        self.hc_fn, self.hc_scale, self.hc_base = ab.mix_weights
        self.kernel_args = (self.hc_scale, self.hc_base, c.hc_eps, c.hc_sinkhorn_iters)
        self.rms_eps = c.eps
        self.lane = aside_lane(ab.device) if aside else None
        mode = mode if backend == "inductor" else None
        if self.same:
            self.first = compiled(_residual_out, backend, mode)
            self.second = compiled(_collapse_project, backend, mode)
        elif aside:
            self.first = compiled(reduced_sum, backend, mode)
            self.second = compiled(_tail, backend, mode)
        else:
            self.first = compiled(_step_without_mixes, backend, mode)
        self.projection = compiled(mix_inputs, backend, mode)

    def mix_inputs(self, residual_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The mixes kernel's (projected, rstd) of ``residual_out``: the compiled
        :func:`mix_inputs`, in full FP32."""
        with fp32_matmul():
            return self.projection(residual_out, self.hc_fn, self.rms_eps)

    def mixes(self, residual_out: torch.Tensor):
        """The next mixes of ``residual_out``: :meth:`mix_inputs`, then the kernel."""
        return launch_user_mixes(*self.mix_inputs(residual_out), *self.kernel_args)

    def _first_args(self, x: BoundaryInputs) -> tuple:
        """The first compiled graph's arguments of the inline step (V4.1) or of
        V4's step."""
        if self.same:
            return (x.attn_out, x.residual, x.post, x.comb, self.wo_a, self.wo_b,
                    self.group_name)
        return (x.attn_out, x.residual, x.post, x.comb, x.pre, self.wo_a, self.wo_b,
                self.fused_wqa_wkv, self.norm_weight, self.eps, self.group_name)

    def _collapse(self, residual_out: torch.Tensor, pre: torch.Tensor):
        """V4's second graph: (layer_input, q) of ``residual_out`` collapsed with ``pre``."""
        return self.second(residual_out, pre, self.norm_weight, self.eps, self.fused_wqa_wkv)

    def stages(self, inputs: BoundaryInputs) -> dict:
        """The inline step's launches, each a callable to time alone (the bench's
        breakdown): its compiled graphs and the mixes kernel."""
        if self.lane is not None:
            raise ValueError("the breakdown times the inline user step (aside=False)")
        first_args = self._first_args(inputs)
        first = self.first(*first_args)
        residual_out = first if self.same else first[0]
        projected, rstd = self.mix_inputs(residual_out)
        pre = launch_user_mixes(projected, rstd, *self.kernel_args)[0]
        stages = {
            ("GEMMs, all-reduce, mHC mix (torch.compile)" if self.same else
             "step without the mixes (torch.compile: GEMMs, all-reduce, mHC, RMSNorm)"):
                lambda: self.first(*first_args),
            "mixes' FP32 projection + RMS (torch.compile)":
                lambda: self.mix_inputs(residual_out),
            "mixes kernel (Triton: sigmoids, softmax, Sinkhorn)":
                lambda: launch_user_mixes(projected, rstd, *self.kernel_args),
        }
        if self.same:
            stages["collapse + RMSNorm + fused_wqa_wkv (torch.compile)"] = \
                lambda: self._collapse(residual_out, pre)
        return stages

    def join(self) -> None:
        """The current stream waits for the mixes an aside step left (else no-op)."""
        if self.lane is not None:
            self.lane.join()

    def __call__(self, inputs: BoundaryInputs) -> BoundaryOutputs:
        x = inputs
        if self.same:
            residual_out = self.first(*self._first_args(x))
            mixes = self.mixes(residual_out)
            return BoundaryOutputs(residual_out, *self._collapse(residual_out, mixes[0]),
                                   *mixes)
        if self.lane is None:
            outs = self.first(*self._first_args(x))
            return BoundaryOutputs(*outs, *self.mixes(outs[0]))
        reduced = self.first(x.attn_out, self.wo_a, self.wo_b, self.group_name)
        self.lane.join()  # the previous step's mixes, before this step's mHC
        outs = self.second(reduced, x.residual, x.post, x.comb, x.pre, self.norm_weight,
                           self.eps, self.fused_wqa_wkv)
        return BoundaryOutputs(*outs, *self.lane.run(self.mixes, outs[0]))
